#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <vector>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "delta/device.hpp"
#include "delta/diff_kernel.hpp"
#include "refit/error.hpp"

namespace refit::delta::cuda {
namespace {

cudaStream_t as_stream(void* s) noexcept { return static_cast<cudaStream_t>(s); }

}  // namespace

struct workspace::impl {
  refit::cuda::device_buffer terms{sizeof(unsigned long long)};
  std::array<refit::cuda::device_buffer, 4> slots;
  std::vector<std::uint64_t> first_chunk;  ///< per span of the last count(): its first chunk's slot index
  std::vector<std::uint64_t> changes;      ///< per span of the last count(): its changed elements
};

workspace::workspace(int device) : device_(device) {
  device_guard guard(device);
  impl_ = new impl;
  check_cuda(cudaMemset(impl_->terms.handle(), 0, sizeof(unsigned long long)), "delta workspace: cudaMemset");
}

workspace::~workspace() {
  try {
    device_guard guard(device_);
    delete impl_;
  } catch (...) {
    delete impl_;
  }
}

unsigned long long* workspace::terms() noexcept { return static_cast<unsigned long long*>(impl_->terms.handle()); }

std::uint64_t workspace::take_terms(void* stream) {
  device_guard guard(device_);
  unsigned long long t = 0;
  check_cuda(cudaMemcpyAsync(&t, terms(), sizeof t, cudaMemcpyDeviceToHost, as_stream(stream)), "delta: reading terms");
  check_cuda(cudaMemsetAsync(terms(), 0, sizeof t, as_stream(stream)), "delta: zeroing terms");
  check_cuda(cudaStreamSynchronize(as_stream(stream)), "delta: cudaStreamSynchronize");
  return t;
}

void* workspace::scratch(int slot, std::uint64_t bytes) {
  auto& b = impl_->slots.at(static_cast<std::size_t>(slot));
  if (b.bytes() < bytes) {
    device_guard guard(device_);
    b = refit::cuda::device_buffer(std::max<std::uint64_t>(bytes, 256));
  }
  return b.handle();
}

std::vector<std::uint64_t> count(const std::byte* base, const std::byte* next, std::uint64_t total, std::uint64_t span,
                                 std::size_t item, workspace& ws, void* stream) {
  device_guard guard(ws.device());
  std::vector<std::uint64_t> changes;
  std::vector<std::uint64_t> first_chunk;
  std::uint64_t chunks = 0;
  for (std::uint64_t off = 0; off < total; off += span) {
    first_chunk.push_back(chunks);
    chunks += (std::min(span, total - off) / item + kernel::chunk_elements - 1) / kernel::chunk_elements;
  }
  auto* counts = static_cast<std::uint32_t*>(ws.scratch(0, (chunks + 1) * 4));
  for (std::uint64_t k = 0, off = 0; off < total; off += span, ++k) {
    const std::uint64_t elements = std::min(span, total - off) / item;
    const std::uint64_t n = (k + 1 < first_chunk.size() ? first_chunk[k + 1] : chunks) - first_chunk[k];
    check_cuda(kernel::launch_count(base + off, next + off, elements, static_cast<int>(item), counts + first_chunk[k],
                                    n, as_stream(stream)),
               "delta count kernel launch");
  }
  std::vector<std::uint32_t> host(chunks);
  if (chunks != 0)
    check_cuda(cudaMemcpyAsync(host.data(), counts, chunks * 4, cudaMemcpyDeviceToHost, as_stream(stream)),
               "delta: reading the counts");
  check_cuda(cudaStreamSynchronize(as_stream(stream)), "delta: cudaStreamSynchronize");
  // Each chunk's first slot, counted from its span's start.
  for (std::size_t k = 0; k < first_chunk.size(); ++k) {
    const std::uint64_t end = k + 1 < first_chunk.size() ? first_chunk[k + 1] : chunks;
    std::uint64_t sum = 0;
    for (std::uint64_t b = first_chunk[k]; b < end; ++b) {
      const std::uint32_t c = host[b];
      host[b] = static_cast<std::uint32_t>(sum);
      sum += c;
    }
    changes.push_back(sum);
  }
  auto* firsts = static_cast<std::uint32_t*>(ws.scratch(1, (chunks + 1) * 4));
  if (chunks != 0)  // from pageable memory: copied before the call returns
    check_cuda(cudaMemcpy(firsts, host.data(), chunks * 4, cudaMemcpyHostToDevice), "delta: writing the slots");
  ws.state().first_chunk = std::move(first_chunk);
  ws.state().changes = changes;
  return changes;
}

void write(std::byte* base, const std::byte* next, std::uint64_t total, std::uint64_t span, std::size_t item,
           std::size_t k, std::byte* out, std::uint64_t weight, workspace& ws, void* stream) {
  device_guard guard(ws.device());
  const auto& first_chunk = ws.state().first_chunk;
  const std::uint64_t off = k * span;
  const std::uint64_t elements = std::min(span, total - off) / item;
  const std::uint64_t chunks = (elements + kernel::chunk_elements - 1) / kernel::chunk_elements;
  const auto* firsts = static_cast<const std::uint32_t*>(ws.scratch(1, 0)) + first_chunk.at(k);
  // The patch's values follow its indices: its size is the span's count, which the caller placed.
  std::uint32_t* indices = nullptr;
  std::byte* values = nullptr;
  if (out != nullptr) {
    const std::uint64_t n = ws.state().changes.at(k);
    indices = reinterpret_cast<std::uint32_t*>(out);
    values = out + 4 * n;
  }
  check_cuda(kernel::launch_write(base + off, next + off, elements, static_cast<int>(item), firsts, chunks, indices,
                                  values, off, total, weight, ws.terms(), as_stream(stream)),
             "delta write kernel launch");
}

void check(std::span<const patch_ref> patches, workspace& ws, void* stream) {
  if (patches.empty()) return;
  device_guard guard(ws.device());
  auto* bad = static_cast<unsigned int*>(ws.scratch(3, patches.size() * sizeof(unsigned int)));
  check_cuda(cudaMemsetAsync(bad, 0, patches.size() * sizeof(unsigned int), as_stream(stream)), "delta: cudaMemset");
  for (std::size_t k = 0; k < patches.size(); ++k) {
    const patch_ref& p = patches[k];
    if (p.bytes % record_bytes(p.item) != 0)
      throw error(errc::apply, fmt::format("the patch of '{}' has {} bytes, not whole {}-byte records", p.name, p.bytes,
                                           record_bytes(p.item)));
    check_cuda(kernel::launch_check(reinterpret_cast<const std::uint32_t*>(p.data), p.bytes / record_bytes(p.item),
                                    p.span / p.item, bad + k, as_stream(stream)),
               "delta check kernel launch");
  }
  std::vector<unsigned int> host(patches.size());
  check_cuda(
      cudaMemcpyAsync(host.data(), bad, host.size() * sizeof(unsigned int), cudaMemcpyDeviceToHost, as_stream(stream)),
      "delta: reading the checks");
  check_cuda(cudaStreamSynchronize(as_stream(stream)), "delta: cudaStreamSynchronize");
  for (std::size_t k = 0; k < patches.size(); ++k)
    if (host[k] != 0)
      throw error(errc::apply, fmt::format("the patch of '{}' is corrupt: an index is out of its span of {} elements "
                                           "or not after the one before; nothing of its batch was written",
                                           patches[k].name, patches[k].span / patches[k].item));
}

void apply(const patch_ref& patch, std::uint64_t off, std::uint64_t total, std::byte* dest, std::uint64_t weight,
           workspace& ws, void* stream) {
  const std::uint64_t n = patch.bytes / record_bytes(patch.item);
  if (n == 0) return;
  device_guard guard(ws.device());
  check_cuda(
      kernel::launch_apply(reinterpret_cast<const std::uint32_t*>(patch.data), patch.data + 4 * n, n,
                           static_cast<int>(patch.item), dest, off, total, weight, ws.terms(), as_stream(stream)),
      "delta apply kernel launch");
}

void add_range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total, std::uint64_t weight,
                     bool negate, workspace& ws, void* stream) {
  device_guard guard(ws.device());
  check_cuda(kernel::launch_range_terms(p, off, n, total, weight, negate, ws.terms(), as_stream(stream)),
             "delta range-terms kernel launch");
}

diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::byte* out, int device) {
  // One span of a tensor whose byte `off` it starts at: shift the pointers so that the span is span 0
  // of a "tensor" of off + span bytes, whose terms are those of the real tensor (the terms depend
  // on the byte's position and on `total`, which the kernels take as given).
  workspace ws(device);
  diff_result r;
  if (span / item == 0) return r;
  device_guard guard(device);
  const auto changes = count(base, next, span, span, item, ws, nullptr);
  r.changes = changes.at(0);
  ws.state().changes = changes;
  const std::uint64_t elements = span / item;
  const std::uint64_t chunks = (elements + kernel::chunk_elements - 1) / kernel::chunk_elements;
  const auto* firsts = static_cast<const std::uint32_t*>(ws.scratch(1, 0));
  check_cuda(kernel::launch_write(base, next, elements, static_cast<int>(item), firsts, chunks,
                                  r.changes != 0 ? reinterpret_cast<std::uint32_t*>(out) : nullptr,
                                  r.changes != 0 ? out + 4 * r.changes : nullptr, off, total, 1, ws.terms(), nullptr),
             "delta write kernel launch");
  r.terms = ws.take_terms(nullptr);
  return r;
}

std::uint64_t apply(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                    std::uint64_t off, std::uint64_t total, std::byte* dest, int device, std::string_view name) {
  workspace ws(device);
  const patch_ref p{patch, bytes, item, span, std::string(name)};
  check({&p, 1}, ws, nullptr);
  apply(p, off, total, dest, 1, ws, nullptr);
  return ws.take_terms(nullptr);
}

}  // namespace refit::delta::cuda

namespace refit::delta::cuda {
void copy_sync(void* dst, const void* src, std::uint64_t bytes, int device) {
  if (bytes == 0) return;
  device_guard guard(device);
  check_cuda(cudaDeviceSynchronize(), "delta: cudaDeviceSynchronize before copying into the base");
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "delta: copying a tensor into the base");
}
}  // namespace refit::delta::cuda
