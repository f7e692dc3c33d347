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
    const auto wave = spans.subspan(k, end - k);
    count(wave, out.subspan(k, end - k));
    // A recycled patch for each span that needs one, handed out here (not by the threads).
    targets_.clear();
    for (std::size_t s = 0; s < wave.size(); ++s) {
      span_patch& o = out[k + s];
      if (o.changes == 0 || o.as_bytes) continue;
      o.patch = patch_memory(o.changes * record_bytes(wave[s].item));
      targets_.push_back(target{s, o.patch.data()});
    }
    write(wave, targets_);
    k = end;
  }
}

void host_differ::count(std::span<const host_span> spans, std::span<span_patch> out) {
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
  for (std::size_t s = 0; s < spans.size(); ++s) {
    span_patch& o = out[s];
    o.changes = 0;
    o.terms = 0;
    o.patch.clear();
    for (std::size_t c = first_chunk_[s]; c < first_chunk_[s + 1]; ++c) {
      o.changes += chunks_[c].changes;
      o.terms += chunks_[c].terms;
    }
    o.as_bytes = o.changes * record_bytes(spans[s].item) >= spans[s].bytes;  // records no smaller: the span's bytes
  }
}

void host_differ::write(std::span<const host_span> spans, std::span<const target> targets) {
  pool_.run(targets.size(), [&](std::size_t k) {
    const std::size_t s = targets[k].span;
    const auto chunks = std::span<const chunk>(chunks_).subspan(first_chunk_[s], first_chunk_[s + 1] - first_chunk_[s]);
    std::uint64_t changes = 0;
    for (const chunk& ch : chunks) changes += ch.changes;
    assemble(spans[s], chunks, changes, targets[k].to);
  });
}

void host_differ::assemble(const host_span& s, std::span<const chunk> chunks, std::uint64_t changes,
                           std::byte* to) const {
  std::byte* indices = to;
  std::byte* values = indices + 4 * changes;
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

std::vector<std::byte> host_differ::patch_memory(std::uint64_t bytes) {
  std::vector<std::byte> p;
  if (!spare_.empty()) {
    p = std::move(spare_.back());
    spare_.pop_back();
    spare_bytes_ -= p.capacity();
  }
  p.resize(bytes);  // a recycled one has the room, most of the time
  return p;
}

void host_differ::recycle(std::vector<std::byte>&& patch) {
  if (patch.capacity() == 0 || spare_bytes_ + patch.capacity() > max_spare_bytes) return;
  patch.clear();
  spare_bytes_ += patch.capacity();
  spare_.push_back(std::move(patch));
}

}  // namespace refit::delta
