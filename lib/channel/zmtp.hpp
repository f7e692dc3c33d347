// refit — the receiver's own ZMTP 3.x server (NULL and CURVE mechanisms), so that what a peer sends
// is read as it arrives and nothing of a message that never ends piles up where refit cannot see it.
//
// libzmq keeps the frames of an unfinished multipart message inside its pipe until the last one
// comes (MAXMSGSIZE bounds a frame, not a message): one connection sending large frames flagged
// MORE, and answering heartbeats, grew a receiver without bound. Here every frame is consumed as
// it arrives: a message that is not a REQ's request ([empty delimiter, MORE][body, last]) is skipped
// to its last frame without keeping a byte, and only a request's body is kept, as it arrives.
//
// CURVE (rfc.zeromq.org/spec/26, CurveZMQ, as libzmq speaks it): the handshake (HELLO, WELCOME,
// INITIATE with the client's vouch, READY) is the decoder's, and afterwards every frame is one
// MESSAGE box, opened whole as it completes (its MAC covers all of it) and then read as the frame
// it carries: so a CURVE peer holds at most one frame (a body and 33 bytes) where a NULL peer holds
// what it sent of one. The client's long-term key must be one of `curve_server_keys::allowed` when
// that list is not empty.
//
// Two parts:
// - `decoder`: the bytes of one connection, greeting to frames, as a pure state machine with no
//   I/O (tests/fuzz/fuzz_zmtp.cpp feeds it anything);
// - `server`: a listening socket (tcp:// or ipc://) and its connections, non-blocking, driven by
//   rep_channel's wait (lib/channel/channel.cpp): it adds its descriptors to the poll and serves
//   what the poll found.
//
// Memory a peer can make a server hold (see README.md "Who may connect"):
//   per connection:  at most one request body (<= options::max_body, kept as it arrives, complete or
//                    not) + the replies and heartbeats queued for it (a connection is not read while
//                    its reply is unsent) + a read-ahead of at most read_chunk bytes (only when a peer
//                    sent a second message before its first was taken) + a few hundred bytes of state;
//   in total:        max_connections x that + one read buffer (read_chunk) per server.
// Specs: ZMTP 3.0 (rfc.zeromq.org/spec/23) and 3.1 (spec/37: PING/PONG).
#pragma once

#include <poll.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "channel/unique_fd.hpp"

namespace refit::channel::zmtp {

/// Bytes read from a connection at a time (also the most one connection holds read ahead).
inline constexpr std::size_t read_chunk = 64 << 10;
/// The largest command (READY with its metadata, PING) a peer may send; a larger one closes it.
inline constexpr std::size_t max_command_bytes = 8 << 10;
/// The greeting's length (ZMTP 3.x).
inline constexpr std::size_t greeting_bytes = 64;

/// A CURVE server's keys, 32 bytes each: its long-term pair, and the clients' long-term public keys
/// it accepts (empty: any client that holds the server's public key).
struct curve_server_keys {
  std::array<std::uint8_t, 32> public_key{};
  std::array<std::uint8_t, 32> secret_key{};
  std::vector<std::array<std::uint8_t, 32>> allowed;
};

/// The bytes a CURVE MESSAGE adds to the frame it carries: its name, nonce, MAC and flags.
inline constexpr std::uint64_t curve_overhead = 8 + 8 + 16 + 1;
/// The flags byte inside a CURVE MESSAGE box: MORE is bit 0 as in a frame header, but COMMAND is
/// bit 1 (0x02), not the frame header's bit 2 (0x04). libzmq puts its message flags there masked to
/// more | command (msg_t::more = 1, msg_t::command = 2) and reads them back the same way: a PING
/// sealed with 0x04 reaches a libzmq REQ as a data frame outside any reply, which its session
/// refuses, ending the connection for good (a protocol error is never reconnected) with the
/// request in flight unanswered.
inline constexpr std::uint8_t sealed_more = 0x01;
inline constexpr std::uint8_t sealed_command = 0x02;

/// A server's limits and intervals. The defaults are the receiver's; tests shorten the intervals.
struct options {
  std::uint64_t max_body = std::uint64_t{64} << 20;  ///< a request's body (wire::max_message_bytes)
  std::size_t max_connections = 256;                 ///< more are accepted and closed at once
  std::chrono::milliseconds handshake{10000};        ///< greeting and READY must be done within
  std::chrono::milliseconds heartbeat_ivl{1000};     ///< a PING after this long without a frame
  /// A connection that sent no complete frame or command this long after a PING is closed; a ZMTP
  /// 3.0 peer (no PING) only when it stopped in the middle of a frame or message.
  std::chrono::milliseconds heartbeat_timeout{10000};
  /// CURVE: the server's keys (every connection must then speak CURVE); null: NULL mechanism.
  std::shared_ptr<const curve_server_keys> curve;
};

/// The options servers made from now on start from (options{} unless a test changed them).
options default_options();
/// For tests: servers made while it lives use `o` (restores the previous defaults when it goes).
class scoped_default_options {
 public:
  explicit scoped_default_options(const options& o);
  ~scoped_default_options();
  scoped_default_options(const scoped_default_options&) = delete;
  scoped_default_options& operator=(const scoped_default_options&) = delete;

 private:
  options previous_;
};

/// What decoder::feed() stopped for.
enum class event {
  none,     ///< every byte given was consumed; more are needed
  ready,    ///< the handshake is complete (greeting and a READY naming REQ or DEALER)
  ping,     ///< a PING came: answer pong(ping_context())
  request,  ///< a REQ's request is complete: take_body()
  dropped,  ///< a message that is not a request ended (dropped_frames() frames, none kept)
  error,    ///< the peer broke the protocol (reason()); the connection must be closed
};

/// One connection's bytes, as the server (ROUTER, NULL or CURVE mechanism) reads them. After
/// event::error it consumes nothing more. With CURVE keys, what the handshake answers (WELCOME,
/// READY) is left in take_output(), and what the server sends afterwards goes through seal().
class decoder {
 public:
  explicit decoder(std::uint64_t max_body, std::shared_ptr<const curve_server_keys> curve = nullptr);
  ~decoder();
  decoder(decoder&&) noexcept;
  decoder& operator=(decoder&&) noexcept;
  decoder(const decoder&) = delete;
  decoder& operator=(const decoder&) = delete;

  struct result {
    std::size_t consumed = 0;  ///< bytes of the input used; the rest is for the next call
    event what = event::none;
  };
  /// Consumes bytes until something happened that the caller must act on, or the input is used up.
  result feed(std::span<const std::uint8_t> in);

  /// After event::request: the body (moves it out).
  std::string take_body();
  /// After event::ping: the context to echo (at most 16 bytes).
  [[nodiscard]] std::string_view ping_context() const noexcept { return ping_context_; }
  /// After event::dropped: how many frames the message had.
  [[nodiscard]] std::uint64_t dropped_frames() const noexcept { return dropped_frames_; }
  /// After event::error: what the peer did wrong.
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }
  /// After event::ready: the peer's Socket-Type, and whether it speaks ZMTP 3.1 (PING/PONG).
  [[nodiscard]] const std::string& socket_type() const noexcept { return socket_type_; }
  [[nodiscard]] bool heartbeats() const noexcept { return minor_ >= 1 || major_ > 3; }
  [[nodiscard]] bool handshaking() const noexcept { return state_ == state::greeting || !ready_; }
  /// Complete frames, commands and greetings so far: a connection that makes progress is alive.
  [[nodiscard]] std::uint64_t progress() const noexcept { return progress_; }
  /// Inside a frame, or between the frames of a message (a peer that stops here holds state).
  [[nodiscard]] bool mid_message() const noexcept;
  /// The bytes of the body held now (what a stalled peer costs; for tests).
  [[nodiscard]] std::size_t held_bytes() const noexcept;

  /// CURVE: this connection's frames are sealed (every frame the server sends goes through seal()).
  [[nodiscard]] bool sealed() const noexcept { return curve_ != nullptr; }
  /// CURVE: frames to send that the handshake produced (WELCOME, READY), then empty.
  std::string take_output() { return std::exchange(output_, std::string()); }
  /// CURVE, after event::ready: one frame (`flags`: sealed_more, sealed_command) with `payload`, as a
  /// MESSAGE.
  std::string seal(std::uint8_t flags, std::string_view payload);
  /// CURVE, after event::ready: the client's long-term public key (Z85 text).
  [[nodiscard]] const std::string& client_key() const noexcept { return client_key_; }

 private:
  struct curve_state;
  enum class state { greeting, header, size, command, frame, failed };
  class body_buffer;
  std::size_t feed_greeting(std::span<const std::uint8_t> in, event& what);
  std::size_t feed_header(std::span<const std::uint8_t> in, event& what);
  std::size_t feed_body(std::span<const std::uint8_t> in, event& what);
  event header_done();
  event frame_done();
  event command_done();
  event ready_command(std::string_view data);
  event message_frame(bool more, std::uint64_t size);
  event curve_handshake(std::string_view name, std::string_view cmd);
  event curve_hello(std::string_view cmd);
  event curve_initiate(std::string_view cmd);
  event sealed_done();
  event fail(std::string why);

  std::uint64_t max_body_;
  state state_ = state::greeting;
  std::string greeting_;
  std::uint8_t major_ = 0;
  std::uint8_t minor_ = 0;
  bool ready_ = false;
  std::string socket_type_;
  // The frame being read.
  std::uint8_t flags_ = 0;
  std::uint8_t size_bytes_ = 0;  ///< of the size field, read so far
  std::uint64_t size_ = 0;
  std::uint64_t left_ = 0;  ///< body bytes still to come
  std::string command_;
  // The message being read.
  std::uint64_t frames_ = 0;  ///< frames of the message so far (the one being read included)
  bool discarding_ = false;   ///< the message is not a request: its bytes are skipped
  std::unique_ptr<body_buffer> body_;
  std::uint64_t body_from_ = 0;  ///< where the body starts in body_ (CURVE: inside the MESSAGE)
  std::uint64_t body_bytes_ = 0;
  // CURVE.
  std::unique_ptr<curve_state> curve_;
  std::unique_ptr<body_buffer> sealed_;  ///< the MESSAGE frame being read
  std::string output_;
  std::string client_key_;
  std::uint64_t progress_ = 0;
  std::uint64_t dropped_frames_ = 0;
  std::string ping_context_;
  std::string reason_;
};

/// The server's greeting: ZMTP 3.1, mechanism NULL (or CURVE), as-server 1.
std::string greeting(bool curve = false);
/// A command's body: `name` and its data (what command() frames).
std::string command_body(std::string_view name, std::string_view data);
/// A command frame: `name` and its data.
std::string command(std::string_view name, std::string_view data);
/// READY with Socket-Type `socket_type` (and nothing else).
std::string ready_frame(std::string_view socket_type);
/// A reply to a REQ: [empty delimiter, MORE][body, last].
std::string reply_header(std::uint64_t body_bytes);

using clock = std::chrono::steady_clock;

/// A listening socket and its connections. Not thread-safe: one thread drives it (the receiver's).
class server {
 public:
  /// True when `endpoint` (after bind_endpoint()) is one this server binds: ipc:///path, and
  /// tcp:// with a numeric IPv4 or bracketed IPv6 address. Others (an interface or host name, an
  /// abstract ipc name, tcp://src;dst) stay with libzmq.
  static bool handles(std::string_view endpoint);
  /// Binds and listens. Throws refit::error(errc::io) naming `endpoint` when it cannot.
  server(const std::string& endpoint, const options& o);
  ~server();
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  /// The bound endpoint, its port resolved (as ZMQ_LAST_ENDPOINT would say).
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }

  /// Processes bytes already read ahead (no I/O). Call before poll_fds().
  void pump();
  /// Appends the descriptors to poll (listener, connections); service() takes the same slice back.
  void poll_fds(std::vector<pollfd>& out);
  /// After a poll of what poll_fds() appended: accepts, reads, writes, then heartbeats and
  /// timeouts (a connection is timed out only after what it sent was read).
  void service(std::span<const pollfd> polled);
  /// When service() must run even if no descriptor is ready (a heartbeat or timeout is due);
  /// clock::time_point::max() when none. clock::now() or earlier: pump() has work.
  [[nodiscard]] clock::time_point next_timer() const noexcept;

  /// True when a request waits to be taken.
  [[nodiscard]] bool ready() const noexcept { return !ready_.empty(); }
  /// The oldest request waiting (one per connection at most, so connections take turns), and the
  /// id of its connection in `peer`; nullopt when none.
  std::optional<std::string> take(std::string& peer);
  /// Sends `bytes` as the reply to connection `peer` ([empty, MORE][bytes]), without blocking: what
  /// the kernel does not take is queued and flushed by service(). Dropped (false) when the
  /// connection is gone.
  bool reply(const std::string& peer, std::string_view bytes);

  /// Messages dropped whole because they were not a REQ's request.
  [[nodiscard]] std::uint64_t dropped() const noexcept { return dropped_; }
  /// Connections closed by the server: a protocol error, a stall, a peer that hung up mid-message
  /// or mid-handshake, one over max_connections.
  [[nodiscard]] std::uint64_t closed() const noexcept { return closed_; }
  /// Connections open now.
  [[nodiscard]] std::size_t connections() const noexcept { return conns_.size(); }

 private:
  struct connection;
  void accept_all(clock::time_point now);
  void read_from(connection& c, clock::time_point now);
  bool consume(connection& c, std::span<const std::uint8_t> bytes, std::size_t& used, clock::time_point now);
  void flush(connection& c, clock::time_point now);
  void queue(connection& c, std::string_view bytes, clock::time_point now);
  void timers(connection& c, clock::time_point now);
  void close(connection& c, std::string_view why);
  std::string command_to(connection& c, std::string_view name, std::string_view data);
  void count_drop(std::uint64_t frames);
  void sweep();
  void bind_ipc(const std::string& path);
  void bind_tcp(const std::string& host, const std::string& port);

  options options_;
  std::string endpoint_;
  unique_fd listener_;
  bool tcp_ = false;
  std::string ipc_path_;  ///< the socket file this server made (unlinked at the end if still its own)
  std::uint64_t ipc_inode_ = 0;
  clock::time_point accept_paused_until_{};
  std::map<std::string, std::unique_ptr<connection>> conns_;
  std::vector<connection*> polled_;  ///< the connections of poll_fds()' slice, in order
  bool polled_listener_ = false;
  std::deque<std::string> ready_;  ///< connections with a request waiting, oldest first
  std::vector<std::uint8_t> scratch_;
  std::uint64_t dropped_ = 0;
  std::uint64_t closed_ = 0;
};

}  // namespace refit::channel::zmtp
