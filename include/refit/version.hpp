// refit — what this librefit is: its version and what it was built with.
//
// The public headers are the same for every build (they come straight from include/refit/, nothing
// in them is generated), so whether CUDA or NCCL were built in is asked of the library at run time,
// the way zmq_has() answers for libzmq.
#pragma once

#include <string_view>

#include "refit/export.hpp"
#include "refit/options.hpp"

namespace refit {

/// The version of the librefit this process loaded ("0.1.0", the project version it was built
/// from). It may be newer than the headers the caller compiled against: they carry no version.
/// Thread-safe; never throws.
[[nodiscard]] REFIT_API std::string_view version() noexcept;

/// Whether this librefit was built with CUDA: tensors on CUDA devices, the cuda_ipc transport and
/// the GPU copy engines. Without it only CPU tensors move (host_shm). Thread-safe; never throws.
[[nodiscard]] REFIT_API bool has_cuda() noexcept;

/// Whether this librefit can move bytes with transport `t`: host_shm always, cuda_ipc when built
/// with CUDA, nccl when built with CUDA and NCCL. A streamer asked for a transport that is not
/// built throws refit::error (errc::invalid_argument) naming the ones that are; ask here first to
/// choose without catching. Thread-safe; never throws.
[[nodiscard]] REFIT_API bool has_transport(transport_kind t) noexcept;

}  // namespace refit
