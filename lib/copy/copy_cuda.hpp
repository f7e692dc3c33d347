// refit — GPU copy engines (built only with CUDA). See copy.hpp.
#pragma once

#include <cstdint>
#include <memory>

#include "copy/copy.hpp"

namespace refit::copy {

/// kernel, memcpy_batch or memcpy_each on CUDA device `device` (offload_from: see make_copier).
std::unique_ptr<copier> make_cuda_copier(engine e, int device, milliseconds timeout, std::uint64_t offload_from);

/// Loads refit's copy and conversion kernels into device `device`'s context, once per process
/// (make_cuda_copier does, so a copier's first launch never loads one mid-refit: see
/// kernel::load_all). Throws refit::error (errc::cuda) when one does not load.
void load_kernels(int device);

/// copy::checksum() of device memory on CUDA device `device` (synchronous).
std::uint64_t cuda_checksum(const void* p, std::uint64_t bytes, int device);

}  // namespace refit::copy
