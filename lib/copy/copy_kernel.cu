// refit — the batched copy kernel and the checksum reduction. See copy_kernel.hpp.
//
// The copy kernel takes a whole batch in one launch: the host lists the ops (with a prefix sum of
// their 64 KiB tiles) in the launch's parameters (up to inline_ops_max ops; each block copies them
// into shared memory first) or, for longer lists, in device memory; a grid of at most
// blocks_per_sm blocks per SM walks the tiles with a grid stride. An op may have several rows with
// their own pitches (a view, a column slice): a long row is cut into tiles, short rows are grouped
// into one. Each block finds the op of its tile by binary search, then copies the tile with the
// widest access both pointers allow: 16-byte vectors when source and destination are equally
// misaligned modulo 16 (the usual case: the plan aligns buffer offsets to 256 and allocators align
// tensors), after a short head of single bytes and before a short tail; 8-, 4- and 1-byte elements
// otherwise. Sixteen independent loads per thread are in flight before the first store.
//
// Every kernel of this file (each instantiation of a template) is listed in load_all(), which
// loads them when a copier is made, never at a first launch mid-refit: a new kernel goes there too.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_fp8.h>

#include "copy/copy_kernel.hpp"

namespace refit::copy::kernel {
namespace {

/// Elements of `n` from `i` on (this thread's: i, i + copy_threads, ...) in groups of U loads in
/// flight; returns where it stopped (fewer than U left for this thread).
template <int U, typename V>
__device__ __forceinline__ std::uint32_t copy_unrolled(const V* __restrict__ s, V* __restrict__ d, std::uint32_t i,
                                                       std::uint32_t n) {
  for (; i + (U - 1) * copy_threads < n; i += U * copy_threads) {
    V r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldg(s + i + u * copy_threads);
#pragma unroll
    for (int u = 0; u < U; ++u) __stcg(d + i + u * copy_threads, r[u]);
  }
  return i;
}

/// Copies `n` elements of type V from s to d with the block's threads: 16 loads in flight per
/// thread (a whole 64 KiB tile of 16-byte vectors in one go), then 4, then one at a time. Sixteen
/// rather than eight: 0.932 against 0.924 of a local cudaMemcpyAsync into another process's
/// cudaIpc-mapped memory, 0.957 against 0.951 into local memory (llama3-8b's tensors, H100,
/// bench/probes/copy_variants.cu; bench/results/2026-11-27-h100-2xh200-fixed-cost-copy-kernel.txt).
template <typename V>
__device__ __forceinline__ void copy_elements(const V* __restrict__ s, V* __restrict__ d, std::uint32_t n) {
  std::uint32_t i = copy_unrolled<16>(s, d, threadIdx.x, n);
  i = copy_unrolled<4>(s, d, i, n);
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
                                                std::uint64_t src_pitch, std::uint64_t dst_pitch, std::uint64_t first,
                                                std::uint64_t count) {
  const auto bits =
      reinterpret_cast<std::uintptr_t>(s) | reinterpret_cast<std::uintptr_t>(d) | bytes | src_pitch | dst_pitch;
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

__global__ void nothing() {}

/// The tiles of `ops` this block takes. `Global`: the op list is in global memory (read through the
/// read-only cache); else in shared memory (plain loads).
template <bool Global>
__device__ __forceinline__ void copy_tiles_of(const device_op* __restrict__ ops, std::uint32_t count,
                                              std::uint64_t total_tiles) {
  // Tiles of one block only increase, so the op index only increases: search from the last one.
  std::uint32_t op = 0;
  for (std::uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    std::uint32_t lo = op;  // ops[lo].first_tile <= t
    std::uint32_t hi = count;
    while (hi - lo > 1) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if ((Global ? __ldg(&ops[mid].first_tile) : ops[mid].first_tile) <= t)
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

__global__ void __launch_bounds__(copy_threads)
    copy_tiles(const device_op* __restrict__ ops, std::uint32_t count, std::uint64_t total_tiles) {
  copy_tiles_of<true>(ops, count, total_tiles);
}

/// An op list passed by value: at most K ops, the first `count` of them used.
template <std::uint32_t K>
struct alignas(16) inline_ops {  // read as 16-byte words
  device_op ops[K];
};

/// The list is copied into shared memory first (`count` ops of dynamic shared memory): every tile
/// looks its op up, and lookups in the parameter space through its generic address made the
/// kernel ~1.5 % slower (bench/results/2026-11-27-h100-2xh200-fixed-cost-copy-kernel.txt).
template <std::uint32_t K>
__global__ void __launch_bounds__(copy_threads)
    copy_tiles_inline(const __grid_constant__ inline_ops<K> list, std::uint32_t count, std::uint64_t total_tiles) {
  extern __shared__ uint4 staged[];
  static_assert(sizeof(device_op) % sizeof(uint4) == 0);
  constexpr std::uint32_t words = sizeof(device_op) / sizeof(uint4);
  const auto* from = reinterpret_cast<const uint4*>(list.ops);
  for (std::uint32_t i = threadIdx.x; i < count * words; i += copy_threads) staged[i] = from[i];
  __syncthreads();
  copy_tiles_of<false>(reinterpret_cast<const device_op*>(staged), count, total_tiles);
}

template <std::uint32_t K>
cudaError_t launch_inline(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                          cudaStream_t stream) noexcept {
  static_assert(sizeof(inline_ops<K>) + 16 <= 32764, "kernel parameters are at most 32764 bytes");
  inline_ops<K> list;
  std::memcpy(list.ops, ops, count * sizeof(device_op));
  copy_tiles_inline<K><<<blocks, copy_threads, count * sizeof(device_op), stream>>>(list, count, total_tiles);
  return cudaGetLastError();
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

// ------------------------------------------------------------------------------ conversions
// Every element goes through copy/convert.hpp, the definition the CPU engine uses too.

/// The largest of the block's `m` (non-negative, never NaN): every thread gets it.
__device__ __forceinline__ float block_max(float m) {
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  __shared__ float warp_max[convert_threads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  float all = 0.0f;
#pragma unroll
  for (int i = 0; i < convert_threads / 32; ++i) all = fmaxf(all, warp_max[i]);
  __syncthreads();  // warp_max may be reused by a later call
  return all;
}

__device__ __forceinline__ void take(float& m, float x) {
  const float a = fabsf(x);
  if (cvt::counts(a) && a > m) m = a;
}

/// A cast or a per-tensor quantisation of one contiguous row: no element needs its position, so
/// neighbouring threads take neighbouring elements (coalesced), four each in flight.
template <std::uint8_t From, std::uint8_t To>
__global__ void __launch_bounds__(convert_threads) convert_flat(convert_args a) {
  const float mul = a.cv.q == cvt::quant_tensor ? __ldg(a.cv.mul) : 1.0f;
  const std::uint64_t n = a.count;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * convert_threads;
  std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * convert_threads + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    float x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = cvt::load(a.src, From, i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) cvt::store(a.dst, To, i + u * stride, x[u], mul);
  }
  for (; i < n; i += stride) cvt::store(a.dst, To, i, cvt::load(a.src, From, i), mul);
}

template <std::uint8_t From>
void launch_flat_to(const convert_args& a, int blocks, cudaStream_t stream) {
  switch (a.cv.to) {
    case cvt::f32: convert_flat<From, cvt::f32><<<blocks, convert_threads, 0, stream>>>(a); break;
    case cvt::bf16: convert_flat<From, cvt::bf16><<<blocks, convert_threads, 0, stream>>>(a); break;
    case cvt::f16: convert_flat<From, cvt::f16><<<blocks, convert_threads, 0, stream>>>(a); break;
    default: convert_flat<From, cvt::f8_e4m3><<<blocks, convert_threads, 0, stream>>>(a); break;
  }
}

void launch_flat(const convert_args& a, int blocks, cudaStream_t stream) {
  switch (a.cv.from) {
    case cvt::f32: launch_flat_to<cvt::f32>(a, blocks, stream); break;
    case cvt::bf16: launch_flat_to<cvt::bf16>(a, blocks, stream); break;
    default: launch_flat_to<cvt::f16>(a, blocks, stream); break;
  }
}

/// Each thread converts `per` consecutive elements; the position in the tensor (row, column,
/// matrix) is found by division once per run of `per` and then stepped.
__global__ void __launch_bounds__(convert_threads) convert_elements(convert_args a) {
  constexpr std::uint64_t per = 8;
  const cvt::conversion& c = a.cv;
  const std::uint64_t total = a.count * a.rows;
  const std::uint32_t si = cvt::item(c.from);
  const std::uint64_t br = cvt::group_rows(c.q, c.rows);
  const std::uint64_t bc = cvt::group_cols(c.q, c.cols);
  const std::uint64_t grid_rows = (c.rows + br - 1) / br;
  const std::uint64_t grid_cols = (c.cols + bc - 1) / bc;
  const bool grouped = c.q != cvt::quant_none && c.q != cvt::quant_tensor;
  // f4_e2m1x2 packs two elements a byte: a thread takes them in pairs (its run starts on an even
  // element, and rows are even long, so a pair never straddles a row or an NVFP4 block).
  const std::uint64_t step = cvt::per_item(c.to);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x * per;
  for (std::uint64_t base = (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * per; base < total;
       base += stride) {
    std::uint64_t r = base / a.count;
    std::uint64_t k = base - r * a.count;
    std::uint64_t lead = 0, rr = 0, col = 0;
    const auto locate = [&] {
      const std::uint64_t e = a.first + r * a.src_pitch + k;
      const std::uint64_t trow = e / c.cols;
      col = e - trow * c.cols;
      lead = trow / c.rows;
      rr = trow - lead * c.rows;
    };
    locate();
    const std::uint64_t n = total - base < per ? total - base : per;
    for (std::uint64_t j = 0; j < n; j += step) {
      if (k == a.count) {
        ++r;
        k = 0;
        locate();
      }
      float mul = 1.0f;
      if (c.q == cvt::quant_tensor)
        mul = __ldg(c.mul);
      else if (grouped)
        mul = __ldg(c.mul + (lead * grid_rows + rr / br) * grid_cols + col / bc);
      const auto* srow = static_cast<const unsigned char*>(a.src) + r * a.src_pitch * si;
      auto* drow = static_cast<unsigned char*>(a.dst) + cvt::bytes_of(c.to, r * a.dst_pitch);
      if (step == 2)
        cvt::store_pair(drow, k / 2, cvt::load(srow, c.from, k), cvt::load(srow, c.from, k + 1), mul);
      else
        cvt::store(drow, c.to, k, cvt::load(srow, c.from, k), mul);
      k += step;
      col += step;
      if (col == c.cols) {
        col = 0;
        if (++rr == c.rows) {
          rr = 0;
          ++lead;
        }
      }
    }
  }
}

__device__ __forceinline__ void write_scale(float amax, float* inv, float* mul, std::uint64_t g) {
  cvt::write_scale(cvt::quant_block128, amax, inv, mul, g);
}

/// One block per 128 × 128 block: (blockIdx.x, blockIdx.y, blockIdx.z) = (column block, row
/// block, matrix).
__global__ void __launch_bounds__(convert_threads)
    block_scales(const void* src, std::uint8_t from, std::uint64_t rows, std::uint64_t cols, float* inv, float* mul) {
  const std::uint64_t r0 = blockIdx.y * cvt::block;
  const std::uint64_t c0 = blockIdx.x * cvt::block;
  const std::uint64_t nr = rows - r0 < cvt::block ? rows - r0 : cvt::block;
  const std::uint64_t nc = cols - c0 < cvt::block ? cols - c0 : cvt::block;
  const std::uint64_t first = (blockIdx.z * rows + r0) * cols + c0;
  float m = 0.0f;
  for (std::uint32_t i = threadIdx.x; i < nr * cvt::block; i += convert_threads) {
    const std::uint32_t rr = i / cvt::block;
    const std::uint32_t cc = i % cvt::block;
    if (cc < nc) take(m, cvt::load(src, from, first + rr * cols + cc));
  }
  m = block_max(m);
  if (threadIdx.x == 0)
    write_scale(m, inv, mul,
                (static_cast<std::uint64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
}

/// The scale pass of a row format (channel, mxfp8, nvfp4): one block per group of `per_group`
/// elements (the last group of a row may be shorter), a reduction over its elements, then thread 0
/// writes its scale, where `layout` puts it (cvt::scale_index over matrices of `mat_rows` rows),
/// and its multiplier (cvt::write_scale; nvfp4: cvt::write_nvfp4_scale with the per-tensor scale
/// at `global`, written before). blockIdx.x is the group within its row, row0 + blockIdx.y the
/// row (rows counted over all matrices).
__global__ void __launch_bounds__(convert_threads)
    row_scales(const void* src, std::uint8_t from, std::uint8_t q, std::uint64_t cols, std::uint64_t per_group,
               void* scale, float* mul, std::uint8_t layout, std::uint64_t mat_rows, std::uint64_t row0,
               const float* global) {
  const std::uint64_t row = row0 + blockIdx.y;
  const std::uint64_t c0 = static_cast<std::uint64_t>(blockIdx.x) * per_group;
  const std::uint64_t n = cols - c0 < per_group ? cols - c0 : per_group;
  const std::uint64_t first = row * cols + c0;
  float m = 0.0f;
  for (std::uint64_t i = threadIdx.x; i < n; i += convert_threads) take(m, cvt::load(src, from, first + i));
  m = block_max(m);
  if (threadIdx.x != 0) return;
  const std::uint64_t g = row * gridDim.x + blockIdx.x;
  const std::uint64_t at = cvt::scale_index(layout, g, mat_rows, gridDim.x);
  if (q == cvt::quant_nvfp4)
    cvt::write_nvfp4_scale(m, *global, scale, at, mul, g);
  else
    cvt::write_scale(q, m, scale, at, mul, g);
}

/// NVFP4's per-tensor scale from the amax tensor_amax left (as bits) in place.
__global__ void nvfp4_finish(float* global) {
  *global = cvt::nvfp4_global(__uint_as_float(*reinterpret_cast<const unsigned int*>(global)));
}

__global__ void __launch_bounds__(convert_threads)
    tensor_amax(const void* src, std::uint8_t from, std::uint64_t n, unsigned int* acc) {
  float m = 0.0f;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * convert_threads;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * convert_threads + threadIdx.x; i < n; i += stride)
    take(m, cvt::load(src, from, i));
  m = block_max(m);
  // Non-negative floats order like their bit patterns.
  if (threadIdx.x == 0) atomicMax(acc, __float_as_uint(m));
}

__global__ void tensor_finish(float* inv, float* mul) {
  const float amax = __uint_as_float(*reinterpret_cast<const unsigned int*>(mul));
  write_scale(amax, inv, mul, 0);
}

/// The end of a fused kernel's reading: the tile's amax from every thread's `m`, its scale
/// written (by thread 0, when wanted) at the tile's place in the grid, and its multiplier 448/amax.
__device__ __forceinline__ float tile_multiplier(float m, float* scale, std::uint64_t scale_pitch) {
  const float a = cvt::clamp_amax(block_max(m));
  if (threadIdx.x == 0 && scale != nullptr)
    scale[(static_cast<std::uint64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * scale_pitch + blockIdx.x] =
        a / cvt::e4m3_max;
  return cvt::e4m3_max / a;
}

/// The fused one-pass kernel: 256 threads hold a 128 × 128 tile in registers (64 elements each:
/// column t % 128, rows t / 128 + 2k), so the source is read once.
__global__ void __launch_bounds__(convert_threads)
    fused_block128(const void* src, std::uint8_t from, std::uint64_t rows, std::uint64_t cols, std::uint8_t* dst,
                   std::uint64_t dst_pitch, std::uint64_t col_lo, std::uint64_t col_hi, float* scale,
                   std::uint64_t scale_pitch) {
  const std::uint64_t bc = blockIdx.x + col_lo / cvt::block;
  const std::uint64_t r0 = blockIdx.y * cvt::block;
  const std::uint64_t c0 = bc * cvt::block;
  const std::uint64_t nr = rows - r0 < cvt::block ? rows - r0 : cvt::block;
  const std::uint64_t nc = cols - c0 < cvt::block ? cols - c0 : cvt::block;
  const std::uint32_t cc = threadIdx.x % cvt::block;
  const std::uint32_t rr0 = threadIdx.x / cvt::block;
  const std::uint64_t matrix = static_cast<std::uint64_t>(blockIdx.z) * rows;
  constexpr int per = static_cast<int>(cvt::block) / 2;
  float v[per];
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const std::uint64_t rr = rr0 + 2 * k;
    v[k] = 0.0f;
    if (rr < nr && cc < nc) {
      v[k] = cvt::load(src, from, (matrix + r0 + rr) * cols + c0 + cc);
      take(m, v[k]);
    }
  }
  const float mul = tile_multiplier(m, scale, scale_pitch);
  const std::uint64_t col = c0 + cc;
  if (cc >= nc || col < col_lo || col >= col_hi) return;
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const std::uint64_t rr = rr0 + 2 * k;
    if (rr < nr) dst[(matrix + r0 + rr) * dst_pitch + (col - col_lo)] = cvt::f32_to_e4m3(v[k] * mul);
  }
}

/// Two e4m3 codes (low byte: `a`) by the hardware's conversion (cvt.rn.satfinite.e4m3x2.f32 on
/// sm_89 and later: one instruction instead of the bit-exact integer routine's dozens, which
/// made the fused kernel compute-bound). Round to nearest even, ±448 for anything finite beyond
/// and for ±inf: cvt::f32_to_e4m3's definition, NaN mapped to its 0x7F explicitly. The gpu
/// suite checks both against each other bit for bit, edges included.
__device__ __forceinline__ std::uint16_t e4m3x2(float a, float b) {
  auto v = static_cast<std::uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
  if (a != a) v = static_cast<std::uint16_t>((v & 0xff00u) | 0x7fu);
  if (b != b) v = static_cast<std::uint16_t>((v & 0x00ffu) | 0x7f00u);
  return v;
}

/// The eight 16-bit elements (bf16 or f16) of one 16-byte word, widened to f32.
template <std::uint8_t From>
__device__ __forceinline__ void unpack8(const uint4& w, float (&out)[8]) {
  const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto lo = static_cast<std::uint16_t>(words[i] & 0xffffu);
    const auto hi = static_cast<std::uint16_t>(words[i] >> 16);
    out[2 * i] = From == cvt::bf16 ? cvt::bf16_to_f32(lo) : cvt::f16_to_f32(lo);
    out[2 * i + 1] = From == cvt::bf16 ? cvt::bf16_to_f32(hi) : cvt::f16_to_f32(hi);
  }
}

/// Eight consecutive elements of a source from one 16-byte load (two for f32; `p` 16-byte aligned).
template <std::uint8_t From>
__device__ __forceinline__ void load8(const void* p, float (&out)[8]) {
  if constexpr (From == cvt::f32) {
    const float4 a = static_cast<const float4*>(p)[0];
    const float4 b = static_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    unpack8<From>(*static_cast<const uint4*>(p), out);
  }
}

/// The amax of a tile a thread holds as raw 16-bit words (`passes` words of eight elements).
template <std::uint8_t From, int passes>
__device__ __forceinline__ float raw_amax(const uint4 (&raw)[passes]) {
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < passes; ++k) {
    float v[8];
    unpack8<From>(raw[k], v);
#pragma unroll
    for (int e = 0; e < 8; ++e) take(m, v[e]);
  }
  return m;
}

/// The codes of eight elements `v` times `mul` as one little-endian 8-byte word.
__device__ __forceinline__ std::uint64_t codes8(const float (&v)[8], float mul) {
  std::uint64_t word = 0;
#pragma unroll
  for (int e = 0; e < 8; e += 2) word |= static_cast<std::uint64_t>(e4m3x2(v[e] * mul, v[e + 1] * mul)) << (8 * e);
  return word;
}

/// Codes of eight elements `v` times `mul` at `out`, as fused_block128 writes them: one 8-byte
/// store when all eight land in [col, col_hi), else byte by byte up to n of them.
__device__ __forceinline__ void store_codes(std::uint8_t* out, const float (&v)[8], float mul, std::uint64_t n,
                                            std::uint64_t col, std::uint64_t col_hi) {
  if (n == 8 && col + 8 <= col_hi) {
    *reinterpret_cast<std::uint64_t*>(out) = codes8(v, mul);
  } else {
    for (std::uint64_t e = 0; e < n && col + e < col_hi; ++e) out[e] = cvt::f32_to_e4m3(v[e] * mul);
  }
}

/// The fused one-pass kernel, vectorised: the same tile, codes and scale as fused_block128 (the
/// same arithmetic per element, so the same bytes), but each thread takes eight neighbouring
/// columns of a row with one 16-byte load (two for f32) and stores their eight codes with one
/// 8-byte store: a row of the tile is 16 threads, the 256 threads cover 16 rows per pass and the
/// tile in 8 passes. Needs a 16-byte aligned source with cols % 8 == 0, an 8-byte aligned
/// destination with dst_pitch % 8 == 0 (launch_fused_block128 checks and falls back). A 16-bit
/// source's tile stays in registers as its raw words (zero where the tile has no element: they
/// count nothing in the amax and are never stored), unpacked again for the stores, as in
/// fused_block128_tiles; an f32 tile is 64 floats a thread either way.
template <std::uint8_t From>
__global__ void __launch_bounds__(convert_threads)
    fused_block128_vec(const void* src, std::uint64_t rows, std::uint64_t cols, std::uint8_t* dst,
                       std::uint64_t dst_pitch, std::uint64_t col_lo, std::uint64_t col_hi, float* scale,
                       std::uint64_t scale_pitch) {
  using elem = std::conditional_t<From == cvt::f32, float, std::uint16_t>;
  const std::uint64_t bc = blockIdx.x + col_lo / cvt::block;
  const std::uint64_t r0 = blockIdx.y * cvt::block;
  const std::uint64_t c0 = bc * cvt::block;
  const std::uint64_t nr = rows - r0 < cvt::block ? rows - r0 : cvt::block;
  const std::uint64_t nc = cols - c0 < cvt::block ? cols - c0 : cvt::block;
  const std::uint32_t group = threadIdx.x % 16;  // eight columns of the tile
  const std::uint32_t sub = threadIdx.x / 16;    // a row of each pass
  const std::uint64_t cb = group * 8u;           // first column of the group within the tile
  const std::uint64_t matrix = static_cast<std::uint64_t>(blockIdx.z) * rows;
  const elem* base = static_cast<const elem*>(src);
  constexpr int passes = static_cast<int>(cvt::block) / 16;
  const std::uint64_t col = c0 + cb;
  const bool stores = cb < nc && col >= col_lo && col < col_hi;
  const std::uint64_t n = nc - cb < 8 ? nc - cb : 8;
  if constexpr (From != cvt::f32) {
    uint4 raw[passes];
    if (nr == cvt::block && nc == cvt::block) {
      // A whole tile (all but the edges): every load issued before any is used, no branch between.
      const elem* p = base + (matrix + r0 + sub) * cols + c0 + cb;
#pragma unroll
      for (int k = 0; k < passes; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(p + 16u * k * cols));
    } else {
#pragma unroll
      for (int k = 0; k < passes; ++k) {
        const std::uint64_t rr = sub + 16u * k;
        raw[k] = make_uint4(0u, 0u, 0u, 0u);
        if (rr >= nr || cb >= nc) continue;
        const elem* p = base + (matrix + r0 + rr) * cols + c0 + cb;
        if (cb + 8 <= nc) {
          raw[k] = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
          std::uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (static_cast<std::uint64_t>(e) < nc - cb) w[e / 2] |= static_cast<std::uint32_t>(p[e]) << (16 * (e % 2));
          raw[k] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
    const float mul = tile_multiplier(raw_amax<From>(raw), scale, scale_pitch);
    if (!stores) return;
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      const std::uint64_t rr = sub + 16u * k;
      if (rr >= nr) continue;
      float v[8];
      unpack8<From>(raw[k], v);
      store_codes(dst + (matrix + r0 + rr) * dst_pitch + (col - col_lo), v, mul, n, col, col_hi);
    }
  } else {
    float m = 0.0f;
    float v[passes][8];
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      const std::uint64_t rr = sub + 16u * k;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] = 0.0f;
      if (rr >= nr || cb >= nc) continue;
      const elem* p = base + (matrix + r0 + rr) * cols + c0 + cb;
      if (cb + 8 <= nc) {
        load8<From>(p, v[k]);
      } else {
        for (std::uint64_t e = 0; e < nc - cb; ++e) v[k][e] = cvt::load(p, From, e);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) take(m, v[k][e]);
    }
    const float mul = tile_multiplier(m, scale, scale_pitch);
    if (!stores) return;
#pragma unroll
    for (int k = 0; k < passes; ++k) {
      const std::uint64_t rr = sub + 16u * k;
      if (rr >= nr) continue;
      store_codes(dst + (matrix + r0 + rr) * dst_pitch + (col - col_lo), v[k], mul, n, col, col_hi);
    }
  }
}

/// fused_block128_vec for a 16-bit source whose launched tiles are all whole (rows and the column
/// range on 128-element edges): the same loads, codes and scale, but the tile stays in registers as
/// its raw 16-bit words (32 registers a thread), unpacked again for the stores: 80 registers and no
/// stack, three blocks to an SM (64 floats a thread went to the stack: 256 bytes of local memory
/// written and read back per thread and tile). No edge or column-range checks at all.
template <std::uint8_t From>
__global__ void __launch_bounds__(convert_threads)
    fused_block128_tiles(const std::uint16_t* src, std::uint64_t rows, std::uint64_t cols, std::uint8_t* dst,
                         std::uint64_t dst_pitch, std::uint64_t col_lo, float* scale, std::uint64_t scale_pitch) {
  const std::uint64_t c0 = (blockIdx.x + col_lo / cvt::block) * cvt::block;
  const std::uint64_t r0 = blockIdx.y * cvt::block;
  const std::uint32_t group = threadIdx.x % 16;  // eight columns of the tile
  const std::uint32_t sub = threadIdx.x / 16;    // a row of each pass
  const std::uint64_t matrix = static_cast<std::uint64_t>(blockIdx.z) * rows;
  constexpr int passes = static_cast<int>(cvt::block) / 16;
  const std::uint16_t* p = src + (matrix + r0 + sub) * cols + c0 + group * 8u;
  uint4 raw[passes];
#pragma unroll
  for (int k = 0; k < passes; ++k) raw[k] = __ldg(reinterpret_cast<const uint4*>(p + 16u * k * cols));
  const float mul = tile_multiplier(raw_amax<From>(raw), scale, scale_pitch);
  std::uint8_t* out = dst + (matrix + r0 + sub) * dst_pitch + (c0 - col_lo) + group * 8u;
#pragma unroll
  for (int k = 0; k < passes; ++k) {
    float v[8];
    unpack8<From>(raw[k], v);
    *reinterpret_cast<std::uint64_t*>(out + 16u * k * dst_pitch) = codes8(v, mul);
  }
}

}  // namespace

cudaError_t launch_convert(const convert_args& a, int max_blocks, cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  const std::uint64_t total = a.count * a.rows;
  if (total == 0) return cudaSuccess;
  const std::uint64_t wanted = (total + 8 * convert_threads - 1) / (8 * convert_threads);
  const auto blocks = static_cast<int>(wanted < static_cast<std::uint64_t>(max_blocks) ? wanted : max_blocks);
  if (a.rows == 1 && (a.cv.q == cvt::quant_none || a.cv.q == cvt::quant_tensor))
    launch_flat(a, blocks, stream);
  else
    convert_elements<<<blocks, convert_threads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_block_scales(const void* src, std::uint8_t from, std::uint64_t lead, std::uint64_t rows,
                                std::uint64_t cols, float* scale_inv, float* mul, cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  if (lead == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + cvt::block - 1) / cvt::block),
                  static_cast<unsigned>((rows + cvt::block - 1) / cvt::block), static_cast<unsigned>(lead));
  block_scales<<<grid, convert_threads, 0, stream>>>(src, from, rows, cols, scale_inv, mul);
  return cudaGetLastError();
}

cudaError_t launch_row_scales(const row_scale_args& a, int blocks, cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  if (a.layout == cvt::layout_swizzled && a.scale_bytes != 0) {
    const cudaError_t e = cudaMemsetAsync(a.scale, 0, a.scale_bytes, stream);  // the padding
    if (e != cudaSuccess) return e;
  }
  if (a.q == cvt::quant_nvfp4) {
    // The per-tensor scale first: every block scale divides by it.
    cudaError_t e = cudaMemsetAsync(a.scale_2, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
    if (a.rows * a.cols != 0)
      tensor_amax<<<blocks, convert_threads, 0, stream>>>(a.src, a.from, a.rows * a.cols,
                                                          reinterpret_cast<unsigned int*>(a.scale_2));
    nvfp4_finish<<<1, 1, 0, stream>>>(a.scale_2);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  const std::uint64_t per_group = cvt::group_cols(a.q, a.cols);
  // gridDim.y is at most 65,535: launch the rows in slices.
  for (std::uint64_t r0 = 0; r0 < a.rows; r0 += 65535) {
    const std::uint64_t n = a.rows - r0 < 65535 ? a.rows - r0 : 65535;
    const dim3 grid(static_cast<unsigned>((a.cols + per_group - 1) / per_group), static_cast<unsigned>(n));
    row_scales<<<grid, convert_threads, 0, stream>>>(a.src, a.from, a.q, a.cols, per_group, a.scale, a.mul, a.layout,
                                                     a.mat_rows, r0, a.scale_2);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_tensor_scale(const void* src, std::uint8_t from, std::uint64_t n, float* scale_inv, float* mul,
                                int blocks, cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  cudaError_t e = cudaMemsetAsync(mul, 0, sizeof(float), stream);
  if (e != cudaSuccess) return e;
  if (n != 0) tensor_amax<<<blocks, convert_threads, 0, stream>>>(src, from, n, reinterpret_cast<unsigned int*>(mul));
  tensor_finish<<<1, 1, 0, stream>>>(scale_inv, mul);
  return cudaGetLastError();
}

cudaError_t launch_fused_block128(const void* src, std::uint8_t from, std::uint64_t lead, std::uint64_t rows,
                                  std::uint64_t cols, std::uint8_t* dst, std::uint64_t dst_pitch, std::uint64_t col_lo,
                                  std::uint64_t col_hi, float* scale, std::uint64_t scale_pitch,
                                  cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  if (lead == 0 || rows == 0 || col_hi <= col_lo) return cudaSuccess;
  const std::uint64_t b_lo = col_lo / cvt::block;
  const std::uint64_t b_hi = (col_hi + cvt::block - 1) / cvt::block;
  const dim3 grid(static_cast<unsigned>(b_hi - b_lo), static_cast<unsigned>((rows + cvt::block - 1) / cvt::block),
                  static_cast<unsigned>(lead));
  // Wide loads and stores when alignment allows (what dense bf16 weights always give).
  const bool vec = reinterpret_cast<std::uintptr_t>(src) % 16 == 0 && cols % 8 == 0 &&
                   reinterpret_cast<std::uintptr_t>(dst) % 8 == 0 && dst_pitch % 8 == 0;
  const bool whole = rows % cvt::block == 0 && col_lo % cvt::block == 0 && col_hi % cvt::block == 0;
  const auto* src16 = static_cast<const std::uint16_t*>(src);
  if (vec && whole && from == cvt::bf16)
    fused_block128_tiles<cvt::bf16>
        <<<grid, convert_threads, 0, stream>>>(src16, rows, cols, dst, dst_pitch, col_lo, scale, scale_pitch);
  else if (vec && whole && from == cvt::f16)
    fused_block128_tiles<cvt::f16>
        <<<grid, convert_threads, 0, stream>>>(src16, rows, cols, dst, dst_pitch, col_lo, scale, scale_pitch);
  else if (vec && from == cvt::bf16)
    fused_block128_vec<cvt::bf16>
        <<<grid, convert_threads, 0, stream>>>(src, rows, cols, dst, dst_pitch, col_lo, col_hi, scale, scale_pitch);
  else if (vec && from == cvt::f16)
    fused_block128_vec<cvt::f16>
        <<<grid, convert_threads, 0, stream>>>(src, rows, cols, dst, dst_pitch, col_lo, col_hi, scale, scale_pitch);
  else if (vec && from == cvt::f32)
    fused_block128_vec<cvt::f32>
        <<<grid, convert_threads, 0, stream>>>(src, rows, cols, dst, dst_pitch, col_lo, col_hi, scale, scale_pitch);
  else
    fused_block128<<<grid, convert_threads, 0, stream>>>(src, from, rows, cols, dst, dst_pitch, col_lo, col_hi, scale,
                                                         scale_pitch);
  return cudaGetLastError();
}

cudaError_t launch_copy(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                        cudaStream_t stream) noexcept {
  (void)cudaGetLastError();  // a stale error of an earlier, unrelated call is not this launch's
  copy_tiles<<<blocks, copy_threads, 0, stream>>>(ops, count, total_tiles);
  return cudaGetLastError();
}

cudaError_t launch_nothing(cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  nothing<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t launch_copy_inline(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                               cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  // The smallest list that holds them: every launch passes its whole parameter block.
  if (count <= 16) return launch_inline<16>(ops, count, total_tiles, blocks, stream);
  if (count <= 64) return launch_inline<64>(ops, count, total_tiles, blocks, stream);
  if (count <= inline_ops_max) return launch_inline<inline_ops_max>(ops, count, total_tiles, blocks, stream);
  return cudaErrorInvalidValue;
}

cudaError_t load_all() noexcept {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(&nothing),
      reinterpret_cast<const void*>(&copy_tiles),
      reinterpret_cast<const void*>(&copy_tiles_inline<16>),
      reinterpret_cast<const void*>(&copy_tiles_inline<64>),
      reinterpret_cast<const void*>(&copy_tiles_inline<inline_ops_max>),
      reinterpret_cast<const void*>(&checksum_words),
      reinterpret_cast<const void*>(&convert_flat<cvt::f32, cvt::f32>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f32, cvt::bf16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f32, cvt::f16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f32, cvt::f8_e4m3>),
      reinterpret_cast<const void*>(&convert_flat<cvt::bf16, cvt::f32>),
      reinterpret_cast<const void*>(&convert_flat<cvt::bf16, cvt::bf16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::bf16, cvt::f16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::bf16, cvt::f8_e4m3>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f16, cvt::f32>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f16, cvt::bf16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f16, cvt::f16>),
      reinterpret_cast<const void*>(&convert_flat<cvt::f16, cvt::f8_e4m3>),
      reinterpret_cast<const void*>(&convert_elements),
      reinterpret_cast<const void*>(&block_scales),
      reinterpret_cast<const void*>(&row_scales),
      reinterpret_cast<const void*>(&tensor_amax),
      reinterpret_cast<const void*>(&tensor_finish),
      reinterpret_cast<const void*>(&fused_block128),
      reinterpret_cast<const void*>(&fused_block128_vec<cvt::bf16>),
      reinterpret_cast<const void*>(&fused_block128_vec<cvt::f16>),
      reinterpret_cast<const void*>(&fused_block128_vec<cvt::f32>),
      reinterpret_cast<const void*>(&fused_block128_tiles<cvt::bf16>),
      reinterpret_cast<const void*>(&fused_block128_tiles<cvt::f16>),
  };
  return load_each(kernels);
}

cudaError_t load_each(std::span<const void* const> kernels) noexcept {
  for (const void* k : kernels) {
    cudaFuncAttributes a{};
    if (const cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_checksum(const void* p, std::uint64_t bytes, unsigned long long* result, int blocks,
                            cudaStream_t stream) noexcept {
  (void)cudaGetLastError();
  checksum_words<<<blocks, checksum_threads, 0, stream>>>(static_cast<const unsigned char*>(p), bytes, result);
  return cudaGetLastError();
}

}  // namespace refit::copy::kernel
