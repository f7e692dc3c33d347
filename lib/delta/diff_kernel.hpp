// refit — the device side of delta versions: what delta_cuda.cpp hands to diff_kernel.cu.
//
// Plain types and launch functions returning cudaError_t, as copy_kernel.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace refit::delta::kernel {

/// Threads per block, and elements each thread looks at: one block diffs chunk_elements elements.
inline constexpr int threads = 256;
inline constexpr int per_thread = 8;
inline constexpr std::uint64_t chunk_elements = threads * per_thread;

/// Pass 1 of a diff: counts[b] = elements of chunk b (of `elements` elements of `item` bytes) where
/// base and next differ.
cudaError_t launch_count(const void* base, const void* next, std::uint64_t elements, int item, std::uint32_t* counts,
                         std::uint64_t chunks, cudaStream_t stream);

/// Pass 2: writes each chunk's changes in order from firsts[b] (the exclusive prefix sum of counts):
/// indices (u32) at `indices`, values at `values`; copies them into base; adds the new minus old
/// checksum terms of the span (at tensor byte `off` of a tensor of `total` bytes), times `weight`, to
/// *terms. `indices` and `values` may be null (only the base and the terms).
cudaError_t launch_write(void* base, const void* next, std::uint64_t elements, int item, const std::uint32_t* firsts,
                         std::uint64_t chunks, std::uint32_t* indices, void* values, std::uint64_t off,
                         std::uint64_t total, std::uint64_t weight, unsigned long long* terms, cudaStream_t stream);

/// Checks a patch of `n` records: indices strictly increasing and below `elements`; sets *bad to 1
/// otherwise.
cudaError_t launch_check(const std::uint32_t* indices, std::uint64_t n, std::uint64_t elements, unsigned int* bad,
                         cudaStream_t stream);

/// Applies a checked patch of `n` records into `dest` (the tensor's byte 0), adding the new minus
/// old checksum terms to *terms.
cudaError_t launch_apply(const std::uint32_t* indices, const void* values, std::uint64_t n, int item, void* dest,
                         std::uint64_t off, std::uint64_t total, std::uint64_t weight, unsigned long long* terms,
                         cudaStream_t stream);

/// Adds weight · delta::range_terms(p, off, n, total) (p: the tensor's byte `off`) to *terms, or
/// subtracts it with `negate`.
cudaError_t launch_range_terms(const void* p, std::uint64_t off, std::uint64_t n, std::uint64_t total,
                               std::uint64_t weight, bool negate, unsigned long long* terms, cudaStream_t stream);

}  // namespace refit::delta::kernel
