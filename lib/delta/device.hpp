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

/// Scratch of the functions below on one CUDA device, kept between calls and grown, never shrunk:
/// the group's span list (device, and page-locked host memory to upload it from), chunk counts and
/// slots, the spans' totals (device, and page-locked host memory to read them into), a
/// checksum-terms accumulator, check flags. Not thread-safe.
class workspace {
 public:
  explicit workspace(int device);
  ~workspace();
  workspace(const workspace&) = delete;
  workspace& operator=(const workspace&) = delete;

  [[nodiscard]] int device() const noexcept { return device_; }
  /// Launches the writes still queued (write()), waits for `stream` and returns the terms summed
  /// since the last take (then zero).
  std::uint64_t take_terms(void* stream);
  /// Drops the writes and applies queued and not launched (a failed refit's: their buffer may be
  /// another batch's by now).
  void discard_writes() noexcept;
  /// The accumulator, device memory.
  [[nodiscard]] unsigned long long* terms() noexcept;
  /// Device memory of at least `bytes`, kept until the next call with `slot`.
  void* scratch(int slot, std::uint64_t bytes);
  /// After count(): the changed elements of each span of tensor `i` of its group, span by span.
  /// Throws refit::error(internal) for an `i` outside the group.
  [[nodiscard]] std::span<const std::uint64_t> changes(std::size_t i) const;

  struct impl;
  [[nodiscard]] impl& state() noexcept { return *impl_; }

 private:
  int device_;
  impl* impl_;
};

/// One tensor of a group that count() diffs: its base (brought up to date by write()) and its new
/// bytes, both device (or page-locked host) memory, `total` bytes of elements of `item` bytes.
struct diff_tensor {
  std::byte* base = nullptr;
  const std::byte* next = nullptr;
  std::uint64_t total = 0;
  std::size_t item = 1;
};

/// Pass 1 of a diff over a group of tensors, each cut into spans of `span` bytes (a multiple of
/// every item; the last span of a tensor may be shorter): counts the changed elements of every span
/// of every tensor (workspace::changes) and leaves on the device each chunk's slot that pass 2
/// needs (valid until the next count()). Enqueued on `stream` (a cudaStream_t) after its work so
/// far, with one upload of the span list, two kernel launches and one download of the spans'
/// totals; returns after one wait for `stream`, however many tensors the group holds. Throws
/// refit::error(cuda), or (invalid_argument) for a span of 2^32 elements or more.
void count(std::span<const diff_tensor> tensors, std::uint64_t span, workspace& ws, void* stream);

/// Pass 2 for span k of tensor i of the last count(): brings the base up to date, writes the span's
/// patch to `out` (device memory, workspace::changes(i)[k] records; null: only the base), and adds
/// `weight` times its checksum terms to the workspace's accumulator. Queued in the workspace and
/// launched with the others (up to kernel::max_writes spans a launch) by launch_writes(), the next
/// count() or take_terms(), on `stream`, which must be count()'s: whoever hands `out` on must call
/// launch_writes() first.
void write(std::size_t i, std::size_t k, std::byte* out, std::uint64_t weight, workspace& ws, void* stream);

/// Enqueues the writes queued by write() on their stream. Throws refit::error(cuda).
void launch_writes(workspace& ws);

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
/// accumulator, on `stream`. Queued in the workspace and launched with the others (up to
/// kernel::max_applies patches a launch) by launch_applies() or take_terms(): whoever hands the
/// patches' memory or the destinations on must call launch_applies() first. `mode` (patch.hpp):
/// terms_only reads `dest` and writes nothing, store_only writes and reads no old value.
void apply(const patch_ref& patch, std::uint64_t off, std::uint64_t total, std::byte* dest, std::uint64_t weight,
           workspace& ws, void* stream, apply_mode mode = apply_mode::both);

/// Enqueues the applies queued by apply() on their stream. Throws refit::error(cuda).
void launch_applies(workspace& ws);

/// Adds (or with `negate` subtracts) `weight` times delta::range_terms of n bytes at p (the
/// tensor's byte `off`) to the accumulator. Enqueued on `stream`.
void add_range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total, std::uint64_t weight,
                     bool negate, workspace& ws, void* stream);

/// One span, synchronously, on the legacy default stream (for tests): count() + write() with
/// weight 1, of the span at tensor byte `off` of a tensor of `total` bytes.
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
