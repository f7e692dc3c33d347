#include "delta/checksum.hpp"

namespace refit::delta {

std::uint64_t name_weight(std::string_view name) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= tail_prime;
  }
  return h | 1;
}

std::uint64_t range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total) noexcept {
  const std::uint64_t whole = total & ~std::uint64_t{7};
  std::uint64_t sum = 0;
  std::uint64_t b = off;
  const std::uint64_t end = off + n;
  // Head bytes up to a word boundary, then whole words, then whatever is left byte by byte.
  for (; b < end && (b & 7) != 0 && b < whole; ++b)
    sum += (static_cast<std::uint64_t>(p[b - off]) << (8 * (b & 7))) * (2 * (b >> 3) + 1);
  for (; b + 8 <= end && b + 8 <= whole; b += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + (b - off), 8);
    sum += w * (2 * (b >> 3) + 1);
  }
  for (; b < end; ++b) {
    const auto v = static_cast<std::uint64_t>(p[b - off]);
    if (b < whole)
      sum += (v << (8 * (b & 7))) * (2 * (b >> 3) + 1);
    else
      sum += v * (2 * (b - whole) + 3) * tail_prime;
  }
  return sum;
}

}  // namespace refit::delta
