// refit — the nccl transport (built only with CUDA and NCCL). See transport.hpp and DESIGN.md.
//
// The streamer is rank 0 of a communicator made per session (the ncclUniqueId travels in HELLO);
// each receiver is one further rank with its own ping-pong receive buffers. A batch is packed into
// the streamer's send buffer i and broadcast into every receiver's buffer i; receivers apply from
// there. Every wait has a deadline; on error or abort the communicator is aborted (ncclCommAbort)
// and the next session builds a fresh one.
#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace refit::transport {

std::unique_ptr<source> make_nccl_source(const source_options& options);
std::unique_ptr<sink> make_nccl_sink(int device, milliseconds timeout);

}  // namespace refit::transport
