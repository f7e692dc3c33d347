// refit — delta kernels: diff with ordered compaction, patch check and apply. See diff_kernel.hpp.
//
// A diff is two passes over the span so that the patch keeps the CPU format (lib/delta/patch.hpp:
// indices strictly increasing, then values): pass 1 counts the changed elements of each chunk of
// chunk_elements and scans the counts of each span into each chunk's first output slot, for a
// whole group of spans at once (the host then reads the spans' totals with one copy, so that it can
// place every patch before it is written), pass 2 writes each chunk's changes at its slot, in
// order, with a scan over the warp's lanes. Both passes read base and next once, a warp per chunk
// with 16-byte loads; the checksum terms are summed per warp and added once per warp.
//
// Every kernel of this file is listed in load_all() (loaded when a workspace is made, never at a
// first launch mid-refit): a new kernel goes there too.
#include <cstdint>

#include "copy/copy_kernel.hpp"
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

/// The last k < n with first(k) <= x, for first() ascending from first(0) <= x. For spans: the span
/// of a group that chunk x belongs to (a span of no chunks shares its first chunk with the next, which
/// is the one found).
template <class First>
__device__ __forceinline__ std::uint64_t last_at_or_before(std::uint64_t n, std::uint64_t x, First first) {
  std::uint64_t lo = 0, hi = n;  // first(lo) <= x < first(hi) (hi = n: past the end)
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (first(mid) <= x)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

__device__ std::uint64_t find_span(const span_desc* spans, std::uint64_t n, std::uint64_t chunk) {
  return last_at_or_before(n, chunk, [&](std::uint64_t k) { return spans[k].first_chunk; });
}

/// The item of `list` whose units hold unit x (the last whose first unit is at or before it).
template <class List>
__device__ __forceinline__ std::uint64_t item_of(const List& list, std::uint64_t x) {
  return last_at_or_before(list.n, x, [&](std::uint64_t k) { return list.first[k]; });
}

// ---- a chunk, one warp: 16-byte loads where both sides are aligned, element by element elsewhere.
//
// A chunk of chunk_elements elements is diffed by one warp: lane l takes the chunk's 16-byte vectors
// l, l + 32, ... (each warp-wide load reads 512 consecutive bytes), the elements after the last whole
// vector (a span's tail, or every element where base or next is not 16-byte aligned) one per lane.
// Each warp walks the chunks of its launch with a stride of every warp of the grid; no block-wide
// barrier anywhere, and one atomic add of checksum terms per warp. (Before: a block of 256 threads
// per chunk, 2-byte loads, two block-wide reductions per chunk; llama3-8b's 16 GB took ~47 ms to
// count and write on an H200, against ~17 ms of HBM reads.)

constexpr unsigned full_mask = 0xffffffffu;

/// Which elements of a 16-byte vector differ between a and b: bit j for element j (16 / ITEM bits).
template <int ITEM>
__device__ __forceinline__ unsigned changed_mask(const uint4& a, const uint4& b) {
  const unsigned x = a.x ^ b.x, y = a.y ^ b.y, z = a.z ^ b.z, w = a.w ^ b.w;
  if constexpr (ITEM == 1) {
    const auto nz = [](unsigned v) {  // a byte's high bit set where the byte is not 0
      const unsigned t = (((v & 0x7f7f7f7fu) + 0x7f7f7f7fu) | v) & 0x80808080u;
      return ((t >> 7) & 1u) | ((t >> 14) & 2u) | ((t >> 21) & 4u) | ((t >> 28) & 8u);
    };
    return nz(x) | nz(y) << 4 | nz(z) << 8 | nz(w) << 12;
  } else if constexpr (ITEM == 2) {
    const auto nz = [](unsigned v) {
      const unsigned t = (((v & 0x7fff7fffu) + 0x7fff7fffu) | v) & 0x80008000u;
      return ((t >> 15) & 1u) | ((t >> 30) & 2u);
    };
    return nz(x) | nz(y) << 2 | nz(z) << 4 | nz(w) << 6;
  } else if constexpr (ITEM == 4) {
    return unsigned{x != 0} | unsigned{y != 0} << 1 | unsigned{z != 0} << 2 | unsigned{w != 0} << 3;
  } else {
    return unsigned{(x | y) != 0} | unsigned{(z | w) != 0} << 1;
  }
}

__device__ __forceinline__ unsigned word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

/// Element j of a 16-byte vector (little-endian, like load()).
template <int ITEM>
__device__ __forceinline__ std::uint64_t element(const uint4& v, int j) {
  if constexpr (ITEM == 8) {
    return word(v, 2 * j) | static_cast<std::uint64_t>(word(v, 2 * j + 1)) << 32;
  } else {
    const int byte = j * ITEM;
    const unsigned w = word(v, byte >> 2) >> (8 * (byte & 3));
    return ITEM == 4 ? w : ITEM == 2 ? (w & 0xffffu) : (w & 0xffu);
  }
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

/// The whole 16-byte vectors of elements [first, end) of a span (0 where base or next is unaligned;
/// first * ITEM is a multiple of 16: chunk_elements is).
template <int ITEM>
__device__ __forceinline__ std::uint64_t whole_vectors(const void* base, const void* next, std::uint64_t first,
                                                       std::uint64_t end) {
  if (!aligned16(base) || !aligned16(next)) return 0;
  return (end - first) * ITEM / 16;
}

__device__ __forceinline__ unsigned warp_sum(unsigned v) {
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(full_mask, v, s);
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(full_mask, v, s);
  return v;
}
/// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ unsigned warp_scan(unsigned v, int lane) {
  for (int s = 1; s < 32; s <<= 1) {
    const unsigned add = __shfl_up_sync(full_mask, v, s);
    if (lane >= s) v += add;
  }
  return v;
}

/// Changed elements of the chunk [first, end) of span s, this lane's share.
template <int ITEM>
__device__ __forceinline__ unsigned count_chunk(const span_desc& s, std::uint64_t first, std::uint64_t end, int lane) {
  const auto* base = static_cast<const std::byte*>(s.base) + first * ITEM;
  const auto* next = static_cast<const std::byte*>(s.next) + first * ITEM;
  const std::uint64_t nvec = whole_vectors<ITEM>(base, next, first, end);
  const auto* a = reinterpret_cast<const uint4*>(base);
  const auto* b = reinterpret_cast<const uint4*>(next);
  unsigned c = 0;
#pragma unroll 4
  for (std::uint64_t v = lane; v < nvec; v += 32) c += __popc(changed_mask<ITEM>(a[v], b[v]));
  for (std::uint64_t i = first + nvec * (16 / ITEM) + lane; i < end; i += 32)
    c += load(s.base, i, ITEM) != load(s.next, i, ITEM) ? 1u : 0u;
  return c;
}

/// One warp per chunk of the group, striding over the grid's warps: counts[chunk] = its changed
/// elements.
__global__ void count_kernel(const span_desc* spans, std::uint64_t n, std::uint64_t chunks, std::uint32_t* counts) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const std::uint64_t warps = (static_cast<std::uint64_t>(gridDim.x) * blockDim.x) / 32;
  for (std::uint64_t chunk = (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; chunk < chunks;
       chunk += warps) {
    const span_desc& s = spans[find_span(spans, n, chunk)];
    const std::uint64_t first = (chunk - s.first_chunk) * chunk_elements;
    const std::uint64_t end = first + chunk_elements < s.elements ? first + chunk_elements : s.elements;
    unsigned c = 0;
    switch (s.item) {
      case 1: c = count_chunk<1>(s, first, end, lane); break;
      case 2: c = count_chunk<2>(s, first, end, lane); break;
      case 4: c = count_chunk<4>(s, first, end, lane); break;
      default: c = count_chunk<8>(s, first, end, lane); break;
    }
    c = warp_sum(c);
    if (lane == 0) counts[chunk] = c;
  }
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

/// Stores value v as the patch's record `slot` (its index i, relative to the span, and its value).
template <int ITEM>
__device__ __forceinline__ void put_record(const write_desc& d, std::uint64_t slot, std::uint64_t i, std::uint64_t v) {
  d.indices[slot] = static_cast<std::uint32_t>(i);
  // The values follow the indices: 8-byte values after an odd count of them are 4-byte aligned only.
  if (ITEM == 1 || (reinterpret_cast<std::uintptr_t>(d.values) & (ITEM - 1)) == 0)
    store(d.values, slot, ITEM, v);
  else
    store_unaligned(d.values, slot, ITEM, v);
}

/// Pass 2 of the chunk [first, end) of span d, one warp: brings the base up to date, writes the
/// chunk's records in element order from its slot, returns this lane's new minus old terms.
template <int ITEM>
__device__ std::uint64_t write_chunk(const write_desc& d, std::uint64_t chunk, std::uint64_t first, std::uint64_t end,
                                     int lane) {
  auto* base = static_cast<std::byte*>(d.base) + first * ITEM;
  const auto* next = static_cast<const std::byte*>(d.next) + first * ITEM;
  const std::uint64_t nvec = whole_vectors<ITEM>(base, next, first, end);
  auto* a = reinterpret_cast<uint4*>(base);
  const auto* b = reinterpret_cast<const uint4*>(next);
  constexpr int per_vector = 16 / ITEM;
  std::uint64_t slot = d.firsts[chunk];
  std::uint64_t t = 0;
  const unsigned below = (1u << lane) - 1u;
  // Each lane loads its next vectors before it looks at these (twice the bytes in flight).
  uint4 o_ahead{}, n_ahead{};
  if (static_cast<std::uint64_t>(lane) < nvec) o_ahead = a[lane], n_ahead = b[lane];
  for (std::uint64_t v0 = 0; v0 < nvec; v0 += 32) {  // every lane, for the scan
    const std::uint64_t v = v0 + static_cast<std::uint64_t>(lane);
    const uint4 o = o_ahead, n = n_ahead;
    if (v + 32 < nvec) o_ahead = a[v + 32], n_ahead = b[v + 32];
    const unsigned m = v < nvec ? changed_mask<ITEM>(o, n) : 0u;
    const unsigned c = __popc(m);
    const unsigned upto = warp_scan(c, lane);
    std::uint64_t at = slot + upto - c;
    slot += __shfl_sync(full_mask, upto, 31);
    if (m == 0) continue;
    a[v] = n;                                         // the whole vector: equal to the base where nothing changed
    const std::uint64_t e0 = first + v * per_vector;  // the vector's first element in the span
    for (unsigned left = m; left != 0;) {
      const int j = __ffs(static_cast<int>(left)) - 1;
      left &= left - 1;
      const std::uint64_t i = e0 + static_cast<std::uint64_t>(j);
      const std::uint64_t nv = element<ITEM>(n, j), ov = element<ITEM>(o, j);
      t += element_term(nv, d.off + i * ITEM, ITEM, d.total) - element_term(ov, d.off + i * ITEM, ITEM, d.total);
      if (d.indices != nullptr) put_record<ITEM>(d, at, i, nv);
      ++at;
    }
  }
  // The elements after the whole vectors, one per lane, in order (ballot).
  for (std::uint64_t i0 = first + nvec * per_vector; i0 < end; i0 += 32) {
    const std::uint64_t i = i0 + static_cast<std::uint64_t>(lane);
    std::uint64_t ov = 0, nv = 0;
    bool changed = false;
    if (i < end) {
      ov = load(d.base, i, ITEM);
      nv = load(d.next, i, ITEM);
      changed = ov != nv;
    }
    const unsigned ballot = __ballot_sync(full_mask, changed);
    if (changed) {
      t += element_term(nv, d.off + i * ITEM, ITEM, d.total) - element_term(ov, d.off + i * ITEM, ITEM, d.total);
      store(d.base, i, ITEM, nv);
      if (d.indices != nullptr) put_record<ITEM>(d, slot + __popc(ballot & below), i, nv);
    }
    slot += __popc(ballot);
  }
  return t;
}

/// One warp per chunk of the spans of `list`, striding over the grid's warps (each finds its span
/// among the launch's few); one atomic add of terms per warp.
__global__ void write_kernel(const __grid_constant__ write_list list, unsigned long long* terms) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const std::uint64_t chunks = list.first[list.n];
  const std::uint64_t warps = (static_cast<std::uint64_t>(gridDim.x) * blockDim.x) / 32;
  unsigned long long sum = 0;
  for (std::uint64_t g = (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; g < chunks;
       g += warps) {
    const std::uint64_t lo = item_of(list, g);
    const write_desc& d = list.at[lo];
    const std::uint64_t chunk = g - list.first[lo];
    const std::uint64_t first = chunk * chunk_elements;
    const std::uint64_t end = first + chunk_elements < d.elements ? first + chunk_elements : d.elements;
    std::uint64_t t = 0;
    switch (d.item) {
      case 1: t = write_chunk<1>(d, chunk, first, end, lane); break;
      case 2: t = write_chunk<2>(d, chunk, first, end, lane); break;
      case 4: t = write_chunk<4>(d, chunk, first, end, lane); break;
      default: t = write_chunk<8>(d, chunk, first, end, lane); break;
    }
    sum += static_cast<unsigned long long>(t * d.weight);
  }
  sum = warp_sum(sum);
  if (lane == 0 && sum != 0) atomicAdd(terms, sum);
}

/// Records of a patch each block of check_kernel checks: 8 a thread.
constexpr std::uint64_t check_tile = threads * 8;

/// One block per tile of check_tile records of the patches of `list`: bad[k] = 1 for patch k when an
/// index is out of its span or not after the one before.
__global__ void check_kernel(const __grid_constant__ check_list list, unsigned int* bad) {
  const std::uint64_t lo = item_of(list, blockIdx.x);
  const check_desc& c = list.at[lo];
  const std::uint64_t first = (blockIdx.x - list.first[lo]) * check_tile;
  bool wrong = false;
  for (std::uint64_t k = first + threadIdx.x; k < first + check_tile && k < c.n; k += threads) {
    const std::uint32_t i = c.indices[k];
    wrong = wrong || i >= c.elements || (k > 0 && i <= c.indices[k - 1]);
  }
  if (__syncthreads_or(wrong) && threadIdx.x == 0) bad[lo] = 1u;
}

/// One block per tile of check_tile records of the (checked) patches of `list`: writes each record's
/// value at its index of the patch's span, adds weight times new minus old terms (one atomic add a
/// block). The indices are read again here from memory the streamer can still write (cuda_ipc maps
/// its buffer): one that now lands past the tensor is skipped, not written, and the version's
/// checksum at END then fails it (nothing is committed).
__global__ void apply_kernel(const __grid_constant__ apply_list list, unsigned long long* terms) {
  __shared__ unsigned long long sums[threads];
  const std::uint64_t lo = item_of(list, blockIdx.x);
  const apply_desc& p = list.at[lo];
  const int item = static_cast<int>(p.item);
  const std::uint64_t first = (blockIdx.x - list.first[lo]) * check_tile;
  auto* span = static_cast<unsigned char*>(p.dest) + p.off;
  std::uint64_t t = 0;
  for (std::uint64_t k = first + threadIdx.x; k < first + check_tile && k < p.n; k += threads) {
    const std::uint64_t i = p.indices[k];
    if (p.off + (i + 1) * static_cast<std::uint64_t>(item) > p.total) continue;
    const std::uint64_t v = load_unaligned(p.values, k, item);
    if (!(p.flags & apply_no_terms)) {
      const std::uint64_t o = load(span, i, item);
      t += element_term(v, p.off + i * item, item, p.total) - element_term(o, p.off + i * item, item, p.total);
    }
    if (!(p.flags & apply_no_store)) store(span, i, item, v);
  }
  const unsigned long long sum = block_sum(static_cast<unsigned long long>(t * p.weight), sums);
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

/// Blocks of `threads` for a warp per chunk over `chunks` chunks: enough to fill the current device
/// (8 blocks of 256 threads a multiprocessor), fewer for fewer chunks; the warps stride over the rest.
unsigned int warp_grid(std::uint64_t chunks) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 132;
  const std::uint64_t per_block = threads / 32;
  const std::uint64_t need = (chunks + per_block - 1) / per_block;
  const std::uint64_t most = 8ull * static_cast<std::uint64_t>(sms > 0 ? sms : 1);
  return static_cast<unsigned int>(need < most ? (need == 0 ? 1 : need) : most);
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
    count_kernel<<<warp_grid(chunks), threads, 0, stream>>>(spans, n, chunks, counts);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  scan_kernel<<<static_cast<unsigned int>(n), threads, 0, stream>>>(spans, counts, firsts, totals);
  return cudaGetLastError();
}

cudaError_t launch_writes(const write_list& list, unsigned long long* terms, cudaStream_t stream) {
  const std::uint64_t blocks = list.first[list.n];
  if (list.n == 0 || blocks == 0) return cudaSuccess;
  write_kernel<<<warp_grid(blocks), threads, 0, stream>>>(list, terms);
  return cudaGetLastError();
}

std::uint64_t check_tiles(std::uint64_t records) { return (records + check_tile - 1) / check_tile; }

cudaError_t launch_check(const check_list& list, unsigned int* bad, cudaStream_t stream) {
  const std::uint64_t blocks = list.first[list.n];
  if (list.n == 0 || blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  check_kernel<<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(list, bad);
  return cudaGetLastError();
}

cudaError_t launch_apply(const apply_list& list, unsigned long long* terms, cudaStream_t stream) {
  const std::uint64_t blocks = list.first[list.n];
  if (list.n == 0 || blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  apply_kernel<<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(list, terms);
  return cudaGetLastError();
}

cudaError_t launch_range_terms(const void* p, std::uint64_t off, std::uint64_t n, std::uint64_t total,
                               std::uint64_t weight, bool negate, unsigned long long* terms, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  range_kernel<<<grid_for(n), threads, 0, stream>>>(static_cast<const unsigned char*>(p), off, n, total, weight, negate,
                                                    terms);
  return cudaGetLastError();
}

cudaError_t load_all() noexcept {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(&count_kernel), reinterpret_cast<const void*>(&scan_kernel),
      reinterpret_cast<const void*>(&write_kernel), reinterpret_cast<const void*>(&check_kernel),
      reinterpret_cast<const void*>(&apply_kernel), reinterpret_cast<const void*>(&range_kernel),
  };
  return copy::kernel::load_each(kernels);
}

}  // namespace refit::delta::kernel
