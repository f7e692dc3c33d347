// refit — the cuda_ipc transport (built only with CUDA). See transport.hpp.
#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace refit::transport {

/// Device buffers on options.device, exported with cudaIpcGetMemHandle, with interprocess events
/// packed[i] / applied[i] per buffer.
std::unique_ptr<source> make_cuda_ipc_source(const source_options& options);
/// Maps a cuda_ipc streamer's buffers and events on CUDA device `device`. `timeout` bounds every
/// wait for the streamer's GPU work (a killed streamer's work may never complete).
std::unique_ptr<sink> make_cuda_ipc_sink(int device, milliseconds timeout);

}  // namespace refit::transport
