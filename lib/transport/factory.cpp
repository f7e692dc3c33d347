#include <fmt/format.h>

#include "config/config.hpp"
#include "refit/error.hpp"
#include "transport/host_shm.hpp"
#include "transport/transport.hpp"
#if REFIT_HAVE_CUDA
#include "transport/cuda_ipc.hpp"
#endif
#if REFIT_HAVE_NCCL
#include "transport/nccl.hpp"
#endif

namespace refit::transport {
namespace {

constexpr const char* built_transports() {
#if REFIT_HAVE_NCCL
  return "host_shm, cuda_ipc, nccl";
#elif REFIT_HAVE_CUDA
  return "host_shm, cuda_ipc";
#else
  return "host_shm";
#endif
}

}  // namespace

capabilities capabilities_of(transport_kind kind) noexcept {
  constexpr std::size_t many = 1u << 16;
  switch (kind) {
    case transport_kind::host_shm: return {};
    case transport_kind::cuda_ipc: return {many, true, false, false};
    case transport_kind::nccl: return {many, false, true, true};
  }
  return {};
}

std::unique_ptr<source> make_source(const source_options& options) {
  if (options.count < 2)
    throw error(errc::invalid_argument,
                fmt::format("buffer_count is {}: refit needs at least 2 buffers (ping-pong)", options.count));
  if (options.bytes == 0) throw error(errc::invalid_argument, "buffer_bytes is 0: give each buffer a capacity");
  switch (options.kind) {
    case transport_kind::host_shm:
      return make_host_shm_source(options);
    case transport_kind::cuda_ipc:
#if REFIT_HAVE_CUDA
      return make_cuda_ipc_source(options);
#else
      break;
#endif
    case transport_kind::nccl:
#if REFIT_HAVE_NCCL
      return make_nccl_source(options);
#else
      break;
#endif
  }
  throw error(errc::invalid_argument,
              fmt::format("transport {} is not built into this refit (built: {}); rebuild with "
                          "-Dcuda=enabled / -Dnccl=enabled, or use host_shm",
                          to_string(options.kind), built_transports()));
}

std::unique_ptr<sink> make_sink(std::string_view transport, int device, milliseconds timeout) {
  (void)device, (void)timeout;
  const auto kind = parse_transport(transport);
  if (kind == transport_kind::host_shm) return make_host_shm_sink();
#if REFIT_HAVE_CUDA
  if (kind == transport_kind::cuda_ipc) return make_cuda_ipc_sink(device, timeout);
#endif
#if REFIT_HAVE_NCCL
  if (kind == transport_kind::nccl) return make_nccl_sink(device, timeout);
#endif
  throw error(errc::transport,
              fmt::format("the streamer uses transport '{}', which this receiver does not support "
                          "(built: {}); start the streamer with one of those",
                          transport, built_transports()));
}

}  // namespace refit::transport
