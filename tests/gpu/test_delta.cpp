// GPU tests of the delta kernels (lib/delta/diff_kernel.cu): the device diff makes the same patch,
// base and checksum terms as the CPU diff (lib/delta/patch.cpp), the device apply rebuilds the new
// version with the same terms, and a corrupt patch is refused before anything is written. All CUDA
// work runs in a child process (see test_cuda_ipc.cpp), which throws to fail.
#include <catch2/catch.hpp>

#include "config/config.hpp"

#if !REFIT_HAVE_CUDA

TEST_CASE("the delta kernels are not built: their GPU tests are skipped", "[delta]") {
  WARN("refit was built without CUDA: the [delta] GPU tests did not run");
}

#else

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "delta/device.hpp"
#include "delta/patch.hpp"
#include "refit/error.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

std::vector<std::byte> download(const void* p, std::uint64_t n) {
  std::vector<std::byte> out(n);
  if (n != 0) refit::check_cuda(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), "download");
  return out;
}

void upload(void* p, const std::vector<std::byte>& v) {
  if (!v.empty()) refit::check_cuda(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice), "upload");
}

/// One case: `elements` of `item` bytes, a fraction `changed` of them different, at tensor byte `off`
/// of a tensor of `total` bytes.
void check_case(std::mt19937_64& rng, std::size_t item, std::uint64_t elements, double changed, std::uint64_t off,
                std::uint64_t total) {
  const std::string what = "item " + std::to_string(item) + ", " + std::to_string(elements) + " elements, " +
                           std::to_string(changed) + " changed, at " + std::to_string(off);
  const std::uint64_t span = elements * item;
  std::vector<std::byte> old_bytes(span), next(span);
  for (auto& b : old_bytes) b = static_cast<std::byte>(rng());
  next = old_bytes;
  std::bernoulli_distribution pick(changed);
  for (std::uint64_t i = 0; i < elements; ++i)
    if (pick(rng)) next[i * item] = static_cast<std::byte>(static_cast<unsigned>(next[i * item]) + 1 + rng() % 250);

  // The CPU's patch, base and terms.
  std::vector<std::byte> cpu_base = old_bytes;
  std::vector<std::uint32_t> idx(elements + 1);
  std::vector<std::byte> values(span + 1);
  const auto cpu = refit::delta::diff(cpu_base.data(), next.data(), off, span, item, total, idx.data(), values.data());
  std::vector<std::byte> cpu_patch(cpu.changes * refit::delta::record_bytes(item));
  std::memcpy(cpu_patch.data(), idx.data(), 4 * cpu.changes);
  std::memcpy(cpu_patch.data() + 4 * cpu.changes, values.data(), cpu.changes * item);

  // The device's.
  refit::cuda::device_buffer base(span + 1), nxt(span + 1), out(elements * refit::delta::record_bytes(item) + 1);
  upload(base.handle(), old_bytes);
  upload(nxt.handle(), next);
  const auto gpu = refit::delta::cuda::diff(static_cast<std::byte*>(base.handle()), static_cast<const std::byte*>(nxt.handle()),
                                            off, span, item, total, static_cast<std::byte*>(out.handle()), 0);
  require(gpu.changes == cpu.changes, what + ": device found " + std::to_string(gpu.changes) + " changes, CPU " +
                                          std::to_string(cpu.changes));
  require(gpu.terms == cpu.terms, what + ": device terms differ from the CPU's");
  require(download(base.handle(), span) == next, what + ": the device base is not the new span");
  require(download(out.handle(), cpu_patch.size()) == cpu_patch, what + ": the device patch differs from the CPU's");

  // The device apply of that patch onto the old bytes.
  refit::cuda::device_buffer dest(off + span + 1);
  std::vector<std::byte> old_tensor(off + span, std::byte{0});
  std::memcpy(old_tensor.data() + off, old_bytes.data(), span);
  upload(dest.handle(), old_tensor);
  const std::uint64_t terms = refit::delta::cuda::apply(static_cast<const std::byte*>(out.handle()), cpu_patch.size(),
                                                        item, span, off, total, static_cast<std::byte*>(dest.handle()),
                                                        0, "t");
  require(terms == cpu.terms, what + ": device apply terms differ");
  const auto applied = download(dest.handle(), off + span);
  require(std::equal(applied.begin() + static_cast<std::ptrdiff_t>(off), applied.end(), next.begin()),
          what + ": the device apply did not rebuild the new span");
}

}  // namespace

TEST_CASE("the device diff makes the CPU's patch, base and checksum terms, and the device apply rebuilds the span",
          "[delta]") {
  rt::child c([] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    std::mt19937_64 rng(16);
    for (const std::size_t item : {1u, 2u, 4u, 8u}) {
      check_case(rng, item, 1, 1.0, 0, item);
      check_case(rng, item, 3000, 0.02, 0, 3000 * item + 5);                  // a tail after the span
      check_case(rng, item, (1u << 20) + 17, 0.02, 4096, (2u << 20) * item);  // many chunks, an offset
      check_case(rng, item, 100000, 0.0, 0, 100000 * item);                   // nothing changed
      check_case(rng, item, 100000, 1.0, 256, 100256 * item);                 // everything changed
    }
    // A span that ends in the checksum's tail bytes (a tensor of 8 k + 6 bytes).
    check_case(rng, 2, 4099, 0.5, 0, 8198);
  });
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("the device apply refuses a corrupt patch before writing anything", "[delta]") {
  rt::child c([] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    std::vector<std::byte> patch(3 * 6);
    const auto set_index = [&](int k, std::uint32_t i) { std::memcpy(patch.data() + 4 * k, &i, 4); };
    set_index(0, 1), set_index(1, 9), set_index(2, 5);  // not increasing
    refit::cuda::device_buffer p(patch.size()), dest(64);
    upload(p.handle(), patch);
    const std::vector<std::byte> before(64, std::byte{0x5a});
    upload(dest.handle(), before);
    bool refused = false;
    try {
      (void)refit::delta::cuda::apply(static_cast<const std::byte*>(p.handle()), patch.size(), 2, 64, 0, 64,
                                      static_cast<std::byte*>(dest.handle()), 0, "w");
    } catch (const refit::error& e) {
      refused = e.code() == refit::errc::apply && std::string(e.what()).find("'w' is corrupt") != std::string::npos;
    }
    require(refused, "a patch with decreasing indices was not refused with errc::apply");
    require(download(dest.handle(), 64) == before, "a refused patch wrote");
    set_index(1, 3), set_index(2, 32);  // 32 is outside a span of 32 elements
    upload(p.handle(), patch);
    refused = false;
    try {
      (void)refit::delta::cuda::apply(static_cast<const std::byte*>(p.handle()), patch.size(), 2, 64, 0, 64,
                                      static_cast<std::byte*>(dest.handle()), 0, "w");
    } catch (const refit::error& e) {
      refused = e.code() == refit::errc::apply;
    }
    require(refused, "a patch with an index outside its span was not refused");
    require(download(dest.handle(), 64) == before, "a refused patch wrote");
  });
  CHECK(c.wait(120s) == 0);
}

#endif
