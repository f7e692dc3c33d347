// refit — the counters behind include/refit/memory.hpp.
#include "model/memory.hpp"

#include <array>
#include <atomic>

#include "refit/memory.hpp"

namespace refit::memory {
namespace {

struct counter {
  std::atomic<std::uint64_t> now{0};
  std::atomic<std::uint64_t> peak{0};
};

std::array<counter, 3>& counters() noexcept {
  static std::array<counter, 3> c;
  return c;
}

counter& of(kind k) noexcept { return counters()[static_cast<std::size_t>(k)]; }

}  // namespace

void acquired(kind k, std::uint64_t bytes) noexcept {
  counter& c = of(k);
  const std::uint64_t now = c.now.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  std::uint64_t peak = c.peak.load(std::memory_order_relaxed);
  while (now > peak && !c.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void released(kind k, std::uint64_t bytes) noexcept { of(k).now.fetch_sub(bytes, std::memory_order_relaxed); }

}  // namespace refit::memory

namespace refit {

memory_usage memory_in_use() noexcept {
  using memory::kind;
  const auto now = [](kind k) { return memory::of(k).now.load(std::memory_order_relaxed); };
  const auto peak = [](kind k) { return memory::of(k).peak.load(std::memory_order_relaxed); };
  return {now(kind::device),  peak(kind::device), now(kind::pinned),
          peak(kind::pinned), now(kind::host),    peak(kind::host)};
}

void reset_memory_peaks() noexcept {
  for (auto& c : memory::counters()) c.peak.store(c.now.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace refit
