// refit — delta versions on a CUDA device (built only with CUDA): the diff and the patch apply of
// patch.hpp for device memory, same format, same checksum terms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "delta/patch.hpp"

namespace refit::delta::cuda {

/// Device scratch of the functions below on one CUDA device, kept between calls: chunk counts and
/// slots, a checksum-terms accumulator, a sink for the patches of spans sent as bytes, check flags.
/// Not thread-safe.
class workspace {
 public:
  explicit workspace(int device);
  ~workspace();
  workspace(const workspace&) = delete;
  workspace& operator=(const workspace&) = delete;

  [[nodiscard]] int device() const noexcept { return device_; }
  /// Waits for `stream` and returns the terms summed since the last take (then zero).
  std::uint64_t take_terms(void* stream);
  /// The accumulator, device memory.
  [[nodiscard]] unsigned long long* terms() noexcept;
  /// Device memory of at least `bytes`, kept until the next call with `slot`.
  void* scratch(int slot, std::uint64_t bytes);

  struct impl;
  [[nodiscard]] impl& state() noexcept { return *impl_; }

 private:
  int device_;
  impl* impl_;
};

/// Pass 1 of a diff over a tensor of `total` bytes cut into spans of `span` bytes: the changed
/// elements of each span; the slots pass 2 needs are uploaded into the workspace (valid until the
/// next count()). Synchronous on `stream` (a cudaStream_t).
std::vector<std::uint64_t> count(const std::byte* base, const std::byte* next, std::uint64_t total, std::uint64_t span,
                                 std::size_t item, workspace& ws, void* stream);

/// Pass 2 for span k of the last count(): brings the base up to date, writes the span's patch to
/// `out` (device memory; null: only the base), and adds `weight` times its checksum terms to the
/// workspace's accumulator. Enqueued on `stream`.
void write(std::byte* base, const std::byte* next, std::uint64_t total, std::uint64_t span, std::size_t item,
           std::size_t k, std::byte* out, std::uint64_t weight, workspace& ws, void* stream);

/// A patch in device memory, as a receiver checks it.
struct patch_ref {
  const std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  std::size_t item = 1;
  std::uint64_t span = 0;
  std::string name;
};
/// Checks every patch (delta::check_patch) on the device, after the work on `stream`; throws
/// refit::error(errc::apply) naming the first corrupt one. Synchronous.
void check(std::span<const patch_ref> patches, workspace& ws, void* stream);

/// Applies a checked patch for the span at tensor byte `off` of a tensor of `total` bytes into
/// `dest` (the tensor's byte 0, device memory) and adds `weight` times its terms to the
/// accumulator. Enqueued on `stream`.
void apply(const patch_ref& patch, std::uint64_t off, std::uint64_t total, std::byte* dest, std::uint64_t weight,
           workspace& ws, void* stream);

/// Adds (or with `negate` subtracts) `weight` times delta::range_terms of n bytes at p (the
/// tensor's byte `off`) to the accumulator. Enqueued on `stream`.
void add_range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total, std::uint64_t weight,
                     bool negate, workspace& ws, void* stream);

/// One span, synchronously, on the legacy default stream (for tests): count() + write() with
/// weight 1.
diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::byte* out, int device);
/// check() + apply() of one patch, synchronously, with weight 1: returns its terms.
std::uint64_t apply(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                    std::uint64_t off, std::uint64_t total, std::byte* dest, int device, std::string_view name);

}  // namespace refit::delta::cuda

namespace refit::delta::cuda {
/// Copies `bytes` from `src` to `dst` (any memory CUDA knows), synchronously. Throws refit::error(cuda).
void copy_sync(void* dst, const void* src, std::uint64_t bytes, int device);
}  // namespace refit::delta::cuda
