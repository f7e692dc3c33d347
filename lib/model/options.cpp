#include "refit/options.hpp"

namespace refit {

std::string_view to_string(transport_kind t) noexcept {
  switch (t) {
    case transport_kind::host_shm: return "host_shm";
    case transport_kind::cuda_ipc: return "cuda_ipc";
    case transport_kind::nccl: return "nccl";
  }
  return "?";
}

std::optional<transport_kind> parse_transport(std::string_view name) noexcept {
  if (name == "host_shm") return transport_kind::host_shm;
  if (name == "cuda_ipc") return transport_kind::cuda_ipc;
  if (name == "nccl") return transport_kind::nccl;
  return std::nullopt;
}

std::string_view to_string(copy_engine e) noexcept {
  switch (e) {
    case copy_engine::automatic: return "automatic";
    case copy_engine::kernel: return "kernel";
    case copy_engine::memcpy_batch: return "memcpy_batch";
    case copy_engine::memcpy_each: return "memcpy_each";
  }
  return "?";
}

std::optional<copy_engine> parse_copy_engine(std::string_view name) noexcept {
  for (const auto e :
       {copy_engine::automatic, copy_engine::kernel, copy_engine::memcpy_batch, copy_engine::memcpy_each})
    if (to_string(e) == name) return e;
  return std::nullopt;
}

}  // namespace refit
