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

/// One span of a group diffed together (see launch_count): where its elements are, and where its
/// chunks sit in the group's per-chunk arrays.
struct span_desc {
  void* base = nullptr;           ///< the base's bytes of the span
  const void* next = nullptr;     ///< the new bytes of the span
  std::uint64_t elements = 0;     ///< elements of the span
  std::uint64_t first_chunk = 0;  ///< the group's index of the span's first chunk
  std::uint64_t chunks = 0;       ///< ceil(elements / chunk_elements)
  std::uint64_t off = 0;          ///< tensor byte of the span's first byte (for the checksum terms)
  std::uint64_t total = 0;        ///< bytes of the span's tensor (for the checksum terms)
  std::uint32_t item = 1;         ///< bytes of an element: 1, 2, 4 or 8
  std::uint32_t reserved = 0;
};

/// Pass 1 of a diff over a group of `n` spans (`spans`: device memory, ordered by first_chunk, the
/// first at chunk 0, `chunks` chunks in all): counts[b] = elements of the group's chunk b where base
/// and next differ (one block per chunk, each finding its span); then, per span, firsts[b] = the
/// exclusive prefix sum of counts over the span's chunks (each chunk's first slot in the span's
/// patch) and totals[s] = the span's changed elements (one block per span). Two launches.
cudaError_t launch_count(const span_desc* spans, std::uint64_t n, std::uint64_t chunks, std::uint32_t* counts,
                         std::uint32_t* firsts, unsigned long long* totals, cudaStream_t stream);

/// Pass 2 of one span: writes each chunk's changes in order from firsts[b] (the span's slots, see
/// launch_count): indices (u32) at `indices`, values at `values`; copies them into base; adds the
/// new minus old checksum terms of the span, times `weight`, to the accumulator. `indices` and
/// `values` may be null (only the base and the terms).
struct write_desc {
  void* base = nullptr;
  const void* next = nullptr;
  std::uint64_t elements = 0;
  const std::uint32_t* firsts = nullptr;  ///< the slot of the span's chunk 0
  std::uint32_t* indices = nullptr;
  void* values = nullptr;
  std::uint64_t off = 0;    ///< tensor byte of the span's first byte
  std::uint64_t total = 0;  ///< bytes of the span's tensor
  std::uint64_t weight = 1;
  std::uint32_t item = 1;
  std::uint32_t reserved = 0;
};

/// Spans one launch of pass 2 writes at most: the list is a kernel parameter (no copy), and stays
/// under the 4 KiB a kernel's parameters may always take.
inline constexpr int max_writes = 32;

/// The spans of one launch of pass 2, and the prefix sum of their chunks (first_block[k]: the
/// launch's block of span k's chunk 0; first_block[n]: the blocks in all).
struct write_list {
  std::uint64_t n = 0;
  std::uint64_t first_block[max_writes + 1] = {};
  write_desc w[max_writes];
};

static_assert(sizeof(write_list) <= 4096, "a write_list must fit a kernel's parameters");

/// Pass 2 of the spans of `list`, one block per chunk, adding the terms to *terms.
cudaError_t launch_writes(const write_list& list, unsigned long long* terms, cudaStream_t stream);

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
