// refit_tracker: the stateful rules of a refit (see wire.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "wire/wire.hpp"

namespace refit::wire {
namespace {

[[noreturn]] void violation(std::string_view what) { throw refit::error(errc::protocol, std::string(what)); }

std::string shape_string(dtype t, std::span<const std::int64_t> shape) {
  return fmt::format("{}[{}]", to_string(t), fmt::join(shape, ", "));
}

/// Every entry in the buffer lies inside it (of `capacity` bytes), every other one reads a source
/// announced so far (`sources` of them, this batch's included); returns the bytes the entries hold.
std::uint64_t check_buffer_ranges(const batch& b, std::uint64_t capacity, std::uint64_t sources) {
  std::uint64_t batch_bytes = 0;
  for (std::size_t i = 0; i < b.entries.size(); ++i) {
    const entry& e = b.entries[i];
    std::uint64_t last = 0;
    if (e.source > sources)
      violation(fmt::format("BATCH {}: entry {} ('{}') reads source {}, but {} sources were announced in this refit",
                            b.seq, i, e.name, e.source, sources));
    if (e.source == 0 && (__builtin_add_overflow(e.buffer_offset, e.bytes, &last) || last > capacity))
      violation(fmt::format("BATCH {}: entry {} ('{}'): buffer range [{}, {} + {}) exceeds buffer {}'s {} bytes", b.seq,
                            i, e.name, e.buffer_offset, e.buffer_offset, e.bytes, b.buffer, capacity));
    if (__builtin_add_overflow(batch_bytes, e.bytes, &batch_bytes))
      violation(fmt::format("BATCH {}: the entries hold more bytes than fit 64 bits", b.seq));
  }
  return batch_bytes;
}

/// No two entries holding bytes overlap in the buffer: sorted by offset, neighbours are compared.
void check_overlaps(const batch& b) {
  std::vector<std::size_t> order;
  order.reserve(b.entries.size());
  for (std::size_t i = 0; i < b.entries.size(); ++i)
    if (b.entries[i].bytes != 0 && b.entries[i].source == 0) order.push_back(i);
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return b.entries[x].buffer_offset < b.entries[y].buffer_offset; });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const entry& p = b.entries[order[k - 1]];
    const entry& c = b.entries[order[k]];
    if (p.buffer_offset + p.bytes > c.buffer_offset)
      violation(fmt::format("BATCH {}: entries {} ('{}') at [{}, {}) and {} ('{}') at [{}, {}) overlap in buffer {}",
                            b.seq, order[k - 1], p.name, p.buffer_offset, p.buffer_offset + p.bytes, order[k], c.name,
                            c.buffer_offset, c.buffer_offset + c.bytes, b.buffer));
  }
}

}  // namespace

refit_tracker::refit_tracker(std::vector<std::uint64_t> buffer_bytes, std::uint64_t max_entries, bool sharded)
    : buffer_bytes_(std::move(buffer_bytes)), max_entries_(max_entries), sharded_(sharded) {}

void refit_tracker::reset() noexcept {
  active_ = false;
  delta_ = false;
  version_ = 0;
  next_seq_ = 0;
  bytes_ = 0;
  sources_ = 0;
  partial_.clear();
  staged_.clear();
  completed_.clear();
}

void refit_tracker::begin(const wire::begin& b, std::optional<std::uint64_t> committed) {
  if (committed && b.version <= *committed)
    violation(
        fmt::format("BEGIN: version {} is not newer than the committed version {}; every refit needs a "
                    "larger version number (a receiver keeps what it committed: continue from a larger version, "
                    "or start a fresh receiver)",
                    b.version, *committed));
  // A BEGIN during a refit restarts: the receiver has aborted the old one.
  reset();
  active_ = true;
  version_ = b.version;
  delta_ = b.base.has_value();
}

void refit_tracker::check(const wire::batch& b) {
  check_header(b);
  const std::uint64_t sources = sources_ + b.sources.size();
  const std::uint64_t batch_bytes = check_buffer_ranges(b, buffer_bytes_[b.buffer], sources);
  check_overlaps(b);
  // Chunk rules are checked against the state as it would be after the entries before each one;
  // the changes are applied only when the whole batch passed.
  check_chunks(b);
  apply(batch_bytes);
  sources_ = sources;
}

/// BEGIN seen, version, sequence, buffer index and entry count.
void refit_tracker::check_header(const wire::batch& b) const {
  if (!active_) violation(fmt::format("BATCH without BEGIN (version {}, seq {})", b.version, b.seq));
  if (b.version != version_)
    violation(fmt::format("BATCH: version {} does not match the refit in progress, version {}", b.version, version_));
  if (b.seq != next_seq_)
    violation(fmt::format("BATCH: sequence number {} out of order, expected {}", b.seq, next_seq_));
  if (b.buffer >= buffer_bytes_.size())
    violation(fmt::format("BATCH {}: buffer index {} out of range: the session has {} buffers", b.seq, b.buffer,
                          buffer_bytes_.size()));
  if (b.entries.size() > max_entries_)
    violation(fmt::format("BATCH {}: {} entries, more than the limit of {}", b.seq, b.entries.size(), max_entries_));
}

void refit_tracker::check_chunks(const wire::batch& b) {
  staged_.clear();
  std::size_t slots = 16;
  while (slots < 2 * b.entries.size()) slots *= 2;
  index_.assign(slots, 0);
  for (std::size_t i = 0; i < b.entries.size(); ++i) {
    const entry& e = b.entries[i];
    const auto where = [&] { return fmt::format("BATCH {}: entry {} ('{}')", b.seq, i, e.name); };
    if (completed_.contains(std::string_view(e.name)))
      violation(fmt::format("{}: duplicate tensor '{}': it already arrived whole", where(), e.name));

    staged* prev = find_staged(e.name);
    staged from_partial;
    if (prev != nullptr) {
      if (prev->done)
        violation(fmt::format("{}: duplicate tensor '{}': it already arrived whole in this batch", where(), e.name));
    } else if (!partial_.empty()) {
      if (const auto it = partial_.find(e.name); it != partial_.end()) {
        const partial& p = it->second;
        from_partial = staged{e.name, p.type, p.shape, p.first, p.next, p.total, false, true};
        prev = &from_partial;
      }
    }

    staged next;
    if (!prev) {
      // A shard starts where it lies in the whole tensor; anything else starts at its first byte.
      if (e.tensor_offset != 0 && !sharded_)
        violation(
            fmt::format("{}: the first chunk of a tensor must start at offset 0, got {}", where(), e.tensor_offset));
      const auto total = checked_nbytes(e.type, e.shape);
      if (!total)
        violation(fmt::format("{}: shape {} has no valid byte count", where(), shape_string(e.type, e.shape)));
      if (e.tensor_offset > *total)
        violation(fmt::format("{}: chunk starts at byte {}, past the tensor's {} bytes ({})", where(), e.tensor_offset,
                              *total, shape_string(e.type, e.shape)));
      next = staged{e.name, e.type, e.shape, e.tensor_offset, e.tensor_offset, *total, false, false};
    } else {
      if (e.type != prev->type || !std::ranges::equal(e.shape, prev->shape))
        violation(fmt::format("{}: chunk changes the tensor from {} to {}", where(),
                              shape_string(prev->type, prev->shape), shape_string(e.type, e.shape)));
      if (e.tensor_offset != prev->next)
        violation(
            fmt::format("{}: chunk starts at byte {} but the previous chunk ended at byte {}; chunks must be "
                        "in order and contiguous",
                        where(), e.tensor_offset, prev->next));
      next = *prev;
    }
    std::uint64_t last = 0;
    if (__builtin_add_overflow(next.next, e.covered(), &last) || last > next.total)
      violation(fmt::format("{}: byte range [{}, {} + {}) exceeds the tensor's {} bytes ({})", where(), e.tensor_offset,
                            e.tensor_offset, e.covered(), next.total, shape_string(e.type, e.shape)));
    if (e.kind == entry_kind::patch && !delta_)
      violation(fmt::format("{}: a patch entry in version {}, which is not a delta (BEGIN named no base)", where(),
                            version_));
    next.next = last;
    // A sharded tracker keeps every range (the group's ranges are checked together at END).
    next.done = !sharded_ && next.next == next.total;
    if (prev != nullptr && prev != &from_partial)
      *prev = next;  // a later chunk of a tensor staged earlier in this batch
    else
      add_staged(next);
  }
}

refit_tracker::staged* refit_tracker::find_staged(std::string_view name) {
  const std::size_t mask = index_.size() - 1;
  for (std::size_t k = name_hash{}(name)&mask;; k = (k + 1) & mask) {
    const std::uint32_t at = index_[k];
    if (at == 0) return nullptr;
    if (staged_[at - 1].name == name) return &staged_[at - 1];
  }
}

void refit_tracker::add_staged(const staged& s) {
  const std::size_t mask = index_.size() - 1;
  std::size_t k = name_hash{}(s.name) & mask;
  while (index_[k] != 0) k = (k + 1) & mask;  // at most half the slots are taken
  staged_.push_back(s);
  index_[k] = static_cast<std::uint32_t>(staged_.size());
}

void refit_tracker::add_completed(std::string_view name) { (void)completed_.insert(name); }

/// Everything passed: records the batch.
void refit_tracker::apply(std::uint64_t batch_bytes) {
  for (const staged& s : staged_) {
    if (s.done) {
      if (s.in_partial) partial_.erase(std::string(s.name));
      add_completed(s.name);
    } else {
      partial_.insert_or_assign(std::string(s.name),
                                partial{s.type, {s.shape.begin(), s.shape.end()}, s.first, s.next, s.total});
    }
  }
  staged_.clear();
  bytes_ += batch_bytes;  // cannot overflow in practice: bounded by batches × buffer size
  ++next_seq_;
}

void refit_tracker::finish(const wire::end& e) {
  if (!active_) violation(fmt::format("END without BEGIN (version {})", e.version));
  if (e.version != version_)
    violation(fmt::format("END: version {} does not match the refit in progress, version {}", e.version, version_));
  if (!partial_.empty() && !sharded_) {
    // Name the first one in order, so the message does not depend on hashing.
    const auto it = std::min_element(partial_.begin(), partial_.end(),
                                     [](const auto& x, const auto& y) { return x.first < y.first; });
    throw refit::error(
        errc::incomplete,
        fmt::format("END of version {}: tensor '{}' is incomplete: {} of {} bytes arrived{}; nothing "
                    "was committed",
                    version_, it->first, it->second.next, it->second.total,
                    partial_.size() > 1 ? fmt::format(" ({} incomplete tensors)", partial_.size()) : std::string()));
  }
  auto mismatch = [&](std::string_view what, std::uint64_t announced, std::uint64_t arrived) {
    if (announced != arrived)
      throw refit::error(errc::incomplete,
                         fmt::format("END of version {}: the streamer sent {} {} but {} arrived; nothing was committed",
                                     version_, announced, what, arrived));
  };
  mismatch("tensors", e.tensors, completed_.size() + (sharded_ ? partial_.size() : 0));
  mismatch("bytes", e.bytes, bytes_);
  mismatch("batches", e.batches, next_seq_);
  active_ = false;
}

}  // namespace refit::wire
