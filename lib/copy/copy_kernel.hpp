// refit — the device side of the GPU copy engines: what copy_cuda.cpp hands to copy_kernel.cu.
//
// Plain types and launch functions returning cudaError_t, so the .cu file needs nothing of the
// library but this header and the host side does all error reporting.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "copy/convert.hpp"

namespace refit::copy::kernel {

/// Bytes of one tile: the unit of work a block takes at a time. Large enough that the binary
/// search per tile is noise, small enough that a batch of a few big tensors still spreads over
/// every SM (a 16 MiB tensor is 256 tiles).
inline constexpr std::uint64_t tile_bytes = 64u << 10;
/// Threads per block of the copy kernel.
inline constexpr int copy_threads = 256;
/// Blocks per SM the copy grid is sized to, at most. Two blocks with sixteen 16-byte loads in flight
/// per thread keep HBM busy, and fewer blocks touch fewer pages at once: on an H100, copying
/// llama3-8b's tensors into another process's memory (a cudaIpc mapping) ran at 0.92-0.93 of a
/// local cudaMemcpyAsync with 2 blocks per SM against 0.90-0.91 with 8, and local copies at
/// 0.95 with either (bench/results/2026-11-25-h100-copy-kernel-vmm.txt; bench/probes/copy_variants.cu
/// measures the same).
inline constexpr int blocks_per_sm = 2;

/// Threads per block of the checksum reduction.
inline constexpr int checksum_threads = 256;

/// One copy as the kernel sees it: `rows` rows of `bytes` bytes (row r at src + r·src_pitch and
/// dst + r·dst_pitch). `first_tile` is the prefix sum of the tile counts of the ops before it, so
/// the op of tile t is the last one with first_tile <= t. A row of at least a tile is split into
/// `tiles_per_row` tiles; shorter rows are grouped `rows_per_tile` to a tile (tiles_per_row 0).
struct device_op {
  const void* src;
  void* dst;
  std::uint64_t bytes;
  std::uint64_t first_tile;
  std::uint64_t rows;
  std::uint64_t src_pitch;
  std::uint64_t dst_pitch;
  std::uint32_t tiles_per_row;
  std::uint32_t rows_per_tile;
};
static_assert(sizeof(device_op) == 64);

/// Tiles of an op of `rows` rows of `bytes` bytes (0 for an empty op), and how they cut it.
struct tiling {
  std::uint64_t tiles = 0;
  std::uint32_t tiles_per_row = 0;
  std::uint32_t rows_per_tile = 0;
};
constexpr tiling tiles_of(std::uint64_t bytes, std::uint64_t rows = 1) noexcept {
  if (bytes == 0 || rows == 0) return {};
  if (bytes >= tile_bytes) {
    const std::uint64_t per_row = (bytes + tile_bytes - 1) / tile_bytes;
    return {rows * per_row, static_cast<std::uint32_t>(per_row), 0};
  }
  const std::uint64_t per_tile = tile_bytes / bytes;
  return {(rows + per_tile - 1) / per_tile, 0, static_cast<std::uint32_t>(per_tile)};
}

/// Enqueues one launch copying every tile of `count` ops (a device array, already filled in
/// stream order) on `stream`, with `blocks` blocks. Returns cudaGetLastError() after the launch.
cudaError_t launch_copy(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                        cudaStream_t stream) noexcept;

/// Most ops a launch takes as a kernel parameter (launch_copy_inline): 448 × 64 bytes, within the
/// 32764 bytes of parameters a kernel may have (CUDA 12.1+, sm_70+).
inline constexpr std::uint32_t inline_ops_max = 448;
/// Enqueues one launch like launch_copy, its `count` ops (host memory, at most inline_ops_max)
/// passed by value in the kernel's parameters: nothing to upload first, so the launch follows the
/// one before on the stream with no copy between them. Returns cudaErrorInvalidValue for more.
cudaError_t launch_copy_inline(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                               cudaStream_t stream) noexcept;
/// Enqueues a kernel of one thread that does nothing on `stream` (copier::prime). Returns
/// cudaGetLastError() after the launch.
cudaError_t launch_nothing(cudaStream_t stream) noexcept;
/// Loads every kernel of this file into the current device's context (cudaFuncGetAttributes of
/// each). Under CUDA's lazy loading (the default since CUDA 12.2) a kernel is otherwise loaded at
/// its first launch, and loading may wait for the context's other work: a first launch in the
/// middle of a refit then waits for whatever the process's own streams are blocked on (a
/// producer stream held by another process's progress, say), which may be this very refit.
/// Returns the first error.
cudaError_t load_all() noexcept;
/// Loads each of `kernels` (the host stubs of __global__ functions) into the current device's
/// context: cudaFuncGetAttributes of each. The first error, or cudaSuccess (the load_all()s).
cudaError_t load_each(std::span<const void* const> kernels) noexcept;
/// Enqueues the checksum reduction of copy::checksum() over `bytes` bytes at `p` into `*result`
/// (device memory, must be zero before), with `blocks` blocks, on `stream`. Every term but the
/// `+ bytes` is computed on the device. Returns cudaGetLastError() after the launch.
cudaError_t launch_checksum(const void* p, std::uint64_t bytes, unsigned long long* result, int blocks,
                            cudaStream_t stream) noexcept;

/// One converting copy as the kernel sees it (see copy::convert_op): `rows` rows of `count`
/// elements, pitches in elements, `first` the tensor's element index of row 0's first element.
struct convert_args {
  const void* src;
  void* dst;
  std::uint64_t count;
  std::uint64_t rows;
  std::uint64_t src_pitch;
  std::uint64_t dst_pitch;
  std::uint64_t first;
  cvt::conversion cv;
};

/// Threads per block of the conversion kernels.
inline constexpr int convert_threads = 256;

/// Enqueues one converting copy on `stream` with at most `max_blocks` blocks.
cudaError_t launch_convert(const convert_args& a, int max_blocks, cudaStream_t stream) noexcept;

/// Enqueues the scale pass of a block128 tensor of `lead` matrices of `rows` × `cols` elements of
/// type `from` at `src`: one block per 128 × 128 block writes scale_inv[g] = amax / 448 and
/// mul[g] = 448 / amax (refit::quant).
cudaError_t launch_block_scales(const void* src, std::uint8_t from, std::uint64_t lead, std::uint64_t rows,
                                std::uint64_t cols, float* scale_inv, float* mul, cudaStream_t stream) noexcept;

/// The scale pass of a row format (channel, mxfp8, nvfp4): `rows` rows (over all matrices, each
/// of `mat_rows`) of `cols` elements of type `from` at `src`.
struct row_scale_args {
  const void* src = nullptr;
  std::uint8_t from = 0;
  std::uint8_t q = 0;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::uint64_t mat_rows = 1;
  void* scale = nullptr;          ///< of scale_dtype(q), in `layout`
  std::uint64_t scale_bytes = 0;  ///< the scale tensor's bytes (a swizzled one is zeroed first)
  std::uint8_t layout = 0;        ///< refit::scale_layout code
  float* mul = nullptr;           ///< one per group, row-major
  float* scale_2 = nullptr;       ///< nvfp4: the per-tensor scale, written first
};

/// Enqueues a row format's scale pass: for nvfp4 a reduction over the whole tensor (`blocks`
/// blocks) into scale_2 first; then one block per group writes its scale (f32, E8M0 or e4m3, of
/// scale_dtype(q)) where the layout puts it and its multiplier mul[g] (refit::quant).
cudaError_t launch_row_scales(const row_scale_args& a, int blocks, cudaStream_t stream) noexcept;

/// Enqueues the scale pass of a per-tensor quantisation of `n` elements (a reduction with
/// `blocks` blocks, then one thread writing scale_inv[0] and mul[0]).
cudaError_t launch_tensor_scale(const void* src, std::uint8_t from, std::uint64_t n, float* scale_inv, float* mul,
                                int blocks, cudaStream_t stream) noexcept;

/// The fused one-pass block128 quantisation of the direct path: one block per 128 × 128 block of
/// a [lead, rows, cols] source loads its tile once, takes its amax, writes the codes to
/// dst + (l·rows + r)·dst_pitch + c (a dense row-major destination, or a column shard of one:
/// `dst` is where source element (0, 0) would land, columns [col_lo, col_hi) of the source are
/// written) and the scale_inv of blocks of those columns to scale + (l·grid_rows + br)·
/// scale_pitch + bc - col_lo / 128 (nullptr: not written).
cudaError_t launch_fused_block128(const void* src, std::uint8_t from, std::uint64_t lead, std::uint64_t rows,
                                  std::uint64_t cols, std::uint8_t* dst, std::uint64_t dst_pitch, std::uint64_t col_lo,
                                  std::uint64_t col_hi, float* scale, std::uint64_t scale_pitch,
                                  cudaStream_t stream) noexcept;

}  // namespace refit::copy::kernel
