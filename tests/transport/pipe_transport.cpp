// A fourth transport, added the way a new one is (lib/transport/README.md): this file alone, plus
// its line in tests/meson.build. It proves the seam: the CPU end-to-end suites run over it with
// no line of refit changed.
//
// "pipe": the batch bytes travel through a Unix stream socket (abstract namespace, a random name
// the streamer puts in HELLO's opaque `session` field). The streamer packs into buffers of its
// own; end_pack(i) hands buffer i to a writer thread that sends it as one frame [u32 index][bytes]
// (a thread, because the receiver reads a frame only after BATCH arrives, and a buffer larger than
// the socket's send buffer would otherwise block before BATCH is sent); begin_pack(i) waits until
// buffer i's last frame has been sent. The receiver reads the frame of buffer i into a buffer of
// its own in begin_read(i). Every wait has a deadline.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "copy/wait.hpp"
#include "refit/error.hpp"
#include "transport/registry.hpp"
#include "transport/transport.hpp"

namespace refit::transport {
namespace {

constexpr std::string_view pipe_name = "pipe";
constexpr milliseconds pipe_timeout{30000};

[[noreturn]] void fail_errno(const std::string& what) {
  throw error(errc::transport, fmt::format("pipe: {}: {}", what, std::strerror(errno)));
}

/// Waits for `events` on `fd` until `until`; throws errc::timeout past it.
void wait_fd(int fd, short events, const deadline& until, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(until.remaining().count()));
    if (n > 0) return;
    if (n < 0 && errno != EINTR) fail_errno(std::string(what));
    if (n == 0 && until.passed())
      throw error(errc::timeout, fmt::format("pipe: {} took longer than {} ms", what, until.budget.count()));
  }
}

void send_all(int fd, const std::byte* p, std::size_t n, const deadline& until) {
  while (n > 0) {
    wait_fd(fd, POLLOUT, until, "sending a buffer");
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      fail_errno("sending a buffer");
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

void receive_all(int fd, std::byte* p, std::size_t n, const deadline& until) {
  while (n > 0) {
    wait_fd(fd, POLLIN, until, "receiving a buffer");
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k == 0) throw error(errc::transport, "pipe: the streamer closed the socket mid-buffer");
    if (k < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      fail_errno("receiving a buffer");
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

sockaddr_un address_of(std::string_view name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  // Abstract namespace: a leading NUL, nothing in the file system to clean up.
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

struct fd_owner {
  int fd = -1;
  fd_owner() = default;
  explicit fd_owner(int f) : fd(f) {}
  fd_owner(fd_owner&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  fd_owner& operator=(fd_owner&& o) noexcept {
    if (this != &o) {
      reset();
      fd = std::exchange(o.fd, -1);
    }
    return *this;
  }
  ~fd_owner() { reset(); }
  void reset() noexcept {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

class pipe_source final : public source {
 public:
  explicit pipe_source(const source_options& o) : bytes_(o.bytes), buffers_(o.count, std::vector<std::byte>(o.bytes)) {
    if (o.receivers != 1) throw error(errc::invalid_argument, "pipe: serves one receiver");
  }
  ~pipe_source() override { close_session(); }

  [[nodiscard]] std::string_view name() const noexcept override { return pipe_name; }
  [[nodiscard]] std::size_t count() const noexcept override { return buffers_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept override { return bytes_; }
  [[nodiscard]] std::byte* data(std::size_t i) noexcept override { return buffers_[i].data(); }
  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::cpu; }
  [[nodiscard]] void* stream() noexcept override { return nullptr; }

  void open_session(wire::hello& h) override {
    close_session();
    std::random_device rd;
    socket_name_ = fmt::format("refit-pipe-{}-{:016x}", ::getpid(), (std::uint64_t{rd()} << 32) | rd());
    listener_ = fd_owner(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (listener_.fd < 0) fail_errno("socket");
    socklen_t len = 0;
    const sockaddr_un a = address_of(socket_name_, len);
    if (::bind(listener_.fd, reinterpret_cast<const sockaddr*>(&a), len) != 0) fail_errno("bind");
    if (::listen(listener_.fd, 1) != 0) fail_errno("listen");
    h.transport = std::string(pipe_name);
    h.peer = process_identity();
    h.host_id = host_identity();
    h.buffers.assign(buffers_.size(), wire::buffer_desc{bytes_, {}, {}, {}});
    h.session = socket_name_;
  }

  void session_accepted(std::span<const wire::ok>) override {
    // The receiver connected before it replied OK: the connection waits in the backlog.
    wait_fd(listener_.fd, POLLIN, deadline::after(pipe_timeout), "accepting the receiver's connection");
    conn_ = fd_owner(::accept4(listener_.fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (conn_.fd < 0) fail_errno("accept");
    listener_.reset();
    stop_ = false;
    failure_.clear();
    pending_.assign(buffers_.size(), false);
    writer_ = std::thread([this] { write_loop(); });
  }

  void close_session() noexcept override {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    if (conn_.fd >= 0) ::shutdown(conn_.fd, SHUT_RDWR);
    if (writer_.joinable()) writer_.join();
    conn_.reset();
    listener_.reset();
    queue_.clear();
  }

  void begin_pack(std::size_t i) override {
    wait_until([&] { return !pending_[i]; }, fmt::format("buffer {} is still being sent", i));
  }
  void after(void*) override {}
  void end_pack(std::size_t i) override {
    {
      const std::lock_guard lock(mutex_);
      pending_[i] = true;
      queue_.push_back(i);
    }
    changed_.notify_all();
  }
  void drain() override {
    wait_until([&] { return queue_.empty() && std::find(pending_.begin(), pending_.end(), true) == pending_.end(); },
               "the last buffers are still being sent");
  }

 private:
  template <class Ready>
  void wait_until(Ready ready, const std::string& what) {
    std::unique_lock lock(mutex_);
    const bool ok = changed_.wait_for(lock, pipe_timeout, [&] { return !failure_.empty() || ready(); });
    if (!failure_.empty()) throw error(errc::transport, failure_);
    if (!ok) throw error(errc::timeout, "pipe: " + what);
  }

  void write_loop() {
    for (;;) {
      std::size_t i = 0;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        i = queue_.front();
        queue_.pop_front();
      }
      try {
        const auto index = static_cast<std::uint32_t>(i);
        const deadline until = deadline::after(pipe_timeout);
        send_all(conn_.fd, reinterpret_cast<const std::byte*>(&index), sizeof index, until);
        send_all(conn_.fd, buffers_[i].data(), buffers_[i].size(), until);
      } catch (const error& e) {
        const std::lock_guard lock(mutex_);
        failure_ = e.what();
      }
      {
        const std::lock_guard lock(mutex_);
        pending_[i] = false;
      }
      changed_.notify_all();
    }
  }

  std::uint64_t bytes_;
  std::vector<std::vector<std::byte>> buffers_;
  std::string socket_name_;
  fd_owner listener_;
  fd_owner conn_;
  std::thread writer_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::size_t> queue_;
  std::vector<bool> pending_;
  std::string failure_;
  bool stop_ = false;
};

class pipe_sink final : public sink {
 public:
  explicit pipe_sink(milliseconds timeout) : timeout_(timeout) {}

  [[nodiscard]] std::string_view name() const noexcept override { return pipe_name; }

  void attach(const wire::hello& h, wire::ok&) override {
    if (h.session.empty() || h.session.size() > sizeof(sockaddr_un::sun_path) - 1)
      throw error(errc::protocol, fmt::format("pipe: HELLO's session names a socket of {} bytes", h.session.size()));
    if (h.buffers.empty() || h.buffers.size() > wire::max_buffers)
      throw error(errc::protocol, fmt::format("pipe: HELLO announces {} buffers", h.buffers.size()));
    detach();
    if (h.alignment > 4096) throw error(errc::protocol, fmt::format("pipe: an alignment of {}", h.alignment));
    alignment_ = std::max<std::uint64_t>(h.alignment, 64);
    for (const auto& b : h.buffers) {
      if (b.bytes == 0 || b.bytes > (1ull << 30))
        throw error(errc::protocol, fmt::format("pipe: a buffer of {} bytes", b.bytes));
      // Entry offsets are multiples of the streamer's alignment: so are these buffers' addresses.
      buffers_.emplace_back(b.bytes + alignment_);
    }
    conn_ = fd_owner(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (conn_.fd < 0) fail_errno("socket");
    socklen_t len = 0;
    const sockaddr_un a = address_of(h.session, len);
    if (::connect(conn_.fd, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
      detach();
      fail_errno(fmt::format("connecting to the streamer's socket '{}'", h.session));
    }
  }
  void detach() noexcept override {
    conn_.reset();
    buffers_.clear();
  }
  [[nodiscard]] bool attached() const noexcept override { return conn_.fd >= 0; }
  [[nodiscard]] std::size_t count() const noexcept override { return buffers_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes(std::size_t i) const noexcept override {
    return i < buffers_.size() ? buffers_[i].size() - alignment_ : 0;
  }
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept override {
    return i < buffers_.size() ? aligned(i) : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::cpu; }
  [[nodiscard]] void* stream() noexcept override { return nullptr; }
  [[nodiscard]] bool asynchronous() const noexcept override { return false; }

  void begin_read(std::size_t i) override {
    const deadline until = deadline::after(timeout_);
    std::uint32_t index = 0;
    receive_all(conn_.fd, reinterpret_cast<std::byte*>(&index), sizeof index, until);
    if (i >= buffers_.size() || index != i)
      throw error(errc::protocol, fmt::format("pipe: the frame of buffer {} came for batch buffer {}", index, i));
    receive_all(conn_.fd, aligned(i), buffer_bytes(i), until);
  }
  void end_read(std::size_t) override {}
  void drain() override {}

 private:
  [[nodiscard]] std::byte* aligned(std::size_t i) const noexcept {
    const auto p = reinterpret_cast<std::uintptr_t>(buffers_[i].data());
    return const_cast<std::byte*>(buffers_[i].data()) + ((alignment_ - p % alignment_) % alignment_);
  }

  milliseconds timeout_;
  std::uint64_t alignment_ = 64;
  fd_owner conn_;
  std::vector<std::vector<std::byte>> buffers_;
};

std::unique_ptr<source> make_pipe_source(const source_options& o) { return std::make_unique<pipe_source>(o); }
std::unique_ptr<sink> make_pipe_sink(int, milliseconds timeout) { return std::make_unique<pipe_sink>(timeout); }

}  // namespace
}  // namespace refit::transport

// One receiver; a failure ends the session (frames of a refused batch may still be in the socket:
// the next refit starts over with a new HELLO and a new socket).
REFIT_TRANSPORT(pipe, {refit::transport::pipe_name, refit::transport::capabilities{1, false, true, false},
                       refit::transport::make_pipe_source, refit::transport::make_pipe_sink});
