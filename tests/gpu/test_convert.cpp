// GPU tests of conversion on the fly: the CUDA engines' scale passes, converting copies
// and fused block128 kernel bit for bit against the CPU engine and the independent reference
// (support/convert_ref.hpp); end-to-end cuda_ipc refits, staged and direct, into fp8 block128
// (dense and a TP column shard), fp8 per-tensor and bf16 destinations; two receivers asking one
// tensor as different things. As in test_cuda_ipc.cpp, all CUDA work runs in forked children.
#include <catch2/catch.hpp>

#include "config/config.hpp"

#if !REFIT_HAVE_CUDA

TEST_CASE("conversion on the GPU is not built: its tests are skipped", "[convert]") {
  WARN("refit was built without CUDA: the GPU [convert] tests did not run");
}

#else

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy/copy.hpp"
#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/convert_ref.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
namespace ref = refit::test::ref;
using refit::dtype;
using refit::quant;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

/// Deterministic source values (edge cases as in the unit test: an all-zero block, values beyond
/// ±448, NaN and ±inf in block (1, 0)) stored as `type`; `values` are their exact f32 values.
struct host_source {
  std::vector<std::uint8_t> bytes;
  std::vector<float> values;
};

host_source make_source(dtype type, std::size_t rows, std::size_t cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  host_source s;
  s.values.resize(rows * cols);
  s.bytes.resize(rows * cols * refit::itemsize(type));
  for (std::size_t i = 0; i < rows * cols; ++i) {
    const std::size_t r = i / cols, c = i % cols;
    float v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
    if (rng() % 97 == 0) v *= 1e4f;
    if (r < 128 && c >= 128 && c < 256) v = 0.0f;
    if (r == 129 && c == 0) v = std::numeric_limits<float>::quiet_NaN();
    if (r == 129 && c == 1) v = std::numeric_limits<float>::infinity();
    if (r == 130 && c == 2) v = -std::numeric_limits<float>::infinity();
    if (type == dtype::f32) {
      std::memcpy(s.bytes.data() + 4 * i, &v, 4);
      s.values[i] = v;
    } else {
      const std::uint16_t h = type == dtype::bf16 ? ref::bf16(v) : ref::f16(v);
      std::memcpy(s.bytes.data() + 2 * i, &h, 2);
      s.values[i] = type == dtype::bf16 ? ref::bf16_value(h) : ref::f16_value(h);
    }
  }
  return s;
}

std::vector<std::uint8_t> download(const void* p, std::size_t n) {
  std::vector<std::uint8_t> out(n);
  refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  refit::check_cuda(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), "download");
  return out;
}

std::vector<float> download_floats(const float* p, std::size_t n) {
  const auto b = download(p, n * 4);
  std::vector<float> out(n);
  std::memcpy(out.data(), b.data(), n * 4);
  return out;
}

refit::cuda::device_buffer upload(const std::vector<std::uint8_t>& bytes) {
  refit::cuda::device_buffer d(std::max<std::size_t>(bytes.size(), 1));
  refit::check_cuda(cudaMemcpy(d.handle(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "upload");
  return d;
}

std::string first_difference(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return "byte " + std::to_string(i) + ": " + std::to_string(got[i]) + ", expected " + std::to_string(want[i]);
  return {};
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

/// The kernels against the reference: scale passes + converting copies (cut into `piece`
/// elements) for each source dtype, block128 and per tensor, and the casts.
void kernels_body() {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
  auto gpu = refit::copy::make_copier(refit::copy::engine::kernel, 0);
  cudaStream_t stream = nullptr;
  for (const dtype from : {dtype::bf16, dtype::f32, dtype::f16}) {
    const std::size_t lead = 2, rows = 300, cols = 260;
    const host_source src = make_source(from, lead * rows, cols, 21);
    const auto dsrc = upload(src.bytes);
    const std::vector<std::int64_t> shape{2, 300, 260};
    for (const quant q : {quant::block128, quant::tensor}) {
      const ref::quantised want = ref::quantise(src.values, q == quant::block128 ? lead : 1,
                                                q == quant::block128 ? rows : lead * rows, cols, q == quant::block128);
      const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
      float* inv = gpu->scratch(groups);
      float* mul = gpu->scratch(groups);
      const refit::copy::scale_job job{dsrc.handle(), from, shape, q, inv, mul};
      gpu->scales(std::span(&job, 1), stream);
      for (const std::uint64_t piece : {std::uint64_t{1000}, std::uint64_t{1} << 20}) {
        refit::cuda::device_buffer out(lead * rows * cols);
        const auto cv = refit::copy::conversion_of(from, dtype::f8_e4m3, q, shape, mul);
        std::vector<refit::copy::convert_op> ops;
        const std::uint64_t n = lead * rows * cols;
        for (std::uint64_t e = 0; e < n; e += piece)
          ops.push_back(refit::copy::convert_op{
              static_cast<const std::byte*>(dsrc.handle()) + e * refit::itemsize(from),
              static_cast<std::byte*>(out.handle()) + e, std::min(piece, n - e), 1, 0, 0, e, cv});
        gpu->convert(ops, stream);
        const auto diff = first_difference(download(out.handle(), n), want.q);
        expect(diff.empty(), std::string(refit::to_string(from)) + " " + std::string(refit::to_string(q)) +
                                 " pieces of " + std::to_string(piece) + ": " + diff);
      }
      expect(same_floats(download_floats(inv, groups), want.scale_inv),
             std::string(refit::to_string(from)) + " " + std::string(refit::to_string(q)) + ": scale_inv differs");
      gpu->reset_scratch();
    }
    // The fused kernel: the whole tensor, and columns [128, cols) into rows of their own with scales
    // in rows of 2. 260 columns take the scalar kernel; 264 (a multiple of 8) the vectorised one,
    // whose whole tiles (NaN and ±inf among them) use the hardware's e4m3 conversion.
    for (const std::size_t fcols : {cols, std::size_t{264}}) {
      const host_source fsrc = fcols == cols ? src : make_source(from, lead * rows, fcols, 23);
      const auto fdsrc = upload(fsrc.bytes);
      const ref::quantised want = ref::quantise(fsrc.values, lead, rows, fcols, true);
      for (const bool shard : {false, true}) {
        const std::uint64_t lo = shard ? 128 : 0, width = fcols - lo, blocks = shard ? 2 : 3;
        refit::cuda::device_buffer out(lead * rows * width);
        refit::cuda::device_buffer scale(lead * 3 * blocks * 4);
        refit::copy::fused_job j;
        j.src = fdsrc.handle();
        j.from = from;
        j.lead = lead;
        j.rows = rows;
        j.cols = fcols;
        j.dst = static_cast<std::uint8_t*>(out.handle());
        j.dst_pitch = width;
        j.col_lo = lo;
        j.col_hi = fcols;
        j.scale = static_cast<float*>(scale.handle());
        j.scale_pitch = blocks;
        gpu->fused(std::span(&j, 1), stream);
        const auto got = download(out.handle(), lead * rows * width);
        std::vector<std::uint8_t> want_q;
        for (std::size_t r = 0; r < lead * rows; ++r)
          for (std::size_t c = lo; c < fcols; ++c) want_q.push_back(want.q[r * fcols + c]);
        const auto diff = first_difference(got, want_q);
        expect(diff.empty(), std::string("fused ") + refit::to_string(from).data() + " cols " + std::to_string(fcols) +
                                 (shard ? " shard: " : ": ") + diff);
        std::vector<float> want_s;
        for (std::size_t g = 0; g < lead * 3; ++g)
          for (std::size_t b = lo / 128; b < 3; ++b) want_s.push_back(want.scale_inv[g * 3 + b]);
        expect(same_floats(download_floats(static_cast<float*>(scale.handle()), want_s.size()), want_s),
               std::string("fused scales ") + refit::to_string(from).data());
      }
    }
  }
  // Casts.
  for (const auto& [from, to] : std::vector<std::pair<dtype, dtype>>{
           {dtype::f32, dtype::bf16}, {dtype::f32, dtype::f16}, {dtype::bf16, dtype::f16}, {dtype::f16, dtype::f32}}) {
    const host_source src = make_source(from, 1000, 77, 5);
    const auto dsrc = upload(src.bytes);
    const std::uint64_t n = src.values.size();
    refit::cuda::device_buffer out(n * refit::itemsize(to));
    const auto cv = refit::copy::conversion_of(from, to, quant::none, std::vector<std::int64_t>{1000, 77}, nullptr);
    const refit::copy::convert_op op{dsrc.handle(), out.handle(), n, 1, 0, 0, 0, cv};
    gpu->convert(std::span(&op, 1), stream);
    auto cpu = refit::copy::make_copier(refit::copy::engine::cpu);
    std::vector<std::uint8_t> want(n * refit::itemsize(to));
    const refit::copy::convert_op host_op{src.bytes.data(), want.data(), n, 1, 0, 0, 0, cv};
    cpu->convert(std::span(&host_op, 1), nullptr);
    const auto diff = first_difference(download(out.handle(), want.size()), want);
    expect(diff.empty(),
           std::string("cast ") + refit::to_string(from).data() + " to " + refit::to_string(to).data() + ": " + diff);
  }
}

/// The row formats (channel, mxfp8) on the GPU against the CPU engine (which the unit tests hold
/// to the specifications' reference): the row scale kernel, then converting copies cut into
/// pieces, and a strided copy (a column shard [32, cols) of every row, as a TP shard's route).
void row_formats_body() {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
  auto gpu = refit::copy::make_copier(refit::copy::engine::kernel, 0);
  auto cpu = refit::copy::make_copier(refit::copy::engine::cpu);
  for (const dtype from : {dtype::bf16, dtype::f32, dtype::f16})
    for (const quant q : {quant::channel, quant::mxfp8})
      for (const std::size_t cols : {std::size_t{260}, std::size_t{70}, std::size_t{1}}) {
        const std::size_t rows = 300;
        const host_source src = make_source(from, rows, cols, 31);
        const auto dsrc = upload(src.bytes);
        const std::vector<std::int64_t> shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
        const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
        const std::uint64_t scale_bytes = groups * refit::itemsize(refit::scale_dtype(q));
        const std::string what = std::string(refit::to_string(from)) + " " + std::string(refit::to_string(q)) +
                                 " cols " + std::to_string(cols);
        // The CPU engine's answer.
        std::vector<std::uint8_t> want_scale(scale_bytes), want(rows * cols);
        std::vector<float> host_mul(groups);
        const refit::copy::scale_job host_job{src.bytes.data(), from, shape, q, want_scale.data(), host_mul.data()};
        cpu->scales(std::span(&host_job, 1), nullptr);
        const auto host_cv = refit::copy::conversion_of(from, dtype::f8_e4m3, q, shape, host_mul.data());
        const refit::copy::convert_op host_op{src.bytes.data(), want.data(), rows * cols, 1, 0, 0, 0, host_cv};
        cpu->convert(std::span(&host_op, 1), nullptr);
        // The GPU's.
        float* scale = gpu->scratch(groups);
        float* mul = gpu->scratch(groups);
        const refit::copy::scale_job job{dsrc.handle(), from, shape, q, scale, mul};
        gpu->scales(std::span(&job, 1), nullptr);
        expect(download(scale, scale_bytes) == want_scale, what + ": scales differ");
        const auto cv = refit::copy::conversion_of(from, dtype::f8_e4m3, q, shape, mul);
        const std::uint64_t n = rows * cols;
        for (const std::uint64_t piece : {std::uint64_t{77}, std::uint64_t{1} << 20}) {
          refit::cuda::device_buffer out(n);
          std::vector<refit::copy::convert_op> ops;
          for (std::uint64_t e = 0; e < n; e += piece)
            ops.push_back(refit::copy::convert_op{
                static_cast<const std::byte*>(dsrc.handle()) + e * refit::itemsize(from),
                static_cast<std::byte*>(out.handle()) + e, std::min(piece, n - e), 1, 0, 0, e, cv});
          gpu->convert(ops, nullptr);
          const auto diff = first_difference(download(out.handle(), n), want);
          expect(diff.empty(), what + " pieces of " + std::to_string(piece) + ": " + diff);
        }
        if (cols > 32) {
          const std::uint64_t width = cols - 32;
          refit::cuda::device_buffer out(rows * width);
          const refit::copy::convert_op op{static_cast<const std::byte*>(dsrc.handle()) + 32 * refit::itemsize(from),
                                           out.handle(),
                                           width,
                                           rows,
                                           cols,
                                           width,
                                           32,
                                           cv};
          gpu->convert(std::span(&op, 1), nullptr);
          std::vector<std::uint8_t> want_shard;
          for (std::size_t r = 0; r < rows; ++r)
            for (std::size_t c = 32; c < cols; ++c) want_shard.push_back(want[r * cols + c]);
          const auto diff = first_difference(download(out.handle(), rows * width), want_shard);
          expect(diff.empty(), what + " column shard: " + diff);
        }
        gpu->reset_scratch();
      }
}

// ------------------------------------------------------------------------------ end to end

/// Sources: w_block bf16 [300, 260] → fp8 block128 (dense); w_shard bf16 [256, 300] → fp8
/// block128, columns [128, 300) (a TP shard ending at the source's end); w_tensor f32 [64, 100] →
/// fp8 per tensor; w_cast f32 [1000] → bf16; w_big bf16 [1024, 1024] → fp8 block128.
struct model {
  host_source block = make_source(dtype::bf16, 300, 260, 1);
  host_source shard = make_source(dtype::bf16, 256, 300, 2);
  host_source tensor = make_source(dtype::f32, 64, 100, 3);
  host_source cast = make_source(dtype::f32, 1, 1000, 4);
  host_source big = make_source(dtype::bf16, 1024, 1024, 5);
};

/// `device`: the receiver's GPU; `shard`: whether w_shard is registered (a slice: an nccl
/// receiver with one does not receive in place).
void receiver_body(const std::string& ep, rt::signal_pipe& ready, int device = 0, bool shard = true) {
  refit::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const model m;
  refit::receiver_options o;
  o.endpoint = ep;
  o.device = device;
  o.idle_timeout = 30000ms;
  refit::receiver r(o);
  refit::cuda::device_buffer q_block(300 * 260), s_block(9 * 4), q_shard(256 * 172), s_shard(2 * 2 * 4), q_tensor(6400),
      s_tensor(4), bf_cast(2000), q_big(1024 * 1024), s_big(64 * 4);
  const auto fp8 = [device](const char* name, std::vector<std::int64_t> shape, refit::cuda::device_buffer& q,
                            refit::cuda::device_buffer& s, quant qu) {
    refit::tensor_dest d{{name, dtype::f8_e4m3, std::move(shape)}, q.handle(), refit::device::cuda(device)};
    d.q = qu;
    d.scale = s.handle();
    return d;
  };
  r.add_parameter(fp8("w_block", {300, 260}, q_block, s_block, quant::block128));
  refit::dest_layout slice;
  slice.slice = refit::source_slice{1, 128, 172};
  if (shard) r.add_parameter(fp8("w_shard", {256, 172}, q_shard, s_shard, quant::block128), slice);
  r.add_parameter(fp8("w_tensor", {64, 100}, q_tensor, s_tensor, quant::tensor));
  r.add_parameter(refit::tensor_dest{{"w_cast", dtype::bf16, {1000}}, bf_cast.handle(), refit::device::cuda(device)});
  r.add_parameter(fp8("w_big", {1024, 1024}, q_big, s_big, quant::block128));
  ready.send("ready");
  int commits = 0;
  for (auto last = std::chrono::steady_clock::now();;) {
    const auto e = r.serve_one(100ms);
    if (e == refit::receiver_event::bye) break;
    expect(e != refit::receiver_event::aborted && e != refit::receiver_event::refused, "receiver: " + r.last_error());
    if (e == refit::receiver_event::idle) {
      expect(std::chrono::steady_clock::now() - last < 60s, "receiver: no message for 60 s");
      continue;
    }
    last = std::chrono::steady_clock::now();
    if (e != refit::receiver_event::committed) continue;
    ++commits;
    const auto rb = ref::quantise(m.block.values, 1, 300, 260, true);
    auto d = first_difference(download(q_block.handle(), 300 * 260), rb.q);
    expect(d.empty(), "w_block: " + d);
    expect(same_floats(download_floats(static_cast<float*>(s_block.handle()), 9), rb.scale_inv), "w_block scales");
    if (shard) {
      const auto rs = ref::quantise(m.shard.values, 1, 256, 300, true);
      std::vector<std::uint8_t> want_shard;
      for (std::size_t row = 0; row < 256; ++row)
        for (std::size_t c = 128; c < 300; ++c) want_shard.push_back(rs.q[row * 300 + c]);
      d = first_difference(download(q_shard.handle(), 256 * 172), want_shard);
      expect(d.empty(), "w_shard: " + d);
      expect(same_floats(download_floats(static_cast<float*>(s_shard.handle()), 4),
                         {rs.scale_inv[1], rs.scale_inv[2], rs.scale_inv[4], rs.scale_inv[5]}),
             "w_shard scales");
    }
    const auto rt_ = ref::quantise(m.tensor.values, 1, 64, 100, false);
    d = first_difference(download(q_tensor.handle(), 6400), rt_.q);
    expect(d.empty(), "w_tensor: " + d);
    expect(same_floats(download_floats(static_cast<float*>(s_tensor.handle()), 1), rt_.scale_inv), "w_tensor scale");
    std::vector<std::uint8_t> want_cast(2000);
    for (std::size_t i = 0; i < 1000; ++i) {
      const std::uint16_t h = ref::bf16(m.cast.values[i]);
      std::memcpy(want_cast.data() + 2 * i, &h, 2);
    }
    d = first_difference(download(bf_cast.handle(), 2000), want_cast);
    expect(d.empty(), "w_cast: " + d);
    const auto rg = ref::quantise(m.big.values, 1, 1024, 1024, true);
    d = first_difference(download(q_big.handle(), 1024 * 1024), rg.q);
    expect(d.empty(), "w_big: " + d);
    expect(same_floats(download_floats(static_cast<float*>(s_big.handle()), 64), rg.scale_inv), "w_big scales");
  }
  expect(commits == 2, std::to_string(commits) + " commits");
}

/// `nccl`: broadcast to the receiver (on cuda:1) instead of cuda_ipc; `shard`: whether w_shard is sent.
void streamer_body(const std::string& ep, bool direct, bool nccl = false, bool shard = true) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const model m;
  const auto b = upload(m.block.bytes), s = upload(m.shard.bytes), t = upload(m.tensor.bytes), c = upload(m.cast.bytes),
             g = upload(m.big.bytes);
  std::vector<refit::tensor_ref> refs{
      {{"w_block", dtype::bf16, {300, 260}}, b.handle(), refit::device::cuda(0), nullptr},
      {{"w_tensor", dtype::f32, {64, 100}}, t.handle(), refit::device::cuda(0), nullptr},
      {{"w_cast", dtype::f32, {1000}}, c.handle(), refit::device::cuda(0), nullptr},
      {{"w_big", dtype::bf16, {1024, 1024}}, g.handle(), refit::device::cuda(0), nullptr}};
  if (shard) refs.push_back({{"w_shard", dtype::bf16, {256, 300}}, s.handle(), refit::device::cuda(0), nullptr});
  refit::streamer_options o;
  if (nccl) {
    o.receivers = {ep};
    o.transport = refit::transport_kind::nccl;
  } else {
    o.endpoint = ep;
    o.transport = refit::transport_kind::cuda_ipc;
  }
  o.buffer_bytes = 256 << 10;  // staged: w_big's 1 MiB of fp8 over several batches
  o.direct = direct;
  o.timeout = 30000ms;
  refit::streamer st(o);
  const std::uint64_t scales = shard ? 4 : 3;
  for (std::uint64_t v : {1, 2}) {
    const auto stats = st.refit(v, refs);
    expect(stats.direct == direct, direct ? "the refit was staged" : "the refit was direct");
    expect(stats.tensors == refs.size() + scales, "stats.tensors " + std::to_string(stats.tensors));
  }
  st.close();
}

void end_to_end(bool direct) {
  const auto ep = rt::temp_endpoint();
  rt::signal_pipe ready;
  rt::child rx([&] { receiver_body(ep, ready); });
  REQUIRE(ready.receive(60s) == "ready");
  rt::child tx([&] { streamer_body(ep, direct); });
  CHECK(tx.wait(180s) == 0);
  CHECK(rx.wait(60s) == 0);
}

/// A row format's expected bytes, from the CPU engine (held to the specifications' reference by
/// the unit tests): codes and the scale tensor's bytes.
struct row_expected {
  std::vector<std::uint8_t> q, scale;
};

row_expected cpu_rows(const host_source& src, dtype from, quant q, const std::vector<std::int64_t>& shape) {
  auto cpu = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::uint64_t n = *refit::checked_numel(shape);
  const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
  row_expected out;
  out.q.resize(n);
  out.scale.resize(groups * refit::itemsize(refit::scale_dtype(q)));
  std::vector<float> mul(groups);
  const refit::copy::scale_job job{src.bytes.data(), from, shape, q, out.scale.data(), mul.data()};
  cpu->scales(std::span(&job, 1), nullptr);
  const auto cv = refit::copy::conversion_of(from, dtype::f8_e4m3, q, shape, mul.data());
  const refit::copy::convert_op op{src.bytes.data(), out.q.data(), n, 1, 0, 0, 0, cv};
  cpu->convert(std::span(&op, 1), nullptr);
  return out;
}

/// Row formats end to end: w_ch bf16 [300, 260] per channel; w_mx f32 [64, 70] MXFP8 (a short
/// last block); w_mx_shard bf16 [256, 300] MXFP8, columns [32, 300) (a TP shard); w_mx_big bf16
/// [1024, 1024] MXFP8 (several staged batches).
struct row_model {
  host_source ch = make_source(dtype::bf16, 300, 260, 41);
  host_source mx = make_source(dtype::f32, 64, 70, 42);
  host_source shard = make_source(dtype::bf16, 256, 300, 43);
  host_source big = make_source(dtype::bf16, 1024, 1024, 44);
};

void row_receiver_body(const std::string& ep, rt::signal_pipe& ready) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const row_model m;
  refit::receiver_options o;
  o.endpoint = ep;
  o.idle_timeout = 30000ms;
  refit::receiver r(o);
  refit::cuda::device_buffer q_ch(300 * 260), s_ch(300 * 4), q_mx(64 * 70), s_mx(64 * 3), q_shard(256 * 268),
      s_shard(256 * 9), q_big(1024 * 1024), s_big(1024 * 32);
  const auto fp8 = [](const char* name, std::vector<std::int64_t> shape, refit::cuda::device_buffer& q,
                      refit::cuda::device_buffer& s, quant qu) {
    refit::tensor_dest d{{name, dtype::f8_e4m3, std::move(shape)}, q.handle(), refit::device::cuda(0)};
    d.q = qu;
    d.scale = s.handle();
    return d;
  };
  r.add_parameter(fp8("w_ch", {300, 260}, q_ch, s_ch, quant::channel));
  r.add_parameter(fp8("w_mx", {64, 70}, q_mx, s_mx, quant::mxfp8));
  refit::dest_layout slice;
  slice.slice = refit::source_slice{1, 32, 268};
  r.add_parameter(fp8("w_mx_shard", {256, 268}, q_shard, s_shard, quant::mxfp8), slice);
  r.add_parameter(fp8("w_mx_big", {1024, 1024}, q_big, s_big, quant::mxfp8));
  const row_expected ch = cpu_rows(m.ch, dtype::bf16, quant::channel, {300, 260});
  const row_expected mx = cpu_rows(m.mx, dtype::f32, quant::mxfp8, {64, 70});
  const row_expected sh = cpu_rows(m.shard, dtype::bf16, quant::mxfp8, {256, 300});
  const row_expected big = cpu_rows(m.big, dtype::bf16, quant::mxfp8, {1024, 1024});
  std::vector<std::uint8_t> want_shard, want_shard_scale;
  for (std::size_t row = 0; row < 256; ++row) {
    for (std::size_t c = 32; c < 300; ++c) want_shard.push_back(sh.q[row * 300 + c]);
    for (std::size_t b = 1; b < 10; ++b) want_shard_scale.push_back(sh.scale[row * 10 + b]);
  }
  ready.send("ready");
  int commits = 0;
  for (auto last = std::chrono::steady_clock::now();;) {
    const auto e = r.serve_one(100ms);
    if (e == refit::receiver_event::bye) break;
    expect(e != refit::receiver_event::aborted && e != refit::receiver_event::refused, "receiver: " + r.last_error());
    if (e == refit::receiver_event::idle) {
      expect(std::chrono::steady_clock::now() - last < 60s, "receiver: no message for 60 s");
      continue;
    }
    last = std::chrono::steady_clock::now();
    if (e != refit::receiver_event::committed) continue;
    ++commits;
    const auto check = [](const void* p, const std::vector<std::uint8_t>& want, const char* what) {
      const auto d = first_difference(download(p, want.size()), want);
      expect(d.empty(), std::string(what) + ": " + d);
    };
    check(q_ch.handle(), ch.q, "w_ch");
    check(s_ch.handle(), ch.scale, "w_ch scales");
    check(q_mx.handle(), mx.q, "w_mx");
    check(s_mx.handle(), mx.scale, "w_mx scales");
    check(q_shard.handle(), want_shard, "w_mx_shard");
    check(s_shard.handle(), want_shard_scale, "w_mx_shard scales");
    check(q_big.handle(), big.q, "w_mx_big");
    check(s_big.handle(), big.scale, "w_mx_big scales");
  }
  expect(commits == 2, std::to_string(commits) + " commits");
}

void row_streamer_body(const std::string& ep, bool direct) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const row_model m;
  const auto c = upload(m.ch.bytes), x = upload(m.mx.bytes), s = upload(m.shard.bytes), g = upload(m.big.bytes);
  const std::vector<refit::tensor_ref> refs{
      {{"w_ch", dtype::bf16, {300, 260}}, c.handle(), refit::device::cuda(0), nullptr},
      {{"w_mx", dtype::f32, {64, 70}}, x.handle(), refit::device::cuda(0), nullptr},
      {{"w_mx_shard", dtype::bf16, {256, 300}}, s.handle(), refit::device::cuda(0), nullptr},
      {{"w_mx_big", dtype::bf16, {1024, 1024}}, g.handle(), refit::device::cuda(0), nullptr}};
  refit::streamer_options o;
  o.endpoint = ep;
  o.transport = refit::transport_kind::cuda_ipc;
  o.buffer_bytes = 256 << 10;
  o.direct = direct;
  o.timeout = 30000ms;
  refit::streamer st(o);
  for (std::uint64_t v : {1, 2}) {
    const auto stats = st.refit(v, refs);
    expect(stats.direct == direct, direct ? "the refit was staged" : "the refit was direct");
    expect(stats.tensors == 2 * refs.size(), "stats.tensors " + std::to_string(stats.tensors));
  }
  st.close();
}

void row_end_to_end(bool direct) {
  const auto ep = rt::temp_endpoint();
  rt::signal_pipe ready;
  rt::child rx([&] { row_receiver_body(ep, ready); });
  REQUIRE(ready.receive(60s) == "ready");
  rt::child tx([&] { row_streamer_body(ep, direct); });
  CHECK(tx.wait(180s) == 0);
  CHECK(rx.wait(60s) == 0);
}

/// NVFP4 (and swizzled scales) the CPU engine's way, which the unit tests hold to the
/// specification's reference: packed codes, the scale tensor's bytes, scale_2.
struct nvfp4_expected {
  std::vector<std::uint8_t> q, scale;
  float scale_2 = 0.0f;
};

nvfp4_expected cpu_nvfp4(const host_source& src, dtype from, quant q, const std::vector<std::int64_t>& shape,
                         refit::scale_layout layout) {
  auto cpu = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::uint64_t n = *refit::checked_numel(shape);
  const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
  nvfp4_expected out;
  const dtype to = refit::quant_dtype(q);
  out.q.resize(refit::copy::cvt::bytes_of(static_cast<std::uint8_t>(to), n));
  out.scale.resize(*refit::checked_numel(refit::scale_shape(q, shape, layout)));
  std::vector<float> mul(groups);
  const refit::copy::scale_job job{src.bytes.data(), from,       shape,        q,
                                   out.scale.data(), mul.data(), &out.scale_2, layout};
  cpu->scales(std::span(&job, 1), nullptr);
  const auto cv = refit::copy::conversion_of(from, to, q, shape, mul.data());
  const refit::copy::convert_op op{src.bytes.data(), out.q.data(), n, 1, 0, 0, 0, cv};
  cpu->convert(std::span(&op, 1), nullptr);
  return out;
}

/// The GPU's NVFP4 scale pass (the per-tensor reduction, then the blocks) and converting copies,
/// and its swizzled scale writes (nvfp4 and mxfp8), against the CPU engine.
void nvfp4_kernels_body() {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
  auto gpu = refit::copy::make_copier(refit::copy::engine::kernel, 0);
  for (const dtype from : {dtype::bf16, dtype::f32, dtype::f16})
    for (const quant q : {quant::nvfp4, quant::mxfp8})
      for (const auto layout : {refit::scale_layout::row_major, refit::scale_layout::swizzled_128x4})
        for (const std::size_t cols : {std::size_t{256}, std::size_t{72}, std::size_t{2}}) {
          const std::size_t rows = 300;
          const host_source src = make_source(from, rows, cols, 51);
          const auto dsrc = upload(src.bytes);
          const std::vector<std::int64_t> shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
          const std::string what = std::string(refit::to_string(from)) + " " + std::string(refit::to_string(q)) + " " +
                                   std::string(refit::to_string(layout)) + " cols " + std::to_string(cols);
          const nvfp4_expected want = cpu_nvfp4(src, from, q, shape, layout);
          const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
          float* scale = gpu->scratch(want.scale.size());
          float* mul = gpu->scratch(groups);
          float* scale_2 = gpu->scratch(1);
          const refit::copy::scale_job job{
              dsrc.handle(), from, shape, q, scale, mul, q == quant::nvfp4 ? scale_2 : nullptr, layout};
          gpu->scales(std::span(&job, 1), nullptr);
          expect(download(scale, want.scale.size()) == want.scale, what + ": scales differ");
          if (q == quant::nvfp4) expect(download_floats(scale_2, 1)[0] == want.scale_2, what + ": scale_2 differs");
          const dtype to = refit::quant_dtype(q);
          const auto cv = refit::copy::conversion_of(from, to, q, shape, mul);
          const std::uint64_t n = rows * cols;
          for (const std::uint64_t piece : {std::uint64_t{78}, std::uint64_t{1} << 20}) {
            refit::cuda::device_buffer out(want.q.size());
            std::vector<refit::copy::convert_op> ops;
            for (std::uint64_t e = 0; e < n; e += piece)
              ops.push_back(refit::copy::convert_op{
                  static_cast<const std::byte*>(dsrc.handle()) + e * refit::itemsize(from),
                  static_cast<std::byte*>(out.handle()) + refit::copy::cvt::bytes_of(static_cast<std::uint8_t>(to), e),
                  std::min(piece, n - e), 1, 0, 0, e, cv});
            gpu->convert(ops, nullptr);
            const auto diff = first_difference(download(out.handle(), want.q.size()), want.q);
            expect(diff.empty(), what + " pieces of " + std::to_string(piece) + ": " + diff);
          }
          gpu->reset_scratch();
        }
}

/// NVFP4 end to end: w_nv bf16 [300, 256] row-major scales; w_nv_swz f32 [200, 72] swizzled (a
/// short last block); w_mx_swz bf16 [130, 70] MXFP8 swizzled; w_nv_big bf16 [1024, 1024] (several
/// staged batches).
struct nvfp4_model {
  host_source nv = make_source(dtype::bf16, 300, 256, 61);
  host_source swz = make_source(dtype::f32, 200, 72, 62);
  host_source mx = make_source(dtype::bf16, 130, 70, 63);
  host_source big = make_source(dtype::bf16, 1024, 1024, 64);
};

struct nvfp4_param {
  const char* name;
  quant q;
  refit::scale_layout layout;
  std::vector<std::int64_t> shape;
  dtype from;
};

const std::vector<nvfp4_param>& nvfp4_params() {
  static const std::vector<nvfp4_param> p{
      {"w_nv", quant::nvfp4, refit::scale_layout::row_major, {300, 256}, dtype::bf16},
      {"w_nv_swz", quant::nvfp4, refit::scale_layout::swizzled_128x4, {200, 72}, dtype::f32},
      {"w_mx_swz", quant::mxfp8, refit::scale_layout::swizzled_128x4, {130, 70}, dtype::bf16},
      {"w_nv_big", quant::nvfp4, refit::scale_layout::row_major, {1024, 1024}, dtype::bf16}};
  return p;
}

void nvfp4_receiver_body(const std::string& ep, rt::signal_pipe& ready) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const nvfp4_model m;
  const host_source* srcs[] = {&m.nv, &m.swz, &m.mx, &m.big};
  refit::receiver_options o;
  o.endpoint = ep;
  o.idle_timeout = 30000ms;
  refit::receiver r(o);
  std::vector<nvfp4_expected> want;
  std::vector<refit::cuda::device_buffer> mem;
  for (std::size_t k = 0; k < nvfp4_params().size(); ++k) {
    const nvfp4_param& p = nvfp4_params()[k];
    want.push_back(cpu_nvfp4(*srcs[k], p.from, p.q, p.shape, p.layout));
    mem.emplace_back(want.back().q.size());
    mem.emplace_back(want.back().scale.size());
    mem.emplace_back(4);
    const dtype to = refit::quant_dtype(p.q);
    refit::tensor_dest d{{p.name, to, refit::storage_shape(to, p.shape)}, mem[3 * k].handle(), refit::device::cuda(0)};
    d.q = p.q;
    d.scale = mem[3 * k + 1].handle();
    d.scale_2 = p.q == quant::nvfp4 ? mem[3 * k + 2].handle() : nullptr;
    d.layout = p.layout;
    r.add_parameter(d);
  }
  ready.send("ready");
  int commits = 0;
  for (auto last = std::chrono::steady_clock::now();;) {
    const auto e = r.serve_one(100ms);
    if (e == refit::receiver_event::bye) break;
    expect(e != refit::receiver_event::aborted && e != refit::receiver_event::refused, "receiver: " + r.last_error());
    if (e == refit::receiver_event::idle) {
      expect(std::chrono::steady_clock::now() - last < 60s, "receiver: no message for 60 s");
      continue;
    }
    last = std::chrono::steady_clock::now();
    if (e != refit::receiver_event::committed) continue;
    ++commits;
    for (std::size_t k = 0; k < nvfp4_params().size(); ++k) {
      const std::string name = nvfp4_params()[k].name;
      const auto d = first_difference(download(mem[3 * k].handle(), want[k].q.size()), want[k].q);
      expect(d.empty(), name + ": " + d);
      const auto ds = first_difference(download(mem[3 * k + 1].handle(), want[k].scale.size()), want[k].scale);
      expect(ds.empty(), name + " scales: " + ds);
      if (nvfp4_params()[k].q == quant::nvfp4)
        expect(download_floats(static_cast<const float*>(mem[3 * k + 2].handle()), 1)[0] == want[k].scale_2,
               name + ": scale_2 differs");
    }
  }
  expect(commits == 2, std::to_string(commits) + " commits");
}

void nvfp4_streamer_body(const std::string& ep, bool direct) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
  const nvfp4_model m;
  const auto a = upload(m.nv.bytes), b = upload(m.swz.bytes), c = upload(m.mx.bytes), g = upload(m.big.bytes);
  const void* data[] = {a.handle(), b.handle(), c.handle(), g.handle()};
  std::vector<refit::tensor_ref> refs;
  for (std::size_t k = 0; k < nvfp4_params().size(); ++k) {
    const nvfp4_param& p = nvfp4_params()[k];
    refs.push_back({{p.name, p.from, p.shape}, data[k], refit::device::cuda(0), nullptr});
  }
  refit::streamer_options o;
  o.endpoint = ep;
  o.transport = refit::transport_kind::cuda_ipc;
  o.buffer_bytes = 256 << 10;
  o.direct = direct;
  o.timeout = 30000ms;
  refit::streamer st(o);
  for (std::uint64_t v : {1, 2}) {
    const auto stats = st.refit(v, refs);
    expect(stats.direct == direct, direct ? "the refit was staged" : "the refit was direct");
    expect(stats.tensors == 3 * 3 + 2, "stats.tensors " + std::to_string(stats.tensors));
  }
  st.close();
}

}  // namespace

TEST_CASE("cuda_ipc refits, staged and direct, write per-channel and MXFP8 weights and scales bit-exact",
          "[convert][cuda_ipc][quant]") {
  const bool direct = GENERATE(false, true);
  INFO((direct ? "direct" : "staged"));
  row_end_to_end(direct);
}

TEST_CASE("the CUDA NVFP4 scale pass, converting copies and swizzled scale writes match the CPU engine",
          "[convert][copy][quant][nvfp4]") {
  rt::child c(nvfp4_kernels_body);
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("cuda_ipc refits, staged and direct, write NVFP4 codes, block scales and scale_2, and swizzled scales",
          "[convert][cuda_ipc][quant][nvfp4]") {
  const bool direct = GENERATE(false, true);
  INFO((direct ? "direct" : "staged"));
  const auto ep = rt::temp_endpoint();
  rt::signal_pipe ready;
  rt::child rx([&] { nvfp4_receiver_body(ep, ready); });
  REQUIRE(ready.receive(60s) == "ready");
  rt::child tx([&] { nvfp4_streamer_body(ep, direct); });
  CHECK(tx.wait(180s) == 0);
  CHECK(rx.wait(60s) == 0);
}

TEST_CASE("the CUDA scale passes, converting copies and fused kernel match the reference bit for bit",
          "[convert][copy]") {
  rt::child c(kernels_body);
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("the CUDA row scale kernel and converting copies quantise per channel and to MXFP8 like the CPU engine",
          "[convert][copy][quant]") {
  rt::child c(row_formats_body);
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("a staged cuda_ipc refit converts into fp8 block128, shard, per-tensor and bf16 destinations bit-exact",
          "[convert][cuda_ipc]") {
  end_to_end(false);
}

TEST_CASE("a direct cuda_ipc refit converts (fused block128 for dense and shard destinations) bit-exact",
          "[convert][cuda_ipc]") {
  end_to_end(true);
}

TEST_CASE("nccl in place converts into staging buffers, and buffered nccl into its send buffers, bit-exact on cuda:1",
          "[convert][nccl]") {
#if REFIT_HAVE_NCCL
  if (!rt::nccl_ranks(2)) {
    WARN("no GPU: skipped");
    return;
  }
  for (const bool direct : {true, false}) {
    INFO((direct ? "in place" : "buffered"));
    const auto ep = rt::temp_endpoint();
    rt::signal_pipe ready;
    rt::child rx([&] { receiver_body(ep, ready, rt::gpu_of(1), false); });
    REQUIRE(ready.receive(60s) == "ready");
    rt::child tx([&] { streamer_body(ep, direct, true, false); });
    CHECK(tx.wait(180s) == 0);
    CHECK(rx.wait(60s) == 0);
  }
#else
  WARN("refit was built without NCCL: skipped");
#endif
}

TEST_CASE("two cuda_ipc receivers asking one tensor as different things refuse the session naming both",
          "[convert][cuda_ipc]") {
  const auto ep0 = rt::temp_endpoint();
  const auto ep1 = rt::temp_endpoint();
  rt::signal_pipe ready0, ready1, done;
  const auto receiver = [&](const std::string& ep, rt::signal_pipe& ready, bool fp8) {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    refit::receiver_options o;
    o.endpoint = ep;
    refit::receiver r(o);
    refit::cuda::device_buffer mem(256 * 256 * 2), scale(16);
    refit::tensor_dest d{{"w", fp8 ? dtype::f8_e4m3 : dtype::bf16, {256, 256}}, mem.handle(), refit::device::cuda(0)};
    if (fp8) {
      d.q = quant::block128;
      d.scale = scale.handle();
    }
    r.add_parameter(d);
    ready.send("ready");
    for (int i = 0; i < 300; ++i) {
      r.serve_one(100ms);
      if (done.try_receive(0ms)) break;
    }
  };
  rt::child r0([&] { receiver(ep0, ready0, true); });
  rt::child r1([&] { receiver(ep1, ready1, false); });
  REQUIRE(ready0.receive(60s) == "ready");
  REQUIRE(ready1.receive(60s) == "ready");
  rt::signal_pipe result;
  rt::child tx([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    refit::cuda::device_buffer src(256 * 256 * 4);
    refit::streamer_options o;
    o.receivers = {ep0, ep1};
    o.transport = refit::transport_kind::cuda_ipc;
    o.direct = true;
    o.timeout = 10000ms;
    refit::streamer st(o);
    const refit::tensor_ref t{{"w", dtype::f32, {256, 256}}, src.handle(), refit::device::cuda(0), nullptr};
    const auto f = rt::failure_of([&] { st.refit(1, std::span(&t, 1)); });
    result.send(f ? f->code + " | " + f->message : std::string("no failure"));
  });
  const std::string line = result.receive(60s);
  done.send("stop");
  done.send("stop");
  CHECK_THAT(line, Catch::StartsWith("invalid_argument | tensor 'w': receiver 1 of 2"));
  CHECK_THAT(line, Catch::Contains("asks for it as f8_e4m3 (block128) and receiver 2 of 2"));
  CHECK_THAT(line, Catch::Contains("as bf16"));
  CHECK(tx.wait(60s) == 0);
  CHECK(r0.wait(60s) == 0);
  CHECK(r1.wait(60s) == 0);
}

#endif
