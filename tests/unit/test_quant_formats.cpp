// The row formats of refit::quant — fp8 e4m3 per channel (one f32 scale per row) and MXFP8 (OCP
// Microscaling v1.0: an E8M0 scale per 32 elements of a row) — bit for bit against a reference
// written here from the specifications, not from the library: amax over finite values, the
// channel scale in f32 (448 / amax), the MX scale from floor(log2(amax)) in double precision, the
// nearest e4m3 code by search. Edge cases: all-zero groups, NaN and ±inf in the source, subnormal
// sources, each format's largest values, rows whose length is not a multiple of 32, single
// elements. Then the registration rules and two host_shm refits that write weights and scales in
// place.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "copy/convert.hpp"
#include "copy/copy.hpp"
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

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------ the reference, from the specs

/// Nearest e4m3fn code of a real value (double), ties to the even code, saturating to ±448; NaN →
/// 0x7F (OCP 8-bit floating point, e4m3 "fn": no infinities, S.1111.111 is NaN).
std::uint8_t e4m3_of(double x) {
  if (std::isnan(x)) return 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7e;
  std::uint8_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(ref::e4m3_value(static_cast<std::uint8_t>(c)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = static_cast<std::uint8_t>(c);
      best_d = d;
    }
  }
  return sign | best;
}

/// A row format's expected output: the codes, and the scale tensor's bytes.
struct expected {
  std::vector<std::uint8_t> q;
  std::vector<std::uint8_t> scale;
};

/// fp8 per channel of `x` viewed as rows of `cols`: per row amax of the finite |x| (at least
/// 1e-4), scale_inv = amax / 448 in f32, q = e4m3(f32(x · f32(448 / amax))).
expected channel_reference(const std::vector<float>& x, std::size_t cols) {
  const std::size_t rows = x.size() / cols;
  expected out;
  out.q.resize(x.size());
  out.scale.resize(rows * 4);
  for (std::size_t r = 0; r < rows; ++r) {
    float amax = 0.0f;
    for (std::size_t c = 0; c < cols; ++c)
      if (std::isfinite(x[r * cols + c])) amax = std::max(amax, std::fabs(x[r * cols + c]));
    amax = std::max(amax, 1e-4f);
    const float inv = amax / 448.0f;
    const float s = 448.0f / amax;
    std::memcpy(out.scale.data() + 4 * r, &inv, 4);
    for (std::size_t c = 0; c < cols; ++c) {
      const float product = x[r * cols + c] * s;  // the product in f32, as refit::quant says
      out.q[r * cols + c] = e4m3_of(product);
    }
  }
  return out;
}

/// MXFP8 of `x` viewed as rows of `cols`, blocks of 32 along each row (the last one shorter):
/// OCP MX v1.0 §6.3, shared_exp = floor(log2(amax)) - emax_elem (8 for e4m3), amax over finite
/// |x|; the E8M0 code is shared_exp + 127 clamped to [0, 254] (amax 0: code 0); elements are
/// x / 2^(code - 127), rounded to nearest even and saturated to ±448.
expected mxfp8_reference(const std::vector<float>& x, std::size_t cols) {
  const std::size_t rows = x.size() / cols;
  const std::size_t blocks = (cols + 31) / 32;
  expected out;
  out.q.resize(x.size());
  out.scale.resize(rows * blocks);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::size_t c0 = b * 32, c1 = std::min(cols, c0 + 32);
      double amax = 0.0;
      for (std::size_t c = c0; c < c1; ++c)
        if (std::isfinite(x[r * cols + c])) amax = std::max(amax, std::fabs(static_cast<double>(x[r * cols + c])));
      int code = 0;
      if (amax > 0.0) code = std::clamp(static_cast<int>(std::floor(std::log2(amax))) - 8 + 127, 0, 254);
      out.scale[r * blocks + b] = static_cast<std::uint8_t>(code);
      const double scale = std::ldexp(1.0, code - 127);
      for (std::size_t c = c0; c < c1; ++c) out.q[r * cols + c] = e4m3_of(static_cast<double>(x[r * cols + c]) / scale);
    }
  return out;
}

// ------------------------------------------------------------------ sources and the CPU engine

using ref::make_source;  // support/convert_ref.hpp
using ref::source_tensor;

/// Rows of `cols` with every edge case in its own row (when there are enough rows): row 0 all
/// zero; row 1 NaN, +inf and -inf among normal values; row 2 subnormal values only; row 3 the
/// largest values (the f32 maximum, and 448 · 2^k exactly); row 4 values whose MX block puts them
/// between 448 and 512 times X (they saturate); the rest random over many magnitudes.
std::vector<float> edge_values(std::size_t rows, std::size_t cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  const auto row = [&](std::size_t r) { return x.begin() + static_cast<std::ptrdiff_t>(r * cols); };
  if (rows > 0 && rows * cols > 1) std::fill(row(0), row(0) + static_cast<std::ptrdiff_t>(cols), 0.0f);
  if (rows > 1 && cols > 3) {
    x[cols + 0] = qnan;
    x[cols + 1] = inf;
    x[cols + 2] = -inf;
  }
  if (rows > 2)
    for (std::size_t c = 0; c < cols; ++c)
      x[2 * cols + c] = std::ldexp(static_cast<float>(1 + rng() % 100), -140) * (c % 2 == 0 ? 1.0f : -1.0f);
  if (rows > 3) {
    x[3 * cols] = std::numeric_limits<float>::max();
    if (cols > 1) x[3 * cols + 1] = -std::numeric_limits<float>::max();
    if (cols > 40) x[3 * cols + 40] = 448.0f * 1024.0f;
  }
  if (rows > 4)
    for (std::size_t c = 0; c < cols; ++c) x[4 * cols + c] = (c % 32 == 0) ? 511.0f : 480.0f - static_cast<float>(c);
  return x;
}

/// The CPU engine's scale pass and converting copies over `src` of `shape` as `q`, cut into ops
/// of `piece` elements: the codes and the scale tensor's bytes.
expected cpu_quantise(const source_tensor& src, dtype from, quant q, const std::vector<std::int64_t>& shape,
                      std::uint64_t piece) {
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::uint64_t n = *refit::checked_numel(shape);
  const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
  expected out;
  out.q.assign(n, 0xaa);
  out.scale.assign(groups * refit::itemsize(refit::scale_dtype(q)), 0xaa);
  std::vector<float> mul(groups, -1.0f);
  const refit::copy::scale_job job{src.bytes.data(), from, shape, q, out.scale.data(), mul.data()};
  copier->scales(std::span(&job, 1), nullptr);
  const auto cv = refit::copy::conversion_of(from, dtype::f8_e4m3, q, shape, mul.data());
  std::vector<refit::copy::convert_op> ops;
  for (std::uint64_t e = 0; e < n; e += piece) {
    const std::uint64_t count = std::min(piece, n - e);
    ops.push_back(
        refit::copy::convert_op{src.bytes.data() + e * refit::itemsize(from), out.q.data() + e, count, 1, 0, 0, e, cv});
  }
  copier->convert(ops, nullptr);
  return out;
}

using ref::differing;

float f32_at(const std::vector<std::uint8_t>& bytes, std::size_t i) {
  float f;
  std::memcpy(&f, bytes.data() + 4 * i, 4);
  return f;
}

}  // namespace

TEST_CASE("the reference of the row formats gives the values the specifications state", "[convert][quant]") {
  // Channel: an all-zero row takes amax 1e-4; NaN and inf do not count in amax and become 0x7F and
  // ±448.
  const expected ch = channel_reference({0.0f, 0.0f, 0.0f, 0.0f, 1.0f, qnan, inf, -2.0f}, 4);
  CHECK(f32_at(ch.scale, 0) == 1e-4f / 448.0f);
  CHECK(f32_at(ch.scale, 1) == 2.0f / 448.0f);
  // 1 · 224 = 1.75 · 2^7 = 0x76; -2 · 224 = -448 = 0xFE.
  CHECK(ch.q == std::vector<std::uint8_t>{0, 0, 0, 0, 0x76, 0x7f, 0x7e, 0xfe});
  // MX: amax 1 → shared exponent 0 - 8 → code 119, X = 2^-8; 1 / X = 256 = 0x78 in e4m3.
  const expected mx = mxfp8_reference({1.0f, 0.5f, -1.0f, 0.0f}, 4);
  CHECK(mx.scale == std::vector<std::uint8_t>{119});
  CHECK(mx.q == std::vector<std::uint8_t>{0x78, 0x70, 0xf8, 0x00});
  // amax 1.9 → still 2^-8: 1.9 · 256 = 486.4 saturates to 448.
  CHECK(mxfp8_reference({1.9f}, 1).q == std::vector<std::uint8_t>{0x7e});
  // All zero, and all non-finite: code 0 (X = 2^-127).
  CHECK(mxfp8_reference({0.0f, -0.0f}, 2).scale == std::vector<std::uint8_t>{0});
  CHECK(mxfp8_reference({0.0f, -0.0f}, 2).q == std::vector<std::uint8_t>{0x00, 0x80});
  CHECK(mxfp8_reference({qnan, -inf}, 2).scale == std::vector<std::uint8_t>{0});
  CHECK(mxfp8_reference({qnan, -inf}, 2).q == std::vector<std::uint8_t>{0x7f, 0xfe});
  // The f32 maximum: floor(log2) = 127 → code 246; it lands at 2^127 · 1.99… / 2^119 ≈ 510: 448.
  CHECK(mxfp8_reference({std::numeric_limits<float>::max()}, 1).scale == std::vector<std::uint8_t>{246});
  CHECK(mxfp8_reference({std::numeric_limits<float>::max()}, 1).q == std::vector<std::uint8_t>{0x7e});
}

TEST_CASE("the E8M0 helpers follow OCP's definition", "[convert][quant]") {
  namespace cvt = refit::copy::cvt;
  CHECK(cvt::e8m0_of(1.0f) == 119);
  CHECK(cvt::e8m0_of(0.0f) == 0);
  CHECK(cvt::e8m0_of(std::ldexp(1.0f, -119)) == 0);
  CHECK(cvt::e8m0_of(std::ldexp(1.0f, -118)) == 1);
  CHECK(cvt::e8m0_of(std::numeric_limits<float>::denorm_min()) == 0);
  CHECK(cvt::e8m0_of(std::numeric_limits<float>::max()) == 246);
  CHECK(cvt::e8m0_multiplier(127) == 1.0f);
  CHECK(cvt::e8m0_multiplier(0) == std::ldexp(1.0f, 127));
  CHECK(cvt::e8m0_multiplier(254) == std::ldexp(1.0f, -127));
  CHECK(cvt::e8m0_multiplier(253) == std::ldexp(1.0f, -126));
  for (int k = -149; k <= 127; ++k) CHECK(cvt::floor_log2(std::ldexp(1.0f, k)) == k);
  CHECK(cvt::floor_log2(std::ldexp(3.0f, -148)) == -147);
}

TEST_CASE("the CPU engine quantises per channel bit for bit like the reference, however the tensor is cut",
          "[convert][quant]") {
  const dtype from = GENERATE(dtype::bf16, dtype::f32, dtype::f16);
  const std::uint64_t piece = GENERATE(1, 7, 37, 1000, 1u << 20);
  INFO(refit::to_string(from) << ", pieces of " << piece);
  const std::size_t rows = 9, cols = 37;
  const source_tensor src = make_source(from, edge_values(rows, cols, 11));
  const expected got = cpu_quantise(src, from, quant::channel, {9, 37}, piece);
  const expected want = channel_reference(src.values, cols);
  std::string first;
  CHECK(differing(got.q, want.q, first) == 0);
  INFO(first);
  CHECK(got.scale == want.scale);
  CHECK(f32_at(got.scale, 0) == 1e-4f / 448.0f);  // the all-zero row
}

TEST_CASE("the CPU engine quantises stacked 3-d tensors, rank-1 tensors and single elements per channel",
          "[convert][quant]") {
  const dtype from = GENERATE(dtype::bf16, dtype::f32);
  INFO(refit::to_string(from));
  for (const std::vector<std::int64_t>& shape :
       {std::vector<std::int64_t>{2, 6, 33}, std::vector<std::int64_t>{50}, std::vector<std::int64_t>{1},
        std::vector<std::int64_t>{1, 1}, std::vector<std::int64_t>{5, 1}}) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    const source_tensor src = make_source(from, edge_values(n / cols, cols, 3));
    const expected got = cpu_quantise(src, from, quant::channel, shape, 5);
    INFO("shape of " << n << " elements, rows of " << cols);
    CHECK(got.scale.size() == 4 * (n / cols));
    CHECK(got.q == channel_reference(src.values, cols).q);
    CHECK(got.scale == channel_reference(src.values, cols).scale);
  }
}

TEST_CASE("the CPU engine quantises to MXFP8 bit for bit like the reference, short last blocks included",
          "[convert][quant]") {
  const dtype from = GENERATE(dtype::bf16, dtype::f32, dtype::f16);
  const std::uint64_t cols = GENERATE(70, 64, 32, 31, 1);
  const std::uint64_t piece = GENERATE(1, 13, 32, 1u << 20);
  INFO(refit::to_string(from) << ", rows of " << cols << ", pieces of " << piece);
  const std::size_t rows = 8;
  const source_tensor src = make_source(from, edge_values(rows, cols, 5));
  const expected got = cpu_quantise(src, from, quant::mxfp8, {8, static_cast<std::int64_t>(cols)}, piece);
  const expected want = mxfp8_reference(src.values, cols);
  std::string first;
  CHECK(differing(got.q, want.q, first) == 0);
  INFO(first);
  CHECK(got.scale == want.scale);
  REQUIRE(got.scale.size() == rows * ((cols + 31) / 32));
  CHECK(got.scale[0] == 0);                                          // the all-zero row's blocks
  CHECK(std::count(got.scale.begin(), got.scale.end(), 0xff) == 0);  // never NaN
}

TEST_CASE("the CPU engine quantises stacked 3-d tensors, rank-1 tensors and single elements to MXFP8",
          "[convert][quant]") {
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{3, 5, 40}, std::vector<std::int64_t>{100},
                                                 std::vector<std::int64_t>{1}, std::vector<std::int64_t>{1, 1}}) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    std::vector<float> x = edge_values(n / cols, cols, 9);
    if (n == 1) x[0] = 3.0f;
    const source_tensor src = make_source(dtype::bf16, x);
    const expected got = cpu_quantise(src, dtype::bf16, quant::mxfp8, shape, 7);
    INFO("shape of " << n << " elements, rows of " << cols);
    CHECK(got.q == mxfp8_reference(src.values, cols).q);
    CHECK(got.scale == mxfp8_reference(src.values, cols).scale);
  }
  // 3 = 1.5 · 2^1: code 1 - 8 + 127 = 120, element 3 · 2^7 = 384 = 0x7C.
  const source_tensor one = make_source(dtype::f32, {3.0f});
  const expected got = cpu_quantise(one, dtype::f32, quant::mxfp8, {1}, 1);
  CHECK(got.scale == std::vector<std::uint8_t>{120});
  CHECK(got.q == std::vector<std::uint8_t>{0x7c});
}

// ======================================================================= registration

namespace {

std::string registration_error(const refit::tensor_dest& d, const refit::dest_layout& l = {}) {
  const rt::scoped_endpoint ep;
  refit::receiver_options o;
  o.endpoint = ep.name;
  refit::receiver r(o);
  try {
    r.add_parameter(d, l);
  } catch (const refit::error& e) {
    return std::string(refit::to_string(e.code())) + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("row-format registrations are checked: scale, rank and slices on block edges", "[convert][quant]") {
  std::vector<std::uint8_t> mem(1 << 16);
  refit::tensor_dest d{{"w", dtype::f8_e4m3, {64, 100}}, mem.data(), refit::device::cpu()};
  d.q = quant::mxfp8;
  d.scale = mem.data() + 8192;
  CHECK(registration_error(d) == "accepted");
  d.q = quant::channel;
  CHECK(registration_error(d) == "accepted");
  auto no_scale = d;
  no_scale.scale = nullptr;
  CHECK(registration_error(no_scale) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 100]) is quantised (channel) but has no scale: pass "
        "its f32 scale_inv tensor of shape [64, 1]");
  no_scale.q = quant::mxfp8;
  CHECK(registration_error(no_scale) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 100]) is quantised (mxfp8) but has no scale: pass "
        "its f8_e8m0 scale tensor of shape [64, 4]");
  auto scalar = d;
  scalar.meta.shape = {};
  scalar.q = quant::mxfp8;
  CHECK(registration_error(scalar) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[]) asks for quant mxfp8, which quantises along the last "
        "dimension: it needs at least 1 dimension, not 0");
  auto bf = d;
  bf.meta.type = dtype::bf16;
  CHECK(registration_error(bf) ==
        "invalid_argument: add_parameter: 'w' (w bf16[64, 100]) asks for quant channel, which quantises to f8_e4m3: "
        "register the destination as f8_e4m3, not bf16");
  auto unknown = d;
  unknown.q = static_cast<quant>(6);
  CHECK(registration_error(unknown) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 100]) has an unknown "
        "quant (code 6)");
  refit::dest_layout shard;
  auto mx = d;
  mx.q = quant::mxfp8;
  mx.meta.shape = {64, 50};
  shard.slice = refit::source_slice{1, 40, 50};
  CHECK(registration_error(mx, shard) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 50]): mxfp8 scales are computed over the global "
        "tensor's MX blocks of 32 elements of a row, so a slice of dimension 1 must start on a block boundary (a "
        "multiple of 32); this one starts at 40");
  shard.slice = refit::source_slice{1, 64, 50};
  CHECK(registration_error(mx, shard) == "accepted");
  shard.slice = refit::source_slice{0, 3, 64};  // rows: any start
  CHECK(registration_error(mx, shard) == "accepted");
  auto ch = d;
  ch.meta.shape = {64, 50};
  shard.slice = refit::source_slice{1, 7, 50};  // a row shard of a channel weight takes the global row's scale
  CHECK(registration_error(ch, shard) == "accepted");
}

// ======================================================================= end to end over host_shm

namespace {

/// Two versions of each source and what the receiver must hold after each.
struct formats_model {
  struct source {
    std::string name;
    dtype type;
    std::vector<std::int64_t> shape;
    source_tensor t[2];
  };
  std::vector<source> sources;

  formats_model() {
    add("w_channel", dtype::bf16, {64, 100}, 1);  // fp8 per channel, f32 scales [64, 1]
    add("w_mx", dtype::f32, {48, 70}, 2);         // MXFP8, e8m0 scales [48, 3]
    add("w_mx_big", dtype::bf16, {256, 200}, 3);  // MXFP8 over several 16 KiB buffers
    add("w_mx_shard", dtype::bf16, {16, 70}, 4);  // MXFP8, a column shard [32:70] (a short last block)
    add("w_ch_rows", dtype::bf16, {40, 30}, 5);   // per channel, a row shard [10:30]
  }
  void add(std::string name, dtype type, std::vector<std::int64_t> shape, std::uint32_t seed) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    source s{std::move(name), type, shape, {}};
    for (int v = 0; v < 2; ++v) s.t[v] = make_source(type, edge_values(n / cols, cols, seed * 10 + v));
    sources.push_back(std::move(s));
  }
  const source& get(const std::string& name) const {
    for (const auto& s : sources)
      if (s.name == name) return s;
    throw std::runtime_error("no source " + name);
  }
  std::vector<refit::tensor_ref> refs(int version) const {
    std::vector<refit::tensor_ref> out;
    for (const auto& s : sources)
      out.push_back(
          refit::tensor_ref{{s.name, s.type, s.shape}, s.t[version].bytes.data(), refit::device::cpu(), nullptr});
    return out;
  }
};

/// Registers weight and scale destinations once, serves two refits and after each checks every
/// byte of both against the reference; sends "v<version> <problems>" after each.
void serve_formats(const std::string& endpoint, const formats_model& m, rt::signal_pipe& result,
                   rt::signal_pipe& stop) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = 5000ms;
  refit::receiver r(o);
  std::vector<std::uint8_t> q_ch(64 * 100), s_ch(64 * 4), q_mx(48 * 70), s_mx(48 * 3), q_big(256 * 200), s_big(256 * 7),
      q_shard(16 * 38), s_shard(16 * 2), q_rows(20 * 30), s_rows(20 * 4);
  const auto fp8 = [](const char* name, std::vector<std::int64_t> shape, std::vector<std::uint8_t>& mem,
                      std::vector<std::uint8_t>& scale, quant q) {
    refit::tensor_dest d{{name, dtype::f8_e4m3, std::move(shape)}, mem.data(), refit::device::cpu()};
    d.q = q;
    d.scale = scale.data();
    return d;
  };
  r.add_parameter(fp8("w_channel", {64, 100}, q_ch, s_ch, quant::channel));
  r.add_parameter(fp8("w_mx", {48, 70}, q_mx, s_mx, quant::mxfp8));
  r.add_parameter(fp8("w_mx_big", {256, 200}, q_big, s_big, quant::mxfp8));
  refit::dest_layout cols, rows;
  cols.slice = refit::source_slice{1, 32, 38};
  rows.slice = refit::source_slice{0, 10, 20};
  r.add_parameter(fp8("w_mx_shard", {16, 38}, q_shard, s_shard, quant::mxfp8), cols);
  r.add_parameter(fp8("w_ch_rows", {20, 30}, q_rows, s_rows, quant::channel), rows);
  const std::vector<const void*> addresses{q_ch.data(),  s_ch.data(),    q_mx.data(),    s_mx.data(),   q_big.data(),
                                           s_big.data(), q_shard.data(), s_shard.data(), q_rows.data(), s_rows.data()};

  for (int v = 0; v < 2; ++v) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
      const auto e = r.serve_one(100ms);
      if (e == refit::receiver_event::committed) break;
      if (e == refit::receiver_event::aborted || e == refit::receiver_event::refused) {
        result.send("v" + std::to_string(v + 1) + " refit failed: " + r.last_error());
        return;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        result.send("v" + std::to_string(v + 1) + " no commit within 20 s");
        return;
      }
    }
    std::string problems;
    const auto check = [&](const std::string& what, bool ok) {
      if (!ok) problems += what + " differs; ";
    };
    const expected ch = channel_reference(m.get("w_channel").t[v].values, 100);
    check("w_channel", q_ch == ch.q);
    check("w_channel scale", s_ch == ch.scale);
    const expected mx = mxfp8_reference(m.get("w_mx").t[v].values, 70);
    check("w_mx", q_mx == mx.q);
    check("w_mx scale", s_mx == mx.scale);
    const expected big = mxfp8_reference(m.get("w_mx_big").t[v].values, 200);
    check("w_mx_big", q_big == big.q);
    check("w_mx_big scale", s_big == big.scale);
    const expected sh = mxfp8_reference(m.get("w_mx_shard").t[v].values, 70);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < 16; ++i) {
      for (std::size_t c = 0; c < 38; ++c) wrong += q_shard[i * 38 + c] != sh.q[i * 70 + 32 + c];
      for (std::size_t b = 0; b < 2; ++b) wrong += s_shard[i * 2 + b] != sh.scale[i * 3 + 1 + b];
    }
    check("w_mx_shard", wrong == 0);
    const expected cr = channel_reference(m.get("w_ch_rows").t[v].values, 30);
    check("w_ch_rows", std::equal(q_rows.begin(), q_rows.end(), cr.q.begin() + 10 * 30));
    check("w_ch_rows scale", std::equal(s_rows.begin(), s_rows.end(), cr.scale.begin() + 10 * 4));
    const std::vector<const void*> now{q_ch.data(),  s_ch.data(),    q_mx.data(),    s_mx.data(),   q_big.data(),
                                       s_big.data(), q_shard.data(), s_shard.data(), q_rows.data(), s_rows.data()};
    check("an address", now == addresses);
    result.send("v" + std::to_string(v + 1) + " " + problems);
  }
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!stop.try_receive(0ms)) {
    r.serve_one(20ms);
    if (std::chrono::steady_clock::now() > deadline) return;
  }
}

}  // namespace

TEST_CASE("two host_shm refits write per-channel and MXFP8 weights and their scales in place, bit for bit",
          "[convert][quant]") {
  const formats_model model;
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe result, stop;
  rt::child rx([&] { serve_formats(endpoint.name, model, result, stop); });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 16 << 10, refit::milliseconds{5000}));
  const auto v1 = model.refs(0);
  const refit::refit_stats stats = s.refit(1, v1);
  CHECK(result.receive(30s) == "v1 ");
  CHECK(stats.tensors == 2 * v1.size());  // each weight and its scale tensor
  CHECK(stats.batches > 2);               // w_mx_big took several
  const auto v2 = model.refs(1);
  s.refit(2, v2);
  CHECK(result.receive(30s) == "v2 ");
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}
