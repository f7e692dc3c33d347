// refit — the streamer's requests: one message to every receiver, its replies collected (and
// failures named, receiver by receiver) before the next is sent. post() and collect() are the two
// halves, so that a BATCH's replies are heard while the next batch is packed.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "model/log.hpp"
#include "model/text.hpp"
#include "streamer/impl.hpp"

namespace refit {

/// Sends a message to every receiver (made per receiver by `make`), runs `between` (the
/// transport's join at HELLO), then collects every reply, and returns the OKs. When any receiver
/// refuses or stays silent, throws refit::error naming each one that did (with the first
/// failure's code), after hearing out all the others, so every REQ socket stays usable. A silent,
/// lost or confused receiver also ends the session; so does any failure on nccl, whose
/// communicator cannot be trusted after one.
std::vector<wire::ok> streamer::impl::request(const std::function<wire::message(std::size_t)>& make,
                                              const std::string& what, const std::function<void()>& between) {
  post(make, what);
  if (between && flight->failures.empty()) {
    try {
      between();
    } catch (const error& e) {
      flight->failures.push_back({channels.size(), e.code(), e.what()});
      flight->session_lost = true;
    }
  }
  return collect();
}

/// The same message to every receiver.
std::vector<wire::ok> streamer::impl::request(const wire::message& m, const std::string& what,
                                              const std::function<void()>& between) {
  return request([&](std::size_t) { return m; }, what, between);
}

/// The first half of request(): sends to every receiver and returns; collect() hears the
/// replies. Nothing else may be sent meanwhile (one request at a time per channel).
void streamer::impl::post(const std::function<wire::message(std::size_t)>& make, const std::string& what) {
  in_flight& f = start_flight(what);
  for (std::size_t k = 0; k < channels.size(); ++k) send_posted(f, k, wire::encode(make(k), secret));
}

/// post() of one message every receiver gets alike, encoded once by the caller.
void streamer::impl::post_alike(std::string_view bytes, const std::string& what) {
  in_flight& f = start_flight(what);
  for (std::size_t k = 0; k < channels.size(); ++k) send_posted(f, k, bytes);
}

streamer::impl::in_flight& streamer::impl::start_flight(const std::string& what) {
  if (flight) throw error(errc::internal, fmt::format("{} while {} waits for its replies", what, flight->what));
  // Assigned, not emplace()d: clang (before 16) cannot tell a nested struct with member
  // initializers default-constructible inside its enclosing class.
  flight = in_flight{};
  in_flight& f = *flight;
  f.what = what;
  f.started = clock::now();
  f.deadline = f.started + options.timeout;
  f.sent.assign(channels.size(), false);
  return f;
}

/// Sends the request posted as `f` to receiver k; a failure is counted in `f`.
void streamer::impl::send_posted(in_flight& f, std::size_t k, std::string_view bytes) {
  try {
    channels[k].send(bytes, left_of(f), f.what);
    f.sent[k] = true;
  } catch (const error& e) {
    f.failures.push_back({k, e.code(), e.what()});
    f.session_lost = true;
  }
}

milliseconds streamer::impl::left_of(const in_flight& f) {
  return std::max(milliseconds{1}, std::chrono::ceil<milliseconds>(f.deadline - clock::now()));
}

/// True when every reply of the request posted has arrived (collect() would not wait).
bool streamer::impl::replies_ready() {
  if (!flight) return true;
  for (std::size_t k = 0; k < channels.size(); ++k)
    if (flight->sent[k] && !channels[k].reply_ready()) return false;
  return true;
}

/// The second half of request(): the replies to the request posted, as request() returns them
/// or throws.
std::vector<wire::ok> streamer::impl::collect() {
  if (!flight) throw error(errc::internal, "collect() without a request posted");
  in_flight f = std::move(*flight);
  flight.reset();
  const std::string& what = f.what;
  std::vector<failure>& failures = f.failures;
  bool session_lost = f.session_lost;
  std::vector<wire::ok> oks(channels.size());
  for (std::size_t k = 0; k < channels.size(); ++k) {
    if (!f.sent[k]) continue;
    try {
      const wire::message reply = wire::decode(channels[k].receive(left_of(f), what));
      if (const auto* ok = std::get_if<wire::ok>(&reply)) {
        oks[k] = *ok;
      } else if (const auto* err = std::get_if<wire::error>(&reply)) {
        failures.push_back({k, err->code, fmt::format("{} refused {}: {}", who(k), what, err->message), true});
      } else {
        channels[k].reset();
        session_lost = true;
        failures.push_back({k, errc::protocol,
                            fmt::format("{} answered {} with {}, not OK or ERROR", who(k), what,
                                        wire::to_string(wire::type_of(reply)))});
      }
    } catch (const error& e) {
      // A timeout (the channel rebuilt itself) or a reply that does not decode.
      if (e.code() != errc::timeout) channels[k].reset();
      session_lost = true;
      failures.push_back({k, e.code(),
                          e.code() == errc::timeout
                              ? std::string(e.what())
                              : fmt::format("bad reply from {} to {}: {}", who(k), what, printable(e.what()))});
    }
  }
  const std::size_t asked = channels.size();
  drop_failed(failures, oks);
  if (failures.empty()) {
    REFIT_DEBUG("{}: answered by {} receiver(s) in {:.0f} us", what, channels.size(), seconds_since(f.started) * 1e6);
    return oks;
  }
  // Only the failures left can have lost the session (a receiver dropped took its part with it).
  session_lost = session_lost && std::ranges::any_of(failures, [](const failure& x) { return !x.answered; });
  receivers_failed = true;
  if (session_lost || can.session_dies_on_error) drop_session();
  if (failures.size() == 1) throw error(failures.front().code, failures.front().message);
  std::string message = fmt::format("{} of {} receivers failed {}:", failures.size(), asked, what);
  for (const auto& fl : failures) message += fmt::format("\n  - {}", fl.message);
  throw error(failures.front().code, message);
}

/// Hears out a request still posted (a refit that failed on this side with a batch in flight),
/// so that the channels can be used again; what the receivers said is only logged.
void streamer::impl::settle() noexcept {
  if (!flight) return;
  try {
    (void)collect();  // takes the flight whatever it hears
  } catch (const std::exception& e) {
    REFIT_DEBUG("a request posted before the failure: {}", e.what());
  }
}

}  // namespace refit
