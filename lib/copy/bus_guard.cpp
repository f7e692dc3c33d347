#include "copy/bus_guard.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csetjmp>
#include <cstring>
#include <mutex>

#include "refit/error.hpp"

namespace refit::copy {
namespace {

// Everything the handler reads is here, in static storage of lock-free atomics: a signal handler
// may not lock, allocate or touch thread_local storage of a shared library (its first use on a
// thread may allocate).

constexpr std::uint64_t no_fault = ~std::uint64_t{0};

/// One registered range; `end` is 0 while the slot is free.
struct range_slot {
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::uintptr_t> end{0};
  std::atomic<std::uint64_t> fault{no_fault};  ///< offset of the first faulting byte
};

/// A thread that has run guarded(): its kernel thread id and where a fault jumps to (null outside
/// guarded()).
struct guard_slot {
  std::atomic<pid_t> tid{0};
  std::atomic<sigjmp_buf*> jump{nullptr};
  std::atomic<std::uintptr_t> fault{0};
};

constexpr std::size_t max_guarded_threads = 256;

std::array<range_slot, peer_memory::max_ranges> ranges;
std::array<guard_slot, max_guarded_threads> guards;
std::atomic<std::size_t> live_ranges{0};
std::uintptr_t page_bytes = 4096;
struct sigaction previous {};

/// Registration and the owners' names: never touched by the handler.
std::mutex registry;
std::array<const peer_memory*, peer_memory::max_ranges> owners{};

static_assert(std::atomic<std::uintptr_t>::is_always_lock_free && std::atomic<pid_t>::is_always_lock_free &&
              std::atomic<sigjmp_buf*>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free);

pid_t current_tid() noexcept { return static_cast<pid_t>(::syscall(SYS_gettid)); }

range_slot* range_of(std::uintptr_t addr) noexcept {
  for (range_slot& r : ranges) {
    const std::uintptr_t end = r.end.load(std::memory_order_acquire);
    if (end != 0 && addr >= r.begin.load(std::memory_order_relaxed) && addr < end) return &r;
  }
  return nullptr;
}

guard_slot* guard_of(pid_t tid) noexcept {
  for (guard_slot& g : guards)
    if (g.tid.load(std::memory_order_acquire) == tid) return &g;
  return nullptr;
}

/// Replaces the pages of `r` from the one holding `addr` to its end by zero pages (what a read of
/// them returns from now on), so that a reader outside guarded() goes on instead of dying.
bool zero_fill(const range_slot& r, std::uintptr_t addr) noexcept {
  const std::uintptr_t from = addr & ~(page_bytes - 1);
  const std::uintptr_t to = (r.end.load(std::memory_order_relaxed) + page_bytes - 1) & ~(page_bytes - 1);
  void* p = ::mmap(reinterpret_cast<void*>(from), to - from, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return p != MAP_FAILED;
}

/// What would have happened without this handler: the one it replaced, or the default action.
void chain(int sig, siginfo_t* info, void* context) noexcept {
  const bool sent = info == nullptr || info->si_code <= 0;  // kill(), raise(), sigqueue(): not a fault
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    if (previous.sa_sigaction != nullptr) previous.sa_sigaction(sig, info, context);
    return;
  }
  if (previous.sa_handler == SIG_IGN && sent) return;
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  // The default action. A fault repeats when the handler returns and then kills the process with
  // the usual signal and core; a sent signal must be sent again.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  if (sent) ::raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {
    const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
    if (range_slot* r = range_of(addr)) {
      std::uint64_t none = no_fault;
      r->fault.compare_exchange_strong(none, addr - r->begin.load(std::memory_order_relaxed));
      if (guard_slot* g = guard_of(current_tid())) {
        if (sigjmp_buf* jump = g->jump.load(std::memory_order_acquire)) {
          g->fault.store(addr, std::memory_order_relaxed);
          siglongjmp(*jump, 1);
        }
      }
      if (zero_fill(*r, addr)) return;
    }
  }
  chain(sig, info, context);
}

void install_once() {
  static std::once_flag once;
  static int failure = 0;
  std::call_once(once, [] {
    if (const long p = ::sysconf(_SC_PAGESIZE); p > 0) page_bytes = static_cast<std::uintptr_t>(p);
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    // SA_NODEFER: leaving the handler by siglongjmp then leaves the signal mask as it was, so
    // sigsetjmp need not save it (a system call per batch).
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &previous) != 0) failure = errno;
  });
  if (failure != 0)
    throw error(errc::transport, fmt::format("cannot install the SIGBUS handler that protects reads of the "
                                             "streamer's shared memory: {} (errno {})",
                                             std::strerror(failure), failure));
}

/// This thread's guard slot, claimed on its first guarded() (again in a forked child: the slot its
/// memory names is its parent thread's); null when every slot is taken (then copies run unguarded,
/// and a fault takes the zero-fill path).
guard_slot* this_thread_guard() noexcept {
  struct claim {
    guard_slot* slot = nullptr;
    pid_t tid = 0;
    ~claim() {
      if (slot != nullptr && slot->tid.load() == tid) {
        slot->jump.store(nullptr);
        slot->tid.store(0, std::memory_order_release);
      }
    }
  };
  thread_local claim mine;
  const pid_t tid = current_tid();
  if (mine.slot != nullptr && mine.tid == tid) return mine.slot;
  for (guard_slot& g : guards) {
    pid_t free = 0;
    if (g.tid.compare_exchange_strong(free, tid, std::memory_order_acq_rel)) {
      g.jump.store(nullptr);
      mine.slot = &g;
      mine.tid = tid;
      return &g;
    }
  }
  return nullptr;
}

/// The message of the fault at `addr` (after guarded() jumped back).
std::string message_at(std::uintptr_t addr) {
  std::lock_guard lock(registry);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const std::uintptr_t end = ranges[i].end.load();
    if (owners[i] != nullptr && end != 0 && addr >= ranges[i].begin.load() && addr < end)
      return owners[i]->fault_message();
  }
  return fmt::format("a SIGBUS at {:#x} in memory of the streamer that is no longer mapped; the refit was aborted",
                     addr);
}

}  // namespace

peer_memory::peer_memory(const void* base, std::uint64_t bytes, std::string name, std::size_t index)
    : slot_(ranges.size()), name_(std::move(name)), index_(index) {
  install_once();
  std::lock_guard lock(registry);
  for (std::size_t i = 0; i < owners.size(); ++i) {
    if (owners[i] != nullptr) continue;
    owners[i] = this;
    slot_ = i;
    ranges[i].fault.store(no_fault);
    ranges[i].begin.store(reinterpret_cast<std::uintptr_t>(base));
    ranges[i].end.store(reinterpret_cast<std::uintptr_t>(base) + bytes, std::memory_order_release);
    live_ranges.fetch_add(1);
    return;
  }
  throw error(errc::transport, fmt::format("cannot map {}: {} buffers of streamers are mapped in this process already",
                                           name_, ranges.size()));
}

peer_memory::~peer_memory() {
  std::lock_guard lock(registry);
  ranges[slot_].end.store(0, std::memory_order_release);
  ranges[slot_].begin.store(0);
  owners[slot_] = nullptr;
  live_ranges.fetch_sub(1);
}

std::optional<std::uint64_t> peer_memory::fault() const noexcept {
  const std::uint64_t at = ranges[slot_].fault.load();
  if (at == no_fault) return std::nullopt;
  return at;
}

std::string peer_memory::fault_message() const {
  return fmt::format(
      "the streamer's shared memory {} shrank under the receiver (SIGBUS reading byte {} of buffer {}): the "
      "streamer is broken or hostile; the refit was aborted",
      name_, fault().value_or(0), index_);
}

bool peer_memory_mapped() noexcept { return live_ranges.load(std::memory_order_relaxed) != 0; }

namespace {

/// body(arg) with a jump back here from a SIGBUS in peer memory; false when one came. Kept apart
/// (and not inlined) so that nothing of the caller's lives in the frame sigsetjmp saves.
[[gnu::noinline]] bool run_guarded(guard_slot* const g, void (*const body)(const void*), const void* const arg) {
  sigjmp_buf* const outer = g->jump.load(std::memory_order_relaxed);
  sigjmp_buf jump;
  // Nothing with a destructor lives from here to the end of body(): the handler leaves by
  // siglongjmp, which runs none.
  if (sigsetjmp(jump, 0) != 0) {
    g->jump.store(outer, std::memory_order_release);
    return false;
  }
  g->jump.store(&jump, std::memory_order_release);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  body(arg);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  g->jump.store(outer, std::memory_order_release);
  return true;
}

}  // namespace

std::optional<std::string> guarded(void (*body)(const void*), const void* arg) {
  guard_slot* const g = this_thread_guard();
  if (g == nullptr) {
    body(arg);
    return std::nullopt;
  }
  if (run_guarded(g, body, arg)) return std::nullopt;
  return message_at(g->fault.load(std::memory_order_relaxed));
}

}  // namespace refit::copy
