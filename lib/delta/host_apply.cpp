#include "delta/host_apply.hpp"

#include <algorithm>
#include <cstring>

#include "delta/checksum.hpp"
#include "delta/patch.hpp"

namespace refit::delta {

host_patcher::host_patcher(std::size_t threads) : pool_(pool_threads(threads)) {}

void host_patcher::cut(std::span<const host_entry> entries, bool patches_only) {
  pieces_.clear();
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const host_entry& e = entries[k];
    if (e.bytes == 0 || (patches_only && !e.patch)) continue;
    const std::uint64_t n = e.patch ? e.bytes / record_bytes(e.item) : e.bytes;
    const std::uint64_t step = e.patch ? piece_records : piece_bytes;
    for (std::uint64_t first = 0; first < n; first += step)
      pieces_.push_back(piece{k, first, std::min(n, first + step), 0});
  }
}

void host_patcher::check(std::span<const host_entry> entries) {
  cut(entries, true);
  pool_.run(pieces_.size(), [&](std::size_t k) {
    piece& p = pieces_[k];
    const host_entry& e = entries[p.entry];
    const auto bad = first_bad_record(e.from, p.first, p.last, e.item, e.span);
    p.terms = bad ? *bad + 1 : 0;
  });
  // In the batch's order, and a patch's pieces in its records' order: the first failure is the
  // one a check on one thread would have refused.
  std::size_t p = 0;
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const host_entry& e = entries[k];
    if (!e.patch) continue;
    check_records(e.bytes, e.item, e.name);
    for (; p < pieces_.size() && pieces_[p].entry == k; ++p)
      if (pieces_[p].terms != 0) refuse_record(e.from, pieces_[p].terms - 1, e.item, e.span, e.name);
  }
}

std::uint64_t host_patcher::apply(std::span<const host_entry> entries, apply_mode mode) {
  cut(entries, false);
  pool_.run(pieces_.size(), [&](std::size_t k) {
    piece& p = pieces_[k];
    const host_entry& e = entries[p.entry];
    if (e.patch) {
      const std::uint64_t n = e.bytes / record_bytes(e.item);
      // Checks each index again where it is used: check() read them from the same shared memory,
      // which the streamer may have changed since. A bad one throws (worker_pool::run hands it on).
      p.terms =
          e.weight * apply_records(e.from, n, p.first, p.last, e.item, e.off, e.span, e.total, e.dests, e.name, mode);
      return;
    }
    const std::uint64_t at = e.off + p.first;
    const std::uint64_t bytes = p.last - p.first;
    const std::byte* from = e.from + p.first;
    p.terms = mode == apply_mode::store_only ? 0
                                             : e.weight * (range_terms(from, at, bytes, e.total) -
                                                           range_terms(e.dests.front() + at, at, bytes, e.total));
    if (mode != apply_mode::terms_only)
      for (std::byte* d : e.dests) std::memcpy(d + at, from, bytes);
  });
  std::uint64_t terms = 0;
  for (const piece& p : pieces_) terms += p.terms;
  return terms;
}

}  // namespace refit::delta
