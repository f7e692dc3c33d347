// refit — the control channel: RAII over cppzmq REQ (streamer) and ROUTER (receiver) sockets with
// deadlines, linger 0, and recovery. Clear errors instead of hangs.
//
// The receiver speaks REP's protocol on the wire (a REQ streamer talks to it unchanged) and parses
// the envelope itself: a request is an empty delimiter and one body frame; anything else is dropped
// whole and counted, never answered in another peer's place. (libzmq's REP loses the next peer's
// reply after a malformed request from a peer that is already gone, and takes each frame of a
// multipart request as a request of its own.) It reads ZMTP itself (zmtp.hpp), NULL or CURVE, so
// a message that never ends holds at most one frame; an endpoint that server does not bind (a host
// or interface name, an abstract ipc name) gets a libzmq ROUTER socket, whose unfinished messages
// only RCVHWM and heartbeats bound. peer_id() names the connection the request in hand came by.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "channel/zmtp.hpp"
#include "refit/error.hpp"
#include "refit/options.hpp"

namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq
struct zmq_pollitem_t;

namespace refit::channel {

class lane;
class fd_link;

/// The process-wide ZeroMQ context (created on first use, never destroyed before exit).
zmq::context_t& context();

/// A private ipc endpoint: "ipc://<dir>/<name>.sock" where <dir> is a fresh directory of mode
/// 0700 under $XDG_RUNTIME_DIR (or /tmp). The directory is removed by remove_private_endpoint().
std::string make_private_endpoint(std::string_view name = "receiver");
/// Removes the socket file and its private directory if `endpoint` was made by
/// make_private_endpoint(); otherwise does nothing. Never throws.
void remove_private_endpoint(std::string_view endpoint) noexcept;

/// Applies the bind defaults: "" → make_private_endpoint(); "tcp://*:N" and "tcp://:N" →
/// "tcp://127.0.0.1:N"; "tcp://N" (port only) → "tcp://127.0.0.1:N". Others unchanged. Throws
/// errc::invalid_argument for a scheme other than ipc:// or tcp://.
std::string bind_endpoint(std::string_view requested);

/// Checks CURVE keys before any socket uses them. Receiver (`server`): none, or a secret key,
/// with a public key that, when given, belongs to it. Streamer: none, or all three keys (its own
/// pair and the receiver's public key). Keys are 40-character Z85 text. Throws
/// refit::error(errc::invalid_argument) naming the option otherwise.
void validate_curve(const curve_keys& curve, bool server);

/// True when `endpoint` (after bind_endpoint()) is reachable from this host only: ipc://, or tcp://
/// on a loopback address (127.0.0.0/8, ::1, localhost, the interface "lo").
bool loopback_only(std::string_view endpoint);

/// True when REFIT_ALLOW_INSECURE is set to 1 in the environment.
bool insecure_allowed_by_env() noexcept;

/// Receiver side. Binds on construction.
class rep_channel {
 public:
  /// Throws refit::error(io) naming the endpoint when bind fails, and errc::invalid_argument for a
  /// tcp endpoint other hosts can reach without CURVE (no curve.secret_key) unless
  /// `allow_insecure` (or REFIT_ALLOW_INSECURE=1).
  rep_channel(std::string_view endpoint, const curve_keys& curve = {}, bool allow_insecure = false);
  /// For tests: without CURVE, with the ZMTP server's limits and intervals `o` (shorter heartbeats).
  rep_channel(std::string_view endpoint, const zmtp::options& o);
  ~rep_channel();
  rep_channel(rep_channel&&) noexcept;
  rep_channel& operator=(rep_channel&&) noexcept;

  /// The bound endpoint with its port resolved (as ZMQ_LAST_ENDPOINT says it).
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }

  /// Waits up to `wait` for a request; nullopt when none came. Must be followed by reply() before
  /// the next receive() when it returned a request.
  /// `soon`: a request is expected shortly (a refit is in progress): the wait asks without
  /// sleeping for a moment before it blocks, sparing the wake-up latency.
  std::optional<std::string> receive(std::chrono::milliseconds wait, bool soon = false);
  /// Replies to the last request, the way it came (ZeroMQ, or the lane). Never blocks for long: what
  /// the socket does not take at once is queued (ZMTP) or dropped (libzmq); a reply to a peer that is
  /// gone is dropped, and that is not an error.
  void reply(std::string_view bytes);

  /// Listens to `l` too from now on (see lane.hpp), in place of any lane before; null: none.
  /// A request that came through the lane replaced is still answered through it.
  void attach_lane(std::unique_ptr<lane> l);
  /// True when the last request came through a lane and waits for its reply.
  [[nodiscard]] bool last_from_lane() const noexcept { return static_cast<bool>(answer_lane_); }
  /// The id of the connection the request in hand came through (one per connection, never reused in
  /// the process); "" when it came through the lane, or once it was answered.
  [[nodiscard]] const std::string& peer_id() const noexcept { return answer_to_; }
  /// True when a lane is attached and a request has come through it: its streamer moved there.
  [[nodiscard]] bool on_lane() const noexcept { return lane_ && lane_heard_; }
  /// True (once) when the lane's streamer was found gone (see lane::streamer_gone()): its process
  /// ended or it closed the lane. The lane is dropped then; its session cannot go on through it.
  [[nodiscard]] bool lane_gone() noexcept { return std::exchange(lane_gone_, false); }
  /// Requests dropped unanswered because their envelope was not a REQ's (for tests and logs).
  [[nodiscard]] std::uint64_t dropped() const noexcept { return server_ ? server_->dropped() : dropped_; }
  /// Connections the ZMTP server closed (protocol errors, stalls, over the limit); 0 with libzmq.
  [[nodiscard]] std::uint64_t closed() const noexcept { return server_ ? server_->closed() : 0; }
  /// Connections the ZMTP server has open now; 0 with libzmq.
  [[nodiscard]] std::size_t connections() const noexcept { return server_ ? server_->connections() : 0; }

  /// Waits up to `wait` until one of `channels` has a request; returns its index (the first ready
  /// one in order), nullopt when none came. `soon` as for receive().
  static std::optional<std::size_t> wait_any(std::span<rep_channel* const> channels, std::chrono::milliseconds wait,
                                             bool soon = false);

 private:
  /// The request waiting (ready) on this channel, taken off the lane or the socket; nullopt when
  /// neither has one.
  std::optional<std::string> take();
  /// The next well-formed request waiting on the socket (malformed ones are dropped), or nullopt.
  std::optional<std::string> take_from_socket();
  void open(std::string_view endpoint, const curve_keys& curve, bool allow_insecure, const zmtp::options& o);
  void open_zmq(const std::string& target, const curve_keys& curve, bool owns);
  [[nodiscard]] bool is_open() const noexcept { return socket_ || server_; }
  /// What one wait polls, kept across its turns (no allocation per poll).
  struct poll_state {
    std::vector<pollfd> fds;
    std::vector<std::pair<std::size_t, std::size_t>> slices;  ///< each channel's server's part of fds
    std::vector<zmq_pollitem_t> sockets;                      ///< the libzmq sockets, in channel order
  };
  /// Polls every channel's server, libzmq socket and (`with_lanes`) lane until `until`, then lets the
  /// servers serve what it found. True when anything was ready.
  static bool poll_once(std::span<rep_channel* const> channels, std::chrono::steady_clock::time_point until,
                        bool with_lanes, poll_state& st);
  static error poll_failure(std::span<rep_channel* const> channels, const std::string& reason);
  /// wait_any() to a deadline, spinning for `spin` first.
  static std::optional<std::size_t> wait_ready(std::span<rep_channel* const> channels,
                                               std::chrono::steady_clock::time_point deadline,
                                               std::chrono::microseconds spin);

  std::shared_ptr<const void> zap_;        ///< this socket's ZAP domain (allowed client keys), if any
  std::unique_ptr<zmq::socket_t> socket_;  ///< an endpoint the ZMTP server does not bind
  std::unique_ptr<zmtp::server> server_;   ///< the others, NULL or CURVE
  std::string endpoint_;
  bool owns_endpoint_ = false;  ///< made by bind_endpoint(""): removed with the channel
  std::shared_ptr<lane> lane_;
  /// The lane the last request came through, while it waits for its reply (it may have been
  /// replaced by attach_lane meanwhile); null when it came through the socket.
  std::shared_ptr<lane> answer_lane_;
  bool lane_heard_ = false;  ///< a message came through lane_ (its files are removed then)
  /// The routing id of the request in hand, owed a reply through the socket; "" when none (or it
  /// came through the lane).
  std::string answer_to_;
  bool lane_gone_ = false;  ///< see lane_gone()
  std::uint64_t dropped_ = 0;
};

/// Streamer side. Connects on construction (ZeroMQ connects in the background; the peer need
/// not exist yet).
class req_channel {
 public:
  req_channel(std::string endpoint, const curve_keys& curve = {});
  ~req_channel();
  req_channel(req_channel&&) noexcept;
  req_channel& operator=(req_channel&&) noexcept;

  /// Sends `bytes` and waits up to `timeout` for the reply. On timeout throws
  /// refit::error(errc::timeout) with a message naming `what` (e.g. "BATCH 12 of version 7"),
  /// the endpoint and how long it waited, and rebuilds the socket (so the channel is usable
  /// again; the next request must start a new session).
  std::string request(std::string_view bytes, std::chrono::milliseconds timeout, std::string_view what);

  /// The two halves of request(), for a streamer talking to several receivers at once: send()
  /// to each, then receive() from each. Same deadlines, errors and recovery as request(); a
  /// send() must be followed by a receive() before the next send().
  void send(std::string_view bytes, std::chrono::milliseconds timeout, std::string_view what);
  std::string receive(std::chrono::milliseconds timeout, std::string_view what);

  /// Closes and reconnects the socket (drops anything in flight), and drops the lane.
  void reset();

  /// Sends the requests through `l` (opened from the receiver's offer, see lane.hpp) from now on,
  /// in place of ZeroMQ; null: through ZeroMQ again.
  void attach_lane(std::unique_ptr<lane> l);
  [[nodiscard]] bool has_lane() const noexcept { return static_cast<bool>(lane_); }
  /// The descriptor link of the lane (see fd_link.hpp); null without a lane or link.
  [[nodiscard]] std::shared_ptr<fd_link> fds() const;

  /// After send(): true when the reply has arrived (receive() will not wait). Never waits itself;
  /// false on any error (receive() then reports it).
  [[nodiscard]] bool reply_ready() noexcept;

  /// Before a request that comes soon (within the receiver's spin, 500 us): wakes the receiver if
  /// it sleeps, through the lane's doorbell (lane::wake_peer), so that its wake-up (~100 us on a
  /// server VM) overlaps the wait instead of adding to the request's round trip. Nothing without
  /// a lane. Never throws, never waits.
  void wake_receiver() noexcept;
  /// A request follows within `hold` (lane::announce): the receiver stops sleeping and waits for it
  /// spinning until it comes or `hold` has passed. False (nothing done) without a lane: a receiver
  /// on another host is not told. Never throws, never waits.
  bool announce(std::chrono::milliseconds hold) noexcept;
  /// True while the receiver waits asleep on the lane's doorbell; false without a lane.
  [[nodiscard]] bool receiver_asleep() const noexcept;

  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }
  /// How many times the socket was rebuilt (for tests and logs).
  [[nodiscard]] std::size_t resets() const noexcept { return resets_; }

 private:
  void connect();
  std::string endpoint_;
  curve_keys curve_;
  std::unique_ptr<zmq::socket_t> socket_;
  std::unique_ptr<lane> lane_;
  std::size_t resets_ = 0;
};

}  // namespace refit::channel
