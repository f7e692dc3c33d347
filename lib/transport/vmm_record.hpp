// refit — how the cuda_ipc transport describes VMM memory to the other process (copy/vmm.hpp), and
// how a direct offer cuts its weights' chunks into such descriptions. Built with or without CUDA
// so that the decoder (which reads what the other process wrote) and the cutting are unit-tested
// everywhere.
//
// A record: "VMM1", one byte that is 1 when the chunks' descriptors follow through the session's
// descriptor link (in chunk order, each tagged with its chunk's id) and 0 when the reader holds the
// span already, the chunk count (u32), then each chunk's id and size (u64 each, little-endian).
// The reader maps the chunks one after the other; offsets count from the first chunk's start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "copy/vmm.hpp"
#include "wire/wire.hpp"

namespace refit::transport {

inline constexpr std::string_view vmm_magic = "VMM1";
inline constexpr std::size_t vmm_head_bytes = 4 + 1 + 4;
inline constexpr std::size_t vmm_flag_at = 4;
/// Chunks of one record, at most: what fits a wire handle (wire::max_handle_bytes) with an offer's
/// "V" before it; 5 GiB of torch's 20 MiB chunks.
inline constexpr std::uint32_t max_vmm_chunks = (wire::max_handle_bytes - 1 - vmm_head_bytes) / 16;

std::string encode_vmm_record(std::span<const copy::vmm::chunk> chunks, bool fds_follow);
/// True when `r` starts like a VMM record (the cudaIpc records of sources have another size).
bool is_vmm_record(std::string_view r) noexcept;

/// A VMM record, read and checked.
struct vmm_span {
  bool fds_follow = false;
  std::vector<std::uint64_t> ids;
  std::vector<std::uint64_t> sizes;
  std::uint64_t bytes = 0;  ///< of all chunks
  std::string key;          ///< the record with its flag cleared: the same span whether or not descriptors follow
};
/// Validates: the header whole, a flag of 0 or 1, 1 to max_vmm_chunks chunks filling the record
/// exactly, no chunk of size 0, sizes that do not overflow. Throws refit::error(protocol) saying
/// "cuda_ipc: <what> is a malformed VMM record (N bytes): <why>".
vmm_span decode_vmm_record(const std::string& r, std::string_view what);

/// The first byte of a destination in VMM memory, and how many bytes its view spans from there.
struct vmm_region {
  std::uintptr_t start = 0;
  std::uint64_t extent = 0;  ///< at least 1
};
/// How a direct offer describes its VMM destinations: records of at most `max_chunks` adjacent
/// chunks, each region inside one record (at its offset from the record's first chunk).
struct vmm_windows {
  std::vector<std::vector<copy::vmm::chunk>> records;
  struct placed {
    std::size_t record = 0;
    std::uint64_t offset = 0;
  };
  std::vector<placed> place;             ///< by region
  std::optional<std::size_t> too_large;  ///< a region that fits no record (spans more chunks, or a gap)
};
/// Regions in address order, each in the open record of its run of adjacent chunks when it fits
/// there, else in a new one from its first chunk. Densely packed weights straddle nearly every
/// chunk boundary, so records may share chunks (the reader maps those twice) rather than cut
/// through a region. `chunks` (by base) must cover every region.
vmm_windows plan_vmm_windows(std::span<const vmm_region> regions,
                             const std::map<std::uintptr_t, copy::vmm::chunk>& chunks,
                             std::uint32_t max_chunks = max_vmm_chunks);

}  // namespace refit::transport
