// refit — the device side of delta versions: what delta_cuda.cpp hands to diff_kernel.cu.
//
// Plain types and launch functions returning cudaError_t, as copy_kernel.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace refit::delta::kernel {

/// Threads per block. A chunk of chunk_elements elements is the unit of the diff's counts and slots,
/// diffed by one warp (a block's 8 warps take 8 chunks at a time, striding over the launch's).
inline constexpr int threads = 256;
inline constexpr std::uint64_t chunk_elements = 2048;

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
/// and next differ (a warp per chunk, each finding its span); then, per span, firsts[b] = the
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

/// Up to Max items of one launch, passed as a kernel parameter (no copy), and the prefix sum of the
/// units (chunks, tiles) each takes: first[k] is the launch's unit of item k's first, first[n] the
/// units in all. The kernels find an item with last_at_or_before (diff_kernel.cu).
template <class Item, int Max>
struct launch_list {
  std::uint64_t n = 0;
  std::uint64_t first[Max + 1] = {};
  Item at[Max];
};

/// The spans of one launch of pass 2; their units are chunks.
using write_list = launch_list<write_desc, max_writes>;

static_assert(sizeof(write_list) <= 4096, "a write_list must fit a kernel's parameters");

/// Pass 2 of the spans of `list`, a warp per chunk, adding the terms to *terms.
cudaError_t launch_writes(const write_list& list, unsigned long long* terms, cudaStream_t stream);

/// One patch to check: `n` records whose indices start at `indices`, into a span of `elements`.
struct check_desc {
  const std::uint32_t* indices = nullptr;
  std::uint64_t n = 0;
  std::uint64_t elements = 0;
};

/// Patches one launch checks at most (the list is a kernel parameter, as write_list).
inline constexpr int max_checks = 64;

/// The patches of one check launch; their units are tiles (check_tiles).
using check_list = launch_list<check_desc, max_checks>;

static_assert(sizeof(check_list) <= 4096, "a check_list must fit a kernel's parameters");

/// Blocks of the check kernel a patch of `records` records takes.
std::uint64_t check_tiles(std::uint64_t records);

/// Checks the patches of `list` (one block per tile of records): indices strictly increasing and
/// below their span's elements; sets bad[k] to 1 for patch k otherwise.
cudaError_t launch_check(const check_list& list, unsigned int* bad, cudaStream_t stream);

/// apply_desc::flags: write nothing (the terms alone, old values read from `dest`), or take no terms
/// (the values written alone, no old value read).
inline constexpr std::uint32_t apply_no_store = 1;
inline constexpr std::uint32_t apply_no_terms = 2;

/// One checked patch to apply: `n` records (indices at `indices`, values at `values`) into the span
/// at tensor byte `off` of `dest` (the tensor's byte 0), a tensor of `total` bytes; its terms count
/// `weight` times.
struct apply_desc {
  const std::uint32_t* indices = nullptr;
  const void* values = nullptr;
  std::uint64_t n = 0;
  void* dest = nullptr;
  std::uint64_t off = 0;
  std::uint64_t total = 0;
  std::uint64_t weight = 1;
  std::uint32_t item = 1;
  std::uint32_t flags = 0;  ///< apply_no_store, apply_no_terms
};

/// Patches one apply launch takes at most (a kernel parameter, as write_list).
inline constexpr int max_applies = 48;

/// The patches of one apply launch; their units are tiles (check_tiles).
using apply_list = launch_list<apply_desc, max_applies>;

static_assert(sizeof(apply_list) <= 4096, "an apply_list must fit a kernel's parameters");

/// Applies the checked patches of `list` (one block per tile of records), adding the new minus old
/// checksum terms to *terms.
cudaError_t launch_apply(const apply_list& list, unsigned long long* terms, cudaStream_t stream);

/// Adds weight · delta::range_terms(p, off, n, total) (p: the tensor's byte `off`) to *terms, or
/// subtracts it with `negate`.
cudaError_t launch_range_terms(const void* p, std::uint64_t off, std::uint64_t n, std::uint64_t total,
                               std::uint64_t weight, bool negate, unsigned long long* terms, cudaStream_t stream);

/// Loads every kernel of this file into the current device's context, as copy::kernel::load_all()
/// does for the copy kernels (why: see there). Returns the first error.
cudaError_t load_all() noexcept;

}  // namespace refit::delta::kernel
