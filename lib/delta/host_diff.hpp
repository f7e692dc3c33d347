// refit — the host diff of many spans at once, on a pool of threads (the streamer's host delta).
//
// A tensor is cut into spans (delta::span_bytes, what one patch covers) and the spans into chunks
// of chunk_bytes; each chunk is diffed by delta::diff() on some thread into
// its own slot of a scratch arena, and each span's patch is then assembled from its chunks in order.
// The result does not depend on the number of threads nor on which thread ran which chunk: the
// indices and values of a span are its chunks' in order, and the checksum terms are a sum mod 2^64.
// So the patches are byte for byte those of one delta::diff() per span.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "delta/pool.hpp"

namespace refit::delta {

/// One span of a tensor to diff: `bytes` bytes at tensor byte `off` of a tensor of `total` bytes with
/// elements of `item` bytes. `base` and `next` point at the span's first byte; the base becomes the
/// new version over the span.
struct host_span {
  std::byte* base = nullptr;
  const std::byte* next = nullptr;
  std::uint64_t off = 0;
  std::uint64_t bytes = 0;
  std::uint64_t total = 0;
  std::size_t item = 1;
};

/// What the diff of one span found.
struct span_patch {
  std::uint64_t changes = 0;  ///< elements that differ
  std::uint64_t terms = 0;    ///< new minus old checksum terms (delta::element_term)
  /// The records would be no smaller than the span: it goes as its plain bytes (no patch).
  bool as_bytes = false;
  /// The patch (wire::entry_kind::patch format) when it is sent as one and something changed.
  std::vector<std::byte> patch;
};

/// Diffs spans on a pool of threads. Thread rules: one thread at a time.
class host_differ {
 public:
  /// Tensor bytes one job diffs (a multiple of 256, so of every itemsize).
  static constexpr std::uint64_t chunk_bytes = 128ull << 10;
  /// Tensor bytes whose chunks are diffed before their spans' patches are assembled: bounds the
  /// arena (5 bytes per byte at most, touched only where elements changed).
  static constexpr std::uint64_t wave_bytes = 32ull << 20;

  /// `threads`: delta::pool_threads(threads) threads, the caller's included. Throws refit::error
  /// when a thread cannot be started.
  explicit host_differ(std::size_t threads);

  /// Diffs every span (spans at most delta::span_bytes of any buffer: 16 MiB), bringing the base up
  /// to date, and sets out[k] for spans[k] (out.size() == spans.size()), its patch included: count()
  /// and write() wave by wave. Throws std::bad_alloc when its scratch or a patch cannot grow (the
  /// base may then be part updated: drop it, as any failure of a delta does).
  void diff(std::span<const host_span> spans, std::span<span_patch> out);

  /// The first half of diff() for spans of one wave (at most wave_bytes in all, or one span):
  /// diffs them, bringing the base up to date, and sets out[k]'s changes, terms and as_bytes (its
  /// patch stays empty). The patches wait in the differ's scratch for write(), until the next
  /// count(). Throws std::bad_alloc when the scratch cannot grow.
  void count(std::span<const host_span> spans, std::span<span_patch> out);

  /// Where write() puts the patch of span `span` of the last count(): its changes ×
  /// delta::record_bytes(item) bytes (the wire::entry_kind::patch format) at `to`.
  struct target {
    std::size_t span;
    std::byte* to;
  };
  /// The second half of diff(): writes the patches of the last count()'s `spans` (the same) to
  /// `targets` (spans that changed, not as_bytes), on the pool's threads. The streamer writes them
  /// straight into the batch's buffer when it is host memory (host_shm): no patch is copied twice.
  void write(std::span<const host_span> spans, std::span<const target> targets);

  /// Memory for a patch of `bytes` bytes: a recycled one when there is one.
  [[nodiscard]] std::vector<std::byte> patch_memory(std::uint64_t bytes);

  [[nodiscard]] std::size_t threads() const noexcept { return pool_.size(); }

  /// Takes back a patch that was sent, so that a later span's patch reuses its memory: a fresh
  /// patch of every span cost the streamer its page faults and unmapping (a fifth of a qwen2.5-0.5b
  /// delta on a 2-core VM). Keeps at most max_spare_bytes.
  void recycle(std::vector<std::byte>&& patch);
  static constexpr std::uint64_t max_spare_bytes = 64ull << 20;

 private:
  /// One chunk of the current wave: span `span` of the wave's, bytes [from, from + bytes) of it.
  struct chunk {
    std::size_t span;
    std::uint64_t from;
    std::uint64_t bytes;
    std::uint64_t slot;  ///< its slot in the arena: u32 indices at indices_[slot], values at values_[slot]
    std::uint64_t changes;
    std::uint64_t terms;
  };
  void assemble(const host_span& s, std::span<const chunk> chunks, std::uint64_t changes, std::byte* to) const;

  worker_pool pool_;
  std::vector<chunk> chunks_;
  std::vector<std::size_t> first_chunk_;       ///< per span of the wave, its first chunk; one more at the end
  std::vector<std::vector<std::byte>> spare_;  ///< recycled patches, empty, with their capacity
  std::vector<target> targets_;                ///< diff()'s scratch
  std::uint64_t spare_bytes_ = 0;
  // Not std::vector: their pages are never touched where nothing changed.
  std::unique_ptr<std::uint32_t[]> indices_;
  std::unique_ptr<std::byte[]> values_;
  std::uint64_t arena_ = 0;  ///< slots of indices_ and values_
};

}  // namespace refit::delta
