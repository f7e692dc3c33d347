// refit — options shared by the streamer and the receiver.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "refit/export.hpp"

namespace refit {

/// How batch bytes reach the receiver.
enum class transport_kind : std::uint8_t {
  host_shm = 0,  ///< POSIX shared memory; CPU tensors; both processes on one host
  cuda_ipc = 1,  ///< device buffers shared with CUDA IPC; GPUs of one host
  nccl = 2,      ///< NCCL broadcast; other GPUs or hosts
};
REFIT_API std::string_view to_string(transport_kind t) noexcept;
REFIT_API std::optional<transport_kind> parse_transport(std::string_view name) noexcept;

/// How GPU transports move the bytes of a batch (host_shm always uses memcpy).
enum class copy_engine : std::uint8_t {
  automatic = 0,     ///< the transport's choice (kernel)
  kernel = 1,        ///< one launch of refit's vectorised copy kernel per batch
  memcpy_batch = 2,  ///< one cudaMemcpyBatchAsync per batch
  memcpy_each = 3,   ///< one cudaMemcpyAsync per tensor (the baseline)
};
REFIT_API std::string_view to_string(copy_engine e) noexcept;
REFIT_API std::optional<copy_engine> parse_copy_engine(std::string_view name) noexcept;

using milliseconds = std::chrono::milliseconds;

/// ZeroMQ CURVE keys (Z85 text, 40 characters each) for tcp endpoints across hosts. Empty: off.
struct curve_keys {
  std::string public_key;
  std::string secret_key;
  std::string server_key;  ///< streamer side: the receiver's public key
  /// Receiver side: the public keys (Z85) of the streamers allowed to connect. Empty: any
  /// streamer that knows the receiver's public key completes the handshake (the session token
  /// still applies).
  std::vector<std::string> allowed_clients;
};

}  // namespace refit
