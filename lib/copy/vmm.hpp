// refit — device memory of the CUDA driver's virtual memory API (VMM), shared between processes
// as file descriptors.
//
// Why: torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which RL
// trainers commonly set) and other allocators built on cuMemCreate hand out memory that
// cudaIpcGetMemHandle refuses. Such memory is physical chunks (20 MiB in torch) mapped one after
// the other into a reserved range, each exportable as a POSIX file descriptor when its creator
// asked for that handle type (torch does). Another process imports each chunk and maps them in
// the same order into a range of its own, so a tensor spanning chunks reads as one. Measured on an
// H100 (bench/results/2026-11-25-h100-copy-kernel-vmm.txt), memory mapped this way is also copied at
// full speed by the other process (0.95 of a local cudaMemcpyAsync with refit's kernel), where a
// cudaIpc mapping runs at 0.87-0.93.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace refit::copy::vmm {

/// One physical allocation, mapped whole at `base` in this process.
struct chunk {
  std::uintptr_t base = 0;
  std::uint64_t bytes = 0;
  /// The driver's process-wide unique id of the physical allocation
  /// (CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID): a new chunk mapped where a freed one was has another.
  std::uint64_t id = 0;
};

/// The chunks that map [p, p + bytes) of CUDA device `device`, in address order, when every byte
/// of it is VMM memory that the driver lets export as a POSIX file descriptor; nullopt otherwise
/// (cudaMalloc memory, a pool, chunks made without that handle type, a hole, a driver that cannot
/// say). Never throws.
std::optional<std::vector<chunk>> chunks_of(const void* p, std::uint64_t bytes, int device) noexcept;

/// A new POSIX file descriptor for the physical allocation mapped at `base` (a chunk's base) of
/// device `device`, owned by the caller; -1 when the driver refuses. Never throws.
int export_fd(std::uintptr_t base, int device) noexcept;

/// Chunks of another process, imported from their descriptors and mapped one after the other in
/// this process's address space, readable and writable by one device. Move-only; unmapped by
/// the destructor.
class mapping {
 public:
  mapping() noexcept = default;
  /// Imports `fds` (it does not close them) and maps chunk i, of `bytes[i]` bytes, after chunk
  /// i - 1, for CUDA device `device`. Throws refit::error(errc::transport) naming the chunk and the
  /// driver's error when one cannot be imported or mapped (a size the chunk does not have
  /// included); nothing stays mapped then.
  mapping(std::span<const int> fds, std::span<const std::uint64_t> bytes, int device);
  ~mapping();
  mapping(mapping&& other) noexcept;
  mapping& operator=(mapping&& other) noexcept;
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;

  [[nodiscard]] std::byte* data() const noexcept { return reinterpret_cast<std::byte*>(base_); }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  void release() noexcept;
  unsigned long long base_ = 0;
  std::uint64_t bytes_ = 0;   ///< reserved
  std::uint64_t mapped_ = 0;  ///< of which mapped (from base_)
  int device_ = 0;
};

/// Test support: `count` chunks of `chunk_bytes` each (a multiple of the device's granularity,
/// see granularity()) made exportable as POSIX descriptors and mapped one after the other, as
/// torch's expandable segments are; freed by the destructor. Throws refit::error(errc::cuda).
class local_chunks {
 public:
  local_chunks(std::size_t count, std::uint64_t chunk_bytes, int device);
  ~local_chunks();
  local_chunks(const local_chunks&) = delete;
  local_chunks& operator=(const local_chunks&) = delete;
  [[nodiscard]] std::byte* data() const noexcept { return reinterpret_cast<std::byte*>(base_); }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  /// Replaces chunk k by a new physical allocation at the same addresses (what an allocator does
  /// after freeing a chunk and growing again): its contents are undefined, its id is new.
  void replace(std::size_t k);

 private:
  unsigned long long base_ = 0;
  std::uint64_t bytes_ = 0;
  std::uint64_t chunk_ = 0;
  std::vector<unsigned long long> handles_;
  int device_ = 0;
};

/// The smallest chunk size (and alignment) the driver allows on `device`. Throws
/// refit::error(errc::cuda).
std::uint64_t granularity(int device);

}  // namespace refit::copy::vmm
