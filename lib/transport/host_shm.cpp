// refit — the host_shm transport: buffers in POSIX shared memory.
//
// The streamer creates `count` segments with random names (mode 0600, O_EXCL), announces the names
// in HELLO, and unlinks them as soon as the receiver has mapped them (OK to HELLO): from then on
// only the two mappings keep the memory alive, so nothing is left in /dev/shm when either process
// dies. A new session therefore needs fresh segments. Names of a streamer that died before that
// point are removed by the next streamer that starts on the host (reap_orphans()). Ordering between packing and reading is
// carried by the REQ/REP messages, so the per-batch calls are no-ops.
#include "transport/registry.hpp"
#include "transport/transport.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "model/log.hpp"
#include "refit/error.hpp"

namespace refit::transport {
namespace {

constexpr std::string_view transport_name = "host_shm";
constexpr std::string_view name_prefix = "/refit-";
constexpr std::size_t max_shm_name = 255;

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

/// Closes a file descriptor at scope exit.
class fd_guard {
 public:
  explicit fd_guard(int fd) noexcept : fd_(fd) {}
  ~fd_guard() {
    if (fd_ >= 0) ::close(fd_);
  }
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  [[nodiscard]] int get() const noexcept { return fd_; }

 private:
  int fd_;
};

std::string random_name() {
  static thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
  }()};
  return fmt::format("{}{}-{:016x}", name_prefix, ::getpid(), rng());
}

/// Unlinks the segments of refit streamers that died before their receiver mapped them (a
/// streamer killed between creating its buffers and the OK to HELLO leaves its names behind).
/// A name is "/refit-<pid>-<hex>": it is removed when no process <pid> exists. A reused pid keeps
/// its names (they may be the new process's own), so this never removes a live streamer's buffer.
void reap_orphans() noexcept {
  try {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string file = entry.path().filename().string();
      const std::string_view prefix = name_prefix.substr(1);  // without the '/'
      if (!file.starts_with(prefix)) continue;
      const auto dash = file.find('-', prefix.size());
      if (dash == std::string::npos) continue;
      char* end = nullptr;
      const long pid = std::strtol(file.c_str() + prefix.size(), &end, 10);
      if (pid <= 0 || end != file.c_str() + dash) continue;
      if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
      if (::shm_unlink(("/" + file).c_str()) == 0)
        REFIT_INFO("host_shm: removed {}, left by dead process {}", file, pid);
    }
  } catch (...) {
    // Best effort: a failure here must not stop a streamer from starting.
  }
}

/// A segment this process created: name, read-write mapping, size, and whether the name is
/// already unlinked. The mapping lives until destruction; the name goes at unlink() or then.
class shm_segment {
 public:
  explicit shm_segment(std::uint64_t bytes) : size_(bytes) {
    if (bytes == 0) throw error(errc::invalid_argument, "host_shm: a buffer of 0 bytes cannot be shared");
    int fd = -1;
    for (int attempt = 0; attempt < 8; ++attempt) {
      name_ = random_name();
      fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0 || errno != EEXIST) break;
    }
    if (fd < 0) {
      const int e = errno;
      throw error(errc::transport, fmt::format("host_shm: cannot create shared memory {}: {}", name_, errno_text(e)));
    }
    fd_guard guard(fd);
    // From here on the name exists: remove it on any failure.
    auto fail = [&](std::string_view what, int e) {
      ::shm_unlink(name_.c_str());
      return error(
          errc::transport,
          fmt::format("host_shm: cannot {} shared memory {} of {} bytes: {}{}", what, name_, bytes, errno_text(e),
                      e == ENOSPC || e == ENOMEM
                          ? "; /dev/shm is too small for the buffers (docker: --shm-size; or lower "
                            "buffer_bytes)"
                          : ""));
    };
    if (::fchmod(fd, 0600) != 0) throw fail("restrict (fchmod 0600)", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw fail("size", errno);
    // Reserve the pages now so a too-small /dev/shm fails here with a message instead of a
    // SIGBUS in the middle of packing. Filesystems without fallocate keep the lazy behaviour.
    if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0 && rc != EOPNOTSUPP && rc != EINVAL)
      throw fail("reserve", rc);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw fail("map", errno);
    data_ = static_cast<std::byte*>(p);
  }
  ~shm_segment() { release(); }
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  shm_segment(shm_segment&& o) noexcept
      : name_(std::move(o.name_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        unlinked_(std::exchange(o.unlinked_, true)) {}
  shm_segment& operator=(shm_segment&& o) noexcept {
    if (this != &o) {
      release();
      name_ = std::move(o.name_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      unlinked_ = std::exchange(o.unlinked_, true);
    }
    return *this;
  }

  /// Removes the name (the memory stays mapped). Never throws.
  void unlink() noexcept {
    if (unlinked_ || name_.empty()) return;
    if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
      REFIT_WARN("host_shm: shm_unlink({}) failed: {}", name_, std::strerror(errno));
    unlinked_ = true;
  }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    unlink();
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
  std::string name_;
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  bool unlinked_ = false;
};

/// A read-only mapping of a segment another process created.
class shm_mapping {
 public:
  shm_mapping(const std::string& name, std::uint64_t expected) {
    const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) {
      const int e = errno;
      throw error(errc::transport,
                  fmt::format("host_shm: cannot open the streamer's shared memory {}: {}; is the streamer still "
                              "alive, and does this process share its /dev/shm (same container or host IPC "
                              "namespace)?",
                              name, errno_text(e)));
    }
    fd_guard guard(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      throw error(errc::transport, fmt::format("host_shm: cannot stat shared memory {}: {}", name, errno_text(e)));
    }
    if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) != expected)
      throw error(errc::transport, fmt::format("host_shm: shared memory {} has {} bytes but HELLO announced {} bytes",
                                               name, static_cast<long long>(st.st_size), expected));
    void* p = ::mmap(nullptr, expected, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      throw error(errc::transport,
                  fmt::format("host_shm: cannot map shared memory {} ({} bytes): {}", name, expected, errno_text(e)));
    }
    data_ = static_cast<const std::byte*>(p);
    size_ = expected;
  }
  ~shm_mapping() {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  }
  shm_mapping(const shm_mapping&) = delete;
  shm_mapping& operator=(const shm_mapping&) = delete;
  shm_mapping(shm_mapping&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

bool looks_like_ours(const std::string& name) {
  if (name.size() > max_shm_name || name.size() <= name_prefix.size()) return false;
  if (!name.starts_with(name_prefix)) return false;
  if (name.find('/', 1) != std::string::npos) return false;
  if (name.find('\0') != std::string::npos) return false;
  return true;
}

// ------------------------------------------------------------------------------------ source

class host_shm_source final : public source {
 public:
  explicit host_shm_source(const source_options& o) : count_(o.count), bytes_(o.bytes) {
    if (count_ == 0 || count_ > wire::max_buffers)
      throw error(errc::invalid_argument,
                  fmt::format("host_shm: buffer_count is {}: give 1..{} buffers", count_, wire::max_buffers));
    if (bytes_ == 0) throw error(errc::invalid_argument, "host_shm: buffer_bytes is 0");
    reap_orphans();
    create();
  }

  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }
  [[nodiscard]] std::size_t count() const noexcept override { return count_; }
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept override { return bytes_; }
  [[nodiscard]] std::byte* data(std::size_t i) noexcept override {
    return i < segments_.size() ? segments_[i].data() : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::cpu; }
  [[nodiscard]] void* stream() noexcept override { return nullptr; }

  void open_session(wire::hello& h) override {
    // A set that was announced before may already be unlinked (or mapped by a receiver that is
    // gone): a new session gets new names. The old set goes first so that at most one is mapped.
    if (shared_ || segments_.size() != count_) {
      segments_.clear();
      shared_ = false;
      create();
    }
    h.transport = std::string(transport_name);
    h.host_id = host_identity();
    h.peer = process_identity();
    h.buffers.clear();
    h.buffers.reserve(segments_.size());
    for (const auto& s : segments_) h.buffers.push_back(wire::buffer_desc{s.size(), s.name(), "", ""});
    shared_ = true;
  }

  void session_accepted(std::span<const wire::ok> replies) override {
    (void)replies;
    for (auto& s : segments_) s.unlink();
  }

  void close_session() noexcept override {
    for (auto& s : segments_) s.unlink();
  }

  void begin_pack(std::size_t) override {}
  void after(void*) override {}
  void end_pack(std::size_t) override {}
  void drain() override {}

 private:
  void create() {
    std::vector<shm_segment> fresh;
    fresh.reserve(count_);
    for (std::size_t i = 0; i < count_; ++i) fresh.emplace_back(bytes_);
    segments_ = std::move(fresh);
  }

  std::size_t count_;
  std::uint64_t bytes_;
  std::vector<shm_segment> segments_;
  bool shared_ = false;
};

// ------------------------------------------------------------------------------------ sink

class host_shm_sink final : public sink {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }

  void attach(const wire::hello& h, wire::ok& reply) override {
    (void)reply;
    detach();
    if (h.transport != transport_name)
      throw error(errc::transport, fmt::format("host_shm receiver got a HELLO for transport '{}'", h.transport));
    const std::string here = host_identity();
    if (h.host_id != here)
      throw error(errc::transport,
                  fmt::format("host_shm needs the streamer and the receiver on one host: the streamer runs on {}, "
                              "this receiver on {}; use the nccl transport across hosts",
                              h.host_id.empty() ? std::string("(unknown)") : h.host_id, here));
    if (h.buffers.empty() || h.buffers.size() > wire::max_buffers)
      throw error(errc::transport, fmt::format("host_shm: HELLO announced {} buffers; expected 1..{}", h.buffers.size(),
                                               wire::max_buffers));
    for (std::size_t i = 0; i < h.buffers.size(); ++i) {
      const auto& d = h.buffers[i];
      if (!looks_like_ours(d.handle))
        throw error(errc::transport,
                    fmt::format("host_shm: buffer {} names '{}', which is not a refit shared memory object "
                                "(expected /refit-<pid>-<hex>)",
                                i, d.handle.substr(0, 300)));
      if (d.bytes == 0) throw error(errc::transport, fmt::format("host_shm: buffer {} ({}) has 0 bytes", i, d.handle));
    }
    std::vector<shm_mapping> mapped;
    mapped.reserve(h.buffers.size());
    for (const auto& d : h.buffers) mapped.emplace_back(d.handle, d.bytes);
    mappings_ = std::move(mapped);
  }

  void detach() noexcept override { mappings_.clear(); }
  [[nodiscard]] bool attached() const noexcept override { return !mappings_.empty(); }
  [[nodiscard]] std::size_t count() const noexcept override { return mappings_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes(std::size_t i) const noexcept override {
    return i < mappings_.size() ? mappings_[i].size() : 0;
  }
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept override {
    return i < mappings_.size() ? mappings_[i].data() : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::cpu; }
  [[nodiscard]] void* stream() noexcept override { return nullptr; }
  [[nodiscard]] bool asynchronous() const noexcept override { return false; }

  void begin_read(std::size_t) override {}
  void end_read(std::size_t) override {}
  void drain() override {}

 private:
  std::vector<shm_mapping> mappings_;
};

std::unique_ptr<source> make_host_shm_source(const source_options& options) {
  return std::make_unique<host_shm_source>(options);
}

std::unique_ptr<sink> make_host_shm_sink(int, milliseconds) { return std::make_unique<host_shm_sink>(); }

}  // namespace

}  // namespace refit::transport

// The registration. One receiver per streamer, always staged through the shared segments.
REFIT_TRANSPORT(host_shm, {refit::transport::transport_name, refit::transport::capabilities{},
                           refit::transport::make_host_shm_source, refit::transport::make_host_shm_sink});
