// NVFP4 (refit::quant::nvfp4) and the swizzled 128 × 4 scale layout (refit::scale_layout) bit for
// bit against a reference written here from the definitions, not from the library: NVIDIA's NVFP4
// as TensorRT-Model-Optimizer's NVFP4QTensor computes it (per-tensor scale amax / (6 · 448), block
// scale e4m3((amax_block / 6) / scale_2), 1.0 for an all-zero block, elements e2m1(x / (block
// scale · scale_2)), low nibble first), the nearest e2m1 value found by search with ties to the even
// code; the swizzle as vLLM's swizzle_blockscale writes it (pad to 128 × 4, reshape to
// [R/128, 4, 32, C/4, 4], permute to (0, 3, 2, 1, 4)). Edge cases: all-zero blocks and tensors,
// NaN and ±inf, subnormal sources, the largest values, rows that are not a multiple of 16.
// Then the registration rules and host_shm refits that write codes and both scales in place.
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
using refit::scale_layout;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------ the reference

/// The e2m1 values of codes 0..7 (OCP MX v1.0 §5.3.3: FP4 E2M1, no inf or NaN).
constexpr double e2m1_values[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

/// Nearest e2m1 code of x, ties to the even code, saturating to ±6; the sign is x's; NaN → 0.
std::uint8_t e2m1_of(float x) {
  if (std::isnan(x)) return 0;
  const std::uint8_t sign = std::signbit(x) ? 0x8 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 6.0) return sign | 7;  // saturating (±inf too)
  std::uint8_t best = 7;
  double best_d = std::numeric_limits<double>::infinity();
  for (std::uint8_t c = 0; c < 8; ++c) {
    const double d = std::fabs(e2m1_values[c] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

struct nvfp4_expected {
  std::vector<std::uint8_t> q;      ///< packed, two a byte
  std::vector<std::uint8_t> scale;  ///< e4m3 codes, row-major [rows, ceil(cols / 16)]
  float scale_2 = 0.0f;
};

/// NVFP4 of x viewed as rows of `cols` (even), in f32 arithmetic as modelopt's torch code does it.
nvfp4_expected nvfp4_reference(const std::vector<float>& x, std::size_t cols) {
  const std::size_t rows = x.size() / cols;
  const std::size_t blocks = (cols + 15) / 16;
  float amax = 0.0f;
  for (const float v : x)
    if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
  nvfp4_expected out;
  out.scale_2 = amax / 2688.0f;
  out.q.assign(x.size() / 2, 0);
  out.scale.resize(rows * blocks);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::size_t c0 = b * 16, c1 = std::min(cols, c0 + 16);
      float a = 0.0f;
      for (std::size_t c = c0; c < c1; ++c)
        if (std::isfinite(x[r * cols + c])) a = std::max(a, std::fabs(x[r * cols + c]));
      const float per_block = a / 6.0f;
      const std::uint8_t code = per_block == 0.0f ? ref::e4m3(1.0f) : ref::e4m3(per_block / out.scale_2);
      out.scale[r * blocks + b] = code;
      const float d = static_cast<float>(ref::e4m3_value(code)) * out.scale_2;
      for (std::size_t c = c0; c < c1; ++c) {
        const float v = x[r * cols + c];
        // d = 0: the block is worth 0 whatever its codes; refit writes ±0 (NaN: +0).
        const std::uint8_t e = d == 0.0f ? (std::isnan(v) ? 0 : std::signbit(v) ? 0x8 : 0) : e2m1_of(v / d);
        out.q[(r * cols + c) / 2] |= static_cast<std::uint8_t>(e << (4 * (c % 2)));
      }
    }
  return out;
}

/// vLLM's swizzle_blockscale of a [lead, rows, cols] grid of one-byte scales: padded with zeros
/// to [lead, R', C'], reshaped to [lead, R'/128, 4, 32, C'/4, 4], permuted to (0, 1, 4, 3, 2, 5).
std::vector<std::uint8_t> swizzle_reference(const std::vector<std::uint8_t>& s, std::size_t lead, std::size_t rows,
                                            std::size_t cols) {
  const std::size_t pr = (rows + 127) / 128 * 128, pc = (cols + 3) / 4 * 4;
  std::vector<std::uint8_t> out(lead * pr * pc, 0);
  std::size_t at = 0;
  for (std::size_t l = 0; l < lead; ++l)
    for (std::size_t rb = 0; rb < pr / 128; ++rb)
      for (std::size_t cb = 0; cb < pc / 4; ++cb)
        for (std::size_t j = 0; j < 32; ++j)
          for (std::size_t i = 0; i < 4; ++i)
            for (std::size_t k = 0; k < 4; ++k, ++at) {
              const std::size_t r = rb * 128 + i * 32 + j, c = cb * 4 + k;
              if (r < rows && c < cols) out[at] = s[(l * rows + r) * cols + c];
            }
  return out;
}

// ------------------------------------------------------------------ sources and the CPU engine

using ref::make_source;  // support/convert_ref.hpp
using ref::source_tensor;

/// Rows of `cols` with an edge case per row: row 0 all zero; row 1 NaN, ±inf among normal values;
/// row 2 subnormal values only; row 3 the f32 maximum; row 4 a block whose scale underflows
/// (tiny values beside row 3's huge ones); row 5 exact e2m1 midpoints of its block; then random.
std::vector<float> edge_values(std::size_t rows, std::size_t cols, std::uint32_t seed, bool huge = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
  const auto at = [&](std::size_t r, std::size_t c) -> float& { return x[r * cols + c]; };
  if (rows > 0)
    for (std::size_t c = 0; c < cols; ++c) at(0, c) = c % 2 == 0 ? 0.0f : -0.0f;
  if (rows > 1 && cols > 3) at(1, 0) = qnan, at(1, 1) = inf, at(1, 2) = -inf;
  if (rows > 2)
    for (std::size_t c = 0; c < cols; ++c)
      at(2, c) = std::ldexp(static_cast<float>(1 + rng() % 100), -140) * (c % 2 == 0 ? 1.0f : -1.0f);
  if (rows > 3 && huge) at(3, 0) = std::numeric_limits<float>::max() / 2, at(3, 1) = -at(3, 0);
  if (rows > 4)
    for (std::size_t c = 0; c < cols; ++c) at(4, c) = std::ldexp(1.0f, -100) * static_cast<float>(c + 1);
  if (rows > 5) {
    // Block amax 6 → its values land on multiples of 0.25 of the e2m1 grid when scale_2 allows.
    const float mids[8] = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    for (std::size_t c = 0; c < cols; ++c) at(5, c) = mids[c % 8] * (c % 3 == 0 ? -1.0f : 1.0f);
  }
  return x;
}

/// The CPU engine's scale pass and converting copies over `src` of `shape`, cut into ops of
/// `piece` elements (even).
nvfp4_expected cpu_nvfp4(const source_tensor& src, dtype from, const std::vector<std::int64_t>& shape,
                         std::uint64_t piece, scale_layout layout = scale_layout::row_major) {
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::uint64_t n = *refit::checked_numel(shape);
  const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(quant::nvfp4, shape));
  nvfp4_expected out;
  out.q.assign(n / 2, 0xaa);
  out.scale.assign(*refit::checked_numel(refit::scale_shape(quant::nvfp4, shape, layout)), 0xaa);
  out.scale_2 = -1.0f;
  std::vector<float> mul(groups, -1.0f);
  const refit::copy::scale_job job{src.bytes.data(), from,       shape,        quant::nvfp4,
                                   out.scale.data(), mul.data(), &out.scale_2, layout};
  copier->scales(std::span(&job, 1), nullptr);
  const auto cv = refit::copy::conversion_of(from, dtype::f4_e2m1x2, quant::nvfp4, shape, mul.data());
  std::vector<refit::copy::convert_op> ops;
  for (std::uint64_t e = 0; e < n; e += piece) {
    const std::uint64_t count = std::min(piece, n - e);
    ops.push_back(refit::copy::convert_op{src.bytes.data() + e * refit::itemsize(from), out.q.data() + e / 2, count, 1,
                                          0, 0, e, cv});
  }
  copier->convert(ops, nullptr);
  return out;
}

using ref::differing;

}  // namespace

TEST_CASE("the NVFP4 reference gives the values NVIDIA's definition states", "[convert][quant][nvfp4]") {
  // amax 6 → scale_2 = 6 / 2688; the block's scale (6 / 6) / scale_2 = 448 (0x7E); d = 6 / 6 = 1
  // up to rounding: 6 → 7, 0.25 → 0 (tie to even), 0.75 → 2 (1.0), -1.25 → 0xA (-1.0).
  const nvfp4_expected a = nvfp4_reference({6.0f, 0.25f, 0.75f, -1.25f}, 4);
  CHECK(a.scale_2 == 6.0f / 2688.0f);
  CHECK(a.scale == std::vector<std::uint8_t>{0x7e});
  CHECK(a.q == std::vector<std::uint8_t>{0x07, 0xa2});
  // An all-zero tensor: scale_2 0, block scale 1.0 (0x38), elements ±0 (-0 keeps its sign).
  const nvfp4_expected z = nvfp4_reference({0.0f, -0.0f}, 2);
  CHECK(z.scale_2 == 0.0f);
  CHECK(z.scale == std::vector<std::uint8_t>{0x38});
  CHECK(z.q == std::vector<std::uint8_t>{0x80});
  // NaN and inf do not count in amax; inf saturates to ±6, NaN is sent as +0.
  const nvfp4_expected n = nvfp4_reference({qnan, inf, -inf, 3.0f}, 4);
  CHECK(n.scale_2 == 3.0f / 2688.0f);
  CHECK(n.q == std::vector<std::uint8_t>{0x70, 0x7f});
}

TEST_CASE("the e2m1 and e4m3 helpers round and decode as the formats define", "[convert][quant][nvfp4]") {
  namespace cvt = refit::copy::cvt;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    if ((c & 0x7f) == 0x7f) continue;
    CHECK(static_cast<double>(cvt::e4m3_to_f32(code)) == ref::e4m3_value(code));
  }
  // Every f32 from 0 to 8 in steps of 1/64, both signs, against the search.
  for (int k = 0; k <= 512; ++k)
    for (const float s : {1.0f, -1.0f}) {
      const float x = s * static_cast<float>(k) / 64.0f;
      CHECK(cvt::f32_to_e2m1(x) == e2m1_of(x));
    }
  CHECK(cvt::f32_to_e2m1(std::nextafter(0.25f, 1.0f)) == 1);
  CHECK(cvt::f32_to_e2m1(std::nextafter(5.0f, 6.0f)) == 7);
  CHECK(cvt::f32_to_e2m1(inf) == 7);
  CHECK(cvt::f32_to_e2m1(-inf) == 0xf);
  CHECK(cvt::f32_to_e2m1(qnan) == 0);
  CHECK(cvt::f32_to_e2m1(std::numeric_limits<float>::denorm_min()) == 0);
  CHECK(cvt::f32_to_e2m1(-std::numeric_limits<float>::max()) == 0xf);
}

TEST_CASE("the CPU engine quantises to NVFP4 bit for bit like the reference, however the tensor is cut",
          "[convert][quant][nvfp4]") {
  const dtype from = GENERATE(dtype::bf16, dtype::f32, dtype::f16);
  const std::uint64_t cols = GENERATE(64, 40, 16, 30, 2);
  const std::uint64_t piece = GENERATE(2, 14, 16, 1u << 20);
  const bool huge = GENERATE(true, false);
  INFO(refit::to_string(from) << ", rows of " << cols << ", pieces of " << piece << (huge ? ", huge row" : ""));
  const std::size_t rows = 9;
  // f16 cannot hold the f32 maximum: it becomes inf, which does not count.
  const source_tensor src = make_source(from, edge_values(rows, cols, 7, huge));
  const nvfp4_expected got = cpu_nvfp4(src, from, {9, static_cast<std::int64_t>(cols)}, piece);
  const nvfp4_expected want = nvfp4_reference(src.values, cols);
  std::string first;
  CHECK(differing(got.q, want.q, first) == 0);
  INFO(first);
  CHECK(got.scale == want.scale);
  CHECK(got.scale_2 == want.scale_2);
  CHECK(got.scale[0] == 0x38);  // the all-zero row's first block
}

TEST_CASE("the CPU engine quantises stacked 3-d tensors, rank-1 tensors and all-zero tensors to NVFP4",
          "[convert][quant][nvfp4]") {
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{3, 5, 40}, std::vector<std::int64_t>{100},
                                                 std::vector<std::int64_t>{2}, std::vector<std::int64_t>{1, 2}}) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    const source_tensor src = make_source(dtype::bf16, edge_values(n / cols, cols, 13));
    const nvfp4_expected got = cpu_nvfp4(src, dtype::bf16, shape, 6);
    INFO("shape of " << n << " elements, rows of " << cols);
    const nvfp4_expected want = nvfp4_reference(src.values, cols);
    CHECK(got.q == want.q);
    CHECK(got.scale == want.scale);
    CHECK(got.scale_2 == want.scale_2);
  }
  const source_tensor zero = make_source(dtype::f32, std::vector<float>(64, 0.0f));
  const nvfp4_expected z = cpu_nvfp4(zero, dtype::f32, {2, 32}, 64);
  CHECK(z.scale_2 == 0.0f);
  CHECK(z.scale == std::vector<std::uint8_t>(4, 0x38));
  CHECK(z.q == std::vector<std::uint8_t>(32, 0));
}

TEST_CASE("swizzled 128 x 4 scales are vLLM's swizzle_blockscale of the row-major ones, padding zero",
          "[convert][quant][nvfp4]") {
  CHECK(refit::scale_shape(quant::nvfp4, std::vector<std::int64_t>{200, 144}, scale_layout::swizzled_128x4) ==
        std::vector<std::int64_t>{256, 12});
  CHECK(refit::scale_shape(quant::mxfp8, std::vector<std::int64_t>{3, 5, 40}, scale_layout::swizzled_128x4) ==
        std::vector<std::int64_t>{3, 128, 4});
  CHECK(refit::scale_shape(quant::nvfp4, std::vector<std::int64_t>{64}, scale_layout::swizzled_128x4) ==
        std::vector<std::int64_t>{128, 4});
  for (const std::vector<std::int64_t>& shape :
       {std::vector<std::int64_t>{200, 144}, std::vector<std::int64_t>{130, 16}, std::vector<std::int64_t>{2, 7, 96},
        std::vector<std::int64_t>{64}}) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    const std::size_t rows = shape.size() >= 2 ? static_cast<std::size_t>(shape[shape.size() - 2]) : 1;
    const std::size_t lead = n / (rows * cols);
    INFO("shape of " << n << " elements, rows of " << cols);
    const source_tensor src = make_source(dtype::bf16, edge_values(n / cols, cols, 17));
    const nvfp4_expected row_major = cpu_nvfp4(src, dtype::bf16, shape, 1u << 20);
    const nvfp4_expected swizzled = cpu_nvfp4(src, dtype::bf16, shape, 1u << 20, scale_layout::swizzled_128x4);
    CHECK(swizzled.q == row_major.q);
    CHECK(swizzled.scale_2 == row_major.scale_2);
    CHECK(swizzled.scale == swizzle_reference(row_major.scale, lead, rows, (cols + 15) / 16));
  }
  // mxfp8's E8M0 scales the same way.
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::vector<std::int64_t> shape{150, 200};
  const source_tensor src = make_source(dtype::f32, edge_values(150, 200, 19));
  std::vector<std::uint8_t> plain(150 * 7), swz(256 * 8, 0xaa);
  std::vector<float> mul(150 * 7), mul2(150 * 7);
  const refit::copy::scale_job a{src.bytes.data(), dtype::f32, shape, quant::mxfp8, plain.data(), mul.data()};
  const refit::copy::scale_job b{src.bytes.data(), dtype::f32,  shape,   quant::mxfp8,
                                 swz.data(),       mul2.data(), nullptr, scale_layout::swizzled_128x4};
  copier->scales(std::span(&a, 1), nullptr);
  copier->scales(std::span(&b, 1), nullptr);
  CHECK(mul == mul2);
  CHECK(swz == swizzle_reference(plain, 1, 150, 7));
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

TEST_CASE("NVFP4 and swizzled registrations are checked: dtype, both scales, layouts and slices",
          "[convert][quant][nvfp4]") {
  std::vector<std::uint8_t> mem(1 << 16);
  refit::tensor_dest d{{"w", dtype::f4_e2m1x2, {64, 50}}, mem.data(), refit::device::cpu()};
  d.q = quant::nvfp4;
  d.scale = mem.data() + 8192;
  d.scale_2 = mem.data() + 16384;
  CHECK(registration_error(d) == "accepted");
  d.layout = scale_layout::swizzled_128x4;
  CHECK(registration_error(d) == "accepted");
  auto no_scale = d;
  no_scale.scale = nullptr;
  CHECK(registration_error(no_scale) ==
        "invalid_argument: add_parameter: 'w' (w f4_e2m1x2[64, 50]) is quantised (nvfp4) but has no scale: pass "
        "its f8_e4m3 scale tensor of shape [128, 8]");
  auto no_scale_2 = d;
  no_scale_2.scale_2 = nullptr;
  CHECK(registration_error(no_scale_2) ==
        "invalid_argument: add_parameter: 'w' (w f4_e2m1x2[64, 50]) is quantised (nvfp4) but has no scale_2: pass "
        "its f32 per-tensor scale (one element, a checkpoint's weight_scale_2)");
  auto fp8 = d;
  fp8.meta.type = dtype::f8_e4m3;
  CHECK(registration_error(fp8) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 50]) asks for quant nvfp4, which quantises to "
        "f4_e2m1x2: register the destination as f4_e2m1x2, not f8_e4m3");
  auto channel = d;
  channel.meta.type = dtype::f8_e4m3;
  channel.q = quant::channel;
  channel.scale_2 = nullptr;
  CHECK(registration_error(channel) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 50]) asks for scale layout swizzled_128x4 with quant "
        "channel: only mxfp8 and nvfp4 scales are swizzled");
  channel.layout = scale_layout::row_major;
  channel.scale_2 = mem.data() + 16384;
  CHECK(registration_error(channel) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[64, 50]) has a scale_2, which only nvfp4 destinations "
        "have (their per-tensor scale)");
  refit::dest_layout rows;
  rows.slice = refit::source_slice{0, 0, 64};
  CHECK(registration_error(d, rows) ==
        "invalid_argument: add_parameter: 'w' (w f4_e2m1x2[64, 50]) takes a slice of its source, but its scales are "
        "swizzled_128x4: a swizzled scale grid covers the whole matrix; register the whole tensor, or row-major "
        "scales");
  auto plain = d;
  plain.layout = scale_layout::row_major;
  CHECK(registration_error(plain, rows) ==
        "invalid_argument: add_parameter: 'w' (w f4_e2m1x2[64, 50]) takes a slice of its source, but nvfp4's "
        "per-tensor scale is the whole source's: register the whole tensor");
  auto overlap = plain;
  overlap.scale_2 = mem.data() + 8192;  // on the block scales
  CHECK(registration_error(overlap) ==
        "invalid_argument: add_parameter: the destination of 'w' (w f4_e2m1x2[64, 50]), its scale and its scale_2 "
        "share bytes");
  auto unknown = plain;
  unknown.q = static_cast<quant>(6);
  CHECK(registration_error(unknown) ==
        "invalid_argument: add_parameter: 'w' (w f4_e2m1x2[64, 50]) has an unknown quant (code 6)");
}

// ======================================================================= end to end over host_shm

namespace {

struct nvfp4_source {
  std::string name;
  dtype type;
  std::vector<std::int64_t> shape;
  quant q;
  scale_layout layout;
  source_tensor t[2];
};

std::vector<nvfp4_source> nvfp4_sources() {
  std::vector<nvfp4_source> out;
  const auto add = [&](std::string name, dtype type, std::vector<std::int64_t> shape, quant q, scale_layout l,
                       std::uint32_t seed) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const auto cols = static_cast<std::size_t>(shape.back());
    nvfp4_source s{std::move(name), type, shape, q, l, {}};
    for (int v = 0; v < 2; ++v) s.t[v] = make_source(type, edge_values(n / cols, cols, seed * 10 + v));
    if (seed == 4) s.t[0] = make_source(type, std::vector<float>(n, 0.0f));  // v1 all zero
    out.push_back(std::move(s));
  };
  add("w_nv", dtype::bf16, {64, 96}, quant::nvfp4, scale_layout::row_major, 1);
  add("w_nv_swz", dtype::f32, {40, 72}, quant::nvfp4, scale_layout::swizzled_128x4, 2);  // a short last block
  add("w_nv_big", dtype::bf16, {256, 200}, quant::nvfp4, scale_layout::row_major, 3);    // several 16 KiB buffers
  add("w_nv_zero", dtype::bf16, {8, 32}, quant::nvfp4, scale_layout::row_major, 4);
  add("w_mx_swz", dtype::bf16, {130, 70}, quant::mxfp8, scale_layout::swizzled_128x4, 5);
  return out;
}

/// The scale tensor bytes the reference says `s` lands as in version v (nvfp4: also scale_2).
nvfp4_expected expected_of(const nvfp4_source& s, int v) {
  const auto cols = static_cast<std::size_t>(s.shape.back());
  const std::size_t rows = s.t[v].values.size() / cols;
  nvfp4_expected e;
  if (s.q == quant::nvfp4) {
    e = nvfp4_reference(s.t[v].values, cols);
  } else {
    // mxfp8's row-major scales from the CPU engine, whose bits test_quant_formats checks.
    auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
    std::vector<float> mul(rows * ((cols + 31) / 32));
    e.scale.resize(mul.size());
    const refit::copy::scale_job j{s.t[v].bytes.data(), s.type, s.shape, quant::mxfp8, e.scale.data(), mul.data()};
    copier->scales(std::span(&j, 1), nullptr);
  }
  if (s.layout == scale_layout::swizzled_128x4)
    e.scale = swizzle_reference(e.scale, 1, rows, (cols + refit::block_cols(s.q) - 1) / refit::block_cols(s.q));
  return e;
}

void serve_nvfp4(const std::string& endpoint, const std::vector<nvfp4_source>& sources, rt::signal_pipe& result,
                 rt::signal_pipe& stop) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = 5000ms;
  refit::receiver r(o);
  struct held {
    std::vector<std::uint8_t> q, scale;
    float scale_2 = -1.0f;
  };
  std::vector<held> mem(sources.size());
  for (std::size_t k = 0; k < sources.size(); ++k) {
    const nvfp4_source& s = sources[k];
    const dtype type = refit::quant_dtype(s.q);
    const std::vector<std::int64_t> stored = refit::storage_shape(type, s.shape);
    mem[k].q.assign(*refit::checked_numel(stored), 0xaa);
    mem[k].scale.assign(*refit::checked_numel(refit::scale_shape(s.q, s.shape, s.layout)), 0xaa);
    refit::tensor_dest d{{s.name, type, stored}, mem[k].q.data(), refit::device::cpu()};
    d.q = s.q;
    d.scale = mem[k].scale.data();
    d.scale_2 = s.q == quant::nvfp4 ? &mem[k].scale_2 : nullptr;
    d.layout = s.layout;
    r.add_parameter(d);
  }
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
    for (std::size_t k = 0; k < sources.size(); ++k) {
      const nvfp4_expected want = expected_of(sources[k], v);
      if (sources[k].q == quant::nvfp4 && mem[k].q != want.q) problems += sources[k].name + " codes; ";
      if (mem[k].scale != want.scale) problems += sources[k].name + " scale; ";
      if (sources[k].q == quant::nvfp4 && mem[k].scale_2 != want.scale_2) problems += sources[k].name + " scale_2; ";
    }
    result.send("v" + std::to_string(v + 1) + " " + problems);
  }
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!stop.try_receive(0ms)) {
    r.serve_one(20ms);
    if (std::chrono::steady_clock::now() > deadline) return;
  }
}

}  // namespace

TEST_CASE("two host_shm refits write NVFP4 codes, block scales and scale_2 in place, swizzled or not",
          "[convert][quant][nvfp4]") {
  const std::vector<nvfp4_source> sources = nvfp4_sources();
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe result, stop;
  rt::child rx([&] { serve_nvfp4(endpoint.name, sources, result, stop); });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 16 << 10, refit::milliseconds{5000}));
  for (int v = 0; v < 2; ++v) {
    std::vector<refit::tensor_ref> refs;
    for (const auto& src : sources)
      refs.push_back(
          refit::tensor_ref{{src.name, src.type, src.shape}, src.t[v].bytes.data(), refit::device::cpu(), nullptr});
    const refit::refit_stats stats = s.refit(static_cast<std::uint64_t>(v + 1), refs);
    CHECK(result.receive(30s) == "v" + std::to_string(v + 1) + " ");
    CHECK(stats.tensors == 3 * 4 + 2);  // nvfp4: codes, scale, scale_2; mxfp8: codes, scale
    CHECK(stats.batches > 2);
  }
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}

TEST_CASE("a source whose rows are odd is refused for NVFP4, naming the tensor", "[convert][quant][nvfp4]") {
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe result, stop;
  rt::child rx([&] {
    refit::receiver_options o;
    o.endpoint = endpoint.name;
    o.idle_timeout = 5000ms;
    refit::receiver r(o);
    std::vector<std::uint8_t> q(8 * 8), scale(8);
    float s2 = 0;
    refit::tensor_dest d{{"odd", dtype::f4_e2m1x2, {8, 8}}, q.data(), refit::device::cpu()};
    d.q = quant::nvfp4;
    d.scale = scale.data();
    d.scale_2 = &s2;
    r.add_parameter(d);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!stop.try_receive(0ms) && std::chrono::steady_clock::now() < deadline) r.serve_one(20ms);
  });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 16 << 10, refit::milliseconds{5000}));
  std::vector<std::uint16_t> x(8 * 15, 0x3f80);
  const std::vector<refit::tensor_ref> refs{
      refit::tensor_ref{{"odd", dtype::bf16, {8, 15}}, x.data(), refit::device::cpu(), nullptr}};
  std::string what;
  try {
    s.refit(1, refs);
  } catch (const refit::error& e) {
    what = std::string(refit::to_string(e.code())) + ": " + e.what();
  }
  CHECK(what ==
        "invalid_argument: tensor odd bf16[8, 15]: the receiver asks for f4_e2m1x2 quantised per block of 16 "
        "(nvfp4), which packs two elements a byte along the last dimension: its length must be even, not 15");
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}
