// bench/probes/bulk_copy.cuh — the copy through the tensor memory accelerator (sm_90's bulk copies), over the same
// op lists as tile_copy.cuh's kcopy: one thread of each block walks the block's 64 KiB tiles in CHUNK-byte pieces,
// each piece loaded into shared memory by cp.async.bulk (completion counted on one of S mbarriers) and stored from
// there by cp.async.bulk to global memory (bulk groups); S - 1 loads in flight ahead of the store, a stage reused
// once its store has read it. No register passes a byte. Pieces must be 16-byte aligned and a multiple of 16 bytes
// (the probes' tensors are). Shared by ipc_matrix.cu and dest_alloc.cu, against kcopy in the same run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "tile_copy.cuh"

namespace bulk {

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

/// Where one block's walk over its tiles stands: the tile, its op and the offset in the tile.
struct cursor {
  uint64_t t;
  int o;
  uint32_t off;
  uint32_t len;  // bytes of the current tile
};

__device__ __forceinline__ uint32_t tile_len(const op& x, uint64_t t) {
  const uint64_t first = (t - x.tiles_before) * (tile / 16);
  const uint64_t left = x.vecs - first;
  return static_cast<uint32_t>((left < tile / 16 ? left : tile / 16) * 16);
}

/// Moves c to the tile t of the block's walk (ops searched forwards from c.o); false past the end.
__device__ __forceinline__ bool seek(cursor& c, const op* ops, int n, uint64_t total) {
  if (c.t >= total) return false;
  while (c.o + 1 < n && ops[c.o + 1].tiles_before <= c.t) ++c.o;
  c.off = 0;
  c.len = tile_len(ops[c.o], c.t);
  return true;
}

/// The piece at c (at most CHUNK bytes): source, destination, bytes; then c moves past it. False past the end.
template <uint32_t CHUNK>
__device__ __forceinline__ bool take(cursor& c, const op* ops, int n, uint64_t total, const char*& s, char*& d,
                                     uint32_t& bytes) {
  if (c.off >= c.len) {
    c.t += gridDim.x;
    if (!seek(c, ops, n, total)) return false;
  }
  const op& x = ops[c.o];
  const uint64_t at = (c.t - x.tiles_before) * tile + c.off;
  s = reinterpret_cast<const char*>(x.s) + at;
  d = reinterpret_cast<char*>(x.d) + at;
  bytes = c.len - c.off < CHUNK ? c.len - c.off : CHUNK;
  c.off += bytes;
  return true;
}

}  // namespace bulk

/// S stages of CHUNK bytes of dynamic shared memory (S * CHUNK + S * 8 bytes); launch with 32 threads a block.
template <int S, uint32_t CHUNK>
__global__ void __launch_bounds__(32) kbulk(const op* __restrict__ ops, int n, uint64_t total) {
  extern __shared__ __align__(128) unsigned char stage[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(stage + S * CHUNK);
  if (threadIdx.x != 0) return;
  for (int k = 0; k < S; ++k) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bulk::smem(bar + k)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  bulk::cursor lc{blockIdx.x, 0, 0, 0}, sc{blockIdx.x, 0, 0, 0};
  if (!bulk::seek(lc, ops, n, total)) return;
  bulk::seek(sc, ops, n, total);
  uint64_t loaded = 0;  // pieces whose load was issued
  auto load = [&]() -> bool {
    const char* s;
    char* d;
    uint32_t bytes;
    if (!bulk::take<CHUNK>(lc, ops, n, total, s, d, bytes)) return false;
    const int k = static_cast<int>(loaded % S);
    const uint32_t b = bulk::smem(bar + k), dst = bulk::smem(stage + k * CHUNK);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(s), "r"(bytes), "r"(b)
                 : "memory");
    ++loaded;
    return true;
  };
  for (int k = 0; k < S - 1; ++k)
    if (!load()) break;
  for (uint64_t p = 0;; ++p) {
    const char* s;
    char* d;
    uint32_t bytes;
    if (!bulk::take<CHUNK>(sc, ops, n, total, s, d, bytes)) break;
    const int k = static_cast<int>(p % S);
    const uint32_t b = bulk::smem(bar + k), src = bulk::smem(stage + k * CHUNK);
    const uint32_t parity = static_cast<uint32_t>((p / S) & 1);
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                   : "=r"(done)
                   : "r"(b), "r"(parity)
                   : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d), "r"(src), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // the next load goes to the stage the previous store read: wait until that store has read it
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    load();
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/// Dynamic shared memory kbulk<S, CHUNK> takes.
template <int S, uint32_t CHUNK>
constexpr int kbulk_smem() {
  return S * CHUNK + S * 8;
}
