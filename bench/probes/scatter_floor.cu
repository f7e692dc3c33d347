// bench/probes/scatter_floor.cu — what writing a sparse delta's values into 16 GB of bf16 weights costs the GPU's
// memory, against copying all 16 GB: the floor of a staged delta's pause from a device stage (apply_prepared() writes
// each patch's values at its indices; lib/receiver/stage.cpp, apply_log()). One value in every `stride` elements, at a
// random place within each run of `stride` (so the indices rise, as a patch's do), indices and values read from device
// memory, one value a thread (grid-stride), as refit's apply kernel writes them, in launches of 2^31 elements (a
// patch's indices are 32-bit). Events around each run, best of 5 after a warm-up. Built and run by
// tools/gpu-check BUNDLE probes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe.hpp"

namespace {

__device__ __forceinline__ std::uint32_t mix(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return static_cast<std::uint32_t>(k);
}

/// Record k: index k * stride + a random offset below stride, and a value.
__global__ void make_records(std::uint32_t* idx, std::uint16_t* val, std::uint64_t n, std::uint32_t stride) {
  for (std::uint64_t k = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    idx[k] = static_cast<std::uint32_t>(k * stride + mix(k) % stride);
    val[k] = static_cast<std::uint16_t>(mix(k + 7));
  }
}

/// The apply: each record's value at its index (indices below 2^32 elements per patch, as refit's).
__global__ void scatter(std::uint16_t* w, const std::uint32_t* idx, const std::uint16_t* val, std::uint64_t n,
                        std::uint64_t base) {
  for (std::uint64_t k = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<std::uint64_t>(gridDim.x) * blockDim.x)
    w[base + idx[k]] = val[k];
}

}  // namespace

int main() {
  constexpr std::uint64_t bytes = 16ull << 30;
  constexpr std::uint64_t elements = bytes / 2;
  constexpr std::uint64_t part = 1ull << 31;  // elements a launch covers (indices are 32-bit, as a patch's)
  std::uint16_t* w = nullptr;
  std::uint16_t* copy = nullptr;
  CK(cudaMalloc(&w, bytes));
  CK(cudaMalloc(&copy, bytes));
  CK(cudaMemset(w, 0, bytes));
  CK(cudaMemset(copy, 1, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned grid = static_cast<unsigned>(sms * 8);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const auto best = [&](auto&& run) {
    float ms = 1e9f;
    for (int i = 0; i < 6; ++i) {
      CK(cudaEventRecord(a));
      run();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      if (i > 0) ms = std::min(ms, t);  // the first is a warm-up
    }
    return ms;
  };
  const float d2d = best([&] { CK(cudaMemcpyAsync(copy, w, bytes, cudaMemcpyDeviceToDevice)); });
  std::printf("copy of 16 GiB device to device: %.2f ms (%.0f GB/s)\n", d2d, bytes / (d2d * 1e6));
  for (const std::uint32_t stride : {50u, 200u, 1000u, 5000u}) {
    const std::uint64_t per_part = part / stride;
    const std::uint64_t parts = elements / part;
    std::uint32_t* idx = nullptr;
    std::uint16_t* val = nullptr;
    CK(cudaMalloc(&idx, per_part * 4));
    CK(cudaMalloc(&val, per_part * 2));
    make_records<<<grid, 256>>>(idx, val, per_part, stride);
    CK(cudaGetLastError());
    const float ms = best([&] {
      for (std::uint64_t p = 0; p < parts; ++p) scatter<<<grid, 256>>>(w, idx, val, per_part, p * part);
    });
    const double changed = 100.0 / stride;
    // A 32-byte sector holds 16 bf16 elements: the share of sectors with at least one change.
    const double sectors = 1.0 - std::max(0.0, 1.0 - 16.0 / stride);
    std::printf(
        "%.2f %% of elements changed (one in %u): %.2f ms = %.2f x the copy; records read %.2f GB; ~%.0f %% of "
        "32-byte sectors written\n",
        changed, stride, ms, ms / d2d, static_cast<double>(parts * per_part * 6) / 1e9, 100.0 * sectors);
    CK(cudaFree(idx));
    CK(cudaFree(val));
  }
  return 0;
}
