// refit — delta versions on a CUDA device (built only with CUDA): the diff and the patch apply of
// patch.hpp for device memory, same format, same checksum terms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "delta/patch.hpp"

namespace refit::delta::cuda {

/// delta::diff() for device memory of CUDA device `device`: compares `span` bytes of `next` with
/// `base` (base may also be page-locked host memory), brings base up to date, and writes the patch
/// (u32 indices, then values: patch.hpp) to `out`, device memory with room for span / item
/// records. Synchronous: returns once the patch is written. Throws refit::error(cuda).
diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::byte* out, int device);

/// delta::check_patch() then delta::apply_patch() for a patch and a dense destination (`dest`: the
/// tensor's byte 0) in device memory: a corrupt patch throws refit::error(errc::apply) naming `name`
/// before anything is written. Returns the new minus old checksum terms. Synchronous.
std::uint64_t apply(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                    std::uint64_t off, std::uint64_t total, std::byte* dest, int device, std::string_view name);

}  // namespace refit::delta::cuda
