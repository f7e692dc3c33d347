// refit — the memory refit itself holds in this process, beyond the caller's tensors.
//
// Every allocation refit makes is counted where it is made: ping-pong buffers (device, page-locked
// or shared host memory), mappings of a peer's shared-memory buffers, device and host stages, delta
// bases, conversion and scatter scratch, VMM chunks. NCCL's own buffers and the CUDA context are
// not refit's and not counted (the driver's view, cudaMemGetInfo, sees them: refit-bench --memory
// reports both). README.md, "Memory", gives each mode's figure as a formula of the options.
#pragma once

#include <cstdint>

#include "refit/export.hpp"

namespace refit {

/// Bytes refit holds now, and the most it held at once since the process started (or since
/// reset_memory_peaks()), per kind.
struct memory_usage {
  std::uint64_t device = 0;  ///< device memory (cudaMalloc, cuMemCreate)
  std::uint64_t device_peak = 0;
  std::uint64_t pinned = 0;  ///< page-locked host memory (cudaMallocHost)
  std::uint64_t pinned_peak = 0;
  std::uint64_t host = 0;  ///< pageable host memory: shared-memory buffers made or mapped, host deltas
  std::uint64_t host_peak = 0;
};

/// What refit holds in this process now, and its peaks. Thread-safe; never throws.
[[nodiscard]] REFIT_API memory_usage memory_in_use() noexcept;

/// Sets every peak to what is held now (to measure one refit's peak). Thread-safe; never throws.
REFIT_API void reset_memory_peaks() noexcept;

}  // namespace refit
