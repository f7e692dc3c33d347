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

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
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
  const auto gpu =
      refit::delta::cuda::diff(static_cast<std::byte*>(base.handle()), static_cast<const std::byte*>(nxt.handle()), off,
                               span, item, total, static_cast<std::byte*>(out.handle()), 0);
  require(gpu.changes == cpu.changes,
          what + ": device found " + std::to_string(gpu.changes) + " changes, CPU " + std::to_string(cpu.changes));
  require(gpu.terms == cpu.terms, what + ": device terms differ from the CPU's");
  require(download(base.handle(), span) == next, what + ": the device base is not the new span");
  require(download(out.handle(), cpu_patch.size()) == cpu_patch, what + ": the device patch differs from the CPU's");

  // The device apply of that patch onto the old bytes.
  refit::cuda::device_buffer dest(off + span + 1);
  std::vector<std::byte> old_tensor(off + span, std::byte{0});
  std::memcpy(old_tensor.data() + off, old_bytes.data(), span);
  upload(dest.handle(), old_tensor);
  const std::uint64_t terms =
      refit::delta::cuda::apply(static_cast<const std::byte*>(out.handle()), cpu_patch.size(), item, span, off, total,
                                static_cast<std::byte*>(dest.handle()), 0, "t");
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

// ------------------------------------------------------------------ over cuda_ipc (staged)

namespace {

/// Both children's view of the trainer: host bytes of every tensor, stepped deterministically
/// (a seed), so that the receiver knows what each version must be.
struct model_bytes {
  std::vector<refit::tensor_meta> metas{{"embed", refit::dtype::bf16, {300000}},
                                        {"layers.0.q", refit::dtype::bf16, {64, 65}},
                                        {"layers.0.odd", refit::dtype::bf16, {4097}},
                                        {"layers.0.norm", refit::dtype::f32, {1000}},
                                        {"frozen", refit::dtype::bf16, {1000}}};
  std::vector<std::vector<std::byte>> bytes;
  std::mt19937_64 rng{99};
  model_bytes() {
    for (const auto& m : metas) {
      bytes.emplace_back(m.nbytes());
      for (auto& b : bytes.back()) b = static_cast<std::byte>(rng());
    }
  }
  /// ~2 % of the bf16 elements change, every f32 element, "frozen" never.
  void step() {
    for (std::size_t k = 0; k < metas.size(); ++k) {
      if (metas[k].name == "frozen") continue;
      const std::size_t item = refit::itemsize(metas[k].type);
      std::bernoulli_distribution pick(metas[k].type == refit::dtype::f32 ? 1.0 : 0.02);
      for (std::uint64_t i = 0; i < bytes[k].size() / item; ++i)
        if (pick(rng))
          bytes[k][i * item] = static_cast<std::byte>(static_cast<unsigned>(bytes[k][i * item]) + 1 + rng() % 200);
    }
  }
};

/// The model's tensors on the device, one allocation each.
struct device_model {
  std::vector<refit::cuda::device_buffer> buffers;
  explicit device_model(const model_bytes& m) {
    for (const auto& b : m.bytes) buffers.emplace_back(b.size());
  }
  void upload_from(const model_bytes& m) {
    for (std::size_t k = 0; k < buffers.size(); ++k) upload(buffers[k].handle(), m.bytes[k]);
  }
  [[nodiscard]] bool equals(const model_bytes& m) const {
    refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (std::size_t k = 0; k < buffers.size(); ++k)
      if (download(buffers[k].handle(), m.bytes[k].size()) != m.bytes[k]) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("delta versions over cuda_ipc staged buffers are bit-exact after 20 steps and send a fraction of the bytes",
          "[delta][cuda_ipc]") {
  const rt::scoped_endpoint ep;
  const std::string endpoint = ep.name;
  constexpr std::uint64_t last = 21;
  rt::signal_pipe from_rx;
  rt::child rx([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    model_bytes expect_model;
    device_model weights(expect_model);
    refit::receiver_options o;
    o.endpoint = endpoint;
    o.idle_timeout = refit::milliseconds{30000};
    refit::receiver r(o);
    for (std::size_t k = 0; k < expect_model.metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{expect_model.metas[k], weights.buffers[k].handle(), refit::device::cuda(0)});
    from_rx.send("ready");
    std::uint64_t seen = 0;
    const auto start = std::chrono::steady_clock::now();
    while (seen < last) {
      require(std::chrono::steady_clock::now() - start < 120s,
              "receiver: version " + std::to_string(last) + " did not come");
      const auto e = r.serve_one(refit::milliseconds{50});
      require(e != refit::receiver_event::aborted, "receiver: aborted: " + r.last_error());
      if (e != refit::receiver_event::committed) continue;
      ++seen;
      if (seen > 1) expect_model.step();
      require(r.committed_version() == std::optional<std::uint64_t>(seen), "receiver: unexpected version");
      require(weights.equals(expect_model), "receiver: version " + std::to_string(seen) + " is not bit-exact");
    }
    for (auto e = r.serve_one(refit::milliseconds{50}); e != refit::receiver_event::bye;
         e = r.serve_one(refit::milliseconds{50}))
      require(std::chrono::steady_clock::now() - start < 150s, "receiver: no BYE");
  });
  rt::child st([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    model_bytes m;
    device_model tensors(m);
    refit::streamer_options o;
    o.endpoint = endpoint;
    o.transport = refit::transport_kind::cuda_ipc;
    o.direct = false;
    o.buffer_bytes = 256 << 10;
    o.timeout = refit::milliseconds{30000};
    o.delta.enable = true;
    o.delta.memory = refit::delta_memory::device;
    refit::streamer s(o);
    std::vector<refit::tensor_ref> refs;
    for (std::size_t k = 0; k < m.metas.size(); ++k)
      refs.push_back(refit::tensor_ref{m.metas[k], tensors.buffers[k].handle(), refit::device::cuda(0), nullptr});
    for (std::uint64_t v = 1; v <= last; ++v) {
      if (v > 1) m.step();
      tensors.upload_from(m);
      const auto stats = s.refit(v, refs);
      require(stats.delta == (v > 1),
              "streamer: version " + std::to_string(v) + (v > 1 ? " was not" : " was") + " a delta");
      if (v > 1)
        require(stats.bytes < stats.tensor_bytes / 4,
                "streamer: a delta sent " + std::to_string(stats.bytes) + " bytes");
    }
    s.close();
  });
  CHECK(from_rx.receive(60s) == "ready");
  CHECK(st.wait(180s) == 0);
  CHECK(rx.wait(180s) == 0);
}

#endif
