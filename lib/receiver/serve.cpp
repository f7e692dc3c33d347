// refit — the receiver's loop: serve_one() → step() → receive() → handle() → dispatch() to the
// handlers (session.cpp, refit.cpp), with the deadlines of a refit in progress.
#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "receiver/impl.hpp"

namespace refit {

receiver_event receiver::impl::serve_one(milliseconds wait) {
  receiver_event e = receiver_event::idle;
  try {
    e = step(wait);
  } catch (...) {
    run_hooks();
    throw;
  }
  run_hooks();
  return e;
}

receiver_event receiver::impl::step(milliseconds wait) {
  for (lane& l : lanes) {
    if (!l.pending) continue;
    // Received by the last call, which ended the refit it superseded; its streamer is waiting.
    ln = &l;
    const wire::message m = std::move(*l.pending);
    l.pending.reset();
    l.last_message = clock::now();
    return dispatch(m);
  }
  for (lane& l : lanes) {
    if (!l.waiting) continue;
    if (must_wait(*l.waiting) && clock::now() - l.waiting_since < wait_bound(*l.waiting)) {
      wait = std::min(wait, milliseconds{10});  // asked again soon: the lower ranks' HELLOs come on other lanes
      continue;
    }
    ln = &l;
    wire::message m = std::move(*l.waiting);
    l.waiting.reset();
    return supersede_or_dispatch(std::move(m));
  }
  if (const auto aborted = enforce_deadlines(wait)) return *aborted;
  const auto request = receive(wait);
  if (!request) return streamer_gone() ? receiver_event::aborted : receiver_event::idle;
  const auto received = clock::now();
  const receiver_event e = handle(*request);
  REFIT_DEBUG("{} handled in {:.0f} us ({} bytes)", to_string(e),
              std::chrono::duration<double, std::micro>(clock::now() - received).count(), request->size());
  return e;
}

/// Aborts the refit in progress when a lane missed its deadline, and shortens `wait` to the next
/// one; nullopt when none was missed (or no refit is in progress).
std::optional<receiver_event> receiver::impl::enforce_deadlines(milliseconds& wait) {
  if (!group_version) return std::nullopt;
  // A refit in progress must not wait forever on a dead streamer: every lane that has not
  // ended its part must say something within the idle timeout (one that has not begun it yet,
  // within the idle timeout of the version's first BEGIN).
  // A lane whose END is held is answered within three quarters of its streamer's reply timeout.
  // An engine-wide version prepared here waits for COMMIT the idle timeout *and* the streamer's
  // reply timeout: the streamer may wait that long for another receiver's END before it sends
  // COMMIT (or ABORT), and a receiver that gave up first would miss a COMMIT the others obey.
  const auto now = clock::now();
  lane* late = nullptr;
  clock::time_point deadline{};
  for (lane& l : lanes) {
    if ((l.held || l.commit_held) && l.reply_timeout.count() == 0) continue;
    const auto due = l.held || l.commit_held ? l.held_since + l.reply_timeout * 3 / 4
                     : l.awaits_commit       ? l.last_message + options.idle_timeout + l.reply_timeout
                                       : (l.refit_active() ? l.last_message : std::max(l.last_message, refit_start)) +
                                             options.idle_timeout;
    if (late == nullptr || due < deadline) late = &l, deadline = due;
  }
  if (late != nullptr && now >= deadline) {
    ln = late;
    abort_refit(late_reason(*late), errc::timeout);
    return receiver_event::aborted;
  }
  if (late != nullptr) wait = std::min(wait, std::chrono::ceil<milliseconds>(deadline - now));
  return std::nullopt;
}

/// Ends the refit in progress when the streamer of a lane that takes part in it was found gone
/// through its control lane (channel::rep_channel::lane_gone()): its process ended, so waiting for
/// receiver_options::idle_timeout would only keep the weights dirty longer. True when it did.
bool receiver::impl::streamer_gone() {
  bool aborted = false;
  for (lane& l : lanes) {
    if (!l.channel.lane_gone() || !l.in_refit() || !group_version) continue;
    ln = &l;
    abort_refit(fmt::format("the streamer {} is gone during version {}: its control lane closed (its process "
                            "ended, or it let go of the session), noticed at once instead of after "
                            "receiver_options.idle_timeout ({} ms)",
                            who(l), *group_version, options.idle_timeout.count()),
                errc::peer);
    aborted = true;
  }
  return aborted;
}

/// Waits up to `wait` for a request on any lane that is not holding one (a held END must be
/// answered first); makes its lane the current one.
std::optional<std::string> receiver::impl::receive(milliseconds wait) {
  if (lanes.size() == 1) {
    ln = &lanes.front();
    return ln->channel.receive(wait, refit_active());
  }
  std::vector<channel::rep_channel*> open;
  std::vector<lane*> owners;
  for (std::size_t k = 0; k < lanes.size(); ++k) {
    lane& l = lanes[(next_lane + k) % lanes.size()];
    if (l.held || l.waiting) continue;  // each answers before its next request
    open.push_back(&l.channel);
    owners.push_back(&l);
  }
  const auto ready = channel::rep_channel::wait_any(open, wait, group_version.has_value());
  if (!ready) return std::nullopt;
  ln = owners[*ready];
  next_lane = (ln->rank + 1) % lanes.size();
  return ln->channel.receive(milliseconds{0});
}

receiver_event receiver::impl::handle(const std::string& bytes) {
  wire::message m;
  std::string secret;
  try {
    m = wire::decode(bytes, &secret);
  } catch (const error& e) {
    // Only the session's owner can break its refit with bytes that do not decode; a stranger
    // hears why and the refit goes on.
    const bool was_active = refit_active() && from_owner();
    answering = ln;
    if (was_active) abort_refit(e.what(), e.code());
    answering = nullptr;
    reply_error(e.code(), e.what());
    return was_active ? receiver_event::aborted : receiver_event::refused;
  }
  if (const auto why = stranger(m, secret)) {
    ++strangers_refused;
    if (std::has_single_bit(strangers_refused))  // 1, 2, 4, ...: a flood does not flood the log
      REFIT_WARN("{} ({} refused so far)", *why, strangers_refused);
    answering = ln;
    ln->channel.reply(wire::encode(wire::error{errc::unauthorized, *why}));
    answering = nullptr;
    return receiver_event::refused;
  }
  ln->last_message = clock::now();
  if (const auto* h = std::get_if<wire::hello>(&m); h != nullptr && must_wait(*h)) {
    REFIT_DEBUG("HELLO of rank {} waits for the sessions of the lower ranks", h->group_rank);
    ln->waiting = *h;
    ln->waiting_since = clock::now();
    return receiver_event::idle;
  }
  return supersede_or_dispatch(std::move(m));
}

/// Handles request `m` of lane `ln`; a request that ends the refit in progress (supersedes()) is
/// reported on its own, and answered by the next call (lane::pending).
receiver_event receiver::impl::supersede_or_dispatch(wire::message m) {
  if (const auto why = supersedes(m)) {
    answering = ln;
    abort_refit(*why, grouped() ? errc::incomplete : errc::apply);
    answering = nullptr;
    ln->pending = std::move(m);
    return receiver_event::aborted;
  }
  return dispatch(m);
}

receiver_event receiver::impl::dispatch(const wire::message& m) {
  answering = ln;
  struct done_answering {
    lane*& a;
    ~done_answering() { a = nullptr; }
  } done{answering};
  return std::visit(
      [&](const auto& msg) -> receiver_event {
        using T = std::decay_t<decltype(msg)>;
        if constexpr (std::is_same_v<T, wire::hello>) {
          return on_hello(msg);
        } else if constexpr (std::is_same_v<T, wire::begin>) {
          return on_begin(msg);
        } else if constexpr (std::is_same_v<T, wire::batch>) {
          return on_batch(msg);
        } else if constexpr (std::is_same_v<T, wire::end>) {
          return on_end(msg);
        } else if constexpr (std::is_same_v<T, wire::bye>) {
          end_session();
          reply_ok();
          ln->channel.attach_lane(nullptr);  // the session's lane goes with it (answered first)
          return receiver_event::bye;
        } else if constexpr (std::is_same_v<T, wire::abort>) {
          return on_abort(msg);
        } else if constexpr (std::is_same_v<T, wire::commit>) {
          return on_commit(msg);
        } else {
          reply_error(errc::protocol, fmt::format("{} is a reply, not a request", wire::to_string(wire::type_of(m))));
          return receiver_event::refused;
        }
      },
      m);
}

}  // namespace refit
