// refit — file descriptors between the two ends of a control lane. See fd_link.hpp.
#include "channel/fd_link.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "channel/unique_fd.hpp"
#include "refit/error.hpp"

namespace refit::channel {
namespace {

using clock = fd_link::clock;

/// Descriptors a message may carry before the kernel truncates its control data (MSG_CTRUNC).
/// The rules allow one; room for a few more lets a message with extras be read whole and closed.
constexpr std::size_t max_carried = 4;

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

unique_fd new_socket() { return unique_fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)); }

sockaddr_un address_of(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // sun_path must hold the terminating NUL too: a longer path would be cut, not refused.
  if (path.empty() || path.size() >= sizeof(addr.sun_path) || path.find('\0') != std::string::npos)
    throw error(errc::io, fmt::format("the descriptor link's socket path {} is not usable (empty, or longer than the "
                                      "{} bytes a Unix socket's path may have): use a shorter directory",
                                      path, sizeof(addr.sun_path) - 1));
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

/// True when the process at the other end of `fd` runs as this user: a descriptor reaches only
/// what could open it itself, whatever a stranger manages to connect to.
bool peer_is_me(int fd) noexcept {
  ucred cred{};
  socklen_t len = sizeof(cred);
  return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof(cred) && cred.uid == ::geteuid();
}

/// Waits until `fd` polls `events` (or an error or hang-up, which the next call on it reports);
/// false once `deadline` has passed.
bool wait_for(int fd, short events, clock::time_point deadline) noexcept {
  for (;;) {
    // Rounded up: a wait never ends before its deadline.
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) return false;
    pollfd item{fd, events, 0};
    const int r = ::poll(&item, 1, static_cast<int>(std::min<std::int64_t>(left, INT_MAX)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

/// The descriptors one received message carried, closed when it goes unless taken.
struct carried {
  std::array<int, max_carried> fds{};
  std::size_t count = 0;

  explicit carried(msghdr& msg) noexcept {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < n && count < fds.size(); ++i)
        std::memcpy(&fds[count++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
  }
  ~carried() {
    for (std::size_t i = 0; i < count; ++i)
      if (fds[i] >= 0) ::close(fds[i]);
  }
  carried(const carried&) = delete;
  carried& operator=(const carried&) = delete;

  /// The first descriptor, now the caller's (the others are still closed with this).
  int take_first() noexcept { return std::exchange(fds[0], -1); }
};

}  // namespace

std::shared_ptr<fd_link> fd_link::listen(const std::string& path) {
  const sockaddr_un addr = address_of(path);
  unique_fd s = new_socket();
  if (!s) throw error(errc::io, fmt::format("cannot make the descriptor link's socket: {}", errno_text(errno)));
  if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0)
    throw error(errc::io, fmt::format("cannot listen for a descriptor link at {}: {}", path, errno_text(errno)));
  // Room for a stranger's connection beside the peer's (accept_until() turns strangers away).
  if (::listen(s.get(), 4) != 0) {
    const int e = errno;
    (void)::unlink(path.c_str());
    throw error(errc::io, fmt::format("cannot listen for a descriptor link at {}: {}", path, errno_text(e)));
  }
  std::shared_ptr<fd_link> link(new fd_link());
  link->listening_ = s.release();
  return link;
}

std::shared_ptr<fd_link> fd_link::connect(const std::string& path) {
  const sockaddr_un addr = address_of(path);
  unique_fd s = new_socket();
  if (!s) throw error(errc::io, fmt::format("cannot make the descriptor link's socket: {}", errno_text(errno)));
  int r = 0;
  do {
    r = ::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    const int e = errno;
    throw error(errc::io,
                fmt::format("cannot connect the descriptor link to {}: {}{}", path, errno_text(e),
                            e == EAGAIN ? " (the receiver has not accepted earlier connections: another process "
                                          "is connecting to its socket)"
                                        : ""));
  }
  // For the connecting end, SO_PEERCRED is who called listen() there.
  if (!peer_is_me(s.get()))
    throw error(errc::io, fmt::format("the descriptor link socket {} is not one of this user's processes: "
                                      "nothing is sent through it",
                                      path));
  std::shared_ptr<fd_link> link(new fd_link());
  link->socket_ = s.release();
  return link;
}

fd_link::~fd_link() {
  if (listening_ >= 0) ::close(listening_);
  if (socket_ >= 0) ::close(socket_);
}

bool fd_link::accept_until(clock::time_point deadline) noexcept {
  if (socket_ >= 0) return true;
  if (listening_ < 0) return false;
  for (;;) {
    unique_fd peer(::accept4(listening_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (peer) {
      if (!peer_is_me(peer.get())) continue;  // a stranger: closed, and the peer still awaited
      socket_ = peer.release();
      // One peer per link: nobody else gets in, even of this user.
      ::close(listening_);
      listening_ = -1;
      return true;
    }
    // ECONNABORTED, EPROTO: that connection is gone, not the socket.
    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    if (!wait_for(listening_, POLLIN, deadline)) return false;
  }
}

bool fd_link::send(std::uint64_t tag, int fd, clock::time_point deadline) noexcept {
  if (!accept_until(deadline)) return false;
  std::uint64_t payload = tag;
  iovec iov{&payload, sizeof(payload)};
  alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int))> control{};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  for (;;) {
    // A SOCK_SEQPACKET message goes whole or not at all.
    const ssize_t n = ::sendmsg(socket_, &msg, MSG_NOSIGNAL);
    if (n >= 0) return n == static_cast<ssize_t>(sizeof(payload));
    const int e = errno;
    if (e == EINTR) continue;
    if (e == EAGAIN || e == EWOULDBLOCK) {
      if (!wait_for(socket_, POLLOUT, deadline)) return false;
    } else if (e == ENOBUFS || e == ETOOMANYREFS) {
      // No memory for the message, or too many descriptors in flight from this user (the peer has
      // not read them yet): neither shows in poll(), so try again every millisecond.
      if (clock::now() >= deadline) return false;
      (void)::poll(nullptr, 0, 1);
    } else {
      return false;  // EPIPE, ECONNRESET: the peer is gone; EBADF: `fd` is not a descriptor
    }
  }
}

int fd_link::receive(std::uint64_t tag, clock::time_point deadline) noexcept {
  if (!accept_until(deadline)) return -1;
  for (;;) {
    std::uint64_t payload = 0;
    iovec iov{&payload, sizeof(payload)};
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int) * max_carried)> control{};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t n = ::recvmsg(socket_, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(socket_, POLLIN, deadline)) continue;
      return -1;
    }
    carried got(msg);       // whatever came is closed, unless it is handed out
    if (n == 0) return -1;  // the peer closed the link (or sent an empty message: broken all the same)
    // A broken peer: a tag cut short or too long, descriptors lost to truncation, or none at all.
    if ((msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0 || n != static_cast<ssize_t>(sizeof(payload)) || got.count == 0)
      return -1;
    if (payload == tag) return got.take_first();
    // Sent for something this end no longer waits for (a refit that failed before it got here).
  }
}

}  // namespace refit::channel
