// refit — patches: what a delta version sends instead of a tensor's bytes.
//
// Format (wire::entry_kind::patch): for a span of a tensor, n little-endian u32 element indices
// (relative to the span's first element, strictly increasing) followed by the n new values.
//
// Why (index, value) records and not changed fixed-size blocks: after one optimizer step the bf16
// elements that change (1–3 %) are scattered, not clustered. With a fraction f of elements changed
// at random, a block of b elements is unchanged with probability (1 - f)^b: at f = 2 % a 256-byte
// block of bf16 (128 elements) is touched 92 % of the time and a 4096-byte block always, so blocks
// would send nearly the whole version; even 16-byte blocks send 15 %. Records send
// f · (4 + itemsize) / itemsize of the bytes: 6 % for bf16 at 2 % (refit-bench --delta prints the
// fraction of 256-byte blocks touched beside it). Where a span changed densely (the records would
// not be smaller than the span: more than a third of bf16 elements, e.g. fp32 weights, or a tensor
// overwritten), the span is sent as plain bytes instead (entry_kind::bytes), so a delta never sends
// more than the whole version. Spans are at most span_bytes(), so one patch fits one buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace refit::delta {

/// Bytes of one (index, value) record.
[[nodiscard]] constexpr std::uint64_t record_bytes(std::size_t item) noexcept { return 4 + item; }

/// The tensor bytes one patch covers at most, for buffers of `buffer_bytes`: a patch is never split
/// across buffers, and it is sent only when smaller than its span, so half a buffer always fits.
/// A multiple of 256 (so of every itemsize and of the checksum's 8-byte words), at most 16 MiB.
[[nodiscard]] std::uint64_t span_bytes(std::uint64_t buffer_bytes) noexcept;

/// What diff() found in one span.
struct diff_result {
  std::uint64_t changes = 0;  ///< elements that differ
  std::uint64_t terms = 0;    ///< new minus old checksum terms of those elements (delta::element_term)
};

/// Compares `span` bytes of `next` with `base` (both at tensor byte `off` of a tensor of `total`
/// bytes, elements of `item` bytes), copies every changed element into `base` (which becomes
/// `next` over the span), and writes the changes: their indices (relative to the span) to
/// `indices` and their values to `values`, each with room for span / item.
diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::uint32_t* indices, std::byte* values) noexcept;

/// Counts the 256-byte blocks of `span` bytes that differ between `a` and `b` (for the bench's
/// block-format comparison).
std::uint64_t changed_blocks(const std::byte* a, const std::byte* b, std::uint64_t span, std::uint64_t block) noexcept;

/// Checks a patch of `bytes` bytes against a span of `span` bytes: whole records, indices strictly
/// increasing and inside the span. Throws refit::error(errc::apply) naming `name`, before anything is
/// written. The same as check_records(), then first_bad_record() over every record and
/// refuse_record() for the one it found (pieces of a patch may be checked apart: delta::host_patcher).
void check_patch(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                 std::string_view name);

/// Throws refit::error(errc::apply) naming `name` unless a patch of `bytes` bytes holds whole records.
void check_records(std::uint64_t bytes, std::size_t item, std::string_view name);

/// The first of records [from, to) of a patch whose index is outside a span of `span` bytes or not
/// after the index of the record before it (record from - 1 included), or nullopt.
[[nodiscard]] std::optional<std::uint64_t> first_bad_record(const std::byte* patch, std::uint64_t from,
                                                            std::uint64_t to, std::size_t item,
                                                            std::uint64_t span) noexcept;

/// Throws what check_patch() throws for a patch whose record `k` is bad (first_bad_record).
[[noreturn]] void refuse_record(const std::byte* patch, std::uint64_t k, std::size_t item, std::uint64_t span,
                                std::string_view name);

/// Applies a checked patch for the span of `span` bytes at tensor byte `off` (of a tensor of
/// `total` bytes) into each destination of `dests` (each the tensor's byte 0: tied weights have
/// several); returns the new minus old checksum terms, the old values read from the first
/// destination. The patch may lie in memory a peer can still write (a host_shm buffer): each
/// record is read once, and an index outside the span (the patch changed since it was checked)
/// throws refit::error(errc::apply) naming `name`, with the records before it written and nothing
/// outside the span.
std::uint64_t apply_patch(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t off,
                          std::uint64_t span, std::uint64_t total, std::span<std::byte* const> dests,
                          std::string_view name);

/// What an apply of a checked patch does: write its values and take their terms (a delta in place),
/// take the terms alone (a staged delta's batch: the old values read from the live weights, nothing
/// written), or write alone (a staged delta's apply_prepared(): the terms were taken at its batch).
enum class apply_mode : std::uint8_t { both, terms_only, store_only };

/// apply_patch() of records [from, to) of a checked patch of `n` records alone: pieces of one patch
/// write different elements, so they may be applied apart, on several threads, and their terms
/// added up. Throws as apply_patch(). `mode`: see apply_mode (terms_only writes nothing and reads the
/// old values from dests.front(); store_only returns 0).
std::uint64_t apply_records(const std::byte* patch, std::uint64_t n, std::uint64_t from, std::uint64_t to,
                            std::size_t item, std::uint64_t off, std::uint64_t span, std::uint64_t total,
                            std::span<std::byte* const> dests, std::string_view name,
                            apply_mode mode = apply_mode::both);

}  // namespace refit::delta
