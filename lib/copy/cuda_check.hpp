// refit — checking CUDA runtime calls, and a scoped current-device switch.
//
// Included only by code compiled with CUDA (lib/copy, lib/transport, the gpu tests).
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <concepts>
#include <source_location>
#include <string_view>

#include "copy/wait.hpp"
#include "refit/error.hpp"

namespace refit {

/// Throws refit::error(errc::cuda, "<what>: <name>: <description> (<file>:<line>)") unless
/// `status` is cudaSuccess. Clears nothing: sticky errors stay sticky.
inline void check_cuda(cudaError_t status, std::string_view what,
                       std::source_location where = std::source_location::current()) {
  if (status == cudaSuccess) return;
  throw error(errc::cuda, fmt::format("{}: {}: {} ({}:{})", what, cudaGetErrorName(status), cudaGetErrorString(status),
                                      where.file_name(), where.line()));
}

/// Same, with the description built by `describe()` only on failure: for hot paths, where
/// formatting a message on every successful call would cost more than the call.
template <std::invocable F>
void check_cuda(cudaError_t status, F&& describe, std::source_location where = std::source_location::current()) {
  if (status == cudaSuccess) return;
  check_cuda(status, std::string_view(describe()), where);
}

/// Polls `query` (a cudaEventQuery or cudaStreamQuery) until it reports the work done, at most
/// `timeout` (copy/wait.hpp: a dead peer's work may never complete): true when done, false when the
/// time ran out. Throws like check_cuda, with `what` (text, or a callable making it), for any
/// other status. Spins `spin` before it sleeps between polls (copy/wait.hpp).
template <class Query, class What>
bool device_work_done(std::chrono::milliseconds timeout, Query&& query, What&& what,
                      std::chrono::milliseconds spin = backoff::default_spin) {
  return poll_until(
      deadline::after(timeout),
      [&] {
        const cudaError_t status = query();
        if (status == cudaErrorNotReady) return false;
        check_cuda(status, what);
        return true;
      },
      spin);
}

/// Makes `device` current for the scope and restores the previous current device after it. The
/// runtime's current device is per thread, so a library call must not leave it changed.
class device_guard {
 public:
  /// Throws errc::cuda when the device cannot be made current (bad ordinal, no driver).
  explicit device_guard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device));
  }
  ~device_guard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
};

/// A device_guard that also makes the device's primary context current on this thread, for
/// driver API calls: a thread that made no runtime call yet (a Python engine's serving thread)
/// has none, and there cudaGetDevice() already says 0, so device_guard(0) switches nothing and a
/// driver call fails with CUDA_ERROR_INVALID_CONTEXT.
class on_device {
 public:
  explicit on_device(int device) : guard_(device) { (void)cudaFree(nullptr); }

 private:
  device_guard guard_;
};

}  // namespace refit
