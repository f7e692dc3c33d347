// refit — CUDA driver functions through the runtime's entry point: refit links no libcuda, so a
// build runs wherever the runtime does, and the driver calls it needs are looked up once.
#pragma once

#include <cuda_runtime_api.h>

namespace refit::copy {

/// The driver function `name` (its CUDA 12.0 version or later), or nullptr when the driver has
/// none.
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace refit::copy
