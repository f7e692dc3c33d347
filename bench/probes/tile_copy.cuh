// bench/probes/tile_copy.cuh — the copy kernel the probes time: op lists walked tile by tile (64 KiB), uint4 loads,
// U in flight per thread, 256 threads a block; MODE PLAIN (__ldg / __stcg, as lib/copy/copy_kernel.cu) or HINT
// (no L1 allocation, streaming stores). Shared by copy_variants.cu and ipc_matrix.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

constexpr uint64_t tile = 64 << 10;
struct op {
  const uint4* s;
  uint4* d;
  uint64_t tiles_before;
  uint64_t vecs;
};
enum { PLAIN = 0, HINT = 1 };
template <int U, int MODE>
__global__ void __launch_bounds__(256) kcopy(const op* __restrict__ ops, int n, uint64_t total) {
  int o = 0;
  for (uint64_t t = blockIdx.x; t < total; t += gridDim.x) {
    while (o + 1 < n && ops[o + 1].tiles_before <= t) ++o;
    const op& x = ops[o];
    const uint64_t first = (t - x.tiles_before) * (tile / 16);
    const uint64_t left = x.vecs - first;
    const uint32_t m = (uint32_t)(left < tile / 16 ? left : tile / 16);
    const uint4* s = x.s + first;
    uint4* d = x.d + first;
    uint32_t i = threadIdx.x;
    for (; i + (U - 1) * 256 < m; i += U * 256) {
      uint4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (MODE == HINT) {
          const uint4* p = s + i + u * 256;
          asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(r[u].x), "=r"(r[u].y), "=r"(r[u].z), "=r"(r[u].w)
                       : "l"(p));
        } else
          r[u] = __ldg(s + i + u * 256);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (MODE == HINT)
          __stcs(d + i + u * 256, r[u]);
        else
          __stcg(d + i + u * 256, r[u]);
      }
    }
    for (; i < m; i += 256) __stcg(d + i, __ldg(s + i));
  }
}
