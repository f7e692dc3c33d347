// refit — the checksum of a version, and its pieces, for delta refits.
//
// copy::checksum(p, n) = n + sum over whole 8-byte words w_k of w_k (2k + 1) + sum over the tail
// bytes b_j of b_j (2j + 3) P (mod 2^64) is linear in the bytes: every byte contributes a term that
// depends only on its value and its position. So a side that changes some bytes of a tensor can
// update a known checksum from the old and new values of those bytes alone, without reading the
// rest. Both sides of a delta do: the streamer while it diffs (it has both values), the receiver
// while it patches (it reads the old value it overwrites). The receiver therefore proves that
// (a) every patch arrived and was applied as the streamer meant it (a corrupted value or index
// changes its sum) and (b) the bytes it overwrote were those of the base the streamer diffed
// against; it does not re-read bytes no patch touched (a whole re-read would cost what the delta
// saves). Its known checksum of a whole version is the one that version's END carried.
//
// A version's checksum combines its tensors' checksums, each weighted by an odd number derived from
// the tensor's name (so two tensors that swapped their bytes differ): sum over tensors t of
// name_weight(t) · copy::checksum(t). Still linear in every byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace refit::delta {

inline constexpr std::uint64_t tail_prime = 0x100000001b3ull;

/// Odd 64-bit weight of a tensor's name in a version checksum (FNV-1a, low bit set).
std::uint64_t name_weight(std::string_view name) noexcept;

/// The terms of bytes [off, off + n) of a tensor of `total` bytes in its copy::checksum, without the
/// `total` constant; `p` points at byte `off`. Any offset and length.
std::uint64_t range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total) noexcept;

/// The term of one element of `item` bytes (1, 2, 4 or 8, `off` a multiple of it) whose bytes, read
/// as a little-endian integer, are `bits`, at byte `off` of a tensor of `total` bytes.
inline std::uint64_t element_term(std::uint64_t bits, std::uint64_t off, std::size_t item,
                                  std::uint64_t total) noexcept {
  const std::uint64_t whole = total & ~std::uint64_t{7};
  if (off + item <= whole) return (bits << (8 * (off & 7))) * (2 * (off >> 3) + 1);
  std::uint64_t sum = 0;  // in the tail: byte by byte
  for (std::size_t i = 0; i < item; ++i) {
    const std::uint64_t j = off + i - whole;
    sum += ((bits >> (8 * i)) & 0xff) * (2 * j + 3) * tail_prime;
  }
  return sum;
}

/// Reads one element of `item` bytes as a little-endian integer.
inline std::uint64_t load_bits(const std::byte* p, std::size_t item) noexcept {
  std::uint64_t v = 0;
  std::memcpy(&v, p, item);  // little-endian hosts only, as copy::checksum
  return v;
}

}  // namespace refit::delta
