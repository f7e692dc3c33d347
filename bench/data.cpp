// Workload data: deterministic random bytes, and cheap checksum updates for perturbed tensors.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/bench.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Word w of the stream seeded `seed`.
inline std::uint64_t word(std::uint64_t seed, std::uint64_t w) noexcept {
  return splitmix64(seed ^ (w * 0xd1342543de82ef95ull));
}

void fill_range(std::byte* out, std::uint64_t n, std::uint64_t seed, std::uint64_t first) noexcept {
  // Byte i of the stream is byte (i % 8) of word (i / 8), whatever `first` is.
  std::uint64_t i = 0;
  while (i < n && (first + i) % 8 != 0) {
    const std::uint64_t g = first + i;
    out[i] = static_cast<std::byte>(word(seed, g / 8) >> (8 * (g % 8)));
    ++i;
  }
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t w = word(seed, (first + i) / 8);
    std::memcpy(out + i, &w, 8);
  }
  for (; i < n; ++i) {
    const std::uint64_t g = first + i;
    out[i] = static_cast<std::byte>(word(seed, g / 8) >> (8 * (g % 8)));
  }
}

}  // namespace

std::uint64_t tensor_seed(std::uint64_t seed, std::size_t i) noexcept {
  return splitmix64(splitmix64(seed) + static_cast<std::uint64_t>(i));
}

void fill_random(std::byte* out, std::uint64_t n, std::uint64_t seed, std::uint64_t first) {
  constexpr std::uint64_t per_thread = 8ull << 20;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const auto threads = static_cast<unsigned>(std::min<std::uint64_t>(hw, (n + per_thread - 1) / per_thread));
  if (threads <= 1) {
    fill_range(out, n, seed, first);
    return;
  }
  const std::uint64_t step = ((n / threads) + 7) & ~std::uint64_t{7};
  std::vector<std::jthread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    const std::uint64_t begin = std::min<std::uint64_t>(n, t * step);
    const std::uint64_t end = t + 1 == threads ? n : std::min<std::uint64_t>(n, begin + step);
    if (begin < end) pool.emplace_back([=] { fill_range(out + begin, end - begin, seed, first + begin); });
  }
}

std::uint64_t checksum_after_flip(std::uint64_t sum, std::uint64_t bytes, std::uint64_t offset, std::uint8_t old_byte,
                                  std::uint8_t new_byte) noexcept {
  // copy::checksum is linear in the bytes: a byte's weight depends only on its position.
  const std::uint64_t delta = static_cast<std::uint64_t>(new_byte) - static_cast<std::uint64_t>(old_byte);
  const std::uint64_t words = bytes / 8;
  const std::uint64_t k = offset / 8;
  if (k < words) return sum + (delta << (8 * (offset % 8))) * (2 * k + 1);
  const std::uint64_t j = offset - 8 * words;
  return sum + delta * (2 * j + 3) * 0x100000001b3ull;
}

void tensor_memory::check_bytes(std::uint64_t size, std::uint64_t offset, std::uint64_t bytes) {
  if (offset > size || bytes > size - offset)
    throw error(errc::invalid_argument,
                fmt::format("refit-bench: bytes {}..{} of a {}-byte tensor", offset, offset + bytes, size));
}

void tensor_memory::check_region(std::uint64_t size, const byte_region& r) {
  if (r.offset + (r.rows - 1) * r.pitch + r.width > size)
    throw error(errc::invalid_argument, fmt::format("refit-bench: {} runs of {} bytes {} apart from byte {} of a "
                                                    "{}-byte tensor",
                                                    r.rows, r.width, r.pitch, r.offset, size));
}

}  // namespace refit::bench
