#include "delta/host_diff.hpp"

#include <algorithm>
#include <cstring>

#include "delta/patch.hpp"

namespace refit::delta {

host_differ::host_differ(std::size_t threads) : pool_(pool_threads(threads)) {}

void host_differ::diff(std::span<const host_span> spans, std::span<span_patch> out) {
  // Waves of whole spans of at most wave_bytes (a span alone when it is larger, which span_bytes()
  // rules out: at most 16 MiB).
  std::size_t k = 0;
  while (k < spans.size()) {
    std::size_t end = k;
    std::uint64_t bytes = 0;
    while (end < spans.size() && (end == k || bytes + spans[end].bytes <= wave_bytes)) bytes += spans[end++].bytes;
    wave(spans.subspan(k, end - k), out.subspan(k, end - k));
    k = end;
  }
}

void host_differ::wave(std::span<const host_span> spans, std::span<span_patch> out) {
  chunks_.clear();
  first_chunk_.clear();
  std::uint64_t slot = 0;
  for (std::size_t s = 0; s < spans.size(); ++s) {
    first_chunk_.push_back(chunks_.size());
    for (std::uint64_t from = 0; from < spans[s].bytes; from += chunk_bytes) {
      const std::uint64_t n = std::min(chunk_bytes, spans[s].bytes - from);
      chunks_.push_back(chunk{s, from, n, slot, 0, 0});
      slot += n;  // room for n indices and n values: at least the chunk's elements
    }
  }
  first_chunk_.push_back(chunks_.size());
  // Grown to the largest wave so far (a wave of a small model's tensors is small), default-
  // initialised: its pages are touched only where elements changed.
  if (slot > arena_) {
    indices_.reset();
    values_.reset();
    indices_.reset(new std::uint32_t[slot]);
    values_.reset(new std::byte[slot]);
    arena_ = slot;
  }
  pool_.run(chunks_.size(), [&](std::size_t c) {
    chunk& ch = chunks_[c];
    const host_span& s = spans[ch.span];
    const diff_result r = delta::diff(s.base + ch.from, s.next + ch.from, s.off + ch.from, ch.bytes, s.item, s.total,
                                      indices_.get() + ch.slot, values_.get() + ch.slot);
    ch.changes = r.changes;
    ch.terms = r.terms;
  });
  // A recycled patch for each span that needs one, handed out here (not by the threads).
  for (std::size_t s = 0; s < spans.size(); ++s) {
    out[s] = span_patch{};
    if (spare_.empty()) continue;
    std::uint64_t changes = 0;
    for (std::size_t c = first_chunk_[s]; c < first_chunk_[s + 1]; ++c) changes += chunks_[c].changes;
    const std::uint64_t bytes = changes * record_bytes(spans[s].item);
    if (changes == 0 || bytes >= spans[s].bytes) continue;
    out[s].patch = std::move(spare_.back());
    spare_.pop_back();
    spare_bytes_ -= out[s].patch.capacity();
  }
  pool_.run(spans.size(), [&](std::size_t s) {
    assemble(spans[s], std::span<const chunk>(chunks_).subspan(first_chunk_[s], first_chunk_[s + 1] - first_chunk_[s]),
             out[s]);
  });
}

void host_differ::assemble(const host_span& s, std::span<const chunk> chunks, span_patch& out) const {
  for (const chunk& ch : chunks) {
    out.changes += ch.changes;
    out.terms += ch.terms;
  }
  const std::uint64_t bytes = out.changes * record_bytes(s.item);
  out.as_bytes = bytes >= s.bytes;  // records no smaller than the span: send the span's bytes
  if (out.as_bytes || out.changes == 0) return;
  out.patch.resize(bytes);  // a recycled one has the room, most of the time
  std::byte* indices = out.patch.data();
  std::byte* values = indices + 4 * out.changes;
  for (const chunk& ch : chunks) {
    // diff() numbered the chunk's elements from its first; the patch numbers them from the span's.
    const auto first = static_cast<std::uint32_t>(ch.from / s.item);
    const std::uint32_t* from = indices_.get() + ch.slot;
    for (std::uint64_t i = 0; i < ch.changes; ++i) {
      const std::uint32_t v = from[i] + first;
      std::memcpy(indices + 4 * i, &v, 4);
    }
    std::memcpy(values, values_.get() + ch.slot, ch.changes * s.item);
    indices += 4 * ch.changes;
    values += ch.changes * s.item;
  }
}

}  // namespace refit::delta

namespace refit::delta {

void host_differ::recycle(std::vector<std::byte>&& patch) {
  if (patch.capacity() == 0 || spare_bytes_ + patch.capacity() > max_spare_bytes) return;
  patch.clear();
  spare_bytes_ += patch.capacity();
  spare_.push_back(std::move(patch));
}

}  // namespace refit::delta
