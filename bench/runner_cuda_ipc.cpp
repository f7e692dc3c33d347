// cuda_ipc path: tensors in device memory on both sides (same GPU by default); the ceiling is a
// device-to-device cudaMemcpyAsync of 1 GiB timed with events, or, when a receiver sits on another
// GPU, the same 1 GiB copied to the receivers' GPUs at once (copy_ceiling).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "bench/bench.hpp"
#include "copy/copy.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"

#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy/cuda_handles.hpp"
#include "copy/unique_handle.hpp"
#include "copy/vmm.hpp"
#endif

namespace refit::bench {

#if REFIT_HAVE_CUDA
namespace {

constexpr std::uint64_t tensor_alignment = 256;
constexpr std::uint64_t ceiling_bytes = 1ull << 30;

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw error(errc::cuda, fmt::format("refit-bench: {} failed: {}", what, cudaGetErrorString(e)));
}

std::uint64_t align_up(std::uint64_t n, std::uint64_t a) { return (n + a - 1) / a * a; }

/// cudaMalloc'd memory the bench allocated with its own messages, released by the library's owner.
using device_block = unique_handle<void*, cuda::detail::free_device>;

/// Chunks of VMM memory as torch's expandable segments make them.
constexpr std::uint64_t vmm_chunk_bytes = 20ull << 20;

/// Where torch's caching allocator puts tensors allocated one after another on a fresh pool
/// (c10/cuda/CUDACachingAllocator.cpp): sizes rounded up to 512 bytes; up to 1 MiB from 2 MiB
/// segments, up to 10 MiB from 20 MiB ones, larger tensors a segment each (rounded up to 2 MiB).
/// Returns each tensor's segment and offset there; `segments` gets the segments' sizes.
std::vector<std::pair<std::size_t, std::uint64_t>> torch_segments(std::span<const std::uint64_t> sizes,
                                                                  std::vector<std::uint64_t>& segments) {
  constexpr std::uint64_t mib = 1ull << 20;
  struct open_segment {
    std::size_t index = 0;
    std::uint64_t used = 0, size = 0;
  } small, medium;
  std::vector<std::pair<std::size_t, std::uint64_t>> at;
  for (const std::uint64_t n : sizes) {
    const std::uint64_t r = align_up(std::max<std::uint64_t>(n, 1), 512);
    if (r >= 10 * mib) {
      at.emplace_back(segments.size(), 0);
      segments.push_back(align_up(r, 2 * mib));
      continue;
    }
    open_segment& o = r <= mib ? small : medium;
    if (o.size == 0 || o.used + r > o.size) {
      o = open_segment{segments.size(), 0, r <= mib ? 2 * mib : 20 * mib};
      segments.push_back(o.size);
    }
    at.emplace_back(o.index, o.used);
    o.used += r;
  }
  return at;
}

class device_memory final : public tensor_memory {
 public:
  /// `how`: dest_memory::torch, segments as torch's caching allocator makes them (torch_segments);
  /// arena, one cudaMalloc holding every tensor; vmm, VMM chunks of vmm_chunk_bytes exportable as
  /// descriptors (copy/vmm.hpp).
  device_memory(const manifest& m, int dev, const char* what, dest_memory how) : dev_(dev) {
    check(cudaSetDevice(dev_), fmt::format("cudaSetDevice({})", dev_));
    std::uint64_t total = 0;
    std::vector<std::uint64_t> offsets;
    for (const auto& e : m.entries) {
      offsets.push_back(total);
      sizes_.push_back(e.meta.nbytes());
      total = align_up(total + sizes_.back(), tensor_alignment);
    }
    std::size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    void* arena = nullptr;
    const auto no_room = [&] {
      return error(errc::cuda, fmt::format("the {} of {} need {:.2f} GB of device memory on GPU {} and "
                                           "{:.2f} GB are free: pick a smaller model or a larger GPU",
                                           what, m.name, total / 1e9, dev_, free_b / 1e9));
    };
    if (how == dest_memory::torch) {
      std::vector<std::uint64_t> segments;
      const auto at = torch_segments(sizes_, segments);
      for (const std::uint64_t n : segments) {
        void* p = nullptr;
        if (cudaMalloc(&p, n) != cudaSuccess) {
          (void)cudaGetLastError();
          throw no_room();  // the segments allocated so far are released with this object's members
        }
        segments_.emplace_back(p);
        check(cudaMemset(p, 0, n), "cudaMemset");
      }
      for (const auto& [segment, offset] : at)
        ptrs_.push_back(static_cast<std::byte*>(segments_[segment].handle()) + offset);
      return;
    }
    if (how == dest_memory::vmm) {
      try {
        chunks_.emplace((std::max<std::uint64_t>(total, 1) + vmm_chunk_bytes - 1) / vmm_chunk_bytes, vmm_chunk_bytes,
                        dev_);
      } catch (const error&) {
        throw no_room();
      }
      arena = chunks_->data();
    } else if (cudaMalloc(&arena, std::max<std::uint64_t>(total, 1)) != cudaSuccess) {
      (void)cudaGetLastError();
      throw no_room();
    } else {
      arena_.reset(arena);
    }
    check(cudaMemset(arena, 0, std::max<std::uint64_t>(total, 1)), "cudaMemset");
    for (const auto off : offsets) ptrs_.push_back(static_cast<std::byte*>(arena) + off);
  }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;

  [[nodiscard]] device where() const noexcept override { return device::cuda(dev_); }
  [[nodiscard]] std::byte* data(std::size_t i) const noexcept override { return ptrs_[i]; }
  [[nodiscard]] std::uint64_t size(std::size_t i) const { return sizes_.at(i); }
  std::uint8_t flip(std::size_t i, std::uint64_t offset, std::uint8_t mask) override {
    std::uint8_t b = 0;
    check(cudaMemcpy(&b, ptrs_.at(i) + offset, 1, cudaMemcpyDeviceToHost), "cudaMemcpy (flip)");
    const std::uint8_t old = b;
    b = static_cast<std::uint8_t>(b ^ mask);
    check(cudaMemcpy(ptrs_.at(i) + offset, &b, 1, cudaMemcpyHostToDevice), "cudaMemcpy (flip)");
    return old;
  }
  [[nodiscard]] std::uint64_t checksum(std::size_t i) const override {
    return copy::checksum(ptrs_.at(i), sizes_.at(i), device::cuda(dev_));
  }
  [[nodiscard]] std::uint64_t checksum(std::size_t i, std::uint64_t offset, std::uint64_t bytes) const override {
    check_bytes(sizes_.at(i), offset, bytes);
    return copy::checksum(ptrs_[i] + offset, bytes, device::cuda(dev_));
  }
  // A strided region (a dim-1 slice) is gathered on the GPU: one cudaMemcpy2D into a scratch buffer.
  [[nodiscard]] std::uint64_t checksum(std::size_t i, const byte_region& r) const override {
    if (r.contiguous()) return checksum(i, r.offset, r.bytes());
    check_region(sizes_.at(i), r);
    check(cudaSetDevice(dev_), fmt::format("cudaSetDevice({})", dev_));
    void* scratch = nullptr;
    check(cudaMalloc(&scratch, r.bytes()), "cudaMalloc (slice scratch)");
    const device_block owned(scratch);
    check(cudaMemcpy2D(scratch, r.width, ptrs_[i] + r.offset, r.pitch, r.width, r.rows, cudaMemcpyDeviceToDevice),
          "cudaMemcpy2D (gathering a slice)");
    return copy::checksum(scratch, r.bytes(), device::cuda(dev_));
  }

 private:
  int dev_;
  device_block arena_;
  std::vector<device_block> segments_;  ///< dest_memory::torch
  std::optional<copy::vmm::local_chunks> chunks_;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::byte*> ptrs_;
};

// Pinned staging for uploads.
struct pinned {
  explicit pinned(std::uint64_t n) : size(n) {
    check(cudaMallocHost(&p, n), "cudaMallocHost (staging)");
    owner.reset(p);
  }
  void* p = nullptr;
  std::uint64_t size;
  unique_handle<void*, cuda::detail::free_host> owner;
};

class cuda_ipc_path final : public transport_path {
 public:
  cuda_ipc_path(int dev, bool vmm_sources, dest_memory dests, std::vector<int> receiver_gpus)
      : dev_(dev), vmm_sources_(vmm_sources), dests_(dests), placement_{dev, std::move(receiver_gpus)} {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      throw error(errc::cuda,
                  "refit-bench: --transport cuda_ipc needs a CUDA device and none is "
                  "visible; use --transport host_shm");
    }
    if (dev_ < 0 || dev_ >= count)
      throw error(errc::invalid_argument,
                  fmt::format("refit-bench: --device {} but {} CUDA devices are visible", dev_, count));
  }
  [[nodiscard]] transport_kind kind() const noexcept override { return transport_kind::cuda_ipc; }
  [[nodiscard]] std::string describe_device() const override {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, dev_), "cudaGetDeviceProperties");
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    std::string s = fmt::format("GPU {}: {} ({:.0f} GiB, sm_{}{}, driver {}.{}, runtime {}.{})", dev_, prop.name,
                                static_cast<double>(prop.totalGlobalMem) / (1ull << 30), prop.major, prop.minor,
                                driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    if (placement_.local()) return s;
    const std::size_t n = placement_.receivers.size();
    std::vector<std::string> where;
    for (const int d : placement_.receivers) {
      const bool ok = cudaGetDeviceProperties(&prop, d) == cudaSuccess;
      where.push_back(fmt::format("GPU {} ({})", d, ok ? prop.name : "?"));
    }
    return fmt::format("{} (streamer); {} receiver{} on {}", s, n, n == 1 ? "" : "s", fmt::join(where, ", "));
  }
  std::unique_ptr<tensor_memory> sources(const manifest& m, std::uint64_t seed,
                                         const std::vector<mapped_file>* files) override {
    auto mem = std::make_unique<device_memory>(m, dev_, "source tensors",
                                               vmm_sources_ ? dest_memory::vmm : dest_memory::arena);
    if (files && !files->empty()) {
      for (std::size_t i = 0; i < m.entries.size(); ++i) {
        const auto& e = m.entries[i];
        const std::byte* src = files->at(static_cast<std::size_t>(e.file)).data() + e.offset;
        if (mem->size(i) != 0)
          check(cudaMemcpy(mem->data(i), src, mem->size(i), cudaMemcpyHostToDevice), "cudaMemcpy (load)");
      }
      return mem;
    }
    constexpr std::uint64_t chunk = 256ull << 20;
    pinned staging(chunk);
    auto* host = static_cast<std::byte*>(staging.p);
    for (std::size_t i = 0; i < m.entries.size(); ++i) {
      const std::uint64_t n = mem->size(i);
      for (std::uint64_t off = 0; off < n; off += chunk) {
        const std::uint64_t len = std::min(chunk, n - off);
        fill_random(host, len, tensor_seed(seed, i), off);
        check(cudaMemcpy(mem->data(i) + off, host, len, cudaMemcpyHostToDevice), "cudaMemcpy (fill)");
      }
    }
    return mem;
  }
  std::unique_ptr<tensor_memory> destinations(const manifest& m) override {
    return std::make_unique<device_memory>(m, dev_, "destination tensors", dests_);
  }
  double measure_ceiling() override { return copy_ceiling(placement_, ceiling_bytes); }
  [[nodiscard]] std::string ceiling_method() const override { return copy_ceiling_method(placement_, ceiling_bytes); }

 private:
  int dev_;
  bool vmm_sources_;
  dest_memory dests_;
  gpu_placement placement_;  ///< the receivers its ceiling is measured to
};

}  // namespace

std::unique_ptr<transport_path> make_cuda_ipc_path(int device, bool vmm_sources, dest_memory dests,
                                                   std::vector<int> receiver_gpus) {
  return std::make_unique<cuda_ipc_path>(device, vmm_sources, dests, std::move(receiver_gpus));
}

#else

std::unique_ptr<transport_path> make_cuda_ipc_path(int /*device*/, bool /*vmm_sources*/, dest_memory /*dests*/,
                                                   std::vector<int> /*receiver_gpus*/) {
  throw error(errc::invalid_argument,
              "refit-bench: the cuda_ipc transport is not built into this bench (refit was built "
              "without CUDA); rebuild with -Dcuda=enabled or use --transport host_shm");
}

#endif

}  // namespace refit::bench
