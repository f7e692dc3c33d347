// refit — the batched copy kernel and the checksum reduction. See copy_kernel.hpp.
//
// The copy kernel takes a whole batch in one launch: the host lists the ops (with a prefix sum of
// their 64 KiB tiles) in device memory, and a grid of at most blocks_per_sm blocks per SM walks
// the tiles with a grid stride. An op may have several rows with their own pitches (a view, a
// column slice): a long row is cut into tiles, short rows are grouped into one. Each block finds the op of its tile by binary search, then copies
// the tile with the widest access both pointers allow: 16-byte vectors when source and
// destination are equally misaligned modulo 16 (the usual case: the plan aligns buffer offsets
// to 256 and allocators align tensors), after a short head of single bytes and before a short
// tail; 8-, 4- and 1-byte elements otherwise. Four independent loads per thread are in flight
// before the first store.
#include <cstdint>

#include "copy/copy_kernel.hpp"

namespace refit::copy::kernel {
namespace {

constexpr int unroll = 4;

/// Copies `n` elements of type V from s to d with the block's threads, `unroll` loads in flight.
template <typename V>
__device__ __forceinline__ void copy_elements(const V* __restrict__ s, V* __restrict__ d, std::uint32_t n) {
  std::uint32_t i = threadIdx.x;
  for (; i + (unroll - 1) * copy_threads < n; i += unroll * copy_threads) {
    V r[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) r[u] = __ldg(s + i + u * copy_threads);
#pragma unroll
    for (int u = 0; u < unroll; ++u) __stcg(d + i + u * copy_threads, r[u]);
  }
  for (; i < n; i += copy_threads) __stcg(d + i, __ldg(s + i));
}

/// Copies n bytes with elements of sizeof(V) bytes; s and d must be equally misaligned modulo
/// sizeof(V). The bytes before the first aligned address and after the last whole element are
/// copied one at a time.
template <typename V>
__device__ __forceinline__ void copy_aligned_as(const unsigned char* s, unsigned char* d, std::uint32_t n) {
  constexpr std::uint32_t w = sizeof(V);
  std::uint32_t head = static_cast<std::uint32_t>((w - (reinterpret_cast<std::uintptr_t>(s) & (w - 1))) & (w - 1));
  if (head > n) head = n;
  if (threadIdx.x < head) d[threadIdx.x] = s[threadIdx.x];
  s += head;
  d += head;
  n -= head;
  const std::uint32_t elements = n / w;
  copy_elements(reinterpret_cast<const V*>(s), reinterpret_cast<V*>(d), elements);
  const std::uint32_t done = elements * w;
  if (threadIdx.x < n - done) d[done + threadIdx.x] = s[done + threadIdx.x];
}

__device__ __forceinline__ void copy_range(const unsigned char* s, unsigned char* d, std::uint32_t n) {
  const auto skew = reinterpret_cast<std::uintptr_t>(s) ^ reinterpret_cast<std::uintptr_t>(d);
  if ((skew & 15) == 0)
    copy_aligned_as<uint4>(s, d, n);
  else if ((skew & 7) == 0)
    copy_aligned_as<uint2>(s, d, n);
  else if ((skew & 3) == 0)
    copy_aligned_as<unsigned int>(s, d, n);
  else
    copy_elements(s, d, n);
}

/// Rows of one tile that are each shorter than a tile, spread over the block's threads as one
/// flat range of 16-byte vectors when every row start and the row length allow it (the usual
/// case: bf16 rows of a TP shard), one row at a time otherwise.
__device__ __forceinline__ void copy_short_rows(const unsigned char* s, unsigned char* d, std::uint64_t bytes,
                                                std::uint64_t src_pitch, std::uint64_t dst_pitch,
                                                std::uint64_t first, std::uint64_t count) {
  const auto bits = reinterpret_cast<std::uintptr_t>(s) | reinterpret_cast<std::uintptr_t>(d) | bytes | src_pitch |
                    dst_pitch;
  if ((bits & 15) == 0) {
    const auto per_row = static_cast<std::uint32_t>(bytes / 16);
    const auto total = static_cast<std::uint32_t>(count) * per_row;
    for (std::uint32_t i = threadIdx.x; i < total; i += copy_threads) {
      const std::uint32_t r = i / per_row;
      const std::uint32_t v = i - r * per_row;
      const std::uint64_t row = first + r;
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(s + row * src_pitch) + v);
      __stcg(reinterpret_cast<uint4*>(d + row * dst_pitch) + v, x);
    }
    return;
  }
  for (std::uint64_t r = first; r < first + count; ++r)
    copy_range(s + r * src_pitch, d + r * dst_pitch, static_cast<std::uint32_t>(bytes));
}

__global__ void __launch_bounds__(copy_threads)
    copy_tiles(const device_op* __restrict__ ops, std::uint32_t count, std::uint64_t total_tiles) {
  // Tiles of one block only increase, so the op index only increases: search from the last one.
  std::uint32_t op = 0;
  for (std::uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    std::uint32_t lo = op;  // ops[lo].first_tile <= t
    std::uint32_t hi = count;
    while (hi - lo > 1) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if (__ldg(&ops[mid].first_tile) <= t)
        lo = mid;
      else
        hi = mid;
    }
    op = lo;
    const device_op& o = ops[op];
    const auto* src = static_cast<const unsigned char*>(o.src);
    auto* dst = static_cast<unsigned char*>(o.dst);
    const std::uint64_t local = t - o.first_tile;
    if (o.tiles_per_row != 0) {
      const std::uint64_t row = local / o.tiles_per_row;
      const std::uint64_t begin = (local - row * o.tiles_per_row) * tile_bytes;
      const std::uint64_t left = o.bytes - begin;
      const auto n = static_cast<std::uint32_t>(left < tile_bytes ? left : tile_bytes);
      copy_range(src + row * o.src_pitch + begin, dst + row * o.dst_pitch + begin, n);
    } else {
      const std::uint64_t first = local * o.rows_per_tile;
      const std::uint64_t rest = o.rows - first;
      copy_short_rows(src, dst, o.bytes, o.src_pitch, o.dst_pitch, first,
                      rest < o.rows_per_tile ? rest : o.rows_per_tile);
    }
  }
}

__global__ void __launch_bounds__(checksum_threads)
    checksum_words(const unsigned char* __restrict__ p, std::uint64_t bytes, unsigned long long* result) {
  const std::uint64_t words = bytes / 8;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(p) & 7) == 0;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * checksum_threads;
  std::uint64_t sum = 0;  // unsigned arithmetic: wraps modulo 2^64 like the CPU version
  for (std::uint64_t k = static_cast<std::uint64_t>(blockIdx.x) * checksum_threads + threadIdx.x; k < words;
       k += stride) {
    std::uint64_t w = 0;
    if (aligned) {
      w = __ldg(reinterpret_cast<const unsigned long long*>(p) + k);
    } else {
      // Byte loads: never touches memory outside [p, p + bytes). Little-endian like the host.
#pragma unroll
      for (int b = 0; b < 8; ++b) w |= static_cast<std::uint64_t>(p[8 * k + b]) << (8 * b);
    }
    sum += w * (2 * k + 1);
  }
  if (blockIdx.x == 0 && threadIdx.x < bytes % 8) {
    const std::uint64_t j = threadIdx.x;
    sum += static_cast<std::uint64_t>(p[8 * words + j]) * (2 * j + 3) * 0x100000001b3ull;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ std::uint64_t warp_sums[checksum_threads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t block_sum = 0;
    for (int i = 0; i < checksum_threads / 32; ++i) block_sum += warp_sums[i];
    atomicAdd(result, static_cast<unsigned long long>(block_sum));
  }
}

}  // namespace

cudaError_t launch_copy(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                        cudaStream_t stream) noexcept {
  (void)cudaGetLastError();  // a stale error of an earlier, unrelated call is not this launch's
  copy_tiles<<<blocks, copy_threads, 0, stream>>>(ops, count, total_tiles);
  return cudaGetLastError();
}

cudaError_t launch_checksum(const void* p, std::uint64_t bytes, unsigned long long* result, int blocks,
                            cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  checksum_words<<<blocks, checksum_threads, 0, stream>>>(static_cast<const unsigned char*>(p), bytes, result);
  return cudaGetLastError();
}

}  // namespace refit::copy::kernel
