// refit — RAII owners of the CUDA runtime handles lib/copy and lib/transport create: device
// memory, page-locked host memory, events and streams.
//
// cppzmq shape: the constructor acquires or throws refit::error(errc::cuda), copy is deleted, a
// move leaves the source empty, the destructor is noexcept and ignores errors (it may run after
// the runtime has shut down), handle() is the escape hatch. A default-constructed owner is empty.
// Included only by code compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <utility>

#include "copy/cuda_check.hpp"

namespace refit::cuda {

/// cudaMalloc'd memory on the current device.
class device_buffer {
 public:
  device_buffer() noexcept = default;
  explicit device_buffer(std::uint64_t bytes) : bytes_(bytes) {
    check_cuda(cudaMalloc(&p_, bytes), fmt::format("cudaMalloc({} bytes)", bytes));
  }
  ~device_buffer() { reset(); }
  device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  [[nodiscard]] void* handle() const noexcept { return p_; }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  void reset() noexcept {
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* p_ = nullptr;
  std::uint64_t bytes_ = 0;
};

/// cudaMallocHost'd (page-locked) host memory.
class pinned_buffer {
 public:
  pinned_buffer() noexcept = default;
  explicit pinned_buffer(std::uint64_t bytes) : bytes_(bytes) {
    check_cuda(cudaMallocHost(&p_, bytes), fmt::format("cudaMallocHost({} bytes)", bytes));
  }
  ~pinned_buffer() { reset(); }
  pinned_buffer(pinned_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  [[nodiscard]] void* handle() const noexcept { return p_; }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  void reset() noexcept {
    if (p_ != nullptr) (void)cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* p_ = nullptr;
  std::uint64_t bytes_ = 0;
};

/// An event of the current device, created with `flags` (cudaEventDisableTiming, ...).
class event {
 public:
  event() noexcept = default;
  explicit event(unsigned int flags) {
    check_cuda(cudaEventCreateWithFlags(&e_, flags), fmt::format("cudaEventCreateWithFlags({:#x})", flags));
  }
  ~event() { reset(); }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;

  [[nodiscard]] cudaEvent_t handle() const noexcept { return e_; }
  explicit operator bool() const noexcept { return e_ != nullptr; }

 private:
  void reset() noexcept {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
    e_ = nullptr;
  }
  cudaEvent_t e_ = nullptr;
};

/// A stream of the current device, created with `flags` (cudaStreamNonBlocking, ...) and
/// `priority` (lower numbers run first; 0 is the default, see greatest_priority()).
class stream {
 public:
  stream() noexcept = default;
  explicit stream(unsigned int flags, int priority = 0) {
    check_cuda(cudaStreamCreateWithPriority(&s_, flags, priority),
               fmt::format("cudaStreamCreateWithPriority({:#x}, {})", flags, priority));
  }
  /// The highest priority a stream of the current device can have: its kernels get the SMs first
  /// when kernels of several streams are ready at once.
  static int greatest_priority() {
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    return greatest;
  }
  ~stream() { reset(); }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  [[nodiscard]] cudaStream_t handle() const noexcept { return s_; }
  explicit operator bool() const noexcept { return s_ != nullptr; }

 private:
  void reset() noexcept {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
    s_ = nullptr;
  }
  cudaStream_t s_ = nullptr;
};

}  // namespace refit::cuda
