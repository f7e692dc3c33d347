// refit — the receiver's host delta: a batch's patches checked and applied on a pool of threads.
//
// A receiver applying a delta on one thread was the larger part of a host_shm delta where the
// streamer diffs on several: at 2 % of bf16 elements changed, one change every ~100 bytes, the
// patches touch most cache lines of the weights (read, then written back), at the memory speed of
// one core. Here a batch's entries are cut in pieces (a patch's records, a span's bytes), each
// checked or applied by one job of a worker_pool. Pieces write different elements; the checksum
// terms are a sum mod 2^64 and the first bad record is taken in the batch's order, so what is
// written, the terms and the error do not depend on the number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "delta/patch.hpp"
#include "delta/pool.hpp"

namespace refit::delta {

/// One entry of a delta batch to apply on the host.
struct host_entry {
  const std::byte* from = nullptr;    ///< its bytes in the buffer: a patch's records, or the span's bytes
  std::uint64_t bytes = 0;            ///< buffer bytes
  bool patch = false;                 ///< a patch (wire::entry_kind::patch), else the span's plain bytes
  std::uint64_t span = 0;             ///< a patch: the tensor bytes it covers
  std::uint64_t off = 0;              ///< the tensor byte it starts at
  std::uint64_t total = 0;            ///< the tensor's bytes
  std::size_t item = 1;               ///< bytes of an element
  std::uint64_t weight = 0;           ///< name_weight() of the tensor
  std::span<std::byte* const> dests;  ///< every destination of the tensor (its byte 0): tied weights have several
  std::string_view name;
};

/// Checks and applies delta batches on a pool of threads. Thread rules: one thread at a time.
class host_patcher {
 public:
  /// Records of a patch one job checks or applies (192 KiB of bf16 records, ~3 MiB of weights at 2 %).
  static constexpr std::uint64_t piece_records = 32768;
  /// Bytes of a span sent as bytes one job writes.
  static constexpr std::uint64_t piece_bytes = 1ull << 20;

  /// `threads`: delta::pool_threads(threads), the caller's included. Throws refit::error when a
  /// thread cannot be started.
  explicit host_patcher(std::size_t threads);

  /// Checks every patch of `entries` (as delta::check_patch); throws refit::error(errc::apply) for
  /// the first bad one in their order, with check_patch's message. Writes nothing.
  void check(std::span<const host_entry> entries);

  /// Writes every entry (checked) into each of its destinations; returns the sum over entries of
  /// weight · (new minus old checksum terms), the old values read from the first destination.
  /// `mode` (patch.hpp): terms_only writes nothing, store_only takes no terms (returns 0).
  std::uint64_t apply(std::span<const host_entry> entries, apply_mode mode = apply_mode::both);

  [[nodiscard]] std::size_t threads() const noexcept { return pool_.size(); }

 private:
  /// Records (a patch) or bytes (a span) [first, last) of entry `entry`.
  struct piece {
    std::size_t entry;
    std::uint64_t first;
    std::uint64_t last;
    std::uint64_t terms;  ///< apply: weighted terms; check: the first bad record + 1, or 0
  };
  void cut(std::span<const host_entry> entries, bool patches_only);

  worker_pool pool_;
  std::vector<piece> pieces_;
};

}  // namespace refit::delta
