// refit — the streamer's receivers changing: added and removed between versions, dropped when they
// fail during one (streamer_options::on_receiver_failure). A failure with `drop` is a removal forced
// by a deadline or a refusal: the receiver leaves the version and the streamer at once, and the
// request goes on with the others. What the session can follow without being made anew is the
// transport's to say (transport::capabilities::peers_apart): on host_shm a receiver leaves without
// the others noticing; one that joins needs a HELLO, and host_shm's buffers are unlinked once every
// receiver of a session mapped them, so a join opens a new session for all at the next version.
// Engines declared as groups (streamer_options::receiver_groups: an engine holds one version on
// every rank or on none, README.md "One version on every rank, or none") leave whole: a rank's
// failure drops its engine's other ranks with it, each told ABORT, and the other engines commit.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "channel/lane.hpp"
#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {

/// Throws errc::invalid_argument when the receivers cannot change now (`what`: the call).
void streamer::impl::check_can_change(std::string_view what) const {
  if (version_in_progress)
    throw error(errc::invalid_argument,
                fmt::format("{} during a refit (from its tensor source): the receivers change between versions; "
                            "call it before or after refit()",
                            what));
  if (options.group_size > 1)
    throw error(errc::invalid_argument,
                fmt::format("{} in a group of streamers (group_size {}): every rank serves the same receivers; make "
                            "the group anew with the new receivers",
                            what, options.group_size));
  if (can.fixed_receivers)
    throw error(errc::invalid_argument,
                fmt::format("{} on the {} transport: its communicator was made with every receiver as a rank; make "
                            "a new streamer with the new receivers",
                            what, buffers->name()));
}

/// Before a refit: throws errc::invalid_argument when no receiver is left, or (with `drop`) fewer
/// than min_receivers.
void streamer::impl::check_receivers_left() const {
  if (endpoints.empty())
    throw error(errc::invalid_argument, "refit() without receivers: every one was dropped; add_receiver() first");
  if (options.on_receiver_failure == receiver_failure::drop && endpoints.size() < options.min_receivers)
    throw error(errc::invalid_argument,
                fmt::format("refit() with {} receiver(s) left, fewer than min_receivers = {}: add_receiver() first",
                            endpoints.size(), options.min_receivers));
}

/// streamer::add_receiver: the receiver joins at the next version's BEGIN (its HELLO).
void streamer::impl::add_receiver(std::string endpoint) {
  check_can_change("add_receiver()");
  if (endpoint.empty())
    throw error(errc::invalid_argument, "add_receiver(): the endpoint is empty: pass the receiver's endpoint()");
  if (std::ranges::find(endpoints, endpoint) != endpoints.end())
    throw error(errc::invalid_argument, fmt::format("add_receiver({}): that receiver is served already", endpoint));
  if (endpoints.size() >= can.max_receivers)
    throw error(errc::invalid_argument,
                fmt::format("add_receiver({}): the {} transport serves at most {} receivers per streamer", endpoint,
                            buffers->name(), can.max_receivers));
  std::erase_if(rejoins, [&](const rejoining& r) { return r.endpoint == endpoint; });
  if (!channels.empty()) channels.emplace_back(endpoint, options.curve);
  endpoints.push_back(std::move(endpoint));
  if (in_session) membership_changed = true;
  REFIT_INFO("receiver {} added: it joins at the next version ({} receivers)", endpoints.back(), endpoints.size());
}

/// streamer::remove_receiver: BYE to it (it keeps its last committed version), and the next
/// version goes to the others.
void streamer::impl::remove_receiver(std::string_view endpoint) {
  check_can_change("remove_receiver()");
  const auto it = std::ranges::find(endpoints, endpoint);
  const auto tried = std::erase_if(rejoins, [&](const rejoining& r) { return r.endpoint == endpoint; });
  if (it == endpoints.end() && tried != 0) return;  // dropped, and no longer tried again
  if (it == endpoints.end())
    throw error(errc::invalid_argument, fmt::format("remove_receiver({}): no such receiver is served (receivers(): {})",
                                                    endpoint, fmt::join(endpoints, ", ")));
  if (endpoints.size() == 1)
    throw error(errc::invalid_argument,
                fmt::format("remove_receiver({}): it is the last receiver; close() the streamer instead", endpoint));
  const auto k = static_cast<std::size_t>(it - endpoints.begin());
  if (in_session && k < channels.size()) {
    try {
      channels[k].request(wire::encode(wire::bye{}, secret), std::min(options.timeout, milliseconds{1000}), "BYE");
    } catch (const std::exception& e) {
      REFIT_DEBUG("BYE to {} not answered: {}", who(k), e.what());
    }
  }
  REFIT_INFO("receiver {} removed ({} left)", endpoint, endpoints.size() - 1);
  forget_receiver(k);
  if (in_session && !can.peers_apart) membership_changed = true;
}

/// With `drop`: a receiver whose failure leaves it out. Not the refusals the streamer itself answers
/// (a delta it holds no base for: sent whole; a restarted receiver without our session: HELLO again),
/// nor a failure of this side's transport (HELLO's join).
bool streamer::impl::droppable(const failure& f) const noexcept {
  if (f.receiver >= channels.size()) return false;
  if (!f.answered || f.with_engine) return true;  // gone, silent, or an answer that is no answer
  return f.code != errc::needs_whole && f.code != errc::peer && f.code != errc::unauthorized;
}

/// With `drop`, after a request's replies are in: every receiver whose failure is droppable() leaves
/// the streamer (its reply taken out of `oks`, its failure out of `failures`, a warning logged at
/// once, refit_stats::dropped told). Throws the last such failure when fewer than min_receivers are
/// left.
void streamer::impl::drop_failed(std::vector<failure>& failures, std::vector<wire::ok>& oks) {
  if (options.on_receiver_failure != receiver_failure::drop) return;
  add_engine_peers(failures);
  std::vector<std::size_t> gone;
  std::vector<failure> kept;
  for (failure& f : failures) {
    if (!droppable(f)) {
      kept.push_back(std::move(f));
      continue;
    }
    REFIT_WARN("dropping {} ({}): {}", who(f.receiver), to_string(f.code), f.message);
    tell_dropped(f.receiver, f);
    dropped.push_back({endpoints[f.receiver], f.code, f.message});
    if (options.rejoin) queue_rejoin(endpoints[f.receiver]);
    gone.push_back(f.receiver);
  }
  if (gone.empty()) return;
  std::ranges::sort(gone, std::greater<>());
  for (const std::size_t k : gone) forget_receiver(k);
  // The replies of those left, moved into a new list: erase() would instantiate std::copy of
  // wire::ok out of line at -O1, a libstdc++ template that lib/librefit.map's `refit::*` exports
  // (its demangled name starts with the return type), which tests/consumer/check_exports.sh refuses.
  std::vector<wire::ok> left;
  left.reserve(oks.size());
  for (std::size_t k = 0; k < oks.size(); ++k)
    if (std::ranges::find(gone, k) == gone.end()) left.push_back(std::move(oks[k]));
  oks = std::move(left);
  for (failure& f : kept)
    f.receiver -= static_cast<std::size_t>(std::ranges::count_if(gone, [&](std::size_t k) { return k < f.receiver; }));
  failures = std::move(kept);
  if (endpoints.size() >= options.min_receivers) return;
  const dropped_receiver& last = dropped.back();
  throw error(last.code, fmt::format("{} receiver(s) left after dropping {}, fewer than min_receivers = {}: {}",
                                     endpoints.size(), last.endpoint, options.min_receivers, last.reason));
}

/// The other ranks of each engine (streamer_options::receiver_groups) that a droppable failure
/// breaks, added to `failures` as dropped with it: an engine holds one version on every rank or on
/// none, so a rank that goes on alone would hold a version its engine cannot serve.
void streamer::impl::add_engine_peers(std::vector<failure>& failures) const {
  if (options.receiver_groups.empty()) return;
  const auto failing = [&](std::size_t k) {
    return std::ranges::any_of(failures, [&](const failure& x) { return x.receiver == k; });
  };
  for (std::size_t i = 0, n = failures.size(); i < n; ++i) {
    if (!droppable(failures[i])) continue;
    for (const std::size_t p : engine_peers(failures[i].receiver)) {
      if (failing(p)) continue;
      failures.push_back({p, failures[i].code,
                          fmt::format("dropped with its engine, whose rank {} failed: {}",
                                      endpoints[failures[i].receiver], failures[i].message),
                          true, true});
    }
  }
}

/// The receivers served now that form one engine with receiver k (its group's other endpoints).
std::vector<std::size_t> streamer::impl::engine_peers(std::size_t k) const {
  std::vector<std::size_t> peers;
  for (const auto& group : options.receiver_groups) {
    if (std::ranges::find(group, endpoints[k]) == group.end()) continue;
    for (std::size_t j = 0; j < endpoints.size(); ++j)
      if (j != k && std::ranges::find(group, endpoints[j]) != group.end()) peers.push_back(j);
  }
  return peers;
}

/// A receiver dropped that may still hear (its control lane is open: it did not answer in time)
/// is told ABORT, within 100 ms each way; one that answered ERROR has aborted the version itself,
/// and one that is gone hears nothing. Closing its channel then closes the lane, at which a
/// receiver aborts too. A rank dropped with its engine answered the request, so its channel is
/// free: it is told ABORT over it (1 s at most), and discards the version whatever it had taken.
void streamer::impl::tell_dropped(std::size_t k, const failure& f) noexcept {
  if (f.with_engine && k < channels.size() && version_in_progress) {
    try {
      channels[k].request(wire::encode(wire::abort{*version_in_progress, f.code, "dropped: " + f.message}, secret),
                          std::min(options.timeout, milliseconds{1000}),
                          fmt::format("ABORT of version {}", *version_in_progress));
    } catch (const std::exception& e) {
      REFIT_DEBUG("ABORT to {}, dropped with its engine, not answered: {}", who(k), e.what());
    }
    return;
  }
  if (f.answered || k >= channels.size() || !channels[k].has_lane() || !version_in_progress) return;
  try {
    const std::string what = fmt::format("ABORT of version {}", *version_in_progress);
    channels[k].send(wire::encode(wire::abort{*version_in_progress, f.code, "dropped: " + f.message}, secret),
                     milliseconds{100}, what);
    (void)channels[k].receive(milliseconds{100}, what);
  } catch (const std::exception& e) {
    REFIT_DEBUG("ABORT to the dropped {} not heard: {}", who(k), e.what());
  }
}

/// Receiver k is no longer served: its channel (and control lane) closed, its endpoint forgotten.
void streamer::impl::forget_receiver(std::size_t k) noexcept {
  if (k < channels.size()) {
    channels[k].attach_lane(nullptr);
    channels.erase(channels.begin() + static_cast<std::ptrdiff_t>(k));
  }
  endpoints.erase(endpoints.begin() + static_cast<std::ptrdiff_t>(k));
}

/// streamer_options::rejoin: `endpoint` was dropped; it is tried at the next version, or, when
/// that was a try, after twice as many versions as before.
void streamer::impl::queue_rejoin(const std::string& endpoint) {
  for (rejoining& r : rejoins)
    if (r.endpoint == endpoint) {
      r.backoff = std::min(r.backoff * 2, max_rejoin_backoff);
      r.wait = r.backoff;
      return;
    }
  rejoins.push_back({endpoint, 0, 1});
}

/// At the start of a version: the dropped receivers due for a try are served again (their HELLO
/// at this version's session).
void streamer::impl::try_rejoins() {
  for (rejoining& r : rejoins) {
    if (r.wait > 0) {
      --r.wait;
      continue;
    }
    if (std::ranges::find(endpoints, r.endpoint) != endpoints.end() || endpoints.size() >= can.max_receivers) continue;
    REFIT_INFO("trying the dropped receiver {} again (rejoin)", r.endpoint);
    if (!channels.empty()) channels.emplace_back(r.endpoint, options.curve);
    endpoints.push_back(r.endpoint);
    if (in_session) membership_changed = true;
  }
}

/// After a version committed: the receivers tried again that took it are no longer tried.
void streamer::impl::forget_rejoined() noexcept {
  std::erase_if(rejoins,
                [&](const rejoining& r) { return std::ranges::find(endpoints, r.endpoint) != endpoints.end(); });
}

}  // namespace refit
