// refit — the nccl transport (built only with CUDA and NCCL). See transport.hpp and lib/README.md.
//
// The streamer is rank 0 of a communicator made per session (the ncclUniqueId travels in HELLO);
// each receiver is one further rank. A batch is one group of ncclBroadcast calls, one per entry,
// from the source tensor itself when it is on the streamer's GPU (else from the send buffer it was
// packed into) into the receiver's destination itself when it lies on the receiver's GPU (else into
// a receive buffer, then applied or handed to the callback). An in-place session
// (wire::session_mode::in_place, granted by every receiver) has no buffers at all. Every wait has
// a deadline; on error or abort the communicator is aborted (ncclCommAbort) and the next session
// builds a fresh one.
#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace refit::transport {

std::unique_ptr<source> make_nccl_source(const source_options& options);
std::unique_ptr<sink> make_nccl_sink(int device, milliseconds timeout);

}  // namespace refit::transport
