// The hardware's own copy bandwidth, measured in the same run as the refits it is compared with.
#include <sys/mman.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

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

bool gpu_placement::local() const noexcept {
  return std::all_of(receivers.begin(), receivers.end(), [&](int gpu) { return gpu == streamer; });
}

// Receivers all on the streamer's GPU keep the device copy the recorded baselines were measured
// against; a receiver elsewhere is bound by the link to its GPU instead.
double copy_ceiling(const gpu_placement& p, std::uint64_t bytes, int reps) {
  return p.local() ? device_copy_bandwidth(p.streamer, bytes, reps)
                   : peer_copy_bandwidth(p.streamer, p.receivers, bytes, reps);
}

std::string copy_ceiling_method(const gpu_placement& p, std::uint64_t bytes, int reps) {
  if (p.local())
    return fmt::format("cudaMemcpyAsync device to device of {} MiB on GPU {}, events, best of {}", bytes >> 20,
                       p.streamer, reps);
  if (p.receivers.size() == 1)
    return fmt::format("cudaMemcpyPeerAsync GPU {} → GPU {} of {} MiB, events, best of {}", p.streamer,
                       p.receivers.front(), bytes >> 20, reps);
  const bool within = std::find(p.receivers.begin(), p.receivers.end(), p.streamer) != p.receivers.end();
  return fmt::format(
      "cudaMemcpyPeerAsync from GPU {} to GPUs {} at once, {:g} MiB each (one stream each{}), "
      "events, best of {}",
      p.streamer, fmt::join(p.receivers, ", "), static_cast<double>(bytes / p.receivers.size()) / (1 << 20),
      within ? fmt::format("; cudaMemcpyAsync within GPU {}", p.streamer) : std::string(), reps);
}

#if REFIT_HAVE_CUDA
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw error(errc::cuda, fmt::format("ceiling: {} failed: {}", what, cudaGetErrorString(e)));
}

// The library's owners release everything on every path; the messages stay the bench's own.
using device_owner = unique_handle<void*, cuda::detail::free_device>;
using stream_owner = unique_handle<cudaStream_t, cuda::detail::destroy_stream>;
using event_owner = unique_handle<cudaEvent_t, cuda::detail::destroy_event>;

/// `create` fills a handle that `owner` then holds; throws with `what` when it fails.
template <class Owner, class Create>
void acquire(Owner& owner, Create create, const char* what) {
  decltype(owner.handle()) h{};
  check(create(&h), what);
  owner.reset(h);
}

device_owner device_memory_of(std::uint64_t bytes, const char* what) {
  device_owner m;
  acquire(
      m, [&](void** p) { return cudaMalloc(p, bytes); }, what);
  return m;
}

stream_owner non_blocking_stream() {
  stream_owner s;
  acquire(
      s, [](cudaStream_t* p) { return cudaStreamCreateWithFlags(p, cudaStreamNonBlocking); }, "cudaStreamCreate");
  return s;
}

event_owner timing_event() {
  event_owner e;
  acquire(
      e, [](cudaEvent_t* p) { return cudaEventCreate(p); }, "cudaEventCreate");
  return e;
}

/// Lets `from` (current) reach `to`'s memory directly; already allowed is fine.
void enable_peer_access(int from, int to) {
  const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw error(errc::cuda, fmt::format("ceiling: cudaDeviceEnablePeerAccess from GPU {} to GPU {} failed: {}; "
                                        "cuda_ipc across these GPUs needs peer access",
                                        from, to, cudaGetErrorString(e)));
  }
}
}  // namespace

double device_copy_bandwidth(int device, std::uint64_t bytes, int reps) {
  check(cudaSetDevice(device), "cudaSetDevice");
  const device_owner a = device_memory_of(bytes, "cudaMalloc (ceiling source)");
  const device_owner b = device_memory_of(bytes, "cudaMalloc (ceiling destination)");
  check(cudaMemset(a.handle(), 0x5a, bytes), "cudaMemset");
  const stream_owner stream = non_blocking_stream();
  const event_owner start = timing_event(), stop = timing_event();
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

// Every share is its own slice of one source buffer on `from`, copied on its own stream (all of
// them created on `from`, where the copies are issued), all at once: a refit's direct writes to
// several ranks overlap the same way. The time is from one start event, which every stream waits
// for, to the last stream's end.
double peer_copy_bandwidth(int from, const std::vector<int>& to, std::uint64_t bytes, int reps) {
  if (to.empty() || bytes < to.size())
    throw error(errc::invalid_argument, fmt::format("ceiling: {} bytes to {} GPUs", bytes, to.size()));
  const std::uint64_t share = bytes / to.size();
  std::vector<device_owner> dst;
  for (const int gpu : to) {
    check(cudaSetDevice(gpu), "cudaSetDevice");
    dst.push_back(device_memory_of(share, "cudaMalloc (ceiling destination)"));
  }
  check(cudaSetDevice(from), "cudaSetDevice");
  const device_owner src = device_memory_of(share * to.size(), "cudaMalloc (ceiling source)");
  check(cudaMemset(src.handle(), 0x5a, share * to.size()), "cudaMemset");
  std::vector<stream_owner> streams;
  std::vector<event_owner> stops;
  for (const int gpu : to) {
    if (gpu != from) enable_peer_access(from, gpu);
    streams.push_back(non_blocking_stream());
    stops.push_back(timing_event());
  }
  const event_owner start = timing_event();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the memset
  double best = 0;
  for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
    check(cudaEventRecord(start.handle(), streams.front().handle()), "cudaEventRecord");
    for (std::size_t j = 0; j < to.size(); ++j) {
      const cudaStream_t s = streams[j].handle();
      const auto* from_bytes = static_cast<const std::byte*>(src.handle()) + j * share;
      check(cudaStreamWaitEvent(s, start.handle(), 0), "cudaStreamWaitEvent");
      check(to[j] == from ? cudaMemcpyAsync(dst[j].handle(), from_bytes, share, cudaMemcpyDeviceToDevice, s)
                          : cudaMemcpyPeerAsync(dst[j].handle(), to[j], from_bytes, from, share, s),
            to[j] == from ? "cudaMemcpyAsync (ceiling)" : "cudaMemcpyPeerAsync (ceiling)");
      check(cudaEventRecord(stops[j].handle(), s), "cudaEventRecord");
    }
    float longest = 0;
    for (const auto& stop : stops) {
      check(cudaEventSynchronize(stop.handle()), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start.handle(), stop.handle()), "cudaEventElapsedTime");
      longest = std::max(longest, ms);
    }
    if (r > 0) best = std::max(best, static_cast<double>(share * to.size()) / (static_cast<double>(longest) * 1e-3));
  }
  return best;
}
#else
double device_copy_bandwidth(int, std::uint64_t, int) {
  throw error(errc::invalid_argument, "the device-copy ceiling needs a build with CUDA");
}
double peer_copy_bandwidth(int, const std::vector<int>&, std::uint64_t, int) {
  throw error(errc::invalid_argument, "the peer-copy ceiling needs a build with CUDA");
}
#endif

}  // namespace refit::bench
