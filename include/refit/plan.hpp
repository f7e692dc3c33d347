// refit — the packer's plan: which bytes of which tensor go where in which batch.
//
// Layer 2: pure arithmetic, no I/O. The streamer feeds tensors to a planner one at a time, in the
// order its source yields them; the planner places each at an aligned offset of the open batch,
// closes batches that are full and splits tensors larger than a buffer into chunks over
// consecutive batches. Every byte of every tensor is placed exactly once; no entry crosses the
// end of the buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "refit/export.hpp"

namespace refit {

struct plan_options {
  std::uint64_t buffer_bytes = 256ull << 20;  ///< capacity of one buffer
  std::uint64_t alignment = 256;              ///< power of two; entry offsets are multiples
  /// Entries per batch at most (bounds messages): 1 to 65536, the most a receiver takes.
  std::uint64_t max_entries = 65536;
  /// A tensor that fits into an empty buffer is never split (callback sinks then see it whole);
  /// false packs buffers full, splitting any tensor at a batch boundary.
  bool keep_whole = true;
};

/// Throws refit::error(invalid_argument) unless alignment is a power of two, buffer_bytes is at
/// least the alignment and max_entries is 1 to 65536 (wire::max_batch_entries).
REFIT_API void validate(const plan_options& options);

/// One entry of a batch: `bytes` bytes of tensor `tensor` starting at `tensor_offset`, at
/// `buffer_offset` in the batch's buffer.
struct plan_entry {
  std::size_t tensor = 0;
  std::uint64_t tensor_offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t buffer_offset = 0;
  friend bool operator==(const plan_entry&, const plan_entry&) = default;
};

/// Where one entry went: the batch (sequence number from 0) and the entry.
struct placement {
  std::uint64_t batch = 0;
  plan_entry entry;
};

/// Incremental planner. Not thread-safe.
class REFIT_API planner {
 public:
  /// Throws like validate().
  explicit planner(const plan_options& options);

  /// Places tensor `tensor` of `bytes` bytes; returns its entries in order (more than one when
  /// it is split). Entries of batch b all come before those of batch b+1. A zero-byte tensor gets
  /// one entry of zero bytes at offset 0.
  std::vector<placement> add(std::size_t tensor, std::uint64_t bytes);

  /// Sequence number of the batch being filled.
  [[nodiscard]] std::uint64_t open_batch() const noexcept { return batch_; }
  /// Entries in the open batch.
  [[nodiscard]] std::uint64_t open_entries() const noexcept { return entries_; }
  /// Batches holding at least one entry so far (the open one included if it has entries).
  [[nodiscard]] std::uint64_t batches() const noexcept { return batch_ + (entries_ ? 1 : 0); }
  [[nodiscard]] const plan_options& options() const noexcept { return options_; }

 private:
  void close_batch() noexcept;

  plan_options options_;
  std::uint64_t batch_ = 0;
  std::uint64_t cursor_ = 0;  ///< first free byte of the open batch
  std::uint64_t entries_ = 0;
};

/// A whole plan at once: batch b holds the entries placed in batch b.
struct REFIT_API plan_batch {
  std::vector<plan_entry> entries;
  /// One past the last byte used.
  [[nodiscard]] std::uint64_t used() const noexcept;
};
REFIT_API std::vector<plan_batch> make_plan(std::span<const std::uint64_t> sizes, const plan_options& options);

}  // namespace refit
