#include "delta/base.hpp"

#include <fmt/format.h>

#include <new>

#include "config/config.hpp"
#include "refit/error.hpp"
#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace refit::delta {

base_store::base_store(memory where, std::uint64_t max_bytes, int device)
    : where_(where), max_bytes_(max_bytes), device_(device) {
#if !REFIT_HAVE_CUDA
  if (where == memory::device)
    throw error(errc::invalid_argument, "a delta base in device memory needs a build with CUDA; use host memory");
#endif
}

base_store::~base_store() { clear(); }

void base_store::clear() noexcept {
  tensors_.clear();
  owned_.clear();
  bytes_ = 0;
  version_.reset();
}

device base_store::dev() const noexcept { return where_ == memory::device ? device::cuda(device_) : device::cpu(); }

void base_store::freer::operator()(std::byte* p) const noexcept {
#if REFIT_HAVE_CUDA
  if (where == memory::device) {
    (void)cudaFree(p);
    return;
  }
  if (pinned) {
    (void)cudaFreeHost(p);
    return;
  }
#endif
  ::operator delete[](p, std::align_val_t{256});
}

std::byte* base_store::allocate(std::uint64_t bytes, bool& pinned) {
  const std::uint64_t n = bytes == 0 ? 1 : bytes;
  pinned = false;
#if REFIT_HAVE_CUDA
  void* p = nullptr;
  const cudaError_t rc = where_ == memory::device ? (cudaSetDevice(device_), cudaMalloc(&p, n))
                                                  : cudaHostAlloc(&p, n, cudaHostAllocDefault);
  if (rc == cudaSuccess) {
    pinned = where_ == memory::host;
    return static_cast<std::byte*>(p);
  }
  (void)cudaGetLastError();
  // A host base on a machine without a usable driver (a CUDA build on a CPU-only host): plain
  // memory serves the CPU diff as well; only a GPU diff wants it page-locked.
  if (where_ == memory::device || (rc != cudaErrorInsufficientDriver && rc != cudaErrorNoDevice))
    throw error(errc::cuda, fmt::format("cannot allocate {} bytes of {} memory for the delta base: {}", n,
                                        where_ == memory::device ? "device" : "page-locked host",
                                        cudaGetErrorString(rc)));
#endif
  return static_cast<std::byte*>(::operator new[](n, std::align_val_t{256}));
}

base_store::tensor* base_store::find(const std::string& name) noexcept {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

base_store::tensor* base_store::place(const tensor_meta& meta) {
  const std::uint64_t bytes = meta.nbytes();
  if (tensor* t = find(meta.name); t != nullptr && t->bytes == bytes) {
    t->meta = meta;
    return t;
  }
  std::uint64_t old = 0;
  if (tensor* t = find(meta.name)) old = t->bytes;
  if (bytes_ - old + bytes > max_bytes_) return nullptr;
  bool pinned = false;
  std::byte* data = allocate(bytes, pinned);
  auto owner = std::unique_ptr<std::byte, freer>(data, freer{where_, pinned});
  tensor t{meta, bytes, owner.get()};
  owned_.insert_or_assign(meta.name, std::move(owner));
  bytes_ = bytes_ - old + bytes;
  return &tensors_.insert_or_assign(meta.name, std::move(t)).first->second;
}

}  // namespace refit::delta
