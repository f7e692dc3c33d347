// refit — RAII owners of the CUDA runtime handles lib/copy and lib/transport create: device
// memory, page-locked host memory, events and streams.
//
// Each is a unique_handle (copy/unique_handle.hpp: cppzmq's shape) whose constructor acquires or
// throws refit::error(errc::cuda). A default-constructed owner is empty.
// Included only by code compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <utility>

#include "copy/cuda_check.hpp"
#include "copy/unique_handle.hpp"
#include "model/memory.hpp"

namespace refit::cuda {
namespace detail {
inline void free_device(void* p) noexcept { (void)cudaFree(p); }
inline void free_host(void* p) noexcept { (void)cudaFreeHost(p); }
inline void destroy_event(cudaEvent_t e) noexcept { (void)cudaEventDestroy(e); }
inline void destroy_stream(cudaStream_t s) noexcept { (void)cudaStreamDestroy(s); }

/// Memory released by `Free`, and its size, counted as `Kind` (include/refit/memory.hpp) while
/// held; a move leaves the source empty and 0 bytes.
template <auto Free, ::refit::memory::kind Kind>
class memory {
 public:
  memory() noexcept = default;
  memory(void* p, std::uint64_t bytes) noexcept
      : p_(p), bytes_(p != nullptr ? bytes : 0), charge_(Kind, p != nullptr ? bytes : 0) {}
  memory(memory&& o) noexcept
      : p_(std::move(o.p_)), bytes_(std::exchange(o.bytes_, 0)), charge_(std::move(o.charge_)) {}
  memory& operator=(memory&& o) noexcept {
    if (this != &o) {
      p_ = std::move(o.p_);
      bytes_ = std::exchange(o.bytes_, 0);
      charge_ = std::move(o.charge_);
    }
    return *this;
  }

  [[nodiscard]] void* handle() const noexcept { return p_.handle(); }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return static_cast<bool>(p_); }

 private:
  unique_handle<void*, Free> p_;
  std::uint64_t bytes_ = 0;
  ::refit::memory::charge charge_;
};
}  // namespace detail

/// cudaMalloc'd memory on the current device.
class device_buffer : public detail::memory<detail::free_device, ::refit::memory::kind::device> {
 public:
  device_buffer() noexcept = default;
  explicit device_buffer(std::uint64_t bytes) : memory(allocate(bytes), bytes) {}
  /// Takes ownership of `p`, cudaMalloc'd by the caller (who worded its own failure).
  static device_buffer adopt(void* p, std::uint64_t bytes) noexcept { return device_buffer(p, bytes); }

 private:
  device_buffer(void* p, std::uint64_t bytes) noexcept : memory(p, bytes) {}
  static void* allocate(std::uint64_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), fmt::format("cudaMalloc({} bytes)", bytes));
    return p;
  }
};

/// cudaMallocHost'd (page-locked) host memory.
class pinned_buffer : public detail::memory<detail::free_host, ::refit::memory::kind::pinned> {
 public:
  pinned_buffer() noexcept = default;
  explicit pinned_buffer(std::uint64_t bytes) : memory(allocate(bytes), bytes) {}
  /// Takes ownership of `p`, cudaMallocHost'd by the caller (who worded its own failure).
  static pinned_buffer adopt(void* p, std::uint64_t bytes) noexcept { return pinned_buffer(p, bytes); }

 private:
  pinned_buffer(void* p, std::uint64_t bytes) noexcept : memory(p, bytes) {}
  static void* allocate(std::uint64_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMallocHost(&p, bytes), fmt::format("cudaMallocHost({} bytes)", bytes));
    return p;
  }
};

/// An event of the current device, created with `flags` (cudaEventDisableTiming, ...).
class event : public unique_handle<cudaEvent_t, detail::destroy_event> {
 public:
  event() noexcept = default;
  explicit event(unsigned int flags) : unique_handle(create(flags)) {}

 private:
  static cudaEvent_t create(unsigned int flags) {
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, flags), fmt::format("cudaEventCreateWithFlags({:#x})", flags));
    return e;
  }
};

/// A stream of the current device, created with `flags` (cudaStreamNonBlocking, ...) and
/// `priority` (lower numbers run first; 0 is the default, see greatest_priority()).
class stream : public unique_handle<cudaStream_t, detail::destroy_stream> {
 public:
  stream() noexcept = default;
  explicit stream(unsigned int flags, int priority = 0) : unique_handle(create(flags, priority)) {}
  /// The highest priority a stream of the current device can have: its kernels get the SMs first
  /// when kernels of several streams are ready at once.
  static int greatest_priority() {
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    return greatest;
  }

 private:
  static cudaStream_t create(unsigned int flags, int priority) {
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreateWithPriority(&s, flags, priority),
               fmt::format("cudaStreamCreateWithPriority({:#x}, {})", flags, priority));
    return s;
  }
};

}  // namespace refit::cuda
