// A raw ZMTP peer for tests: bytes of our own choosing over a plain tcp or unix socket, to play
// what a libzmq socket never sends (unfinished messages, bad greetings, commands) against the
// receiver's ZMTP server (lib/channel/zmtp.hpp). Header-only: the unit tests that use it include it.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include "channel/zmtp.hpp"

namespace refit::test {

/// A message frame: flags (MORE), size (short or long), body.
inline std::string zmtp_frame_header(std::uint64_t size, bool more) {
  std::string out;
  if (size > 255) {
    out.push_back(static_cast<char>(0x02 | (more ? 1 : 0)));
    for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((size >> (8 * i)) & 0xff));
  } else {
    out.push_back(static_cast<char>(more ? 1 : 0));
    out.push_back(static_cast<char>(size));
  }
  return out;
}
inline std::string zmtp_frame(std::string_view body, bool more) {
  return zmtp_frame_header(body.size(), more) + std::string(body);
}
/// A client's greeting of ZMTP major.minor with `mechanism` (NULL by default).
inline std::string zmtp_greeting(int major = 3, int minor = 1, std::string_view mechanism = "NULL") {
  std::string g = channel::zmtp::greeting();
  g[10] = static_cast<char>(major);
  g[11] = static_cast<char>(minor);
  std::memset(g.data() + 12, 0, 20);
  std::memcpy(g.data() + 12, mechanism.data(), std::min<std::size_t>(mechanism.size(), 20));
  g[32] = 0;
  return g;
}

/// One connection to a receiver's endpoint (tcp://127.0.0.1:PORT or ipc://PATH), blocking writes.
class zmtp_peer {
 public:
  explicit zmtp_peer(const std::string& endpoint) {
    if (endpoint.starts_with("ipc://")) {
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      const std::string path = endpoint.substr(6);
      std::memcpy(a.sun_path, path.data(), path.size());
      fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd_ < 0 || ::connect(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
        throw std::runtime_error("zmtp_peer: cannot connect to " + endpoint);
      return;
    }
    const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || ::connect(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
      throw std::runtime_error("zmtp_peer: cannot connect to " + endpoint);
  }
  ~zmtp_peer() { close(); }
  zmtp_peer(const zmtp_peer&) = delete;
  zmtp_peer& operator=(const zmtp_peer&) = delete;

  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Writes every byte; false when the server closed the connection first.
  bool send(std::string_view bytes) {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const auto n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }
  /// Greeting and READY of a `socket_type` (the server's greeting and READY are read by replies()).
  bool handshake(std::string_view socket_type = "REQ") {
    std::string props = std::string(1, '\x0b') + "Socket-Type";
    for (int i = 3; i >= 0; --i) props.push_back(static_cast<char>((socket_type.size() >> (8 * i)) & 0xff));
    props.append(socket_type);
    return send(zmtp_greeting() + channel::zmtp::command("READY", props));
  }
  /// Reads what has arrived, without waiting; true when the server closed the connection.
  bool hung_up() {
    char buf[65536];
    for (;;) {
      const auto n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        received_.append(buf, static_cast<std::size_t>(n));
        continue;
      }
      if (n == 0) return true;
      if (errno == EINTR) continue;
      return errno != EAGAIN && errno != EWOULDBLOCK;
    }
  }
  /// Everything received so far (hung_up() reads).
  [[nodiscard]] const std::string& received() const noexcept { return received_; }
  /// Waits up to `wait` for the server to close the connection; true when it did.
  bool wait_hung_up(std::chrono::milliseconds wait) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      if (hung_up()) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      (void)::poll(&p, 1, static_cast<int>(left.count()));
    }
  }

 private:
  int fd_ = -1;
  std::string received_;
};

}  // namespace refit::test
