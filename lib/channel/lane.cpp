// refit — the same-host control lane. See lane.hpp.
#include "channel/lane.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>
#include <utility>
#include <thread>
#include <vector>

#include "channel/unique_fd.hpp"
#include "model/log.hpp"
#include "refit/error.hpp"

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer tracks synchronisation by address. The two ends of a lane in one process (a
// test's streamer and receiver on two threads) map the segment at two addresses, so its atomics
// order nothing that TSan can see: every post and take also releases, and every observed one
// acquires, one address of this process.
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace refit::channel {
namespace {

#if defined(__SANITIZE_THREAD__)
char tsan_lane_sync;
void published() noexcept { __tsan_release(&tsan_lane_sync); }
void observed() noexcept { __tsan_acquire(&tsan_lane_sync); }
#else
void published() noexcept {}
void observed() noexcept {}
#endif

constexpr std::uint64_t magic = 0x6e616c2d74696665ull;  // "efit-lan"
constexpr std::uint64_t layout_version = 2;             // 2: announced
constexpr std::size_t nonce_bytes = 16;

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

template <class T>
T load(T& v, std::memory_order o = std::memory_order_seq_cst) noexcept {
  return std::atomic_ref<T>(v).load(o);
}
template <class T>
void store(T& v, T x, std::memory_order o = std::memory_order_seq_cst) noexcept {
  std::atomic_ref<T>(v).store(x, o);
}

int open_bell(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    throw error(errc::io, fmt::format("cannot open the control lane's doorbell {}: {}", path, errno_text(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    throw error(errc::protocol, fmt::format("{} is not a control lane's doorbell (a FIFO of this user)", path));
  }
  return fd;
}

/// The files of a lane's directory (all of them: remove_lane_files() leaves the directory empty).
constexpr std::array<const char*, 5> lane_files = {"segment", "to-receiver", "to-streamer", "life", "fds"};
/// A lane's directory is `<base>/refit-lane-<pid of its receiver>-XXXXXX`.
constexpr std::string_view dir_prefix = "refit-lane-";

/// Removes the files and then the directory `name` of `base` (an open directory), if it is a
/// directory of this user; never follows a link. Never throws.
void remove_lane_files(int base, const char* name) noexcept {
  const unique_fd dir{::openat(base, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)};
  struct stat st {};
  if (dir.get() < 0 || ::fstat(dir.get(), &st) != 0 || st.st_uid != ::geteuid()) return;
  for (const char* f : lane_files) (void)::unlinkat(dir.get(), f, 0);
  (void)::unlinkat(base, name, AT_REMOVEDIR);
}

/// remove_lane_files() for the directory at `path`.
void remove_lane_dir(const std::string& path) noexcept {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return;
  const std::string parent_path = slash == 0 ? "/" : path.substr(0, slash);
  const unique_fd parent{::open(parent_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (parent.get() >= 0) remove_lane_files(parent.get(), path.c_str() + slash + 1);
}

/// True when the lane directory `name` of `base` belongs to a receiver that is gone: its pid (in
/// the name) is not a process, and no process holds the read end of its `life` FIFO, which its
/// receiver held for as long as it lived (so a receiver of another pid namespace sharing the
/// directory, whose pid means nothing here, is not taken for dead).
bool orphaned(int base, std::string_view name) noexcept {
  if (!name.starts_with(dir_prefix)) return false;
  const std::string rest(name.substr(dir_prefix.size()));
  char* end = nullptr;
  const long pid = std::strtol(rest.c_str(), &end, 10);
  if (pid <= 0 || end == rest.c_str() || *end != '-') return false;
  if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) return false;
  const std::string life = std::string(name) + "/life";
  const int w = ::openat(base, life.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (w >= 0) {
    ::close(w);  // a reader holds it: a live receiver
    return false;
  }
  return errno == ENXIO || errno == ENOENT;  // no reader, or killed before it made the FIFO
}

/// Removes the lane directories in `base` whose receiver died before removing them (SIGKILL
/// before the streamer opened the lane). Best effort, never throws: a receiver must still start.
void reap_orphans(const std::string& base) noexcept {
  const unique_fd dir{::open(base.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir.get() < 0) return;
  const int scan = ::dup(dir.get());  // fdopendir takes it; `dir` stays for the *at calls
  if (scan < 0) return;
  DIR* d = ::fdopendir(scan);
  if (d == nullptr) {
    ::close(scan);
    return;
  }
  std::vector<std::string> dead;
  while (const dirent* e = ::readdir(d))
    if (orphaned(dir.get(), e->d_name)) dead.emplace_back(e->d_name);
  ::closedir(d);
  for (const std::string& name : dead) {
    remove_lane_files(dir.get(), name.c_str());
    REFIT_INFO("control lane: removed {}/{}, left by a receiver that died", base, name);
  }
}

std::string hex(std::span<const std::uint8_t> bytes) {
  std::string out;
  for (const std::uint8_t b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

}  // namespace

/// The shared segment: a header, then the two slots (data[k] holds what goes to side k).
struct lane::segment {
  struct alignas(64) flag {
    std::uint32_t value;
  };
  struct alignas(64) counter {
    std::uint64_t value;
  };
  struct direction {
    counter posted;  ///< chunks the writer has put in the slot
    counter taken;   ///< chunks the reader has copied out
    struct alignas(64) chunk {
      std::uint64_t total;   ///< bytes of the whole message
      std::uint64_t offset;  ///< of this chunk in it
      std::uint64_t bytes;   ///< of this chunk
    } head;
  };
  std::uint64_t magic;
  std::uint64_t layout;
  std::uint64_t slot;
  std::array<std::uint8_t, nonce_bytes> nonce;
  flag sleeping[2];  ///< by side: that end waits on its doorbell
  flag closed;       ///< the receiver closed the lane (its session was replaced, or it ended)
  /// The streamer's last announcement (lane::announce): its number (from 1) times 2^16, plus the
  /// milliseconds it holds the receiver awake (below 2^16). One word: read whole or not at all.
  counter announced;
  direction to[2];  ///< by side: messages to that end

  static constexpr std::size_t data_offset = 4096;
  static constexpr std::size_t total_bytes = data_offset + 2 * slot_bytes;
  std::byte* data(side s) noexcept {
    return reinterpret_cast<std::byte*>(this) + data_offset + static_cast<std::size_t>(s) * slot_bytes;
  }
};

std::unique_ptr<lane> lane::create() {
  static_assert(sizeof(segment) <= segment::data_offset);
  std::vector<std::string> bases;
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)) bases.emplace_back("/dev/shm");
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && *x == '/') bases.emplace_back(x);
  bases.emplace_back("/tmp");
  std::string failures;
  for (const std::string& base : bases) {
    reap_orphans(base);
    std::string dir = fmt::format("{}/{}{}-XXXXXX", base, dir_prefix, ::getpid());
    if (::mkdtemp(dir.data()) == nullptr) {
      failures += fmt::format("; {}: {}", base, errno_text(errno));
      continue;
    }
    std::unique_ptr<lane> l(new lane());
    l->me_ = side::receiver;
    l->dir_ = dir;  // removed by the destructor from here on
    struct stat made {};
    if (::lstat(dir.c_str(), &made) == 0) l->dir_id_ = {made.st_dev, made.st_ino};
    const std::string seg_path = dir + "/segment";
    unique_fd fd{::open(seg_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600)};
    if (fd.get() < 0) {
      failures += fmt::format("; {}: {}", seg_path, errno_text(errno));
      continue;
    }
    // Reserve the pages now: on a full tmpfs a later first touch would be SIGBUS, not an error.
    const int e = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(segment::total_bytes));
    if (e != 0 && (e == ENOSPC || ::ftruncate(fd.get(), static_cast<off_t>(segment::total_bytes)) != 0)) {
      failures += fmt::format("; {}: {}", seg_path, errno_text(e != 0 ? e : errno));
      continue;
    }
    void* p = ::mmap(nullptr, segment::total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) {
      failures += fmt::format("; mmap({}): {}", seg_path, errno_text(errno));
      continue;
    }
    l->seg_ = static_cast<segment*>(p);
    l->mapped_ = segment::total_bytes;
    std::memset(p, 0, segment::data_offset);
    std::array<std::uint8_t, nonce_bytes> nonce{};
    if (::getrandom(nonce.data(), nonce.size(), 0) != static_cast<ssize_t>(nonce.size()))
      throw error(errc::io, fmt::format("getrandom for a control lane's nonce: {}", errno_text(errno)));
    l->seg_->nonce = nonce;
    l->seg_->slot = slot_bytes;
    l->seg_->layout = layout_version;
    store(l->seg_->magic, magic);  // last: the header is whole once the magic is there
    const std::string mine = dir + "/to-receiver", theirs = dir + "/to-streamer", life = dir + "/life";
    if (::mkfifo(mine.c_str(), 0600) != 0 || ::mkfifo(theirs.c_str(), 0600) != 0 || ::mkfifo(life.c_str(), 0600) != 0) {
      failures += fmt::format("; mkfifo in {}: {}", dir, errno_text(errno));
      continue;
    }
    l->my_bell_ = open_bell(mine);
    l->peer_bell_ = open_bell(theirs);
    // The read end of `life`, held for as long as this process lives (see lane::life_).
    l->life_ = ::open(life.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
    if (l->life_ < 0) throw error(errc::io, fmt::format("cannot open {}: {}", life, errno_text(errno)));
    // Without it the lane works all the same; only descriptors cannot pass.
    try {
      l->fds_ = fd_link::listen(dir + "/fds");
    } catch (const error& e) {
      REFIT_DEBUG("control lane {}: no descriptor link: {}", dir, e.what());
    }
    l->offer_ = dir + "\n" + hex(nonce);
    return l;
  }
  throw error(errc::io, fmt::format("cannot make a control lane{}", failures));
}

std::unique_ptr<lane> lane::open(std::string_view offer) {
  const auto cut = offer.rfind('\n');
  if (cut == std::string_view::npos || offer.size() - cut - 1 != 2 * nonce_bytes || offer.front() != '/' ||
      offer.find('\0') != std::string_view::npos)
    throw error(errc::protocol, "the receiver's control lane offer is malformed (expected a directory and a nonce)");
  const std::string dir(offer.substr(0, cut));
  const std::string nonce_text(offer.substr(cut + 1));
  std::unique_ptr<lane> l(new lane());
  l->me_ = side::streamer;
  const std::string seg_path = dir + "/segment";
  unique_fd fd{::open(seg_path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW)};
  if (fd.get() < 0)
    throw error(errc::io, fmt::format("cannot open the control lane {}: {}", seg_path, errno_text(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      static_cast<std::uint64_t>(st.st_size) != segment::total_bytes)
    throw error(errc::protocol, fmt::format("{} is not a control lane of this user ({} bytes expected)", seg_path,
                                            segment::total_bytes));
  void* p = ::mmap(nullptr, segment::total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) throw error(errc::io, fmt::format("mmap({}): {}", seg_path, errno_text(errno)));
  l->seg_ = static_cast<segment*>(p);
  l->mapped_ = segment::total_bytes;
  if (load(l->seg_->magic) != magic || l->seg_->layout != layout_version || l->seg_->slot != slot_bytes ||
      hex(l->seg_->nonce) != nonce_text)
    throw error(errc::protocol,
                fmt::format("{} is not the control lane the receiver offered (another build of refit, or another "
                            "receiver's lane at the same path)",
                            seg_path));
  l->my_bell_ = open_bell(dir + "/to-streamer");
  l->peer_bell_ = open_bell(dir + "/to-receiver");
  // The write end of `life`: it opens only while the receiver holds the read end, and polls
  // POLLERR once no process does (the receiver's ended).
  const std::string life = dir + "/life";
  l->life_ = ::open(life.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (l->life_ < 0)
    throw error(errc::io, fmt::format("cannot open the control lane's {}: {}{}", life, errno_text(errno),
                                      errno == ENXIO ? " (the receiver is gone)" : ""));
  try {
    l->fds_ = fd_link::connect(dir + "/fds");
  } catch (const error& e) {
    REFIT_DEBUG("control lane {}: no descriptor link: {}", dir, e.what());
  }
  l->offer_ = std::string(offer);
  // Both ends hold everything open now (the receiver has since create(); the link's connection
  // waits in its listening socket until accepted): nobody needs the files any more, so they go at
  // once, and neither process killed from here on leaves them behind.
  remove_lane_dir(dir);
  return l;
}

lane::~lane() {
  if (me_ == side::receiver) close();
  if (seg_ != nullptr) ::munmap(seg_, mapped_);
  if (my_bell_ >= 0) ::close(my_bell_);
  if (peer_bell_ >= 0) ::close(peer_bell_);
  if (life_ >= 0) ::close(life_);
  remove_files();
}

void lane::remove_files() noexcept {
  if (dir_.empty()) return;
  // The streamer removes them once it opened the lane (open()); a directory at this path now is
  // another lane's, made since (the same random name), unless it is the one made here.
  struct stat st {};
  if (::lstat(dir_.c_str(), &st) == 0 && std::pair(st.st_dev, st.st_ino) == dir_id_) remove_lane_dir(dir_);
  dir_.clear();
}

void lane::close() noexcept {
  if (seg_ == nullptr || me_ != side::receiver) return;
  store(seg_->closed.value, 1u);
  ring_peer();
}

void lane::refuse_if_closed() {
  if (me_ != side::streamer) return;
  if (load(seg_->closed.value) != 0)
    throw error(errc::peer,
                "the receiver closed the control lane of this session (a new session replaced it: another "
                "streamer's HELLO); the streamer must say HELLO again");
  if (receiver_gone())
    throw error(errc::peer,
                "the receiver's process ended since the session began (nothing was sent to it); the streamer "
                "must say HELLO again, to the process serving the endpoint now");
}

bool lane::receiver_gone() {
  if (gone_) return true;
  if (life_ < 0 || me_ != side::streamer) return false;
  pollfd item{life_, 0, 0};  // no events asked: POLLERR (no reader left) is reported all the same
  if (::poll(&item, 1, 0) > 0 && (item.revents & (POLLERR | POLLHUP)) != 0) gone_ = true;
  return gone_;
}

bool lane::streamer_gone() const noexcept {
  if (life_ < 0 || me_ != side::receiver) return false;
  // POLLHUP on a FIFO's read end once every writer that opened it has closed it (never before the
  // first writer came).
  pollfd item{life_, 0, 0};
  return ::poll(&item, 1, 0) > 0 && (item.revents & POLLHUP) != 0;
}

bool lane::ready() const noexcept {
  auto& d = seg_->to[static_cast<int>(me_)];
  return load(d.posted.value) != load(d.taken.value, std::memory_order_relaxed);
}

void lane::arm() noexcept { store(seg_->sleeping[static_cast<int>(me_)].value, 1u); }

void lane::disarm() noexcept {
  store(seg_->sleeping[static_cast<int>(me_)].value, 0u);
  std::array<char, 64> sink{};
  while (::read(my_bell_, sink.data(), sink.size()) > 0) {
  }
}

bool lane::peer_asleep() const noexcept { return load(seg_->sleeping[static_cast<int>(peer())].value) != 0; }

void lane::ring_peer() noexcept {
  if (!peer_asleep()) return;
  const char one = 1;
  (void)!::write(peer_bell_, &one, 1);  // a full FIFO (EAGAIN) has rung already
}

void lane::announce(std::chrono::milliseconds hold) noexcept {
  if (me_ != side::streamer) return;
  const auto ms = static_cast<std::uint64_t>(
      std::clamp<std::int64_t>(hold.count(), 0, std::chrono::milliseconds(announce_max).count()));
  announce_unchecked((++announced_ << 16) | ms);
}

void lane::announce_unchecked(std::uint64_t word) noexcept {
  store(seg_->announced.value, word);
  ring_peer();
}

lane::clock::time_point lane::awake_until() noexcept {
  if (me_ != side::receiver) return awake_until_;
  const std::uint64_t word = load(seg_->announced.value, std::memory_order_relaxed);
  if (word >> 16 != announced_) {
    // Whatever the streamer wrote: at most 2^16 - 1 ms from the field, and at most announce_max.
    announced_ = word >> 16;
    awake_until_ =
        clock::now() + std::min<std::chrono::milliseconds>(std::chrono::milliseconds(word & 0xffff), announce_max);
  }
  return awake_until_;
}

template <class Pred>
bool lane::wait_until(Pred done, clock::time_point deadline, std::chrono::microseconds spin) {
  if (done()) return true;
  if (spin.count() > 0) {
    const auto spin_until = std::min(deadline, clock::now() + spin);
    do {
      std::this_thread::yield();
      if (done()) return true;
    } while (clock::now() < spin_until);
  }
  for (;;) {
    arm();
    if (done()) {
      disarm();
      return true;
    }
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) {
      disarm();
      return done();
    }
    // The streamer also watches the receiver's life (see life_): a receiver that died never answers.
    std::array<pollfd, 2> items{pollfd{my_bell_, POLLIN, 0}, pollfd{life_, 0, 0}};
    const nfds_t count = me_ == side::streamer && life_ >= 0 ? 2 : 1;
    (void)::poll(items.data(), count, static_cast<int>(std::min<std::int64_t>(left, 0x7fffffff)));  // EINTR: again
    if (count == 2 && (items[1].revents & (POLLERR | POLLHUP)) != 0) gone_ = true;
    disarm();
    if (done()) return true;
  }
}

bool lane::send(std::string_view bytes, clock::time_point deadline, std::chrono::microseconds spin) {
  auto& d = seg_->to[static_cast<int>(peer())];
  std::uint64_t offset = 0;
  do {
    refuse_if_closed();
    const std::uint64_t posted = load(d.posted.value, std::memory_order_relaxed);  // ours alone
    if (!wait_until([&] { return load(d.taken.value) == posted || closed(); }, deadline, spin)) return false;
    refuse_if_closed();
    observed();
    const std::uint64_t n = std::min<std::uint64_t>(slot_bytes, bytes.size() - offset);
    post_unchecked(bytes.size(), offset, n, bytes.substr(offset, n));
    offset += n;
  } while (offset < bytes.size());
  return true;
}

bool lane::closed() const noexcept { return me_ == side::streamer && (gone_ || load(seg_->closed.value) != 0); }

void lane::post_unchecked(std::uint64_t total, std::uint64_t offset, std::uint64_t bytes, std::string_view data,
                          std::uint64_t posts) noexcept {
  auto& d = seg_->to[static_cast<int>(peer())];
  if (!data.empty()) std::memcpy(seg_->data(peer()), data.data(), std::min<std::size_t>(data.size(), slot_bytes));
  store(d.head.total, total, std::memory_order_relaxed);
  store(d.head.offset, offset, std::memory_order_relaxed);
  store(d.head.bytes, bytes, std::memory_order_relaxed);
  published();
  store(d.posted.value, load(d.posted.value, std::memory_order_relaxed) + posts);
  ring_peer();
}

std::optional<std::string> lane::receive(clock::time_point deadline, std::chrono::microseconds spin) {
  if (!wait_until([&] { return ready() || closed(); }, deadline, spin)) return std::nullopt;
  if (!ready() && load(seg_->closed.value) == 0 && gone_)
    throw error(errc::timeout, "the receiver's process ended before it answered");
  if (!ready()) refuse_if_closed();
  auto& d = seg_->to[static_cast<int>(me_)];
  const std::byte* slot = seg_->data(me_);
  std::string out;
  std::uint64_t total = 0;
  clock::time_point rest_deadline = deadline;
  for (bool first = true;; first = false) {
    const std::uint64_t taken = load(d.taken.value, std::memory_order_relaxed);  // ours alone
    const std::uint64_t posted = load(d.posted.value, std::memory_order_acquire);
    observed();
    if (posted != taken + 1)
      throw error(errc::protocol, fmt::format("control lane: {} chunks posted while {} were taken (one at a time "
                                              "expected); the peer is broken",
                                              posted, taken));
    const std::uint64_t t = load(d.head.total, std::memory_order_relaxed);
    const std::uint64_t off = load(d.head.offset, std::memory_order_relaxed);
    const std::uint64_t n = load(d.head.bytes, std::memory_order_relaxed);
    if (first) {
      if (t > max_message_bytes)
        throw error(errc::protocol, fmt::format("control lane: a message of {} bytes, more than the limit of {}", t,
                                                max_message_bytes));
      total = t;
      out.reserve(total);
    }
    if (t != total || off != out.size() || n > slot_bytes || n > total - off || (n == 0 && total != 0))
      throw error(errc::protocol,
                  fmt::format("control lane: a chunk of {} bytes at {} of a {}-byte message, after {} of {} bytes; "
                              "the peer is broken",
                              n, off, t, out.size(), total));
    out.append(reinterpret_cast<const char*>(slot), n);
    published();
    store(d.taken.value, taken + 1);
    ring_peer();
    if (out.size() == total) return out;
    // One deadline for the whole message, set at its first chunk: a peer that posts a byte at a
    // time, each within a per-chunk wait, would otherwise hold this end for as long as it likes.
    if (first) rest_deadline = std::max(deadline, clock::now() + rest_of_message);
    if (!wait_until([&] { return ready() || closed(); }, rest_deadline, spin) || !ready())
      throw error(errc::timeout,
                  fmt::format("control lane: a message stopped after {} of its {} bytes (the whole message has "
                              "{} ms once its first chunk arrived); the peer is broken or stuck",
                              out.size(), total,
                              std::chrono::duration_cast<std::chrono::milliseconds>(rest_of_message).count()));
  }
}

}  // namespace refit::channel
