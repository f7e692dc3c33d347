// refit — file descriptors between the two ends of a control lane.
//
// Why: memory that the CUDA driver shares as a file descriptor (VMM allocations: torch's
// expandable segments, cuMemCreate with POSIX handles) can only reach another process as that
// descriptor, and a descriptor only travels through a Unix socket (SCM_RIGHTS). The receiver's
// lane directory (mode 0700, see lane.hpp) holds one: the receiver listens there, the streamer
// connects when it opens the lane, and the receiver accepts at its first use of the link. After
// that either end may send.
//
// Each message is one descriptor and a 64-bit tag saying what it is (the sender's id of the
// memory). A reader asks for the next descriptor of a tag: descriptors of other tags before it
// (sent for a refit that failed before the reader got there) are closed and skipped, so a
// half-used link never hands one thing out for another.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace refit::channel {

class fd_link {
 public:
  using clock = std::chrono::steady_clock;

  /// Receiver: listens at `path` (a new socket file; the caller's directory keeps strangers out).
  /// Throws refit::error(errc::io) naming the path and the system error.
  static std::shared_ptr<fd_link> listen(const std::string& path);
  /// Streamer: connects to the socket at `path`. Throws refit::error(errc::io) when it cannot
  /// (nothing listens there, not a socket of this user).
  static std::shared_ptr<fd_link> connect(const std::string& path);

  ~fd_link();
  fd_link(const fd_link&) = delete;
  fd_link& operator=(const fd_link&) = delete;

  /// Sends a duplicate of `fd` tagged `tag` (the caller keeps `fd`), waiting for room at most
  /// until `deadline`. False, having sent nothing, when it could not: no room in time, the peer
  /// gone, no connection accepted by the deadline (listening end). Never throws.
  bool send(std::uint64_t tag, int fd, clock::time_point deadline) noexcept;

  /// The next descriptor tagged `tag` (the caller owns it), closing those of other tags that come
  /// before it; -1 when none came by `deadline`, the peer closed the link, or a message broke the
  /// rules (no descriptor, a short tag). Never throws.
  int receive(std::uint64_t tag, clock::time_point deadline) noexcept;

 private:
  fd_link() = default;
  /// Listening end: accepts the peer's connection, waiting at most until `deadline`.
  bool accept_until(clock::time_point deadline) noexcept;

  int listening_ = -1;  ///< receiver: the listening socket, until accepted
  int socket_ = -1;     ///< the connected socket
};

}  // namespace refit::channel
