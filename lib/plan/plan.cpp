#include "refit/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "refit/error.hpp"
#include "wire/wire.hpp"

namespace refit {
namespace {

constexpr std::uint64_t u64_max = std::numeric_limits<std::uint64_t>::max();

// Rounds up to a multiple of `a` (a power of two). Saturates at the maximum on overflow: such an
// offset never fits any buffer, which is what the callers need to know.
std::uint64_t align_up(std::uint64_t x, std::uint64_t a) noexcept {
  const std::uint64_t rem = x & (a - 1);
  if (rem == 0) return x;
  std::uint64_t out = 0;
  if (__builtin_add_overflow(x, a - rem, &out)) return u64_max;
  return out;
}

std::uint64_t align_down(std::uint64_t x, std::uint64_t a) noexcept { return x & ~(a - 1); }

// True when [off, off + bytes) lies within a buffer of `capacity` bytes (no overflow).
bool fits(std::uint64_t off, std::uint64_t bytes, std::uint64_t capacity) noexcept {
  std::uint64_t end = 0;
  return !__builtin_add_overflow(off, bytes, &end) && end <= capacity;
}

}  // namespace

void validate(const plan_options& options) {
  const std::uint64_t a = options.alignment;
  if (a == 0 || (a & (a - 1)) != 0)
    throw error(errc::invalid_argument,
                fmt::format("plan: alignment {} is not a power of two; use 1, 2, 4, ..., e.g. 256", a));
  if (options.buffer_bytes < a)
    throw error(errc::invalid_argument,
                fmt::format("plan: buffer_bytes {} is smaller than the alignment {}; use buffers of at "
                            "least the alignment (typically many MiB)",
                            options.buffer_bytes, a));
  if (options.max_entries < 1 || options.max_entries > wire::max_batch_entries)
    throw error(errc::invalid_argument,
                fmt::format("plan: max_entries {} must be at least 1 and at most {} (the entries of a BATCH a "
                            "receiver takes)",
                            options.max_entries, wire::max_batch_entries));
}

planner::planner(const plan_options& options) : options_(options) { validate(options_); }

void planner::close_batch() noexcept {
  ++batch_;
  cursor_ = 0;
  entries_ = 0;
}

std::vector<placement> planner::add(std::size_t tensor, std::uint64_t bytes) {
  const std::uint64_t cap = options_.buffer_bytes;
  const std::uint64_t a = options_.alignment;
  std::vector<placement> out;

  // Every entry goes through here: a batch holding max_entries entries is closed first.
  auto make_room = [&] {
    if (entries_ >= options_.max_entries) close_batch();
  };
  auto place = [&](std::uint64_t tensor_offset, std::uint64_t n, std::uint64_t off) {
    out.push_back({batch_, {tensor, tensor_offset, n, off}});
    ++entries_;
  };

  make_room();
  if (bytes == 0) {
    place(0, 0, 0);
    return out;
  }

  std::uint64_t off = align_up(cursor_, a);
  if (fits(off, bytes, cap)) {
    place(0, bytes, off);
    cursor_ = off + bytes;
    return out;
  }
  if (bytes <= cap && options_.keep_whole) {
    // The tensor does not fit behind what the open batch holds (so it holds something), but it
    // fits an empty buffer: start the next batch rather than split it.
    close_batch();
    place(0, bytes, 0);
    cursor_ = bytes;
    return out;
  }

  // Split: fill the open batch, then whole buffers, then put the rest into a fresh batch. Chunk
  // boundaries inside the tensor are multiples of the alignment, so every chunk stays aligned.
  std::uint64_t done = 0;
  for (;;) {
    make_room();
    off = align_up(cursor_, a);
    const std::uint64_t avail = off < cap ? cap - off : 0;
    const std::uint64_t remaining = bytes - done;
    if (remaining <= avail) {
      place(done, remaining, off);
      cursor_ = off + remaining;
      return out;
    }
    const std::uint64_t take = align_down(avail, a);
    if (take == 0) {
      close_batch();
      continue;
    }
    place(done, take, off);
    done += take;
    close_batch();
  }
}

std::uint64_t plan_batch::used() const noexcept {
  std::uint64_t used = 0;
  for (const auto& e : entries) used = std::max(used, e.buffer_offset + e.bytes);
  return used;
}

std::vector<plan_batch> make_plan(std::span<const std::uint64_t> sizes, const plan_options& options) {
  planner p(options);
  std::vector<plan_batch> batches;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (const placement& pl : p.add(i, sizes[i])) {
      if (pl.batch >= batches.size()) batches.resize(pl.batch + 1);
      batches[pl.batch].entries.push_back(pl.entry);
    }
  }
  return batches;
}

}  // namespace refit
