// refit — delta kernels: diff with ordered compaction, patch check and apply. See diff_kernel.hpp.
//
// A diff is two passes over the span so that the patch keeps the CPU format (lib/delta/patch.hpp:
// indices strictly increasing, then values): pass 1 counts the changed elements of each chunk of
// chunk_elements and scans the counts of each span into each chunk's first output slot, for a
// whole group of spans at once (the host then reads the spans' totals with one copy, so that it can
// place every patch before it is written), pass 2 writes each chunk's changes at its slot, in
// order, with a scan over the block's threads. Both passes read base and next once
// with every thread on per_thread consecutive elements; the checksum terms are summed per block and
// added once per block.
#include <cstdint>

#include "delta/diff_kernel.hpp"

namespace refit::delta::kernel {
namespace {

constexpr std::uint64_t tail_prime = 0x100000001b3ull;

/// delta::element_term on the device (see delta/checksum.hpp).
__device__ __forceinline__ std::uint64_t element_term(std::uint64_t bits, std::uint64_t off, int item,
                                                      std::uint64_t total) {
  const std::uint64_t whole = total & ~std::uint64_t{7};
  if (off + item <= whole) return (bits << (8 * (off & 7))) * (2 * (off >> 3) + 1);
  std::uint64_t sum = 0;
  for (int i = 0; i < item; ++i) sum += ((bits >> (8 * i)) & 0xff) * (2 * (off + i - whole) + 3) * tail_prime;
  return sum;
}

__device__ __forceinline__ std::uint64_t load(const void* p, std::uint64_t i, int item) {
  switch (item) {
    case 1: return static_cast<const std::uint8_t*>(p)[i];
    case 2: return static_cast<const std::uint16_t*>(p)[i];
    case 4: return static_cast<const std::uint32_t*>(p)[i];
    default: return static_cast<const std::uint64_t*>(p)[i];
  }
}

__device__ __forceinline__ void store(void* p, std::uint64_t i, int item, std::uint64_t v) {
  switch (item) {
    case 1: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
    case 2: static_cast<std::uint16_t*>(p)[i] = static_cast<std::uint16_t>(v); break;
    case 4: static_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v); break;
    default: static_cast<std::uint64_t*>(p)[i] = v; break;
  }
}

/// The same for a patch's values, which follow its 4-byte indices and so may sit at any multiple
/// of 4 (8-byte values after an odd count): byte by byte, little-endian like the loads above.
__device__ __forceinline__ std::uint64_t load_unaligned(const void* p, std::uint64_t i, int item) {
  const auto* b = static_cast<const unsigned char*>(p) + i * static_cast<std::uint64_t>(item);
  std::uint64_t v = 0;
  for (int k = 0; k < item; ++k) v |= static_cast<std::uint64_t>(b[k]) << (8 * k);
  return v;
}

__device__ __forceinline__ void store_unaligned(void* p, std::uint64_t i, int item, std::uint64_t v) {
  auto* b = static_cast<unsigned char*>(p) + i * static_cast<std::uint64_t>(item);
  for (int k = 0; k < item; ++k) b[k] = static_cast<unsigned char>(v >> (8 * k));
}

/// Sum over the block of `v` (every thread gets it).
template <typename T>
__device__ T block_sum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = threads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();
  return total;
}

/// Inclusive scan of `v` over the block's threads (Hillis-Steele in `scan`); every thread gets its
/// own prefix, and scan[threads - 1] holds the block's total until the next call.
__device__ std::uint32_t block_scan(std::uint32_t v, std::uint32_t* scan) {
  scan[threadIdx.x] = v;
  __syncthreads();
  for (int s = 1; s < threads; s <<= 1) {
    const std::uint32_t add = threadIdx.x >= s ? scan[threadIdx.x - s] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  return scan[threadIdx.x];
}

/// The span of a group that chunk `chunk` belongs to: the last one whose first chunk is at or before
/// it (a span of no chunks shares its first chunk with the next, which is the one found).
__device__ std::uint64_t find_span(const span_desc* spans, std::uint64_t n, std::uint64_t chunk) {
  std::uint64_t lo = 0, hi = n;  // spans[lo].first_chunk <= chunk < spans[hi].first_chunk (hi = n: past the end)
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (spans[mid].first_chunk <= chunk)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/// One block per chunk of the group: counts[chunk] = its changed elements.
__global__ void count_kernel(const span_desc* spans, std::uint64_t n, std::uint32_t* counts) {
  __shared__ std::uint32_t shared[threads];
  __shared__ std::uint64_t which;
  const std::uint64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) which = find_span(spans, n, chunk);
  __syncthreads();
  const span_desc s = spans[which];
  const int item = static_cast<int>(s.item);
  const std::uint64_t first = (chunk - s.first_chunk) * chunk_elements + threadIdx.x * per_thread;
  std::uint32_t c = 0;
  for (int k = 0; k < per_thread; ++k) {
    const std::uint64_t i = first + k;
    if (i < s.elements && load(s.base, i, item) != load(s.next, i, item)) ++c;
  }
  const std::uint32_t total = block_sum(c, shared);
  if (threadIdx.x == 0) counts[chunk] = total;
}

/// Chunks each thread of scan_kernel sums in turn: a tile of threads * scan_per_thread chunks covers
/// a span of 16 MiB of bf16 (delta::span_bytes' largest) in one block-wide scan.
constexpr int scan_per_thread = 16;

/// One block per span: firsts = the exclusive prefix sum of the span's chunk counts, tile by tile
/// (each thread sums scan_per_thread consecutive chunks, the block scans the threads' sums);
/// totals[span] = their sum. A thread's sum is at most scan_per_thread * chunk_elements, a tile's at
/// most 2^23: 32 bits hold both.
__global__ void scan_kernel(const span_desc* spans, const std::uint32_t* counts, std::uint32_t* firsts,
                            unsigned long long* totals) {
  __shared__ std::uint32_t scan[threads];
  const span_desc s = spans[blockIdx.x];
  const std::uint32_t* in = counts + s.first_chunk;
  std::uint32_t* out = firsts + s.first_chunk;
  std::uint64_t carry = 0;
  for (std::uint64_t tile = 0; tile < s.chunks; tile += threads * scan_per_thread) {
    const std::uint64_t first = tile + threadIdx.x * static_cast<std::uint64_t>(scan_per_thread);
    std::uint32_t mine[scan_per_thread];
    std::uint32_t sum = 0;
    for (int k = 0; k < scan_per_thread; ++k) {
      mine[k] = first + k < s.chunks ? in[first + k] : 0;
      sum += mine[k];
    }
    std::uint64_t at = carry + block_scan(sum, scan) - sum;
    for (int k = 0; k < scan_per_thread && first + k < s.chunks; ++k) {
      out[first + k] = static_cast<std::uint32_t>(at);
      at += mine[k];
    }
    carry += scan[threads - 1];
    __syncthreads();  // every thread has read the tile's total before the next tile's scan writes
  }
  if (threadIdx.x == 0) totals[blockIdx.x] = carry;
}

/// One block per chunk of the spans of `list` (each block finds its span among the launch's few).
__global__ void write_kernel(const __grid_constant__ write_list list, unsigned long long* terms) {
  __shared__ std::uint32_t scan[threads];
  __shared__ unsigned long long sums[threads];
  std::uint64_t lo = 0, hi = list.n;  // the last span whose first block is at or before this one
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (list.first_block[mid] <= blockIdx.x)
      lo = mid;
    else
      hi = mid;
  }
  const write_desc& d = list.w[lo];
  const int item = static_cast<int>(d.item);
  const std::uint64_t chunk = blockIdx.x - list.first_block[lo];
  const std::uint64_t first = chunk * chunk_elements + threadIdx.x * per_thread;
  std::uint32_t c = 0;
  for (int k = 0; k < per_thread; ++k) {
    const std::uint64_t i = first + k;
    if (i < d.elements && load(d.base, i, item) != load(d.next, i, item)) ++c;
  }
  // This thread's first slot: the chunk's, then the threads' before it.
  std::uint64_t slot = d.firsts[chunk] + block_scan(c, scan) - c;
  std::uint64_t t = 0;
  for (int k = 0; k < per_thread; ++k) {
    const std::uint64_t i = first + k;
    if (i >= d.elements) break;
    const std::uint64_t o = load(d.base, i, item);
    const std::uint64_t n = load(d.next, i, item);
    if (o == n) continue;
    t += element_term(n, d.off + i * item, item, d.total) - element_term(o, d.off + i * item, item, d.total);
    store(d.base, i, item, n);
    if (d.indices != nullptr) {
      d.indices[slot] = static_cast<std::uint32_t>(i);
      store_unaligned(d.values, slot, item, n);
    }
    ++slot;
  }
  const unsigned long long sum = block_sum(static_cast<unsigned long long>(t * d.weight), sums);
  if (threadIdx.x == 0 && sum != 0) atomicAdd(terms, sum);
}

__global__ void check_kernel(const std::uint32_t* indices, std::uint64_t n, std::uint64_t elements, unsigned int* bad) {
  for (std::uint64_t k = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t i = indices[k];
    if (i >= elements || (k > 0 && i <= indices[k - 1])) atomicOr(bad, 1u);
  }
}

__global__ void apply_kernel(const std::uint32_t* indices, const void* values, std::uint64_t n, int item, void* dest,
                             std::uint64_t off, std::uint64_t total, std::uint64_t weight, unsigned long long* terms) {
  __shared__ unsigned long long sums[threads];
  std::uint64_t t = 0;
  auto* span = static_cast<unsigned char*>(dest) + off;
  for (std::uint64_t k = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t i = indices[k];
    const std::uint64_t o = load(span, i, item);
    const std::uint64_t v = load_unaligned(values, k, item);
    t += element_term(v, off + i * item, item, total) - element_term(o, off + i * item, item, total);
    store(span, i, item, v);
  }
  const unsigned long long sum = block_sum(static_cast<unsigned long long>(t * weight), sums);
  if (threadIdx.x == 0 && sum != 0) atomicAdd(terms, sum);
}

/// delta::range_terms on the device, byte by byte (it runs only over spans a delta sends as bytes).
__global__ void range_kernel(const unsigned char* p, std::uint64_t off, std::uint64_t n, std::uint64_t total,
                             std::uint64_t weight, bool negate, unsigned long long* terms) {
  __shared__ unsigned long long sums[threads];
  const std::uint64_t whole = total & ~std::uint64_t{7};
  std::uint64_t t = 0;
  for (std::uint64_t k = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t b = off + k;
    const std::uint64_t v = p[k];
    t += b < whole ? (v << (8 * (b & 7))) * (2 * (b >> 3) + 1) : v * (2 * (b - whole) + 3) * tail_prime;
  }
  const unsigned long long sum = block_sum(static_cast<unsigned long long>(t * weight), sums);
  if (threadIdx.x == 0 && sum != 0) atomicAdd(terms, negate ? 0ull - sum : sum);
}

unsigned int grid_for(std::uint64_t n) {
  const std::uint64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks == 0 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

}  // namespace

cudaError_t launch_count(const span_desc* spans, std::uint64_t n, std::uint64_t chunks, std::uint32_t* counts,
                         std::uint32_t* firsts, unsigned long long* totals, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (chunks > 0x7fffffffu || n > 0x7fffffffu) return cudaErrorInvalidConfiguration;  // grid.x at most 2^31 - 1
  if (chunks != 0) {
    count_kernel<<<static_cast<unsigned int>(chunks), threads, 0, stream>>>(spans, n, counts);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  scan_kernel<<<static_cast<unsigned int>(n), threads, 0, stream>>>(spans, counts, firsts, totals);
  return cudaGetLastError();
}

cudaError_t launch_writes(const write_list& list, unsigned long long* terms, cudaStream_t stream) {
  const std::uint64_t blocks = list.first_block[list.n];
  if (list.n == 0 || blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  write_kernel<<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(list, terms);
  return cudaGetLastError();
}

cudaError_t launch_check(const std::uint32_t* indices, std::uint64_t n, std::uint64_t elements, unsigned int* bad,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  check_kernel<<<grid_for(n), threads, 0, stream>>>(indices, n, elements, bad);
  return cudaGetLastError();
}

cudaError_t launch_apply(const std::uint32_t* indices, const void* values, std::uint64_t n, int item, void* dest,
                         std::uint64_t off, std::uint64_t total, std::uint64_t weight, unsigned long long* terms,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  apply_kernel<<<grid_for(n), threads, 0, stream>>>(indices, values, n, item, dest, off, total, weight, terms);
  return cudaGetLastError();
}

cudaError_t launch_range_terms(const void* p, std::uint64_t off, std::uint64_t n, std::uint64_t total,
                               std::uint64_t weight, bool negate, unsigned long long* terms, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  range_kernel<<<grid_for(n), threads, 0, stream>>>(static_cast<const unsigned char*>(p), off, n, total, weight, negate,
                                                    terms);
  return cudaGetLastError();
}

}  // namespace refit::delta::kernel
