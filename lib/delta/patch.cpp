#include "delta/patch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "delta/checksum.hpp"
#include "refit/error.hpp"

namespace refit::delta {
namespace {

/// diff() for elements of ITEM bytes. The common case (a small fraction changed) is decided 64
/// bytes at a time: eight XORed words ORed together, which the compiler vectorises; only blocks with
/// a difference are looked at word by word, and only differing words element by element.
template <std::size_t ITEM>
diff_result diff_items(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span,
                       std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept {
  diff_result r;
  const auto note = [&](std::uint64_t b) {  // element at span byte b differs
    const std::uint64_t o = load_bits(base + b, ITEM);
    const std::uint64_t n = load_bits(next + b, ITEM);
    r.terms += element_term(n, off + b, ITEM, total) - element_term(o, off + b, ITEM, total);
    std::memcpy(base + b, next + b, ITEM);
    indices[r.changes] = static_cast<std::uint32_t>(b / ITEM);
    std::memcpy(values + r.changes * ITEM, next + b, ITEM);
    ++r.changes;
  };
  const auto word = [&](std::uint64_t b) {
    std::uint64_t x, y;
    std::memcpy(&x, base + b, 8);
    std::memcpy(&y, next + b, 8);
    std::uint64_t d = x ^ y;
    if (d == 0) return;
    for (std::uint64_t e = 0; e < 8; e += ITEM) {
      const std::uint64_t mask = ITEM == 8 ? ~std::uint64_t{0} : ((std::uint64_t{1} << (8 * ITEM)) - 1) << (8 * e);
      if ((d & mask) != 0) note(b + e);
    }
  };
  std::uint64_t b = 0;
  for (; b + 64 <= span; b += 64) {
    std::uint64_t x[8], y[8];
    std::memcpy(x, base + b, 64);
    std::memcpy(y, next + b, 64);
    std::uint64_t any = 0;
    for (int k = 0; k < 8; ++k) any |= x[k] ^ y[k];
    if (any == 0) continue;
    for (std::uint64_t k = 0; k < 64; k += 8) word(b + k);
  }
  for (; b + 8 <= span; b += 8) word(b);
  for (; b < span; b += ITEM)
    if (std::memcmp(base + b, next + b, ITEM) != 0) note(b);
  return r;
}

#if defined(__SSE2__)
/// diff_items<2> with SSE2 (every x86-64): 64 bytes compared per step with four 16-bit compares,
/// whose byte masks make a 64-bit mask of the differing bytes; only its set bits are visited (about
/// 0.6 elements per step at 2 % changed), so the loop runs at the speed of reading the two inputs.
/// Blocks where nothing changed cost two loads, a compare and a test per 16 bytes.
diff_result diff_bf16_sse2(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span,
                           std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept {
  diff_result r;
  std::uint16_t* const out = reinterpret_cast<std::uint16_t*>(values);
  std::uint64_t b = 0;
  for (; b + 64 <= span; b += 64) {
    std::uint64_t mask = 0;
    for (int q = 0; q < 4; ++q) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + b + 16 * q));
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(next + b + 16 * q));
      mask |= static_cast<std::uint64_t>(static_cast<std::uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(x, y))) ^ 0xffffu)
              << (16 * q);
    }
    mask &= 0x5555555555555555ull;  // one bit per element: its low byte's
    while (mask != 0) {
      const std::uint64_t e = b + static_cast<std::uint64_t>(__builtin_ctzll(mask));
      mask &= mask - 1;
      std::uint16_t o, n;
      std::memcpy(&o, base + e, 2);
      std::memcpy(&n, next + e, 2);
      r.terms += element_term(n, off + e, 2, total) - element_term(o, off + e, 2, total);
      std::memcpy(base + e, &n, 2);
      indices[r.changes] = static_cast<std::uint32_t>(e / 2);
      std::memcpy(out + r.changes, &n, 2);
      ++r.changes;
    }
  }
  for (; b < span; b += 2) {
    std::uint16_t o, n;
    std::memcpy(&o, base + b, 2);
    std::memcpy(&n, next + b, 2);
    if (o == n) continue;
    r.terms += element_term(n, off + b, 2, total) - element_term(o, off + b, 2, total);
    std::memcpy(base + b, &n, 2);
    indices[r.changes] = static_cast<std::uint32_t>(b / 2);
    std::memcpy(out + r.changes, &n, 2);
    ++r.changes;
  }
  return r;
}
#endif

template <std::size_t ITEM>
std::uint64_t apply_items(const std::byte* patch, std::uint64_t n, std::uint64_t off, std::uint64_t total,
                          std::span<std::byte* const> dests) noexcept {
  const std::byte* values = patch + 4 * n;
  std::byte* first = dests.front() + off;
  std::uint64_t terms = 0;
  for (std::uint64_t k = 0; k < n; ++k) {
    std::uint32_t i;
    std::memcpy(&i, patch + 4 * k, 4);
    const std::uint64_t b = std::uint64_t{i} * ITEM;
    const std::uint64_t o = load_bits(first + b, ITEM);
    const std::uint64_t v = load_bits(values + k * ITEM, ITEM);
    terms += element_term(v, off + b, ITEM, total) - element_term(o, off + b, ITEM, total);
    for (std::byte* d : dests) std::memcpy(d + off + b, values + k * ITEM, ITEM);
  }
  return terms;
}

}  // namespace

std::uint64_t span_bytes(std::uint64_t buffer_bytes) noexcept {
  const std::uint64_t half = (buffer_bytes / 2) & ~std::uint64_t{255};
  return std::max<std::uint64_t>(256, std::min<std::uint64_t>(half, 16ull << 20));
}

diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept {
  switch (item) {
    case 1: return diff_items<1>(base, next, off, span, total, indices, values);
#if defined(__SSE2__)
    case 2: return diff_bf16_sse2(base, next, off, span, total, indices, values);
#else
    case 2: return diff_items<2>(base, next, off, span, total, indices, values);
#endif
    case 4: return diff_items<4>(base, next, off, span, total, indices, values);
    default: return diff_items<8>(base, next, off, span, total, indices, values);
  }
}

std::uint64_t changed_blocks(const std::byte* a, const std::byte* b, std::uint64_t span, std::uint64_t block) noexcept {
  std::uint64_t n = 0;
  for (std::uint64_t o = 0; o < span; o += block)
    if (std::memcmp(a + o, b + o, std::min(block, span - o)) != 0) ++n;
  return n;
}

void check_patch(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                 std::string_view name) {
  if (bytes % record_bytes(item) != 0)
    throw error(errc::apply, fmt::format("the patch of '{}' has {} bytes, not whole {}-byte records", name, bytes,
                                         record_bytes(item)));
  const std::uint64_t n = bytes / record_bytes(item);
  const std::uint64_t elements = span / item;
  std::int64_t prev = -1;
  for (std::uint64_t k = 0; k < n; ++k) {
    std::uint32_t i;
    std::memcpy(&i, patch + 4 * k, 4);
    if (i >= elements || static_cast<std::int64_t>(i) <= prev)
      throw error(errc::apply,
                  fmt::format("the patch of '{}' is corrupt: change {} names element {} ({}), in a span of {} "
                              "elements; nothing of its batch was written",
                              name, k, i, i >= elements ? "out of the span" : "not after the one before", elements));
    prev = i;
  }
}

std::uint64_t apply_patch(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t off,
                          std::uint64_t total, std::span<std::byte* const> dests) noexcept {
  const std::uint64_t n = bytes / record_bytes(item);
  switch (item) {
    case 1: return apply_items<1>(patch, n, off, total, dests);
    case 2: return apply_items<2>(patch, n, off, total, dests);
    case 4: return apply_items<4>(patch, n, off, total, dests);
    default: return apply_items<8>(patch, n, off, total, dests);
  }
}

}  // namespace refit::delta
