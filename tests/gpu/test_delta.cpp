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
#include <signal.h>
#include <unistd.h>

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
#include "delta/checksum.hpp"
#include "delta/device.hpp"
#include "delta/patch.hpp"
#include "refit/error.hpp"
#include "refit/version.hpp"
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

// ------------------------------------------------------------------ a group of tensors at once

namespace {

/// One tensor of a group: `elements` of `item` bytes; span k of it changes a fraction `changed` of
/// its elements, or with `mixed` a fraction changed, none, every one as k % 3 is 0, 1, 2.
struct group_spec {
  std::size_t item;
  std::uint64_t elements;
  double changed;
  bool mixed = false;
};

/// The CPU's view of one tensor of the group, and its device copies.
struct group_tensor {
  group_spec spec;
  std::vector<std::byte> base, next;
  refit::cuda::device_buffer device_base, device_next;
  [[nodiscard]] std::uint64_t total() const { return spec.elements * spec.item; }
};

/// Where the first difference between `got` and `want` (a patch of `n` records of `item` bytes)
/// lies: which record's index or value.
std::string first_difference(const std::vector<std::byte>& got, const std::vector<std::byte>& want, std::uint64_t n,
                             std::size_t item) {
  std::uint64_t b = 0;
  while (b < got.size() && b < want.size() && got[b] == want[b]) ++b;
  const auto word = [&](const std::vector<std::byte>& v, std::uint64_t at, std::size_t len) {
    std::uint64_t x = 0;
    for (std::size_t k = 0; k < len && at + k < v.size(); ++k)
      x |= std::to_integer<std::uint64_t>(v[at + k]) << (8 * k);
    return std::to_string(x);
  };
  if (b < 4 * n)
    return "index of record " + std::to_string(b / 4) + ": device " + word(got, b / 4 * 4, 4) + ", CPU " +
           word(want, b / 4 * 4, 4);
  const std::uint64_t r = (b - 4 * n) / item;
  return "value of record " + std::to_string(r) + " (CPU index " + word(want, 4 * r, 4) + "): device " +
         word(got, 4 * n + r * item, item) + ", CPU " + word(want, 4 * n + r * item, item);
}

/// Steps every tensor of the group (its spec's fractions), diffs the group on the device with one
/// count() and a write() per span (spans whose records would not be smaller than the span get no
/// output, as the streamer sends them as bytes), and compares each span's count and patch, each
/// base and the weighted terms with the CPU diff (delta::diff), span by span.
void check_group(std::mt19937_64& rng, std::vector<group_tensor>& tensors, std::uint64_t span,
                 refit::delta::cuda::workspace& ws, cudaStream_t stream, const std::string& round) {
  // Step the new bytes (the base is the last round's new bytes, or the start).
  for (group_tensor& t : tensors) {
    const std::uint64_t per_span = span / t.spec.item;
    for (std::uint64_t i = 0; i < t.spec.elements; ++i) {
      double f = t.spec.changed;
      if (t.spec.mixed) f = (i / per_span) % 3 == 0 ? t.spec.changed : ((i / per_span) % 3 == 1 ? 0.0 : 1.0);
      if (f > 0 && std::bernoulli_distribution(f)(rng))
        t.next[i * t.spec.item] =
            static_cast<std::byte>(std::to_integer<unsigned>(t.next[i * t.spec.item]) + 1 + rng() % 250);
    }
    upload(t.device_next.handle(), t.next);
  }
  std::vector<refit::delta::cuda::diff_tensor> diffs;
  for (group_tensor& t : tensors)
    diffs.push_back(refit::delta::cuda::diff_tensor{static_cast<std::byte*>(t.device_base.handle()),
                                                    static_cast<const std::byte*>(t.device_next.handle()), t.total(),
                                                    t.spec.item});
  refit::delta::cuda::count(diffs, span, ws, stream);

  // The CPU's patches; the device's counts against them; each patch placed after the last, at a
  // multiple of 4 only (the indices' alignment), as a packed batch could place them.
  struct placed {
    std::size_t tensor;
    std::size_t k;
    std::uint64_t at;
    std::uint64_t n;
    std::vector<std::byte> patch;
  };
  std::vector<placed> patches;
  std::uint64_t out_bytes = 0;
  std::uint64_t terms = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    group_tensor& t = tensors[i];
    const std::size_t item = t.spec.item;
    const std::uint64_t total = t.total();
    const std::uint64_t weight = refit::delta::name_weight("t" + std::to_string(i));
    const std::string what = round + ", tensor " + std::to_string(i) + " (item " + std::to_string(item) + ", " +
                             std::to_string(t.spec.elements) + " elements)";
    const auto changes = ws.changes(i);
    require(changes.size() == (total + span - 1) / span, what + ": " + std::to_string(changes.size()) + " spans");
    std::vector<std::uint32_t> idx(span / item + 1);
    std::vector<std::byte> values(span + 8);
    for (std::uint64_t k = 0, off = 0; off < total; off += span, ++k) {
      const std::uint64_t n = std::min(span, total - off);
      const auto cpu =
          refit::delta::diff(t.base.data() + off, t.next.data() + off, off, n, item, total, idx.data(), values.data());
      terms += weight * cpu.terms;
      require(changes[k] == cpu.changes, what + ", span " + std::to_string(k) + ": device counted " +
                                             std::to_string(changes[k]) + " changes, CPU " +
                                             std::to_string(cpu.changes));
      const std::uint64_t bytes = cpu.changes * refit::delta::record_bytes(item);
      if (bytes >= n) {  // sent as bytes: only the base and the terms
        refit::delta::cuda::write(i, k, nullptr, weight, ws, stream);
        continue;
      }
      placed p{i, k, out_bytes, cpu.changes, std::vector<std::byte>(bytes)};
      std::memcpy(p.patch.data(), idx.data(), 4 * cpu.changes);
      std::memcpy(p.patch.data() + 4 * cpu.changes, values.data(), cpu.changes * item);
      out_bytes += (bytes + 3) / 4 * 4;
      patches.push_back(std::move(p));
    }
  }
  refit::cuda::device_buffer out(out_bytes + 8);
  for (const placed& p : patches) {
    if (p.n == 0) continue;  // the streamer writes nothing for a span without changes
    refit::delta::cuda::write(p.tensor, p.k, static_cast<std::byte*>(out.handle()) + p.at,
                              refit::delta::name_weight("t" + std::to_string(p.tensor)), ws, stream);
  }
  const std::uint64_t device_terms = ws.take_terms(stream);  // waits for the stream

  const auto got = download(out.handle(), out_bytes);
  for (const placed& p : patches) {
    const std::vector<std::byte> mine(got.begin() + static_cast<std::ptrdiff_t>(p.at),
                                      got.begin() + static_cast<std::ptrdiff_t>(p.at + p.patch.size()));
    require(mine == p.patch, round + ", tensor " + std::to_string(p.tensor) + ", span " + std::to_string(p.k) +
                                 ": the device patch differs from the CPU's at the " +
                                 first_difference(mine, p.patch, p.n, tensors[p.tensor].spec.item));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    group_tensor& t = tensors[i];
    const auto b = download(t.device_base.handle(), t.total());
    std::uint64_t e = 0;
    while (e < t.spec.elements &&
           std::memcmp(b.data() + e * t.spec.item, t.next.data() + e * t.spec.item, t.spec.item) == 0)
      ++e;
    require(e == t.spec.elements, round + ", tensor " + std::to_string(i) +
                                      ": the device base is not the new "
                                      "version at element " +
                                      std::to_string(e) + " (span " + std::to_string(e * t.spec.item / span) + ")");
    t.base = t.next;  // what the CPU diff made of its base
  }
  require(device_terms == terms, round + ": the device's weighted terms differ from the CPU's");
}

}  // namespace

TEST_CASE("one batched device diff of a group of tensors makes the CPU's patches, bases and terms, span by span",
          "[delta]") {
  rt::child c([] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    std::mt19937_64 rng(1616);
    const std::vector<group_spec> specs{
        {2, 1, 1.0},              // one element, changed
        {8, 1, 0.0},              // one element, unchanged
        {2, 0, 0.0},              // no elements: no spans
        {2, 300000, 0.02},        // bf16 at 2 %
        {4, 70001, 1.0},          // every element (fp32 weights)
        {1, 1u << 20, 0.02},      // many chunks per span
        {2, 4099, 0.5},           // ends in the checksum's tail bytes
        {8, 33333, 0.0},          // nothing changed
        {4, 200000, 0.02, true},  // spans of 2 %, none and all
        {2, 2048 * 3, 0.3},       // whole chunks
        {1, 777, 0.02, true},
        {1, (16u << 20) + 4097, 0.01},  // a largest span of 8192 chunks (two tiles of the scan), and a short one
    };
    refit::delta::cuda::workspace ws(0);
    refit::cuda::stream stream(cudaStreamNonBlocking);
    // Small spans (one chunk or less each, thousands per group, a search per block), spans of
    // hundreds of chunks, and the streamer's largest spans (the scan over more than one tile).
    for (const std::uint64_t span : {256ull, 4096ull, 1ull << 20, 16ull << 20}) {
      std::vector<group_tensor> tensors;
      for (const group_spec& g : specs) {
        group_tensor t{g,
                       {},
                       {},
                       refit::cuda::device_buffer(g.elements * g.item + 8),
                       refit::cuda::device_buffer(g.elements * g.item + 8)};
        t.base.resize(t.total());
        for (auto& b : t.base) b = static_cast<std::byte>(rng());
        t.next = t.base;
        upload(t.device_base.handle(), t.base);
        tensors.push_back(std::move(t));
      }
      const std::string where = "span " + std::to_string(span);
      for (int round = 0; round < 3; ++round)  // reusing the workspace, and the bases the last round wrote
        check_group(rng, tensors, span, ws, stream.handle(), where + ", round " + std::to_string(round));
      // A group of one tensor after larger ones, then the whole group again (the scratch only grows).
      std::vector<group_tensor> one;
      one.push_back(std::move(tensors[3]));
      check_group(rng, one, span, ws, stream.handle(), where + ", one tensor");
      tensors[3] = std::move(one[0]);
      check_group(rng, tensors, span, ws, stream.handle(), where + ", again");
    }
  });
  CHECK(c.wait(600s) == 0);
}

// ------------------------------------------------------------------ over cuda_ipc (staged)

namespace {

/// Both children's view of the trainer: host bytes of every tensor, stepped deterministically
/// (a seed), so that the receiver knows what each version must be.
struct model_bytes {
  /// `embed` elements of the first tensor: past 16 Mi, its patches close a batch of their own
  /// (a delta's batch covers 32 MiB of tensors).
  explicit model_bytes(std::int64_t embed = 300000)
      : metas{{"embed", refit::dtype::bf16, {embed}},
              {"layers.0.q", refit::dtype::bf16, {64, 65}},
              {"layers.0.odd", refit::dtype::bf16, {4097}},
              {"layers.0.norm", refit::dtype::f32, {1000}},
              {"frozen", refit::dtype::bf16, {1000}}} {
    for (const auto& m : metas) {
      bytes.emplace_back(m.nbytes());
      for (auto& b : bytes.back()) b = static_cast<std::byte>(rng());
    }
  }
  std::vector<refit::tensor_meta> metas;
  std::vector<std::vector<std::byte>> bytes;
  std::mt19937_64 rng{99};
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

/// The options of a delta streamer on cuda:0 over `transport` (buffers: patches travel in them).
refit::streamer_options delta_options(const std::string& endpoint, refit::transport_kind transport) {
  refit::streamer_options o;
  if (transport == refit::transport_kind::nccl)
    o.receivers = {endpoint};
  else
    o.endpoint = endpoint;
  o.transport = transport;
  o.device = 0;
  o.direct = false;
  o.buffer_bytes = 256 << 10;
  o.timeout = refit::milliseconds{30000};
  o.delta.enable = true;
  o.delta.memory = refit::delta_memory::device;
  return o;
}

/// The GPU of the receiver: its own over nccl (shared where there is one: rt::nccl_ranks).
int receiver_gpu(refit::transport_kind transport) {
  return transport == refit::transport_kind::nccl ? rt::gpu_of(1) : 0;
}

/// A receiver of `model_bytes` on its GPU that checks every version it commits against the model
/// stepped as many times, until `last` is committed; reports "ready". `staged`: a device stage, whose
/// weights must still hold the version before until it applies each prepared one at once.
void checking_receiver(const std::string& endpoint, refit::transport_kind transport, std::uint64_t last,
                       rt::signal_pipe& to_parent, bool staged = false) {
  const int gpu = receiver_gpu(transport);
  refit::check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
  model_bytes expect_model;
  device_model weights(expect_model);
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.device = gpu;
  o.idle_timeout = refit::milliseconds{30000};
  if (staged) o.stage = refit::stage_kind::device;
  refit::receiver r(o);
  for (std::size_t k = 0; k < expect_model.metas.size(); ++k)
    r.add_parameter(refit::tensor_dest{expect_model.metas[k], weights.buffers[k].handle(), refit::device::cuda(gpu)});
  to_parent.send("ready");
  std::uint64_t seen = 0;
  const auto start = std::chrono::steady_clock::now();
  while (seen < last) {
    require(std::chrono::steady_clock::now() - start < 120s,
            "receiver: version " + std::to_string(last) + " did not come");
    const auto e = r.serve_one(refit::milliseconds{50});
    require(e != refit::receiver_event::aborted, "receiver: aborted: " + r.last_error());
    if (e == refit::receiver_event::prepared) {
      require(seen == 0 || weights.equals(expect_model), "receiver: the weights changed before apply_prepared()");
      require(r.apply_prepared() == std::optional<std::uint64_t>(seen + 1), "receiver: applied another version");
    } else if (e != refit::receiver_event::committed) {
      continue;
    }
    ++seen;
    if (seen > 1) expect_model.step();
    require(r.committed_version() == std::optional<std::uint64_t>(seen), "receiver: unexpected version");
    require(weights.equals(expect_model), "receiver: version " + std::to_string(seen) + " is not bit-exact");
  }
  for (auto e = r.serve_one(refit::milliseconds{50}); e != refit::receiver_event::bye;
       e = r.serve_one(refit::milliseconds{50}))
    require(std::chrono::steady_clock::now() - start < 150s, "receiver: no BYE");
}

void delta_steps(refit::transport_kind transport, bool staged = false) {
  const rt::scoped_endpoint ep;
  const std::string endpoint = ep.name;
  constexpr std::uint64_t last = 21;
  rt::signal_pipe from_rx;
  rt::child rx([&] { checking_receiver(endpoint, transport, last, from_rx, staged); });
  rt::child st([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    model_bytes m;
    device_model tensors(m);
    refit::streamer s(delta_options(endpoint, transport));
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

}  // namespace

TEST_CASE("delta versions over cuda_ipc staged buffers are bit-exact after 20 steps and send a fraction of the bytes",
          "[delta][cuda_ipc]") {
  delta_steps(refit::transport_kind::cuda_ipc);
}

TEST_CASE(
    "delta versions into a device stage over cuda_ipc and nccl are patched there, the weights untouched until each "
    "apply, bit-exact after 20 steps",
    "[delta][stage]") {
  delta_steps(refit::transport_kind::cuda_ipc, true);
  if (rt::nccl_ranks(2)) delta_steps(refit::transport_kind::nccl, true);
}

TEST_CASE("delta versions over nccl buffers are bit-exact after 20 steps and send a fraction of the bytes",
          "[delta][nccl]") {
  if (!rt::nccl_ranks(2)) {
    WARN("no nccl or no GPU: skipped");
    return;
  }
  delta_steps(refit::transport_kind::nccl);
}

namespace {

/// A receiver that restarted gets the next version whole within the same refit, then deltas; a
/// streamer killed mid-delta leaves it poisoned until a whole version commits; weights changed
/// behind its back fail the next delta's checksum and poison it, and the whole version after cures it.
void delta_faults(refit::transport_kind transport) {
  const rt::scoped_endpoint ep;
  const std::string endpoint = ep.name;
  // The receiver: a child that reports every event but idle and batch, with its committed version,
  // whether its weights are the model's at that version, and on an abort whether it is poisoned.
  rt::signal_pipe to_rx, from_rx;
  constexpr std::int64_t embed = 17'000'000;
  const auto receiver = [&] {
    const int gpu = receiver_gpu(transport);
    refit::check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
    model_bytes expect(embed);
    device_model weights(expect);
    refit::receiver_options o;
    o.endpoint = endpoint;
    o.device = gpu;
    o.idle_timeout = refit::milliseconds{3000};
    refit::receiver r(o);
    for (std::size_t k = 0; k < expect.metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{expect.metas[k], weights.buffers[k].handle(), refit::device::cuda(gpu)});
    from_rx.send("ready");
    std::uint64_t at = 1;  // the model's version `expect` holds
    for (;;) {
      if (const auto cmd = to_rx.try_receive(0ms)) {
        if (*cmd != "flip") return;
        // Weights changed behind the receiver's back: the first byte of "layers.0.norm", whose
        // every element each step changes, so the next delta's patch overwrites it.
        std::vector<std::byte> norm = download(weights.buffers[3].handle(), expect.bytes[3].size());
        norm[0] ^= std::byte{0x01};
        upload(weights.buffers[3].handle(), norm);
        from_rx.send("flipped");
        continue;
      }
      const auto e = r.serve_one(refit::milliseconds{20});
      // Refusals (a BEGIN without a session, a delta without a base) are the streamer's to report.
      if (e != refit::receiver_event::committed && e != refit::receiver_event::aborted) continue;
      std::string line = std::string(refit::to_string(e));
      if (e == refit::receiver_event::committed) {
        for (; at < *r.committed_version(); ++at) expect.step();
        line += " " + std::to_string(*r.committed_version()) + (weights.equals(expect) ? " exact" : " WRONG");
      } else if (e == refit::receiver_event::aborted) {
        line += std::string(r.poisoned() ? " poisoned" : " clean") + (r.dirty() ? " dirty | " : " | ") + r.last_error();
      }
      from_rx.send(line);
    }
  };
  // The streamer: refits the versions it is told ("v N"), reporting "delta|whole[ refused] bytes";
  // "block N" makes version N's source stop after its first tensor (and report "blocked").
  rt::signal_pipe to_st, from_st;
  const auto streamer = [&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    model_bytes m(embed);
    device_model tensors(m);
    refit::streamer s(delta_options(endpoint, transport));
    std::vector<refit::tensor_ref> refs;
    for (std::size_t k = 0; k < m.metas.size(); ++k)
      refs.push_back(refit::tensor_ref{m.metas[k], tensors.buffers[k].handle(), refit::device::cuda(0), nullptr});
    std::uint64_t at = 1;
    for (;;) {
      const std::string cmd = to_st.receive(120s);
      if (cmd == "stop") {
        s.close();
        return;
      }
      const bool block = cmd.starts_with("block ");
      const std::uint64_t v = std::stoull(cmd.substr(cmd.find(' ') + 1));
      for (; at < v; ++at) m.step();
      tensors.upload_from(m);
      if (block) {
        // The big first tensor's patches are a batch of their own (it covers 32 MiB), sent
        // before the source is asked for the next tensor.
        struct one_then_block final : refit::tensor_source {
          const std::vector<refit::tensor_ref>& refs;
          rt::signal_pipe& to_parent;
          std::size_t i = 0;
          one_then_block(const std::vector<refit::tensor_ref>& r, rt::signal_pipe& p) : refs(r), to_parent(p) {}
          std::optional<refit::tensor_ref> next() override {
            if (i == 1) {
              to_parent.send("blocked");
              for (;;) ::pause();
            }
            return refs[i++];
          }
        } source(refs, from_st);
        s.refit(v, source);
      }
      try {
        const auto stats = s.refit(v, refs);
        from_st.send(std::string(stats.delta ? "delta" : "whole") + (stats.whole_after_refusal ? " refused" : "") +
                     " " + std::to_string(stats.bytes));
      } catch (const refit::error& e) {
        from_st.send(std::string("failed ") + std::string(refit::to_string(e.code())) + " | " + e.what());
      }
    }
  };

  std::uint64_t model_total = 0;
  for (const auto& m : model_bytes(embed).metas) model_total += m.nbytes();
  const auto bytes_of = [](const std::string& line) { return std::stoull(line.substr(line.rfind(' ') + 1)); };
  const std::string whole = "whole " + std::to_string(model_total);
  // Version v from the streamer: what it says of it.
  const auto refit_to = [&](std::uint64_t v) {
    to_st.send("v " + std::to_string(v));
    return from_st.receive(60s);
  };
  const auto committed = [](std::uint64_t v) { return "committed " + std::to_string(v) + " exact"; };

  auto rx = std::make_unique<rt::child>(receiver);
  REQUIRE(from_rx.receive(60s) == "ready");
  auto st = std::make_unique<rt::child>(streamer);
  CHECK(refit_to(1) == whole);
  CHECK(from_rx.receive(60s) == committed(1));
  std::string line = refit_to(2);
  CHECK(line.starts_with("delta "));
  CHECK(bytes_of(line) < model_total / 4);
  CHECK(from_rx.receive(60s) == committed(2));

  // A receiver restarted: it holds no base, so version 3's delta is refused before anything is
  // sent, and the same refit() sends it whole over a new communicator.
  to_rx.send("stop");
  CHECK(rx->wait(60s) == 0);
  rx = std::make_unique<rt::child>(receiver);
  REQUIRE(from_rx.receive(60s) == "ready");
  CHECK(refit_to(3) == "whole refused " + std::to_string(model_total));
  CHECK(from_rx.receive(60s) == committed(3));
  CHECK(refit_to(4).starts_with("delta "));
  CHECK(from_rx.receive(60s) == committed(4));

  // The streamer dies mid-delta, after a batch of patches was applied: the receiver gives the
  // version up at its idle timeout, poisoned and dirty, with version 4 still its committed one.
  to_st.send("block 5");
  CHECK(from_st.receive(60s) == "blocked");
  line = from_rx.receive(30s);
  INFO("receiver: " << line);
  CHECK(line.starts_with("aborted poisoned dirty | poisoned: delta version 5 failed after patching"));
  st->kill();
  CHECK(st->wait(10s) == -SIGKILL);

  // A new streamer holds no base: its version 5 is whole, and cures the receiver.
  st = std::make_unique<rt::child>(streamer);
  CHECK(refit_to(5) == whole);
  CHECK(from_rx.receive(60s) == committed(5));
  CHECK(refit_to(6).starts_with("delta "));
  CHECK(from_rx.receive(60s) == committed(6));

  // Weights changed behind the receiver's back: the delta's checksum of the whole version does not
  // check out; the receiver is poisoned, the streamer drops its base, and its next refit is whole.
  to_rx.send("flip");
  CHECK(from_rx.receive(60s) == "flipped");
  line = refit_to(7);
  INFO("streamer: " << line);
  CHECK(line.starts_with("failed apply | "));
  CHECK(line.find("delta version 7 does not check out") != std::string::npos);
  line = from_rx.receive(60s);
  INFO("receiver: " << line);
  CHECK(line.starts_with("aborted poisoned dirty | poisoned: delta version 7 failed"));
  CHECK(refit_to(8) == whole);
  CHECK(from_rx.receive(60s) == committed(8));
  to_st.send("stop");
  CHECK(st->wait(60s) == 0);
  to_rx.send("stop");
  CHECK(rx->wait(60s) == 0);
}

}  // namespace

TEST_CASE(
    "over cuda_ipc, a restarted receiver gets the next version whole, a streamer killed mid-delta or weights "
    "changed behind the receiver's back poison it, and a whole version cures it",
    "[delta][cuda_ipc]") {
  delta_faults(refit::transport_kind::cuda_ipc);
}

TEST_CASE(
    "over nccl, a restarted receiver gets the next version whole, a streamer killed mid-delta or weights "
    "changed behind the receiver's back poison it, and a whole version cures it",
    "[delta][nccl]") {
  if (!rt::nccl_ranks(2)) {
    WARN("no nccl or no GPU: skipped");
    return;
  }
  delta_faults(refit::transport_kind::nccl);
}

#endif
