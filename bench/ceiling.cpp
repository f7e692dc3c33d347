// The hardware's own copy bandwidth, measured in the same run as the refits it is compared with.
#include <sys/mman.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"

#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy/cuda_handles.hpp"
#include "copy/unique_handle.hpp"
#endif

namespace refit::bench {
namespace {

struct anon_map {
  explicit anon_map(std::uint64_t n) : size(n) {
    p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw error(errc::io, fmt::format("ceiling: cannot allocate {} MiB of host memory", n >> 20));
  }
  ~anon_map() { ::munmap(p, size); }
  anon_map(const anon_map&) = delete;
  anon_map& operator=(const anon_map&) = delete;
  void* p;
  std::uint64_t size;
};

}  // namespace

double host_memcpy_bandwidth(std::uint64_t bytes, int reps) {
  anon_map a(bytes), b(bytes);
  fill_random(static_cast<std::byte*>(a.p), bytes, 42);
  std::memcpy(b.p, a.p, bytes);  // warm: page tables, caches
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.p, a.p, bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) / s);
  }
  return best;
}

#if REFIT_HAVE_CUDA
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw error(errc::cuda, fmt::format("ceiling: {} failed: {}", what, cudaGetErrorString(e)));
}
}  // namespace

double device_copy_bandwidth(int device, std::uint64_t bytes, int reps) {
  check(cudaSetDevice(device), "cudaSetDevice");
  // The library's owners release everything on every path; the messages stay the bench's own.
  unique_handle<void*, cuda::detail::free_device> a, b;
  unique_handle<cudaStream_t, cuda::detail::destroy_stream> stream;
  unique_handle<cudaEvent_t, cuda::detail::destroy_event> start, stop;
  const auto acquire = [](auto& owner, auto create, const char* what) {
    decltype(owner.handle()) h{};
    check(create(&h), what);
    owner.reset(h);
  };
  acquire(
      a, [&](void** p) { return cudaMalloc(p, bytes); }, "cudaMalloc (ceiling source)");
  acquire(
      b, [&](void** p) { return cudaMalloc(p, bytes); }, "cudaMalloc (ceiling destination)");
  check(cudaMemset(a.handle(), 0x5a, bytes), "cudaMemset");
  acquire(
      stream, [](cudaStream_t* p) { return cudaStreamCreateWithFlags(p, cudaStreamNonBlocking); }, "cudaStreamCreate");
  acquire(
      start, [](cudaEvent_t* p) { return cudaEventCreate(p); }, "cudaEventCreate");
  acquire(
      stop, [](cudaEvent_t* p) { return cudaEventCreate(p); }, "cudaEventCreate");
  check(cudaMemcpyAsync(b.handle(), a.handle(), bytes, cudaMemcpyDeviceToDevice, stream.handle()),
        "cudaMemcpyAsync");  // warm
  check(cudaStreamSynchronize(stream.handle()), "cudaStreamSynchronize");
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(start.handle(), stream.handle()), "cudaEventRecord");
    check(cudaMemcpyAsync(b.handle(), a.handle(), bytes, cudaMemcpyDeviceToDevice, stream.handle()), "cudaMemcpyAsync");
    check(cudaEventRecord(stop.handle(), stream.handle()), "cudaEventRecord");
    check(cudaEventSynchronize(stop.handle()), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.handle(), stop.handle()), "cudaEventElapsedTime");
    best = std::max(best, static_cast<double>(bytes) / (static_cast<double>(ms) * 1e-3));
  }
  return best;
}
#else
double device_copy_bandwidth(int, std::uint64_t, int) {
  throw error(errc::invalid_argument, "the device-copy ceiling needs a build with CUDA");
}
#endif

}  // namespace refit::bench
