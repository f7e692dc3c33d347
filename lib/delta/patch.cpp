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
/// The element at span byte `b` differs: its checksum terms, the base brought up to date, and its
/// record (index and new value) appended to `r`.
template <std::size_t ITEM>
inline void record_change(std::byte* base, const std::byte* next, std::uint64_t b, std::uint64_t off,
                          std::uint64_t total, std::uint32_t* indices, std::byte* values, diff_result& r) noexcept {
  const std::uint64_t o = load_bits(base + b, ITEM);
  const std::uint64_t n = load_bits(next + b, ITEM);
  r.terms += element_term(n, off + b, ITEM, total) - element_term(o, off + b, ITEM, total);
  std::memcpy(base + b, next + b, ITEM);
  indices[r.changes] = static_cast<std::uint32_t>(b / ITEM);
  std::memcpy(values + r.changes * ITEM, next + b, ITEM);
  ++r.changes;
}

template <std::size_t ITEM>
diff_result diff_items(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span,
                       std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept {
  diff_result r;
  const auto note = [&](std::uint64_t b) { record_change<ITEM>(base, next, b, off, total, indices, values, r); };
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
/// The elements of ITEM bytes that differ between 64 bytes at `x` and at `y`: one bit per element,
/// at its first byte's position. Four SSE2 compares of 16 bytes (8-byte elements: two 4-byte halves).
template <std::size_t ITEM>
inline std::uint64_t differing(const std::byte* x, const std::byte* y) noexcept {
  std::uint64_t eq = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(y + 16 * q));
    __m128i e;
    if constexpr (ITEM == 1)
      e = _mm_cmpeq_epi8(a, b);
    else if constexpr (ITEM == 2)
      e = _mm_cmpeq_epi16(a, b);
    else
      e = _mm_cmpeq_epi32(a, b);
    eq |= static_cast<std::uint64_t>(static_cast<std::uint32_t>(_mm_movemask_epi8(e))) << (16 * q);
  }
  std::uint64_t d = ~eq;
  if constexpr (ITEM == 8) d |= d >> 4;  // either half
  constexpr std::uint64_t first_bytes = ITEM == 1   ? ~std::uint64_t{0}
                                        : ITEM == 2 ? 0x5555555555555555ull
                                        : ITEM == 4 ? 0x1111111111111111ull
                                                    : 0x0101010101010101ull;
  return d & first_bytes;
}

/// diff_items() with SSE2 (every x86-64): 64 bytes compared per step, and only the set bits of the
/// mask of differing elements visited (about 0.6 per step for bf16 at 2 % changed), so the loop runs
/// near the speed of reading the two inputs. In blocks wholly inside the tensor's whole 8-byte
/// words, an element's checksum term is a shift and one multiply of its new minus old bits (the
/// terms are linear): element_term's tail case cannot arise there.
template <std::size_t ITEM>
diff_result diff_sse2(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span,
                      std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept {
  diff_result r;
  const std::uint64_t whole = total & ~std::uint64_t{7};
  const std::uint64_t blocks = off < whole ? std::min(span, whole - off) & ~std::uint64_t{63} : 0;
  std::uint64_t b = 0;
  std::byte sink[8];  // where an element that did not change is "written" (see take)
  // One element of the mask, without a branch: its record is written at the next slot, which only
  // counts when the element changed; its new value is stored into the base, or into `sink` when it
  // did not change (so an unchanged block's base lines stay clean); its terms are 0 then. With no
  // bit left, the block's last element stands in (unchanged, inside the block).
  const auto take = [&](std::uint64_t & mask, std::uint64_t b) __attribute__((always_inline)) {
    const bool changed = mask != 0;
    const std::uint64_t e = b + static_cast<std::uint64_t>(__builtin_ctzll(mask | (std::uint64_t{1} << (64 - ITEM))));
    mask &= mask - 1;
    const std::uint64_t o = load_bits(base + e, ITEM);
    const std::uint64_t n = load_bits(next + e, ITEM);
    const std::uint64_t at = off + e;
    r.terms += ((n - o) << (8 * (at & 7))) * (2 * (at >> 3) + 1);
    std::memcpy(changed ? base + e : sink, &n, ITEM);
    indices[r.changes] = static_cast<std::uint32_t>(e / ITEM);
    std::memcpy(values + r.changes * ITEM, &n, ITEM);
    r.changes += changed ? 1 : 0;
  };
  // At 2 % of bf16 elements changed, half the 64-byte blocks have a change (which no branch
  // predicts), nearly all of those one or two: the first two are taken without a branch, the rest
  // (3 % of blocks) in a loop. 256 bytes without a change (8 % of them at 2 %, most at 0.05 %) are
  // skipped by one predictable branch. Both lambdas are always inlined: at -O3 (meson's release
  // build) GCC 12 made `block` a call, four a 256-byte step, and the diff of 512 MB of bf16 took
  // 85 ms instead of the 60 ms of -O2 on one core of the 2-core VM.
  const auto block = [&](std::uint64_t mask, std::uint64_t b) __attribute__((always_inline)) {
    take(mask, b);
    take(mask, b);
    while (mask != 0) take(mask, b);
  };
  for (; b + 256 <= blocks; b += 256) {
    const std::uint64_t m0 = differing<ITEM>(base + b, next + b);
    const std::uint64_t m1 = differing<ITEM>(base + b + 64, next + b + 64);
    const std::uint64_t m2 = differing<ITEM>(base + b + 128, next + b + 128);
    const std::uint64_t m3 = differing<ITEM>(base + b + 192, next + b + 192);
    if ((m0 | m1 | m2 | m3) == 0) continue;
    block(m0, b);
    block(m1, b + 64);
    block(m2, b + 128);
    block(m3, b + 192);
  }
  for (; b < blocks; b += 64) block(differing<ITEM>(base + b, next + b), b);
  // The rest (under 64 bytes, or the tensor's tail bytes): element by element.
  for (; b < span; b += ITEM)
    if (std::memcmp(base + b, next + b, ITEM) != 0) record_change<ITEM>(base, next, b, off, total, indices, values, r);
  return r;
}
#endif

/// Records ahead of the one applied whose element is prefetched (see apply_items).
constexpr std::uint64_t prefetch_records = 64;

/// The refusal of record `k` of the patch of `name` whose index `i` lies outside a span of
/// `elements` elements, found while applying: a peer changed the patch after it was checked (a
/// host_shm buffer is shared with the streamer, which can still write it). Cold: out of the loop.
[[noreturn, gnu::cold, gnu::noinline]] void refuse_changed(std::string_view name, std::uint64_t k, std::uint32_t i,
                                                           std::uint64_t elements) {
  throw error(errc::apply,
              fmt::format("the patch of '{}' is corrupt: change {} names element {} (out of the span), in a span "
                          "of {} elements; it changed after it was checked (the streamer wrote the buffer it "
                          "shares), and its batch is partly written",
                          name, k, i, elements));
}

/// apply_patch() for elements of ITEM bytes. At 2 % of bf16 elements changed, a record's element is
/// ~100 bytes after the one before, on a cache line of its own that is not in the cache: reading its
/// old value (for the checksum) stalled the loop on memory once a record (88 % of its samples), at
/// a few GB/s of weights on one core. The element prefetch_records ahead is prefetched for writing,
/// so that the misses overlap: 512 MB of bf16 at 2 % applied in 57 ms before, 20 ms with 64 records
/// ahead (16: 35 ms, 32: 26 ms, 128 and 256 no better than 64), one core of the 2-core VM.
///
/// The records may lie in memory a peer still writes (a host_shm buffer): each index and value is
/// read once, into a local, and the index is compared with the span there, however the patch was
/// checked before. The prefetch's index needs no check: a prefetch never faults.
template <std::size_t ITEM, apply_mode MODE>
std::uint64_t apply_items(const std::byte* indices, const std::byte* values, std::uint64_t n, std::uint64_t first_k,
                          std::uint64_t off, std::uint64_t total, std::uint64_t elements,
                          std::span<std::byte* const> dests, std::string_view name) {
  std::byte* first = dests.front() + off;
  std::uint64_t terms = 0;
  for (std::uint64_t k = 0; k < n; ++k) {
    if (k + prefetch_records < n) {
      std::uint32_t ahead;
      std::memcpy(&ahead, indices + 4 * (k + prefetch_records), 4);
      __builtin_prefetch(first + std::uint64_t{ahead} * ITEM, MODE == apply_mode::terms_only ? 0 : 1);
    }
    std::uint32_t i;
    std::memcpy(&i, indices + 4 * k, 4);
    if (i >= elements) [[unlikely]]
      refuse_changed(name, first_k + k, i, elements);
    const std::uint64_t b = std::uint64_t{i} * ITEM;
    const std::uint64_t v = load_bits(values + k * ITEM, ITEM);
    if constexpr (MODE != apply_mode::store_only) {
      const std::uint64_t o = load_bits(first + b, ITEM);
      terms += element_term(v, off + b, ITEM, total) - element_term(o, off + b, ITEM, total);
    }
    // The value as its terms were taken (little-endian hosts only, as load_bits).
    if constexpr (MODE != apply_mode::terms_only)
      for (std::byte* d : dests) std::memcpy(d + off + b, &v, ITEM);
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
#if defined(__SSE2__)
    case 1: return diff_sse2<1>(base, next, off, span, total, indices, values);
    case 2: return diff_sse2<2>(base, next, off, span, total, indices, values);
    case 4: return diff_sse2<4>(base, next, off, span, total, indices, values);
    default: return diff_sse2<8>(base, next, off, span, total, indices, values);
#else
    case 1: return diff_items<1>(base, next, off, span, total, indices, values);
    case 2: return diff_items<2>(base, next, off, span, total, indices, values);
    case 4: return diff_items<4>(base, next, off, span, total, indices, values);
    default: return diff_items<8>(base, next, off, span, total, indices, values);
#endif
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
  check_records(bytes, item, name);
  const std::uint64_t n = bytes / record_bytes(item);
  if (const auto k = first_bad_record(patch, 0, n, item, span)) refuse_record(patch, *k, item, span, name);
}

void check_records(std::uint64_t bytes, std::size_t item, std::string_view name) {
  if (bytes % record_bytes(item) != 0)
    throw error(errc::apply, fmt::format("the patch of '{}' has {} bytes, not whole {}-byte records", name, bytes,
                                         record_bytes(item)));
}

std::optional<std::uint64_t> first_bad_record(const std::byte* patch, std::uint64_t from, std::uint64_t to,
                                              std::size_t item, std::uint64_t span) noexcept {
  const std::uint64_t elements = span / item;
  std::int64_t prev = -1;
  if (from != 0) {
    std::uint32_t i;
    std::memcpy(&i, patch + 4 * (from - 1), 4);
    prev = i;
  }
  for (std::uint64_t k = from; k < to; ++k) {
    std::uint32_t i;
    std::memcpy(&i, patch + 4 * k, 4);
    if (i >= elements || static_cast<std::int64_t>(i) <= prev) return k;
    prev = i;
  }
  return std::nullopt;
}

void refuse_record(const std::byte* patch, std::uint64_t k, std::size_t item, std::uint64_t span,
                   std::string_view name) {
  const std::uint64_t elements = span / item;
  std::uint32_t i;
  std::memcpy(&i, patch + 4 * k, 4);
  throw error(errc::apply,
              fmt::format("the patch of '{}' is corrupt: change {} names element {} ({}), in a span of {} "
                          "elements; nothing of its batch was written",
                          name, k, i, i >= elements ? "out of the span" : "not after the one before", elements));
}

std::uint64_t apply_patch(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t off,
                          std::uint64_t span, std::uint64_t total, std::span<std::byte* const> dests,
                          std::string_view name) {
  const std::uint64_t n = bytes / record_bytes(item);
  return apply_records(patch, n, 0, n, item, off, span, total, dests, name);
}

std::uint64_t apply_records(const std::byte* patch, std::uint64_t n, std::uint64_t from, std::uint64_t to,
                            std::size_t item, std::uint64_t off, std::uint64_t span, std::uint64_t total,
                            std::span<std::byte* const> dests, std::string_view name, apply_mode mode) {
  const std::byte* indices = patch + 4 * from;
  const std::byte* values = patch + 4 * n + from * item;
  const std::uint64_t elements = span / item;
  const auto by_item = [&]<apply_mode M>() {
    switch (item) {
      case 1: return apply_items<1, M>(indices, values, to - from, from, off, total, elements, dests, name);
      case 2: return apply_items<2, M>(indices, values, to - from, from, off, total, elements, dests, name);
      case 4: return apply_items<4, M>(indices, values, to - from, from, off, total, elements, dests, name);
      default: return apply_items<8, M>(indices, values, to - from, from, off, total, elements, dests, name);
    }
  };
  switch (mode) {
    case apply_mode::terms_only: return by_item.template operator()<apply_mode::terms_only>();
    case apply_mode::store_only: return by_item.template operator()<apply_mode::store_only>();
    default: return by_item.template operator()<apply_mode::both>();
  }
}

}  // namespace refit::delta
