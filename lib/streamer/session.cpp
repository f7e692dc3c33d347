// refit — the streamer's session: HELLO (once per session) with its secret, the control lanes the
// receivers offer, the conversions they ask for, and ABORT when a refit fails on this side.
//
// A refit that fails on this side after BEGIN (a tensor it cannot send, the source throwing, a
// copy failing) sends ABORT to every receiver, best effort with a short deadline, so that none is
// left holding a half-applied refit until its idle timeout; then the caller gets the original
// error. A refit that fails because a receiver refused or stayed silent needs none: that receiver
// knows, and the session is rebuilt.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "channel/lane.hpp"
#include "model/log.hpp"
#include "model/text.hpp"
#include "streamer/impl.hpp"

namespace refit {
namespace {

/// A fresh session secret (wire::hello::secret): 16 bytes from the system's random source. Every
/// request of the session carries it, so that no other peer of the receiver can act in it.
std::string new_secret() {
  std::random_device rd;
  std::string s(16, '\0');
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const std::uint32_t v = rd();
    std::memcpy(s.data() + i, &v, 4);
  }
  return s;
}

}  // namespace

/// Forgets the session: the next refit says HELLO again.
void streamer::impl::drop_session() noexcept {
  in_session = false;
  try {
    // The stream (and what a later drain waits for) follows the direct writes still running, as
    // when they ran on it. It does not hold the unmapping below: close_session() waits for nothing.
    if (copier && buffers) copier->join(buffers->stream());
  } catch (const std::exception& e) {
    REFIT_DEBUG("joining the copies of the session dropped: {}", e.what());
  }
  buffers->close_session();
}

/// "the receiver at EP" or "receiver 2 of 3 (EP)".
std::string streamer::impl::who(std::size_t k) const {
  if (endpoints.size() == 1) return fmt::format("the receiver at {}", endpoints[k]);
  return fmt::format("receiver {} of {} ({})", k + 1, endpoints.size(), endpoints[k]);
}

void streamer::impl::ensure_session() {
  // A receiver joined since the session opened: it needs a HELLO, and the buffers of this one are
  // unlinked (see fleet.cpp), so every receiver gets a new session.
  if (in_session && membership_changed) drop_session();
  if (in_session) return;
  membership_changed = false;
  while (channels.size() < endpoints.size()) channels.emplace_back(endpoints[channels.size()], options.curve);
  wire::hello h;
  h.token = token;
  secret = new_secret();
  h.secret = secret;
  h.alignment = options.alignment;
  h.layout = options.layout;
  h.group_rank = options.group_rank;
  h.group_size = options.group_size;
  h.reply_timeout_ms = static_cast<std::uint64_t>(options.timeout.count());
  h.lane = options.control_lane;
  buffers->open_session(h);
  if (h.host_id.empty()) h.host_id = transport::host_identity();  // a transport that does not say
  // HELLO starts a session afresh, through ZeroMQ: the receiver makes a new lane for it.
  for (channel::req_channel& c : channels) c.attach_lane(nullptr);
  try {
    const auto hello_to = [&](std::size_t k) {
      wire::hello mine = h;
      buffers->hello_for(k, mine);
      return wire::message(std::move(mine));
    };
    const auto answered = [this] {  // some receiver replied to HELLO already (join() says why it asks)
      for (std::size_t k = 0; k < channels.size(); ++k)
        if (flight && flight->sent[k] && channels[k].reply_ready()) return true;
      return false;
    };
    const auto oks = request(hello_to, "HELLO", [&] { buffers->join(options.timeout, answered); });
    conversions = merge_conversions(oks);
    // The lanes first: memory shared as descriptors (VMM weights offered for direct writes, and
    // this side's VMM tensors later) needs each lane's descriptor link.
    open_lanes(oks);
    std::vector<std::shared_ptr<channel::fd_link>> links;
    for (const channel::req_channel& c : channels) links.push_back(c.fds());
    buffers->link(std::move(links));
    try {
      buffers->session_accepted(oks);
    } catch (const error& e) {
      // The receivers offered their weights for direct or in-place writes, but that cannot be done
      // from here: start over with a session that stages through the buffers (not where several
      // receivers need direct writes: cuda_ipc).
      if (e.code() != errc::transport || (endpoints.size() > 1 && can.several_need_direct)) throw;
      REFIT_WARN("cannot write straight into the weights of {}: {}; staging through the buffers instead",
                 endpoints.size() > 1 ? std::string("the receivers") : who(0), e.what());
      buffers->disable_direct();
      drop_session();
      ensure_session();
      return;
    }
  } catch (...) {
    drop_session();
    throw;
  }
  in_session = true;
  ++session_number;
  REFIT_INFO("session with {} receiver(s) at {}: {} × {} MiB {} buffers", endpoints.size(), fmt::join(endpoints, ", "),
             options.buffer_count, options.buffer_bytes >> 20, to_string(options.transport));
}

/// Sends the session's requests to each receiver through the control lane it offered, when it
/// offered one and it opens here (otherwise through ZeroMQ, as before).
void streamer::impl::open_lanes(const std::vector<wire::ok>& oks) {
  if (!options.control_lane) return;
  for (std::size_t k = 0; k < oks.size() && k < channels.size(); ++k) {
    if (oks[k].lane.empty()) continue;
    try {
      channels[k].attach_lane(channel::lane::open(oks[k].lane));
    } catch (const error& e) {
      REFIT_INFO("cannot open the control lane of {} (requests go through ZeroMQ): {}", who(k), e.what());
    }
  }
}

/// The conversions every receiver asked for, one per name. Two receivers asking one name as
/// different things cannot both be served by one stream of bytes: errc::invalid_argument.
std::unordered_map<std::string, wire::conversion> streamer::impl::merge_conversions(
    const std::vector<wire::ok>& oks) const {
  std::unordered_map<std::string, wire::conversion> merged;
  std::unordered_map<std::string, std::size_t> asked_by;
  for (std::size_t k = 0; k < oks.size(); ++k) {
    for (const wire::conversion& c : oks[k].convert) {
      const auto [it, fresh] = merged.emplace(c.name, c);
      if (fresh) {
        asked_by.emplace(c.name, k);
        continue;
      }
      if (it->second == c) continue;
      const auto describe_one = [](const wire::conversion& x) {
        return x.q == quant::none ? std::string(to_string(x.type))
                                  : fmt::format("{} ({})", to_string(x.type), to_string(x.q));
      };
      throw error(
          errc::invalid_argument,
          fmt::format("tensor '{}': {} asks for it as {} and {} as {}: one streamer sends one conversion of "
                      "a tensor to all its receivers; register the same dtype and quant everywhere",
                      printable(c.name), who(asked_by.at(c.name)), describe_one(it->second), who(k), describe_one(c)));
    }
  }
  return merged;
}

/// Tells every receiver that this side gave up refit `version` (ABORT), within a short
/// deadline, and ignores their answers: a receiver that misses it still aborts at its idle
/// timeout. A silent one ends the session; so does nccl, whose receivers drop their
/// communicator when they abort.
void streamer::impl::abort_everywhere(std::uint64_t version, errc code, const std::string& reason) noexcept {
  settle();
  // A receiver that refused the request in flight knows; when it is the only one, nobody else needs
  // telling. Several: the others would hold the version open until their idle timeout.
  if (receivers_failed && channels.size() < 2) return;
  tell_abort(version, code, reason);
}

/// Sends ABORT of `version` to every receiver and hears their answers (within at most 1 s); a
/// receiver that no longer holds the version answers OK all the same, one whose channel was
/// rebuilt takes it for a stranger's, and either is only logged.
void streamer::impl::tell_abort(std::uint64_t version, errc code, const std::string& reason) noexcept {
  try {
    REFIT_INFO("version {} failed: {}; telling {} receiver(s) (ABORT)", version, reason, channels.size());
    const std::string bytes = wire::encode(wire::abort{version, code, reason}, secret);
    const std::string what = fmt::format("ABORT of version {}", version);
    const auto deadline = clock::now() + std::min(options.timeout, milliseconds{1000});
    const auto left = [&] {
      return std::max(milliseconds{1}, std::chrono::ceil<milliseconds>(deadline - clock::now()));
    };
    bool lost = can.session_dies_on_error;
    std::vector<bool> sent(channels.size(), false);
    for (std::size_t k = 0; k < channels.size(); ++k) {
      try {
        channels[k].send(bytes, left(), what);
        sent[k] = true;
      } catch (const std::exception& e) {
        REFIT_DEBUG("{} to {} not sent: {}", what, who(k), e.what());
        lost = true;
      }
    }
    for (std::size_t k = 0; k < channels.size(); ++k) {
      if (!sent[k]) continue;
      try {
        (void)channels[k].receive(left(), what);  // OK, or ERROR from a receiver too old to know ABORT
      } catch (const std::exception& e) {
        REFIT_DEBUG("{} not answered by {}: {}", what, who(k), e.what());
        lost = true;  // the channel rebuilt itself
      }
    }
    if (lost) drop_session();
  } catch (...) {
    drop_session();
  }
}

}  // namespace refit
