// refit — the host_shm transport: buffers in shared memory of the streamer, read by the receiver.
//
// The buffers are sealed memfds by default. The streamer makes each one with
// memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING), mode 0600, sized and reserved, then sealed with
// F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, and announces it in HELLO as
// "/proc/<pid>/fd/<fd>:<tag>" (tag: the memfd's own name, "refit-<pid>-<16 hex>"). The receiver
// opens that path (following the magic link, which names the streamer's open file, with O_PATH
// first: nothing that is not a regular file is ever opened), checks type, owner, mode, size, the
// tag and the seals, and maps it; the streamer closes its descriptor once the receiver accepted
// (OK to HELLO), so from then on nothing names the memory. No name exists in /dev/shm at any
// time, so a streamer killed at any point leaves nothing behind, and a sealed buffer cannot shrink
// under the receiver's reads.
//
// Named segments stay as the fallback, and the receiver still accepts them: "/refit-<pid>-<pidns>-<16
// hex>" in /dev/shm (mode 0600, O_EXCL), used where memfds cannot be made (memfd_create refused:
// an old kernel, a seccomp filter) or where the receiver cannot open the streamer's /proc/<pid>/fd
// (another pid namespace sharing /dev/shm: containers with a shared IPC namespace only), chosen
// there with REFIT_HOST_SHM=named on the streamer. Refusing every unsealed object would break
// exactly those deployments, so the receiver keeps them and relies on its other checks (a regular
// file, owned by its effective uid, 0600, of the announced size) and on the SIGBUS guard
// (copy/bus_guard.hpp) for a streamer of the same uid that truncates a segment it still holds:
// the refit fails with errc::transport, the receiver lives. The receiver unlinks a named segment
// as soon as it has mapped it (the streamer does too, at OK); names of a streamer killed before
// any receiver mapped them are removed by the next streamer on the host (reap_orphans(), which
// knows names of its own pid namespace only).
//
// Ordering between packing and reading is carried by the REQ/REP messages, so the per-batch calls
// only check that no read of the buffer faulted.
#include "transport/registry.hpp"
#include "transport/transport.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "channel/unique_fd.hpp"
#include "copy/bus_guard.hpp"
#include "model/log.hpp"
#include "model/memory.hpp"
#include "refit/error.hpp"

namespace refit::transport {
namespace {

using channel::unique_fd;

constexpr std::string_view transport_name = "host_shm";
constexpr std::string_view name_prefix = "/refit-";
constexpr std::string_view proc_prefix = "/proc/";
constexpr std::size_t max_shm_name = 255;
constexpr unsigned required_seals = F_SEAL_SHRINK | F_SEAL_GROW;

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

/// The decimal number `s` is, when it is one (digits only, no sign, at most 10 of them).
std::optional<std::uint64_t> number(std::string_view s) {
  std::uint64_t v = 0;
  if (s.empty() || s.size() > 10) return std::nullopt;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

bool is_hex16(std::string_view s) {
  return s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

/// This process's pid namespace (the inode of /proc/self/ns/pid; 0 when /proc does not say): a
/// named segment carries its creator's, so that a reaper in another namespace, where that pid
/// means nothing, leaves it alone.
std::uint64_t pid_namespace() noexcept {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

/// A named segment's name, split: "/refit-<pid>-<pidns>-<16 hex>".
struct segment_name {
  std::uint64_t pid = 0;
  std::uint64_t pidns = 0;
};
std::optional<segment_name> parse_segment_name(std::string_view name) {
  if (!name.starts_with(name_prefix) || name.size() > max_shm_name) return std::nullopt;
  name.remove_prefix(name_prefix.size());
  const auto a = name.find('-');
  const auto b = a == std::string_view::npos ? a : name.find('-', a + 1);
  if (b == std::string_view::npos || !is_hex16(name.substr(b + 1))) return std::nullopt;
  const auto pid = number(name.substr(0, a));
  const auto ns = number(name.substr(a + 1, b - a - 1));
  if (!pid || !ns || *pid == 0) return std::nullopt;
  return segment_name{*pid, *ns};
}

/// A memfd buffer's handle, split: "/proc/<pid>/fd/<fd>:refit-<pid>-<16 hex>".
struct memfd_handle {
  std::uint64_t pid = 0;
  std::uint64_t fd = 0;
  std::string_view tag;  ///< the memfd's name
};
std::optional<memfd_handle> parse_memfd_handle(std::string_view h) {
  if (!h.starts_with(proc_prefix)) return std::nullopt;
  h.remove_prefix(proc_prefix.size());
  const auto slash = h.find('/');
  const auto colon = h.find(':');
  if (slash == std::string_view::npos || colon == std::string_view::npos || colon < slash) return std::nullopt;
  const auto pid = number(h.substr(0, slash));
  const std::string_view rest = h.substr(slash, colon - slash);  // "/fd/<fd>"
  if (!pid || *pid == 0 || !rest.starts_with("/fd/")) return std::nullopt;
  const auto fd = number(rest.substr(4));
  const std::string_view tag = h.substr(colon + 1);
  const std::string tag_prefix = fmt::format("refit-{}-", *pid);
  if (!fd || !tag.starts_with(tag_prefix) || !is_hex16(tag.substr(tag_prefix.size()))) return std::nullopt;
  return memfd_handle{*pid, *fd, tag};
}

/// True for exactly what this file's streamers announce: a memfd handle or a segment name.
bool looks_like_ours(const std::string& handle) {
  if (handle.find('\0') != std::string::npos) return false;
  return parse_memfd_handle(handle).has_value() || parse_segment_name(handle).has_value();
}

std::uint64_t random_tag() {
  static thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
  }()};
  return rng();
}

/// Unlinks the segments of refit streamers that died before a receiver mapped them (a streamer
/// killed between creating its named buffers and its receiver's mapping leaves them behind). A
/// name is removed when it was made in this pid namespace and no process <pid> exists here; a
/// reused pid keeps its names (they may be the new process's own), and a name of another
/// namespace is never removed (its pid says nothing here), so this never removes a live
/// streamer's buffer. Names of earlier refit versions ("/refit-<pid>-<hex>") follow the pid rule.
void reap_orphans() noexcept {
  try {
    const std::uint64_t here = pid_namespace();
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = "/" + entry.path().filename().string();
      std::uint64_t pid = 0;
      if (const auto parsed = parse_segment_name(name)) {
        if (parsed->pidns != here || here == 0) continue;
        pid = parsed->pid;
      } else if (name.starts_with(name_prefix)) {  // an earlier version's: "/refit-<pid>-<hex>"
        const std::string_view rest = std::string_view(name).substr(name_prefix.size());
        const auto dash = rest.find('-');
        const auto p = number(rest.substr(0, dash));
        if (dash == std::string_view::npos || !p || rest.find('-', dash + 1) != std::string_view::npos) continue;
        pid = *p;
      } else {
        continue;
      }
      if (pid == 0 || pid > 0x7fffffff) continue;
      if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
      if (::shm_unlink(name.c_str()) == 0) REFIT_INFO("host_shm: removed {}, left by dead process {}", name, pid);
    }
  } catch (...) {
    // Best effort: a failure here must not stop a streamer from starting.
  }
}

/// How the streamer shares its buffers (REFIT_HOST_SHM: "memfd", the default, or "named").
enum class sharing { memfd, named };
sharing requested_sharing() {
  const char* v = std::getenv("REFIT_HOST_SHM");
  if (v == nullptr || *v == '\0' || std::string_view(v) == "memfd") return sharing::memfd;
  if (std::string_view(v) == "named") return sharing::named;
  throw error(errc::invalid_argument,
              fmt::format("REFIT_HOST_SHM is '{}': use memfd (the default: sealed buffers no name refers to) or "
                          "named (segments in /dev/shm, for receivers in another pid namespace)",
                          v));
}

/// A buffer this process created, mapped read-write until destruction: a sealed memfd, named by
/// its descriptor in this process's /proc until unlink() closes it, or a named segment in
/// /dev/shm until unlink() removes the name.
class shm_segment {
 public:
  /// A sealed memfd of `bytes`, or nullopt when this kernel makes none (memfd_create or sealing
  /// refused). Throws refit::error(transport) when it cannot be sized, reserved or mapped.
  static std::optional<shm_segment> make_memfd(std::uint64_t bytes) {
    const std::string tag = fmt::format("refit-{}-{:016x}", ::getpid(), random_tag());
    unique_fd fd(::memfd_create(tag.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd) {
      const int e = errno;
      if (e == ENOSYS || e == EPERM || e == EINVAL) return std::nullopt;
      throw error(errc::transport,
                  fmt::format("host_shm: cannot create a memfd of {} bytes: {}", bytes, errno_text(e)));
    }
    shm_segment s;
    s.handle_ = fmt::format("{}{}/fd/{}:{}", proc_prefix, ::getpid(), fd.get(), tag);
    s.map(fd.get(), bytes, [&](std::string_view what, int e) { return s.failure(what, bytes, e); });
    // After sizing and reserving: the receiver checks SHRINK and GROW; SEAL keeps anyone holding
    // the descriptor from removing them.
    if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      const int e = errno;
      if (e == EINVAL || e == EPERM) return std::nullopt;  // a filesystem without seals
      throw s.failure("seal", bytes, e);
    }
    s.fd_ = std::move(fd);
    return s;
  }

  /// A named segment of `bytes` in /dev/shm. Throws refit::error(transport).
  static shm_segment make_named(std::uint64_t bytes) {
    shm_segment s;
    unique_fd fd;
    static const std::uint64_t pidns = pid_namespace();
    for (int attempt = 0; attempt < 8; ++attempt) {
      s.name_ = fmt::format("{}{}-{}-{:016x}", name_prefix, ::getpid(), pidns, random_tag());
      fd = unique_fd(::shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
      if (fd || errno != EEXIST) break;
    }
    if (!fd) {
      const int e = errno;
      throw error(errc::transport, fmt::format("host_shm: cannot create shared memory {}: {}", s.name_, errno_text(e)));
    }
    s.handle_ = s.name_;
    // From here on the name exists: remove it on any failure.
    s.map(fd.get(), bytes, [&](std::string_view what, int e) {
      ::shm_unlink(s.name_.c_str());
      s.name_.clear();
      return s.failure(what, bytes, e);
    });
    return s;
  }

  ~shm_segment() { release(); }
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  shm_segment(shm_segment&& o) noexcept
      : handle_(std::move(o.handle_)),
        name_(std::exchange(o.name_, {})),
        fd_(std::move(o.fd_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        counted_(std::move(o.counted_)) {}
  shm_segment& operator=(shm_segment&& o) noexcept {
    if (this != &o) {
      release();
      handle_ = std::move(o.handle_);
      name_ = std::exchange(o.name_, {});
      fd_ = std::move(o.fd_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      counted_ = std::move(o.counted_);
    }
    return *this;
  }

  /// Makes the handle name nothing (the memory stays mapped): removes a segment's name, closes a
  /// memfd's descriptor. Never throws.
  void unlink() noexcept {
    fd_.reset();
    if (name_.empty()) return;
    if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT)  // ENOENT: the receiver unlinked it
      REFIT_WARN("host_shm: shm_unlink({}) failed: {}", name_, std::strerror(errno));
    name_.clear();
  }
  /// What HELLO announces.
  [[nodiscard]] const std::string& handle() const noexcept { return handle_; }
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  shm_segment() = default;

  error failure(std::string_view what, std::uint64_t bytes, int e) const {
    return error(
        errc::transport,
        fmt::format("host_shm: cannot {} shared memory {} of {} bytes: {}{}", what, handle_, bytes, errno_text(e),
                    e == ENOSPC || e == ENOMEM
                        ? "; /dev/shm is too small for the buffers (docker: --shm-size; or lower "
                          "buffer_bytes)"
                        : ""));
  }

  /// Restricts, sizes, reserves and maps the new object `fd`; `fail(what, errno)` makes the error.
  template <class Fail>
  void map(int fd, std::uint64_t bytes, Fail&& fail) {
    if (bytes == 0) throw fail("size (0 bytes)", EINVAL);
    if (::fchmod(fd, 0600) != 0) throw fail("restrict (fchmod 0600)", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw fail("size", errno);
    // Reserve the pages now so a too-small /dev/shm fails here with a message instead of a
    // SIGBUS in the middle of packing. Filesystems without fallocate keep the lazy behaviour.
    if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0 && rc != EOPNOTSUPP && rc != EINVAL)
      throw fail("reserve", rc);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw fail("map", errno);
    data_ = static_cast<std::byte*>(p);
    size_ = bytes;
    counted_ = memory::charge(memory::kind::host, bytes);
  }

  void release() noexcept {
    unlink();
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
    counted_.reset();
  }

  std::string handle_;
  std::string name_;  ///< a named segment's, until unlinked
  unique_fd fd_;      ///< a memfd's, until unlinked
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  memory::charge counted_;  ///< size_, while mapped (include/refit/memory.hpp)
};

// ------------------------------------------------------------------------------------ receiver's checks

std::string_view kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

struct stat stat_of(int fd, const std::string& handle) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    throw error(errc::transport, fmt::format("host_shm: cannot stat shared memory {}: {}", handle, errno_text(e)));
  }
  return st;
}

void check_type(const struct stat& st, const std::string& handle) {
  if (!S_ISREG(st.st_mode))
    throw error(errc::transport, fmt::format("host_shm: the streamer's shared memory {} is {}, not a regular file: "
                                             "refused",
                                             handle, kind_of(st.st_mode)));
}

/// What the receiver requires of any object it maps: a regular file of its own effective uid, open
/// to nobody else, of the announced size. Throws refit::error(transport) naming the check.
void check_object(const struct stat& st, const std::string& handle, std::uint64_t expected) {
  check_type(st, handle);
  if (st.st_uid != ::geteuid())
    throw error(errc::transport,
                fmt::format("host_shm: the streamer's shared memory {} belongs to uid {}, not to this process's "
                            "effective uid {}: refused (run the streamer and the receiver as one user)",
                            handle, st.st_uid, ::geteuid()));
  if ((st.st_mode & 077) != 0)
    throw error(errc::transport,
                fmt::format("host_shm: the streamer's shared memory {} has mode {:04o}, open to group or others: "
                            "refused (refit's buffers are 0600)",
                            handle, st.st_mode & 07777));
  if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) != expected)
    throw error(errc::transport, fmt::format("host_shm: shared memory {} has {} bytes but HELLO announced {} bytes",
                                             handle, static_cast<long long>(st.st_size), expected));
}

/// Opens a named segment for reading: never through a symbolic link (O_NOFOLLOW), never waiting
/// (O_NONBLOCK: a FIFO would block open() until a writer came), never becoming a controlling
/// terminal.
unique_fd open_named(const std::string& name) {
  const std::string path = "/dev/shm" + name;
  unique_fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (fd) return fd;
  const int e = errno;
  if (e == ELOOP)
    throw error(errc::transport, fmt::format("host_shm: the streamer's shared memory {} is a symbolic link: refused "
                                             "(refit's buffers are regular files)",
                                             name));
  throw error(errc::transport,
              fmt::format("host_shm: cannot open the streamer's shared memory {}: {}; is the streamer still alive, "
                          "and does this process share its /dev/shm (same container or host IPC namespace)?",
                          name, errno_text(e)));
}

/// Opens the streamer's memfd through its /proc/<pid>/fd link. That is a magic link (O_NOFOLLOW
/// would refuse it, and it names the streamer's open file, not a path anyone can swap), so it is
/// opened O_PATH first, which opens nothing (no FIFO blocks, no device's open runs): only a regular
/// file is then opened for reading, through this process's own descriptor of it. The object must
/// be the memfd the handle's tag names, and sealed.
unique_fd open_memfd(const std::string& handle, const memfd_handle& m) {
  const std::string path = fmt::format("{}{}/fd/{}", proc_prefix, m.pid, m.fd);
  unique_fd at(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!at) {
    const int e = errno;
    throw error(errc::transport,
                fmt::format("host_shm: cannot open the streamer's buffer {}: {}; is the streamer still alive, in "
                            "this process's pid namespace, of this user and dumpable? (a receiver that cannot see "
                            "the streamer's /proc needs named segments: REFIT_HOST_SHM=named on the streamer)",
                            handle, errno_text(e)));
  }
  check_type(stat_of(at.get(), handle), handle);
  const std::string self = fmt::format("/proc/self/fd/{}", at.get());
  std::array<char, 512> link{};
  const ssize_t n = ::readlink(self.c_str(), link.data(), link.size() - 1);
  const std::string expect = fmt::format("/memfd:{} (deleted)", m.tag);
  if (n < 0 || std::string_view(link.data(), static_cast<std::size_t>(n)) != expect)
    throw error(errc::transport,
                fmt::format("host_shm: {} is not the streamer's buffer {} (it is '{}'): refused", path, m.tag,
                            n < 0 ? std::string("?") : std::string(link.data(), static_cast<std::size_t>(n))));
  unique_fd fd(::open(self.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd) {
    const int e = errno;
    throw error(errc::transport,
                fmt::format("host_shm: cannot open the streamer's buffer {}: {}", handle, errno_text(e)));
  }
  return fd;
}

void check_seals(int fd, const std::string& handle) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & required_seals) != required_seals)
    throw error(errc::transport,
                fmt::format("host_shm: the streamer's buffer {} is not sealed against shrinking and growing "
                            "(F_GET_SEALS: {}): refused",
                            handle, seals < 0 ? errno_text(errno) : fmt::format("{:#x}", seals)));
}

/// A read-only mapping of a buffer another process created, checked before it is mapped (see the
/// top of this file) and guarded against SIGBUS while it is (copy/bus_guard.hpp).
class shm_mapping {
 public:
  shm_mapping(const std::string& handle, std::uint64_t expected, std::size_t index) {
    const auto memfd = parse_memfd_handle(handle);
    const unique_fd fd = memfd ? open_memfd(handle, *memfd) : open_named(handle);
    const struct stat st = stat_of(fd.get(), handle);
    check_object(st, handle, expected);
    if (memfd) check_seals(fd.get(), handle);
    void* p = ::mmap(nullptr, expected, PROT_READ, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      throw error(errc::transport,
                  fmt::format("host_shm: cannot map shared memory {} ({} bytes): {}", handle, expected, errno_text(e)));
    }
    data_ = static_cast<const std::byte*>(p);
    size_ = expected;
    counted_ = memory::charge(memory::kind::host, expected);
    try {
      guard_ = std::make_unique<copy::peer_memory>(data_, size_, handle, index);
    } catch (...) {
      release();
      throw;
    }
    if (!memfd) unlink_if_same(handle, st);
  }
  ~shm_mapping() { release(); }
  shm_mapping(const shm_mapping&) = delete;
  shm_mapping& operator=(const shm_mapping&) = delete;
  shm_mapping(shm_mapping&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        guard_(std::move(o.guard_)),
        counted_(std::move(o.counted_)) {}
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      guard_ = std::move(o.guard_);
      counted_ = std::move(o.counted_);
    }
    return *this;
  }
  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  /// Throws refit::error(transport) when a read of this buffer took a SIGBUS (it shrank).
  void check() const {
    if (guard_ && guard_->fault()) throw error(errc::transport, "host_shm: " + guard_->fault_message());
  }

 private:
  /// The receiver removes a named segment's name once it holds the mapping, so that a streamer
  /// killed before it hears OK leaves nothing in /dev/shm; only when the name still is the file it
  /// checked (a file of its own uid), never another.
  static void unlink_if_same(const std::string& name, const struct stat& mapped) noexcept {
    struct stat now {};
    if (::lstat(("/dev/shm" + name).c_str(), &now) == 0 && now.st_dev == mapped.st_dev && now.st_ino == mapped.st_ino)
      ::shm_unlink(name.c_str());
  }
  void release() noexcept {
    guard_.reset();  // before the range goes: a fault there must not be taken for ours
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
    counted_.reset();
  }
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  std::unique_ptr<copy::peer_memory> guard_;
  memory::charge counted_;  ///< size_, while mapped (include/refit/memory.hpp)
};

// ------------------------------------------------------------------------------------ source

class host_shm_source final : public source {
 public:
  explicit host_shm_source(const source_options& o) : count_(o.count), bytes_(o.bytes) {
    if (count_ == 0 || count_ > wire::max_buffers)
      throw error(errc::invalid_argument,
                  fmt::format("host_shm: buffer_count is {}: give 1..{} buffers", count_, wire::max_buffers));
    if (bytes_ == 0) throw error(errc::invalid_argument, "host_shm: buffer_bytes is 0");
    sharing_ = requested_sharing();
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
    for (const auto& s : segments_) h.buffers.push_back(wire::buffer_desc{s.size(), s.handle(), "", ""});
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
    for (std::size_t i = 0; i < count_; ++i) fresh.push_back(make_one());
    segments_ = std::move(fresh);
  }

  shm_segment make_one() {
    if (sharing_ == sharing::memfd) {
      if (auto s = shm_segment::make_memfd(bytes_)) return std::move(*s);
      REFIT_WARN("host_shm: this kernel makes no sealed memfds; sharing the buffers as named segments in /dev/shm");
      sharing_ = sharing::named;
    }
    return shm_segment::make_named(bytes_);
  }

  std::size_t count_;
  std::uint64_t bytes_;
  sharing sharing_ = sharing::memfd;
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
                                "(expected /proc/<pid>/fd/<fd>:refit-<pid>-<hex> or /refit-<pid>-<pidns>-<hex>)",
                                i, d.handle.substr(0, 300)));
      if (d.bytes == 0) throw error(errc::transport, fmt::format("host_shm: buffer {} ({}) has 0 bytes", i, d.handle));
    }
    std::vector<shm_mapping> mapped;
    mapped.reserve(h.buffers.size());
    for (std::size_t i = 0; i < h.buffers.size(); ++i) mapped.emplace_back(h.buffers[i].handle, h.buffers[i].bytes, i);
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

  // A read of buffer i that took a SIGBUS outside the copier's guard (a batch callback, the host
  // delta apply) read zeros from then on: the batch fails here, and so does every later one.
  void begin_read(std::size_t i) override { check(i); }
  void end_read(std::size_t i) override { check(i); }
  void drain() override {
    for (std::size_t i = 0; i < mappings_.size(); ++i) check(i);
  }

 private:
  void check(std::size_t i) const {
    if (i < mappings_.size()) mappings_[i].check();
  }

  std::vector<shm_mapping> mappings_;
};

std::unique_ptr<source> make_host_shm_source(const source_options& options) {
  return std::make_unique<host_shm_source>(options);
}

std::unique_ptr<sink> make_host_shm_sink(int, milliseconds) { return std::make_unique<host_shm_sink>(); }

}  // namespace

}  // namespace refit::transport

// The registration. Up to 64 receivers per streamer (the ranks or replicas of engines on this host),
// always staged through the shared segments: each receiver maps them read-only and finishes with a
// buffer before it answers the batch after it, and the streamer reuses a buffer only once every
// receiver has answered.
REFIT_TRANSPORT(host_shm,
                {refit::transport::transport_name, refit::transport::capabilities{64, false, false, false, true},
                 refit::transport::make_host_shm_source, refit::transport::make_host_shm_sink});
