// refit — the receiver's sessions: its lanes (one per streamer of a group), HELLO and the session
// it opens, who may act in it (stranger(), from_owner()), replies, and end_session().
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "receiver/impl.hpp"

namespace refit {
namespace {

/// The endpoint lane `rank` of `count` binds (see receiver_options::streamers).
std::string lane_endpoint(const std::string& requested, std::size_t rank, std::size_t count) {
  if (count == 1 || requested.empty()) return requested;
  if (const auto at = requested.find("{rank}"); at != std::string::npos)
    return requested.substr(0, at) + std::to_string(rank) + requested.substr(at + 6);
  if (requested.starts_with("tcp://") && (requested.ends_with(":0") || requested.ends_with(":*"))) return requested;
  throw error(errc::invalid_argument,
              fmt::format("receiver_options.endpoint '{}': a receiver of {} streamers binds one endpoint per streamer; "
                          "give \"\" (private ipc endpoints), a tcp endpoint with port 0, or a pattern with "
                          "\"{{rank}}\" in it",
                          requested, count));
}

}  // namespace

receiver::impl::impl(receiver_options o)
    : options(std::move(o)),
      token(options.token.empty() && std::getenv("REFIT_TOKEN") != nullptr ? std::getenv("REFIT_TOKEN")
                                                                           : options.token) {
  if (options.idle_timeout.count() <= 0)
    throw error(errc::invalid_argument, "receiver_options.idle_timeout must be positive");
  if (options.streamers == 0 || options.streamers > wire::max_group_size)
    throw error(errc::invalid_argument, fmt::format("receiver_options.streamers is {}; it must be in [1, {}]",
                                                    options.streamers, wire::max_group_size));
  if (options.delta_threads > delta::max_threads)
    throw error(errc::invalid_argument,
                fmt::format("receiver_options.delta_threads is {}: a host delta is applied on at most {} threads "
                            "(0: min(hardware threads, 8))",
                            options.delta_threads, delta::max_threads));
  if (options.stage == stage_kind::device && !REFIT_HAVE_CUDA)
    throw error(errc::invalid_argument,
                "receiver_options.stage = device: a staging area on the GPU needs CUDA, and this refit was built "
                "without it; use stage = host (host weights over host_shm) or none");
  if (options.stage != stage_kind::none && options.stage != stage_kind::host && options.stage != stage_kind::device)
    throw error(errc::invalid_argument,
                fmt::format("receiver_options.stage has an unknown value ({})", static_cast<unsigned>(options.stage)));
  lanes.reserve(options.streamers);
  try {
    for (std::size_t r = 0; r < options.streamers; ++r)
      lanes.emplace_back(r, lane_endpoint(options.endpoint, r, options.streamers), options.curve,
                         options.allow_insecure_tcp);
  } catch (...) {
    remove_endpoints();
    throw;
  }
  ln = &lanes.front();
}

receiver::impl::~impl() {
  for (lane& l : lanes) {
    ln = &l;
    end_session();
  }
  remove_endpoints();
}

void receiver::impl::remove_endpoints() noexcept {
  if (options.endpoint.empty())
    for (const lane& l : lanes) channel::remove_private_endpoint(l.channel.endpoint());
}

/// A message kept by serve_one() waits for its reply on some lane.
bool receiver::impl::owes() const noexcept {
  return std::any_of(lanes.begin(), lanes.end(),
                     [](const lane& l) { return l.pending.has_value() || l.waiting.has_value(); });
}

/// The reply timeout HELLO `h` says its streamer has (zero when it does not say), bounded.
milliseconds receiver::impl::reply_timeout_of(const wire::hello& h) {
  return milliseconds{static_cast<std::int64_t>(std::min<std::uint64_t>(h.reply_timeout_ms, std::uint64_t{1} << 40))};
}

/// The streamer of lane `l`, for messages: its peer name, and its rank in a group.
std::string receiver::impl::who(const lane& l) const {
  const std::string name = l.peer.empty() ? std::string("a streamer") : printable(l.peer, 256);
  return grouped() ? fmt::format("rank {} ({})", l.rank, name) : name;
}

std::optional<std::uint64_t> receiver::impl::committed_version() const noexcept {
  if (!has_committed.load(std::memory_order_acquire)) return std::nullopt;
  return committed.load(std::memory_order_acquire);
}

void receiver::impl::note_error(const std::string& message) {
  std::lock_guard lock(mutex);
  last_error_ = message;
}

/// Ends the current lane's session (and the refit in progress, if the lane takes part in it).
void receiver::impl::end_session() noexcept {
  if (ln->in_refit()) abort_refit(fmt::format("the session with {} ended", who(*ln)), errc::incomplete);
  if (ln->sink) {
    try {
      ln->sink->drain();
    } catch (const std::exception& e) {
      REFIT_WARN("draining the session with {} failed: {}", ln->peer, e.what());
    }
    ln->sink->detach();
  }
  ln->tracker.reset();
  ln->copier.reset();
  ln->peer.clear();
  ln->owned = false;
  ln->owner.clear();
  ln->secret.clear();
  ln->direct = false;
  ln->into_stage = false;
  ln->offered_stage = nullptr;
  release_retired_stages();
  ln->in_place = false;
  ln->parts = false;
  ln->laid_out = false;
}

void receiver::impl::reply_ok(std::vector<std::string> handles, wire::session_mode mode,
                              std::vector<wire::conversion> convert, std::string lane) {
  wire::ok ok;
  ok.lane = std::move(lane);
  ok.convert = std::move(convert);
  ok.committed = committed_version();
  ok.dirty = is_dirty.load();
  ok.handles = std::move(handles);
  ok.mode = mode;
  ln->channel.reply(wire::encode(ok));
}

void receiver::impl::reply_error(errc code, const std::string& message) {
  note_error(message);
  ln->channel.reply(wire::encode(wire::error{code, message}));
}

/// Refuses a HELLO without touching the session in use: logs `logged`, replies `message`.
receiver_event receiver::impl::refuse_hello(const wire::hello& h, errc code, const std::string& message,
                                            std::string_view logged) {
  REFIT_WARN("refused HELLO from {}: {}", h.peer.empty() ? "an unnamed peer" : h.peer, logged);
  reply_error(code, message);
  return receiver_event::refused;
}

receiver_event receiver::impl::on_hello(const wire::hello& h) {
  if (const auto refused = check_hello(h)) return *refused;
  // A new session replaces the old one (its streamer is gone or restarted).
  end_session();
  try {
    open_session(h);
    return receiver_event::hello;
  } catch (const error& e) {
    if (ln->sink) ln->sink->detach();
    ln->tracker.reset();
    REFIT_WARN("refused HELLO from {}: {}", h.peer, e.what());
    reply_error(e.code(), e.what());
    return receiver_event::refused;
  }
}

/// Refuses HELLO `h` when it may not open a session here (token, group rank, layout, memory the
/// table no longer owns), without touching the session in use; nullopt when it may.
std::optional<receiver_event> receiver::impl::check_hello(const wire::hello& h) {
  if (!same_token(h.token, token)) {
    const std::string message = fmt::format(
        "session token mismatch: this receiver expects {}; set the same REFIT_TOKEN (or options.token) on "
        "both sides",
        token.empty() ? "no token" : "another token");
    return refuse_hello(h, errc::unauthorized, message, "token mismatch");
  }
  if (h.group_size != lanes.size() || h.group_rank != ln->rank) {
    // Shards of one group assembled with another's, or two streamers on one lane, would commit
    // versions nobody sent whole.
    const std::string message =
        lanes.size() == 1
            ? fmt::format(
                  "this receiver takes one streamer, but the streamer says it is rank {} of a group of {} "
                  "(streamer_options::group_size): give the receiver receiver_options::streamers = {}",
                  h.group_rank, h.group_size, h.group_size)
            : fmt::format(
                  "this endpoint takes rank {} of a group of {} streamers (receiver_options::streamers), but "
                  "the streamer says it is rank {} of {}: rank k connects to the receiver's endpoints()[k]",
                  ln->rank, lanes.size(), h.group_rank, h.group_size);
    return refuse_hello(h, errc::invalid_argument, message, message);
  }
  if (!h.layout.empty() && !options.layout.empty() && h.layout != options.layout) {
    // Bytes laid out for another engine would land in the wrong places: refuse before any move.
    const std::string message = fmt::format(
        "engine layout mismatch: the streamer's tensors were recorded for layout {}, this receiver's parameter "
        "table for layout {}; record the route table again and give both sides the same one",
        h.layout, options.layout);
    return refuse_hello(h, errc::invalid_argument, message, message);
  }
  if (const auto gone = memory_gone()) {
    // Writing into memory the engine freed or reallocated would corrupt whatever lives there now.
    return refuse_hello(h, errc::invalid_argument, *gone, *gone);
  }
  return std::nullopt;
}

/// Sets up the session HELLO `h` asks for on the current lane and answers it. Throws refit::error
/// (on_hello() refuses the HELLO).
void receiver::impl::open_session(const wire::hello& h) {
  if (!ln->sink || ln->sink->name() != h.transport)
    ln->sink = transport::make_sink(h.transport, options.device, options.idle_timeout);
  wire::ok reply;
  ln->sink->attach(h, reply);
  // The session's requests may come through a lane of shared memory from here on (the old
  // session's lane, if any, is replaced: this HELLO's reply still goes the way it came). Its
  // descriptor link serves the transport too (VMM memory), from the offer on.
  std::unique_ptr<channel::lane> lane = offer_lane(h);
  ln->sink->link(lane ? lane->fds() : nullptr);
  if (!callback) reply.convert = conversions();
  ln->asked = reply.convert;
  offer_placement(h, reply);
  std::vector<std::uint64_t> sizes;
  for (std::size_t i = 0; i < ln->sink->count(); ++i)
    sizes.push_back(ln->direct || ln->in_place ? transport::direct_batch_bytes : ln->sink->buffer_bytes(i));
  ln->tracker.emplace(std::move(sizes), wire::max_entries, grouped());
  ln->copier = copy::make_copier(copy::choose(ln->sink->engine(), options.engine), options.device, options.idle_timeout,
                                 copy::offload_for(options.engine));
  ln->peer = h.peer;
  ln->owned = true;
  ln->owner = ln->channel.peer_id();
  ln->secret = h.secret;
  ln->reply_timeout = reply_timeout_of(h);
  ln->laid_out = h.mode == wire::session_mode::in_place;
  ln->session_generation = sink_generation;
  REFIT_INFO("session with {}: {} × {} MiB {} buffers{}", who(*ln), ln->sink->count(), ln->sink->buffer_bytes(0) >> 20,
             h.transport, ln->direct || ln->in_place ? ", written in place" : "");
  reply_ok(std::move(reply.handles), reply.mode, std::move(reply.convert), lane ? lane->offer() : std::string());
  ln->channel.attach_lane(std::move(lane));
  ln->sink->after_reply();
}

/// How the session's bytes land: written by the streamer straight into the table (direct),
/// received straight into it (in place), or staged in the buffers (neither).
void receiver::impl::offer_placement(const wire::hello& h, wire::ok& reply) {
  // A staged receiver's weights are written by apply_prepared() alone: it offers them to no
  // streamer. A device stage is offered in their place (stage_offer()): a cuda_ipc streamer that asks
  // for direct writes writes the stage, and nccl in place receives into it, which is how one streamer
  // serves several staged TP ranks (nccl: each only its parts). Offered no destination (a callback
  // sink, a stage that cannot be offered), a transport declines and makes the buffers the batches
  // come through (nccl makes its receive buffers here).
  ln->direct = ln->in_place = ln->parts = ln->into_stage = false;
  std::vector<plan::destination> dests;
  if (staged()) {
    dests = stage_offer();
  } else if (!callback) {
    dests.reserve(table.size());
    for (const auto& [name, slots] : table)
      for (const slot& sl : slots) dests.push_back(sl.dest);
  }
  ln->direct = !dests.empty() && ln->sink->offer_direct(h, dests, reply);
  ln->in_place = !ln->direct && ln->sink->offer_in_place(h, dests, reply);
  ln->parts = ln->in_place && ln->sink->parts();
  ln->into_stage = staged() && (ln->direct || ln->in_place);
  // A streamer that writes the stage maps it: it is kept while this session lasts (retire_stage()).
  if (ln->into_stage && ln->direct) ln->offered_stage = device_stage.get();
}

/// A control lane for the session HELLO `h` starts, when its streamer asked for one, runs on this
/// host and the options allow it; null otherwise (or when none can be made: the session then
/// goes through ZeroMQ alone).
std::unique_ptr<channel::lane> receiver::impl::offer_lane(const wire::hello& h) {
  if (!h.lane || !options.control_lane || h.host_id != transport::host_identity()) return nullptr;
  try {
    return channel::lane::create();
  } catch (const error& e) {
    REFIT_INFO("no control lane for {} (its requests go through ZeroMQ): {}", who(*ln), e.what());
    return nullptr;
  }
}

/// True when the request in hand came from the peer that owns the lane's session: through its
/// control lane, or through the connection its HELLO came by while it has not moved to the lane.
bool receiver::impl::from_owner() const {
  if (!ln->owned) return false;
  if (ln->channel.last_from_lane()) return true;
  return !ln->channel.on_lane() && ln->channel.peer_id() == ln->owner;
}

/// Why request `m` (which carried `secret`) may not act in the lane's session, or nullopt. A HELLO
/// may always try (its token decides); every other request of a session must come from the
/// session's owner and carry its secret. Without a session, the handlers refuse what needs one.
std::optional<std::string> receiver::impl::stranger(const wire::message& m, const std::string& secret) const {
  if (std::holds_alternative<wire::hello>(m) || !ln->owned) return std::nullopt;
  if (from_owner() && same_token(secret, ln->secret)) return std::nullopt;
  const std::string_view what = wire::to_string(wire::type_of(m));
  if (!ln->channel.last_from_lane() && ln->channel.on_lane())
    return fmt::format(
        "{} refused: the session with {} moved to its control lane; over ZeroMQ this receiver "
        "takes only a new HELLO",
        what, who(*ln));
  return fmt::format(
      "{} refused: it does not come from the peer that opened the session with {} (another "
      "connection, or not the session's secret); say HELLO first",
      what, who(*ln));
}

}  // namespace refit
