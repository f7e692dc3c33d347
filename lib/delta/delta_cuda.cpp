#include <fmt/format.h>

#include <vector>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "delta/device.hpp"
#include "delta/diff_kernel.hpp"
#include "refit/error.hpp"

namespace refit::delta::cuda {

diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::byte* out, int device) {
  diff_result r;
  const std::uint64_t elements = span / item;
  if (elements == 0) return r;
  device_guard guard(device);
  const std::uint64_t chunks = (elements + kernel::chunk_elements - 1) / kernel::chunk_elements;
  refit::cuda::device_buffer counts(chunks * sizeof(std::uint32_t));
  refit::cuda::device_buffer firsts(chunks * sizeof(std::uint32_t));
  refit::cuda::device_buffer terms(sizeof(unsigned long long));
  const int it = static_cast<int>(item);
  check_cuda(kernel::launch_count(base, next, elements, it, static_cast<std::uint32_t*>(counts.handle()), chunks, nullptr),
             "delta count kernel launch");
  std::vector<std::uint32_t> host(chunks);
  check_cuda(cudaMemcpy(host.data(), counts.handle(), chunks * sizeof(std::uint32_t), cudaMemcpyDeviceToHost),
             "delta diff: reading the counts");
  for (std::uint64_t b = 0; b < chunks; ++b) {  // exclusive prefix sum: each chunk's first slot
    const std::uint32_t c = host[b];
    host[b] = static_cast<std::uint32_t>(r.changes);
    r.changes += c;
  }
  if (r.changes == 0) return r;
  check_cuda(cudaMemcpy(firsts.handle(), host.data(), chunks * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
             "delta diff: writing the slots");
  check_cuda(cudaMemset(terms.handle(), 0, sizeof(unsigned long long)), "delta diff: cudaMemset(terms)");
  auto* indices = reinterpret_cast<std::uint32_t*>(out);
  check_cuda(kernel::launch_write(base, next, elements, it, static_cast<const std::uint32_t*>(firsts.handle()), chunks,
                                  indices, out + 4 * r.changes, off, total,
                                  static_cast<unsigned long long*>(terms.handle()), nullptr),
             "delta write kernel launch");
  unsigned long long t = 0;
  check_cuda(cudaMemcpy(&t, terms.handle(), sizeof t, cudaMemcpyDeviceToHost), "delta diff: reading the terms");
  r.terms = t;
  return r;
}

std::uint64_t apply(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                    std::uint64_t off, std::uint64_t total, std::byte* dest, int device, std::string_view name) {
  if (bytes % record_bytes(item) != 0)
    throw error(errc::apply, fmt::format("the patch of '{}' has {} bytes, not whole {}-byte records", name, bytes,
                                         record_bytes(item)));
  const std::uint64_t n = bytes / record_bytes(item);
  if (n == 0) return 0;
  device_guard guard(device);
  refit::cuda::device_buffer flags(sizeof(unsigned int) + sizeof(unsigned long long) * 2);
  auto* bad = static_cast<unsigned int*>(flags.handle());
  auto* terms = reinterpret_cast<unsigned long long*>(static_cast<std::byte*>(flags.handle()) + 8);
  check_cuda(cudaMemset(flags.handle(), 0, flags.bytes()), "delta apply: cudaMemset");
  const auto* indices = reinterpret_cast<const std::uint32_t*>(patch);
  check_cuda(kernel::launch_check(indices, n, span / item, bad, nullptr), "delta check kernel launch");
  unsigned int h = 0;
  check_cuda(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost), "delta apply: reading the check");
  if (h != 0)
    throw error(errc::apply, fmt::format("the patch of '{}' is corrupt: an index is out of its span of {} elements or "
                                         "not after the one before; nothing of it was written",
                                         name, span / item));
  check_cuda(kernel::launch_apply(indices, patch + 4 * n, n, static_cast<int>(item), dest, off, total, terms, nullptr),
             "delta apply kernel launch");
  unsigned long long t = 0;
  check_cuda(cudaMemcpy(&t, terms, sizeof t, cudaMemcpyDeviceToHost), "delta apply: reading the terms");
  return t;
}

}  // namespace refit::delta::cuda
