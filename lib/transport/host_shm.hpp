// refit — the host_shm transport. See transport.hpp.
#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace refit::transport {

/// Buffers in POSIX shared memory (mode 0600, random names), unlinked once the receiver mapped
/// them; a new session gets fresh segments.
std::unique_ptr<source> make_host_shm_source(const source_options& options);
std::unique_ptr<sink> make_host_shm_sink();

}  // namespace refit::transport
