// refit — the device side of the GPU copy engines: what copy_cuda.cpp hands to copy_kernel.cu.
//
// Plain types and launch functions returning cudaError_t, so the .cu file needs nothing of the
// library but this header and the host side does all error reporting.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace refit::copy::kernel {

/// Bytes of one tile: the unit of work a block takes at a time. Large enough that the binary
/// search per tile is noise, small enough that a batch of a few big tensors still spreads over
/// every SM (a 16 MiB tensor is 256 tiles).
inline constexpr std::uint64_t tile_bytes = 64u << 10;
/// Threads per block of the copy kernel (8 blocks of 256 fill an SM's 2048 threads).
inline constexpr int copy_threads = 256;
/// Blocks per SM the copy grid is sized to, at most.
inline constexpr int blocks_per_sm = 8;

/// Threads per block of the checksum reduction.
inline constexpr int checksum_threads = 256;

/// One copy as the kernel sees it. `first_tile` is the prefix sum of the tile counts of the ops
/// before it, so the op of tile t is the last one with first_tile <= t.
struct device_op {
  const void* src;
  void* dst;
  std::uint64_t bytes;
  std::uint64_t first_tile;
};
static_assert(sizeof(device_op) == 32);

/// Tiles of an op of `bytes` bytes (0 for an empty op).
constexpr std::uint64_t tiles_of(std::uint64_t bytes) noexcept { return (bytes + tile_bytes - 1) / tile_bytes; }

/// Enqueues one launch copying every tile of `count` ops (a device array, already filled in
/// stream order) on `stream`, with `blocks` blocks. Returns cudaGetLastError() after the launch.
cudaError_t launch_copy(const device_op* ops, std::uint32_t count, std::uint64_t total_tiles, int blocks,
                        cudaStream_t stream) noexcept;

/// Enqueues the checksum reduction of copy::checksum() over `bytes` bytes at `p` into `*result`
/// (device memory, must be zero before), with `blocks` blocks, on `stream`. Every term but the
/// `+ bytes` is computed on the device. Returns cudaGetLastError() after the launch.
cudaError_t launch_checksum(const void* p, std::uint64_t bytes, unsigned long long* result, int blocks,
                            cudaStream_t stream) noexcept;

}  // namespace refit::copy::kernel
