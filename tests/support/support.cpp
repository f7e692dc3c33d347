// Test helpers shared by the unit and gpu suites.
#include "support/support.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <stdexcept>
#include <thread>

#include "channel/channel.hpp"
#include "config/config.hpp"
#include "refit/version.hpp"

#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace refit::test {
namespace {

using clock = std::chrono::steady_clock;

void flush_all() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
}

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t fnv1a(const std::string& s) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

constexpr std::uint64_t version_mix = 0xd6e8feb86659fd93ull;

std::uint64_t pattern_seed(const std::string& name, std::uint64_t version) noexcept {
  return fnv1a(name) ^ (version * version_mix);
}

int remaining_ms(clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : static_cast<int>(left);
}

// Reads one line (without its newline) from `fd` into `line`. False when `deadline` passed first,
// `line` then holding what had arrived; throws std::runtime_error at end of file or on an error.
bool read_line(int fd, clock::time_point deadline, std::string& line) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("signal_pipe poll failed: ") + std::strerror(errno));
    }
    if (r == 0) return false;
    char c = 0;
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("signal_pipe read failed: ") + std::strerror(errno));
    }
    if (n == 0) throw std::runtime_error("signal_pipe: end of file (the other side is gone)");
    if (c == '\n') return true;
    line.push_back(c);
  }
}

/// nccl_ranks() found fewer GPUs than ranks (see nccl_shares_gpus()).
bool g_nccl_shared = false;

}  // namespace

bool nccl_ranks(int ranks, bool distinct) {
  if (!refit::has_transport(refit::transport_kind::nccl)) {
    std::fprintf(stderr, "this nccl test needs a refit built with NCCL: skipped\n");
    return false;
  }
  // NVLink SHARP multicast is off on the test machines (and broadcast does not use it anyway).
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  const int devices = cuda_device_count();
  g_nccl_shared = false;
  if (devices >= ranks) return true;
  if (devices == 0 || distinct) {
    std::fprintf(stderr, "this nccl test needs %d GPUs%s; %d visible: skipped\n", ranks,
                 distinct ? " (one per rank: it crosses GPUs)" : "", devices);
    return false;
  }
  g_nccl_shared = true;
  return true;
}

int gpu_of(int k) {
  const int devices = cuda_device_count();
  return devices > 0 ? k % devices : 0;
}

bool nccl_shares_gpus() { return g_nccl_shared; }

int cuda_device_count() {
#if REFIT_HAVE_CUDA
  // Asked in a short-lived child so that this process never initialises the CUDA runtime: tests
  // fork afterwards, and a forked child cannot use CUDA once its parent has.
  static const int count = [] {
    flush_all();
    const pid_t pid = ::fork();
    if (pid < 0) return 0;
    if (pid == 0) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
      ::_exit(std::clamp(n, 0, 255));
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0) {
      if (errno != EINTR) return 0;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  }();
  return count;
#else
  return 0;
#endif
}

std::string temp_endpoint() {
  static std::atomic<unsigned> counter{0};
  // The directory is unique already; the counter only makes logs easier to follow.
  return channel::make_private_endpoint("test-" + std::to_string(counter.fetch_add(1)));
}

// ------------------------------------------------------------------------------------ child

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define REFIT_FORK_GUARD 1
/// Whether every thread of this process but the caller sleeps in a system call that is not one
/// of the memory-mapping ones AddressSanitizer's allocator makes while it holds a lock.
bool others_asleep() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return true;  // no /proc: nothing to learn, fork as ever
  const std::string self = std::to_string(::gettid());
  bool asleep = true;
  while (const dirent* e = ::readdir(dir)) {
    const std::string tid = e->d_name;
    if (tid == "." || tid == ".." || tid == self) continue;
    std::ifstream stat("/proc/self/task/" + tid + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) continue;  // exited meanwhile
    // The system call it sleeps in: "running" reads as none; an unreadable file (a kernel that
    // hides it) leaves the state alone to go by.
    std::ifstream call("/proc/self/task/" + tid + "/syscall");
    std::string first;
    const bool known = static_cast<bool>(call >> first);
    const long number = known && !first.empty() && std::isdigit(static_cast<unsigned char>(first[0])) != 0
                            ? std::strtol(first.c_str(), nullptr, 10)
                            : -1;
    const bool mapping = number == SYS_mmap || number == SYS_mprotect || number == SYS_munmap || number == SYS_mremap ||
                         number == SYS_madvise;
    if (line[paren + 2] != 'S' || (known && number < 0) || mapping) {
      asleep = false;
      break;
    }
  }
  ::closedir(dir);
  return asleep;
}
#endif

/// GCC 12's AddressSanitizer does not lock its allocator around fork(): a child forked while
/// another thread of this process (ZeroMQ's reaper, just after a socket closed) holds one of the
/// allocator's size-class locks inherits it locked, and the child's first thread to need that
/// size class waits forever (seen: a receiver child whose ZeroMQ I/O thread hung, so that no
/// streamer ever had an answer). Under it, fork only once every other thread has been asleep in
/// a system call twice in a row (at most 2 s). glibc's malloc locks its arenas around fork
/// itself. ThreadSanitizer gets the same guard: compiler-rt's own fork test says "TSAN does not
/// lock allocator", and CI's TSan stage once saw a receiver child that said it was ready and then
/// never answered HELLO (5 s), the symptom ASan's hang had.
void before_fork() {
  flush_all();
#if defined(REFIT_FORK_GUARD)
  const auto deadline = clock::now() + std::chrono::seconds(2);
  int calm = 0;
  while (calm < 2 && clock::now() < deadline) {
    calm = others_asleep() ? calm + 1 : 0;
    if (calm < 2) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
#endif
}

}  // namespace

child::child(const std::function<void()>& body) {
  before_fork();
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    // A suite killed at its time limit takes its children with it: none is left holding the GPU
    // or a port (the parent may already be gone by the time the request is made).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(3);
    int code = 0;
    if (nccl_shares_gpus()) ::setenv("NCCL_HOSTID", ("refit-test-" + std::to_string(::getpid())).c_str(), 1);
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      code = 1;
    } catch (...) {
      code = 2;  // a failed Catch2 REQUIRE, or anything else that is not a std::exception
    }
    flush_all();
    ::_exit(code);
  }
  pid_ = pid;
}

child::~child() { kill(); }

int child::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) throw std::runtime_error("child::wait: no child");
  if (!reaped_) {
    const auto deadline = clock::now() + timeout;
    auto pause = std::chrono::microseconds(200);
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        break;
      }
      if (r < 0 && errno != EINTR) throw std::runtime_error(std::string("waitpid failed: ") + std::strerror(errno));
      if (clock::now() >= deadline) {
        kill();
        throw std::runtime_error("child " + std::to_string(pid_) + " did not exit within " +
                                 std::to_string(timeout.count()) + " ms (killed)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }
  }
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) return -WTERMSIG(status_);
  return -1;
}

void child::kill() noexcept {
  if (pid_ <= 0 || reaped_) return;
  ::kill(pid_, SIGKILL);
  while (::waitpid(pid_, &status_, 0) < 0) {
    if (errno != EINTR) break;
  }
  reaped_ = true;
}

// ------------------------------------------------------------------------------------ signal_pipe

signal_pipe::signal_pipe() {
  if (::pipe(fds_) != 0) throw std::runtime_error(std::string("pipe failed: ") + std::strerror(errno));
}

signal_pipe::~signal_pipe() {
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void signal_pipe::send(const std::string& line) {
  const std::string data = line + '\n';
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fds_[1], data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("signal_pipe write failed: ") + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

std::string signal_pipe::receive(std::chrono::milliseconds timeout) {
  std::string line;
  if (!read_line(fds_[0], clock::now() + timeout, line))
    throw std::runtime_error("signal_pipe: no line within " + std::to_string(timeout.count()) + " ms (got '" + line +
                             "' so far)");
  return line;
}

std::optional<std::string> signal_pipe::try_receive(std::chrono::milliseconds wait) {
  std::string line;
  if (!read_line(fds_[0], clock::now() + wait, line)) return std::nullopt;
  return line;
}

// ------------------------------------------------------------------------------------ patterns

std::uint8_t pattern_byte(const std::string& name, std::uint64_t version, std::uint64_t i) noexcept {
  const std::uint64_t h = splitmix64(pattern_seed(name, version) ^ (i / 8));
  return static_cast<std::uint8_t>(h >> (8 * (i % 8)));
}

void fill_pattern(const std::string& name, std::uint64_t version, std::uint8_t* out, std::uint64_t n) {
  const std::uint64_t seed = pattern_seed(name, version);
  const std::uint64_t words = n / 8;
  for (std::uint64_t w = 0; w < words; ++w) {
    const std::uint64_t h = splitmix64(seed ^ w);
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(out + 8 * w, &h, 8);
    } else {
      for (int k = 0; k < 8; ++k) out[8 * w + k] = static_cast<std::uint8_t>(h >> (8 * k));
    }
  }
  if (const std::uint64_t tail = n % 8; tail != 0) {
    const std::uint64_t h = splitmix64(seed ^ words);
    for (std::uint64_t k = 0; k < tail; ++k) out[8 * words + k] = static_cast<std::uint8_t>(h >> (8 * k));
  }
}

// ------------------------------------------------------------------------------------ models

std::vector<tensor_meta> mixed_model(std::size_t count, std::uint64_t oversize_bytes, std::uint64_t seed) {
  static constexpr const char* kinds[] = {"attn.q", "attn.k",   "attn.v",   "attn.o",
                                          "mlp.up", "mlp.gate", "mlp.down", "norm"};
  constexpr std::uint64_t max_bytes = 64u << 10;
  std::mt19937_64 rng(splitmix64(seed));
  std::vector<tensor_meta> out;
  out.reserve(count + 1);
  for (std::size_t i = 0; i < count; ++i) {
    tensor_meta m;
    m.name = "layers." + std::to_string(i) + "." + kinds[i % std::size(kinds)] + ".weight";
    m.type = static_cast<dtype>(i % 15);
    const std::size_t rank = rng() % 5;
    for (std::size_t d = 0; d < rank; ++d) m.shape.push_back(static_cast<std::int64_t>(1 + rng() % 96));
    // Keep tensors small (at most 64 KiB) so a test model of a few hundred tensors stays cheap.
    while (m.nbytes() > max_bytes) {
      auto largest = std::max_element(m.shape.begin(), m.shape.end());
      *largest = (*largest + 1) / 2;
    }
    if (i % 25 == 12) {
      if (m.shape.empty())
        m.shape.push_back(0);
      else
        m.shape[rng() % m.shape.size()] = 0;
    }
    out.push_back(std::move(m));
  }
  if (oversize_bytes > 0) {
    tensor_meta big{"oversize.weight", dtype::u8, {static_cast<std::int64_t>(oversize_bytes)}};
    out.insert(out.begin() + static_cast<std::ptrdiff_t>(out.size() / 2), std::move(big));
  }
  return out;
}

scoped_endpoint::~scoped_endpoint() { channel::remove_private_endpoint(name); }

host_tensors::host_tensors(std::vector<tensor_meta> m, std::uint64_t version) : metas(std::move(m)) {
  bytes.reserve(metas.size());
  refs.reserve(metas.size());
  for (const auto& meta : metas) {
    const auto n = meta.nbytes();
    // At least one byte, so that even a zero-size tensor has a real pointer.
    auto& b = bytes.emplace_back(std::max<std::uint64_t>(n, 1), std::uint8_t{0});
    fill_pattern(meta.name, version, b.data(), n);
    refs.push_back(tensor_ref{meta, b.data(), device::cpu(), nullptr});
  }
}

refit::tensor_ref shard_of(const tensor_meta& t, const std::vector<std::uint8_t>& bytes, std::int64_t start,
                           std::int64_t count) {
  tensor_meta local = t;
  local.shape[0] = count;
  const std::uint64_t row = t.shape[0] == 0 ? 0 : t.nbytes() / static_cast<std::uint64_t>(t.shape[0]);
  refit::tensor_ref ref{local, bytes.data() + row * static_cast<std::uint64_t>(start), refit::device::cpu(), nullptr};
  ref.shard = refit::tensor_shard{t.shape, 0, start};
  return ref;
}

std::vector<refit::tensor_ref> rank_shards(const host_tensors& whole, std::size_t r, std::size_t n) {
  std::vector<refit::tensor_ref> out;
  for (std::size_t k = 0; k < whole.metas.size(); ++k) {
    const std::int64_t rows = whole.metas[k].shape[0];
    const std::int64_t per = (rows + static_cast<std::int64_t>(n) - 1) / static_cast<std::int64_t>(n);
    const std::int64_t start = std::min<std::int64_t>(rows, per * static_cast<std::int64_t>(r));
    out.push_back(shard_of(whole.metas[k], whole.bytes[k], start, std::min<std::int64_t>(rows, start + per) - start));
  }
  return out;
}

std::string pattern_mismatch(const tensor_meta& meta, std::uint64_t version, const std::uint8_t* data) {
  const auto n = meta.nbytes();
  std::vector<std::uint8_t> want(n);
  fill_pattern(meta.name, version, want.data(), n);
  const auto [w, d] = std::mismatch(want.begin(), want.end(), data);
  if (w == want.end()) return {};
  const auto i = static_cast<std::uint64_t>(w - want.begin());
  return describe(meta) + " byte " + std::to_string(i) + " is " + std::to_string(*d) + ", version " +
         std::to_string(version) + " has " + std::to_string(*w);
}

refit::streamer_options host_shm_streamer(const std::string& endpoint, std::uint64_t buffer_bytes,
                                          refit::milliseconds timeout, std::size_t buffer_count) {
  refit::streamer_options o;
  o.endpoint = endpoint;
  o.transport = refit::transport_kind::host_shm;
  // The suites also run over transports registered from their own file (tests/transport/): the
  // test list names one here, and these streamers use it instead.
  if (const char* name = std::getenv("REFIT_TEST_TRANSPORT"); name != nullptr && *name != '\0') o.transport_name = name;
  o.buffer_count = buffer_count;
  o.buffer_bytes = buffer_bytes;
  o.timeout = timeout;
  return o;
}

std::string outcome(const std::string& event, std::optional<std::uint64_t> committed, bool dirty,
                    const std::string& check) {
  return event + " committed=" + (committed ? std::to_string(*committed) : std::string("none")) +
         " dirty=" + (dirty ? "1" : "0") + " check=" + (event == "committed" ? check : "-");
}

std::string code_name(errc c) { return std::string(to_string(c)); }

}  // namespace refit::test
