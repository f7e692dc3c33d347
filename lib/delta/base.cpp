#include "delta/base.hpp"

#include <fmt/format.h>

#include <algorithm>
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
  slabs_.clear();
  open_ = false;
  bytes_ = 0;
  reserved_ = 0;
  abandoned_ = 0;
  version_.reset();
}

device base_store::dev() const noexcept { return where_ == memory::device ? device::cuda(device_) : device::cpu(); }

void base_store::freer::operator()(std::byte* p) const noexcept {
#if REFIT_HAVE_CUDA
  if (how == allocator::device) {
    (void)cudaFree(p);
    return;
  }
  if (how == allocator::pinned) {
    (void)cudaFreeHost(p);
    return;
  }
#endif
  ::operator delete[](p, std::align_val_t{256});
}

std::unique_ptr<std::byte, base_store::freer> base_store::allocate(std::uint64_t bytes) {
  const std::uint64_t n = bytes == 0 ? 1 : bytes;
#if REFIT_HAVE_CUDA
  void* p = nullptr;
  if (where_ == memory::device) {
    cudaError_t rc = cudaSetDevice(device_);
    if (rc == cudaSuccess) rc = cudaMalloc(&p, n);
    if (rc != cudaSuccess)
      throw error(errc::cuda, fmt::format("cannot allocate {} bytes of cuda:{} memory for the delta base: {}", n,
                                          device_, cudaGetErrorString(rc)));
    return {static_cast<std::byte*>(p),
            freer{allocator::device, refit::memory::charge(refit::memory::kind::device, n)}};
  }
  // Page-locked, so that a GPU diff reads it directly; plain memory where CUDA cannot (no device).
  if (cudaHostAlloc(&p, n, cudaHostAllocDefault) == cudaSuccess)
    return {static_cast<std::byte*>(p),
            freer{allocator::pinned, refit::memory::charge(refit::memory::kind::pinned, n)}};
  (void)cudaGetLastError();
#endif
  return {static_cast<std::byte*>(::operator new[](n, std::align_val_t{256})),
          freer{allocator::plain, refit::memory::charge(refit::memory::kind::host, n)}};
}

base_store::tensor* base_store::find(const std::string& name) noexcept {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

namespace {
constexpr std::uint64_t align = 256;
constexpr std::uint64_t largest_slab = 256ull << 20;
constexpr std::uint64_t own_from = 64ull << 20;  ///< tensors this large are allocated alone
}  // namespace

std::byte* base_store::carve(std::uint64_t bytes) {
  const std::uint64_t n = (std::max<std::uint64_t>(bytes, 1) + align - 1) / align * align;
  if (n >= own_from) {
    // Its own allocation, slotted before the open slab (which stays open).
    slab own{allocate(n), n, n};
    std::byte* p = own.memory.get();
    reserved_ += n;
    slabs_.insert(open_ ? slabs_.end() - 1 : slabs_.end(), std::move(own));
    return p;
  }
  if (!open_ || slabs_.back().size - slabs_.back().used < n) {
    // Slabs grow with the base (4 MiB, then as much as is reserved already, up to 256 MiB): a small
    // model's base stays small, a large one's takes few allocations.
    const std::uint64_t size = std::max(n, std::clamp<std::uint64_t>(reserved_, 4ull << 20, largest_slab));
    slabs_.push_back(slab{allocate(size), size, 0});
    reserved_ += size;
    open_ = true;
  }
  slab& s = slabs_.back();
  std::byte* p = s.memory.get() + s.used;
  s.used += n;
  return p;
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
  tensor t{meta, bytes, carve(bytes)};
  abandoned_ += old;
  bytes_ = bytes_ - old + bytes;
  return &tensors_.insert_or_assign(meta.name, std::move(t)).first->second;
}

}  // namespace refit::delta
