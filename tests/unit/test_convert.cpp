// Conversions: the element functions and the CPU engine's converting copies bit for bit
// against the independent reference in support/convert_ref.hpp; the registration rules of
// converting destinations; end-to-end host_shm refits into fp8 (block128, per tensor) and bf16
// destinations, a TP shard of a block-quantised weight and a tensor chunked over several batches.
#include <algorithm>
#include <catch2/catch.hpp>
#include <optional>

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
namespace cvt = refit::copy::cvt;
using refit::dtype;
using refit::quant;

namespace {

std::string hex(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

/// Floats every conversion must get right: ties, subnormals of each target, the edges of each
/// range, ±0, ±inf, NaN, and random bit patterns.
std::vector<float> probe_floats(std::size_t random_count) {
  std::vector<float> v;
  for (std::uint32_t h = 0; h < 0x10000; ++h) v.push_back(ref::from_bits(h << 16));  // every bf16
  for (std::uint32_t h = 0; h < 0x10000; ++h) v.push_back(ref::f16_value(static_cast<std::uint16_t>(h)));
  for (int c = 0; c < 256; ++c) {  // every e4m3 value, the midpoints around it, and one ulp either side
    const double a = ref::e4m3_value(static_cast<std::uint8_t>(c));
    if (std::isnan(a)) continue;
    const double b = ref::e4m3_value(static_cast<std::uint8_t>(c + 1 == 0x7f || c + 1 == 0xff ? c : c + 1));
    const auto mid = static_cast<float>((a + b) / 2);
    v.push_back(mid);
    v.push_back(std::nextafter(mid, 0.0f));
    v.push_back(std::nextafter(mid, 1e9f));
    v.push_back(std::nextafter(mid, -1e9f));
  }
  for (float f : {448.0f,
                  449.0f,
                  463.99f,
                  464.0f,
                  465.0f,
                  480.0f,
                  500.0f,
                  1e6f,
                  65504.0f,
                  65519.99f,
                  65520.0f,
                  std::ldexp(1.0f, -10),
                  std::ldexp(3.0f, -10),
                  std::ldexp(1.0f, -6),
                  std::ldexp(15.0f, -10),
                  std::ldexp(1.0f, -24),
                  std::ldexp(1.0f, -25),
                  std::ldexp(3.0f, -26),
                  1e-45f,
                  1.00390625f,
                  1.01171875f,
                  std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(),
                  0.0f}) {
    v.push_back(f);
    v.push_back(-f);
  }
  std::mt19937 rng(13);
  for (std::size_t i = 0; i < random_count; ++i) v.push_back(ref::from_bits(static_cast<std::uint32_t>(rng())));
  return v;
}

}  // namespace

// ======================================================================= element conversions

TEST_CASE("f32 to e4m3 rounds to nearest even, saturates at 448 and keeps subnormals, like the reference",
          "[convert]") {
  CHECK(cvt::f32_to_e4m3(448.0f) == 0x7e);
  CHECK(cvt::f32_to_e4m3(500.0f) == 0x7e);
  CHECK(cvt::f32_to_e4m3(-1e30f) == 0xfe);
  CHECK(cvt::f32_to_e4m3(std::numeric_limits<float>::infinity()) == 0x7e);
  CHECK(cvt::f32_to_e4m3(-std::numeric_limits<float>::infinity()) == 0xfe);
  CHECK(cvt::f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  CHECK(cvt::f32_to_e4m3(-std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  CHECK(cvt::f32_to_e4m3(-0.0f) == 0x80);
  CHECK(cvt::f32_to_e4m3(std::ldexp(1.0f, -9)) == 0x01);    // the smallest subnormal
  CHECK(cvt::f32_to_e4m3(std::ldexp(1.0f, -10)) == 0x00);   // half of it: a tie, to even (zero)
  CHECK(cvt::f32_to_e4m3(std::ldexp(3.0f, -10)) == 0x02);   // 1.5 units: a tie, to even (2)
  CHECK(cvt::f32_to_e4m3(std::ldexp(15.0f, -10)) == 0x08);  // 7.5 units: to the smallest normal
  std::size_t wrong = 0;
  std::string first;
  for (const float f : probe_floats(200000)) {
    const std::uint8_t want = ref::e4m3(f);
    const std::uint8_t got = cvt::f32_to_e4m3(f);
    if (got != want && wrong++ == 0) first = hex(ref::bits(f)) + " → " + hex(got) + ", want " + hex(want);
  }
  INFO(first);
  CHECK(wrong == 0);
}

TEST_CASE(
    "f32 to bf16 and to f16 round to nearest even like the reference; f16 keeps subnormals and overflows "
    "to inf",
    "[convert]") {
  CHECK(cvt::f32_to_bf16(ref::from_bits(0x3f808000)) == 0x3f80);  // a tie, to even
  CHECK(cvt::f32_to_bf16(ref::from_bits(0x3f818000)) == 0x3f82);  // a tie, to even (up)
  CHECK(cvt::f32_to_bf16(ref::from_bits(0x3f808001)) == 0x3f81);
  CHECK(cvt::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7fc0);
  CHECK(cvt::f32_to_f16(65520.0f) == 0x7c00);
  CHECK(cvt::f32_to_f16(65519.99f) == 0x7bff);
  CHECK(cvt::f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(cvt::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);  // a tie, to even
  CHECK(cvt::f32_to_f16(std::ldexp(3.0f, -26)) == 0x0001);
  std::size_t wrong_bf16 = 0;
  std::size_t wrong_f16 = 0;
  std::string first;
  for (const float f : probe_floats(300000)) {
    if (cvt::f32_to_bf16(f) != ref::bf16(f) && wrong_bf16++ == 0)
      first = "bf16 of " + hex(ref::bits(f)) + ": " + hex(cvt::f32_to_bf16(f)) + ", want " + hex(ref::bf16(f));
    if (cvt::f32_to_f16(f) != ref::f16(f) && wrong_f16++ == 0)
      first = "f16 of " + hex(ref::bits(f)) + ": " + hex(cvt::f32_to_f16(f)) + ", want " + hex(ref::f16(f));
  }
  INFO(first);
  CHECK(wrong_bf16 == 0);
  CHECK(wrong_f16 == 0);
}

TEST_CASE("every f16 and bf16 widens to f32 exactly", "[convert]") {
  std::size_t wrong = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float want = ref::f16_value(x);
    const float got = cvt::f16_to_f32(x);
    if (std::isnan(want) ? !std::isnan(got) : ref::bits(want) != ref::bits(got)) ++wrong;
    if (ref::bits(cvt::bf16_to_f32(x)) != (h << 16)) ++wrong;
  }
  CHECK(wrong == 0);
}

// ======================================================================= the CPU engine

namespace {

/// Source values with what the edge cases need: a range of magnitudes, values beyond ±448, one
/// all-zero 128 × 128 block (when the tensor has one: block (0, 1)), and NaN and ±inf in block (1, 0).
std::vector<float> source_values(std::size_t rows, std::size_t cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      float v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
      if (rng() % 97 == 0) v *= 1e4f;  // beyond ±448 before scaling
      if (r < 128 && c >= 128 && c < 256) v = 0.0f;
      x[r * cols + c] = v;
    }
  if (rows > 130 && cols > 3) {
    x[129 * cols + 0] = std::numeric_limits<float>::quiet_NaN();
    x[129 * cols + 1] = std::numeric_limits<float>::infinity();
    x[130 * cols + 2] = -std::numeric_limits<float>::infinity();
  }
  return x;
}

/// The source as stored in `type` (what the trainer holds), and its exact f32 values.
using ref::make_source;  // support/convert_ref.hpp
using ref::source_tensor;

/// Runs the CPU engine's scale pass and converting copies over `src`, cut into ops of `piece`
/// elements, into `out` (and `scale_inv`).
void cpu_convert(const source_tensor& src, dtype from, dtype to, quant q, const std::vector<std::int64_t>& shape,
                 std::uint64_t piece, std::vector<std::uint8_t>& out, std::vector<float>& scale_inv) {
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  const std::uint64_t n = *refit::checked_numel(shape);
  out.assign(n * refit::itemsize(to), 0xaa);
  std::vector<float> mul;
  if (q != quant::none) {
    const std::uint64_t groups = *refit::checked_numel(refit::scale_shape(q, shape));
    scale_inv.assign(groups, -1.0f);
    mul.assign(groups, -1.0f);
    const refit::copy::scale_job job{src.bytes.data(), from, shape, q, scale_inv.data(), mul.data()};
    copier->scales(std::span(&job, 1), nullptr);
  }
  const auto cv = refit::copy::conversion_of(from, to, q, shape, mul.data());
  std::vector<refit::copy::convert_op> ops;
  for (std::uint64_t e = 0; e < n; e += piece) {
    const std::uint64_t count = std::min(piece, n - e);
    ops.push_back(refit::copy::convert_op{src.bytes.data() + e * refit::itemsize(from),
                                          out.data() + e * refit::itemsize(to), count, 1, 0, 0, e, cv});
  }
  copier->convert(ops, nullptr);
}

using ref::differing;

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("the CPU engine quantises per 128 x 128 block bit for bit like the reference, however the tensor is cut",
          "[convert]") {
  const dtype from = GENERATE(dtype::bf16, dtype::f32, dtype::f16);
  const std::uint64_t piece = GENERATE(1, 77, 128, 1000, 1u << 20);
  const std::size_t rows = 300, cols = 260;  // partial blocks at the right and the bottom
  const source_tensor src = make_source(from, source_values(rows, cols, 7));
  std::vector<std::uint8_t> q;
  std::vector<float> scale;
  cpu_convert(src, from, dtype::f8_e4m3, quant::block128, {300, 260}, piece, q, scale);
  const ref::quantised want = ref::quantise(src.values, 1, rows, cols, true);
  std::string first;
  INFO(refit::to_string(from) << ", pieces of " << piece);
  CHECK(differing(q, want.q, first) == 0);
  INFO(first);
  REQUIRE(scale.size() == 9);
  CHECK(same_floats(scale, want.scale_inv));
  CHECK(scale[1] == 1e-4f / 448.0f);  // the all-zero block: amax clamped
}

TEST_CASE("the CPU engine quantises per tensor, and stacked 3-d tensors per block of each matrix", "[convert]") {
  SECTION("per tensor") {
    const source_tensor src = make_source(dtype::f32, source_values(200, 140, 3));
    std::vector<std::uint8_t> q;
    std::vector<float> scale;
    cpu_convert(src, dtype::f32, dtype::f8_e4m3, quant::tensor, {200, 140}, 999, q, scale);
    const ref::quantised want = ref::quantise(src.values, 1, 200, 140, false);
    std::string first;
    CHECK(differing(q, want.q, first) == 0);
    INFO(first);
    CHECK(same_floats(scale, want.scale_inv));
  }
  SECTION("stacked experts [3, 130, 129]") {
    const source_tensor src = make_source(dtype::bf16, source_values(3 * 130, 129, 5));
    std::vector<std::uint8_t> q;
    std::vector<float> scale;
    cpu_convert(src, dtype::bf16, dtype::f8_e4m3, quant::block128, {3, 130, 129}, 5000, q, scale);
    const ref::quantised want = ref::quantise(src.values, 3, 130, 129, true);
    std::string first;
    CHECK(differing(q, want.q, first) == 0);
    INFO(first);
    CHECK(scale.size() == 12);
    CHECK(same_floats(scale, want.scale_inv));
  }
  SECTION("no elements: per tensor gets the clamped scale") {
    const source_tensor src = make_source(dtype::bf16, {});
    std::vector<std::uint8_t> q;
    std::vector<float> scale;
    cpu_convert(src, dtype::bf16, dtype::f8_e4m3, quant::tensor, {0, 128}, 64, q, scale);
    CHECK(q.empty());
    REQUIRE(scale.size() == 1);
    CHECK(scale[0] == 1e-4f / 448.0f);
  }
}

TEST_CASE("the CPU engine casts among f32, bf16 and f16 like the reference", "[convert]") {
  const std::vector<float> x = probe_floats(20000);
  const auto check = [&](dtype from, dtype to) {
    const source_tensor src = make_source(from, x);
    std::vector<std::uint8_t> out;
    std::vector<float> unused;
    cpu_convert(src, from, to, quant::none, {static_cast<std::int64_t>(x.size())}, 4097, out, unused);
    std::vector<std::uint8_t> want(x.size() * refit::itemsize(to));
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float v = src.values[i];
      if (to == dtype::f32) {
        std::memcpy(want.data() + 4 * i, &v, 4);
        if (std::isnan(v)) std::memcpy(want.data() + 4 * i, out.data() + 4 * i, 4);  // any NaN
      } else {
        const std::uint16_t h = to == dtype::bf16 ? ref::bf16(v) : ref::f16(v);
        std::memcpy(want.data() + 2 * i, &h, 2);
      }
    }
    std::string first;
    INFO(refit::to_string(from) << " to " << refit::to_string(to));
    CHECK(differing(out, want, first) == 0);
    INFO(first);
  };
  check(dtype::f32, dtype::bf16);
  check(dtype::f32, dtype::f16);
  check(dtype::bf16, dtype::f16);
  check(dtype::f16, dtype::bf16);
  check(dtype::bf16, dtype::f32);
  check(dtype::f16, dtype::f32);
}

TEST_CASE("a strided converting copy (a column shard) finds each element's block", "[convert]") {
  // Columns [128, 260) of a [300, 260] bf16 tensor, as the direct path writes a shard: rows of 132
  // elements, the source pitch one tensor row.
  const source_tensor src = make_source(dtype::bf16, source_values(300, 260, 11));
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  std::vector<float> scale(9), mul(9);
  const refit::copy::scale_job job{src.bytes.data(), dtype::bf16,  {300, 260},
                                   quant::block128,  scale.data(), mul.data()};
  copier->scales(std::span(&job, 1), nullptr);
  const auto cv = refit::copy::conversion_of(dtype::bf16, dtype::f8_e4m3, quant::block128,
                                             std::vector<std::int64_t>{300, 260}, mul.data());
  std::vector<std::uint8_t> shard(300 * 132, 0);
  const refit::copy::convert_op op{src.bytes.data() + 128 * 2, shard.data(), 132, 300, 260, 132, 128, cv};
  copier->convert(std::span(&op, 1), nullptr);
  const ref::quantised want = ref::quantise(src.values, 1, 300, 260, true);
  std::size_t wrong = 0;
  for (std::size_t r = 0; r < 300; ++r)
    for (std::size_t c = 0; c < 132; ++c) wrong += shard[r * 132 + c] != want.q[r * 260 + 128 + c];
  CHECK(wrong == 0);
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

TEST_CASE("every bad converting registration is refused with its reason", "[convert]") {
  std::vector<std::uint8_t> mem(1 << 20);
  std::vector<float> scale(64);
  refit::tensor_dest d{{"w", dtype::f8_e4m3, {256, 384}}, mem.data(), refit::device::cpu()};
  d.q = quant::block128;
  d.scale = scale.data();
  CHECK(registration_error(d) == "accepted");

  auto bf = d;
  bf.meta.type = dtype::bf16;
  CHECK(registration_error(bf) ==
        "invalid_argument: add_parameter: 'w' (w bf16[256, 384]) asks for quant block128, which quantises to f8_e4m3: "
        "register the destination as f8_e4m3, not bf16");
  auto no_scale = d;
  no_scale.scale = nullptr;
  CHECK(registration_error(no_scale) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[256, 384]) is quantised (block128) but has no scale: pass "
        "its f32 scale_inv tensor of shape [2, 3]");
  auto flat = d;
  flat.meta.shape = {4096};
  CHECK(registration_error(flat) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[4096]) asks for quant block128, which quantises 128 × 128 "
        "blocks of the last two dimensions: it needs at least 2 dimensions, not 1");
  auto scale_only = d;
  scale_only.q = quant::none;
  CHECK(registration_error(scale_only) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[256, 384]) has a scale but no quant: a scale belongs to an "
        "f8_e4m3 destination quantised per tensor or per 128 × 128 block, channel or MX block of 32 (set quant)");
  auto reserved = d;
  reserved.meta.name = std::string("w") + std::string(refit::scale_suffix);
  CHECK(registration_error(reserved) ==
        "invalid_argument: add_parameter: the name 'w' contains the control character \\x1f, which refit reserves for "
        "the scale tensors of quantised destinations");
  refit::dest_layout shard;
  shard.slice = refit::source_slice{1, 100, 384};
  CHECK(registration_error(d, shard) ==
        "invalid_argument: add_parameter: 'w' (w f8_e4m3[256, 384]): block128 scales are computed over the global "
        "tensor's 128 × 128 blocks, so a slice of dimension 1 must start on a block boundary (a multiple of 128); "
        "this one starts at 100");
  shard.slice = refit::source_slice{1, 128, 384};
  CHECK(registration_error(d, shard) == "accepted");
  auto overlapping = d;
  overlapping.scale = mem.data() + 1000;
  CHECK(registration_error(overlapping) ==
        "invalid_argument: add_parameter: the scale of 'w' shares bytes with its destination (w f8_e4m3[256, 384])");
  // A plain f8_e4m3 destination (an f8_e4m3 source copied as it is) stays allowed.
  refit::tensor_dest plain{{"p", dtype::f8_e4m3, {16}}, mem.data(), refit::device::cpu()};
  CHECK(registration_error(plain) == "accepted");
}

TEST_CASE("two destinations of one source must ask for the same conversion", "[convert]") {
  const rt::scoped_endpoint ep;
  refit::receiver_options o;
  o.endpoint = ep.name;
  refit::receiver r(o);
  std::vector<std::uint8_t> a(4096), b(4096);
  std::vector<float> sa(1), sb(1);
  refit::tensor_dest d{{"w", dtype::f8_e4m3, {64}}, a.data(), refit::device::cpu()};
  d.q = quant::tensor;
  d.scale = sa.data();
  r.add_parameter(d);
  auto other = d;
  other.data = b.data();
  other.scale = sb.data();
  other.q = quant::block128;
  other.meta.shape = {8, 8};
  const auto f = rt::failure_of([&] { r.add_parameter(other); });
  REQUIRE(f);
  CHECK(f->message ==
        "add_parameter: 'w' is registered as f8_e4m3 (tensor) and again as f8_e4m3 (block128): every destination of "
        "one source has its dtype and quant");
}

// ======================================================================= end to end over host_shm

namespace {

/// The model of the end-to-end test: sources (what the streamer holds) and the expected bytes of
/// every destination, computed by the reference.
struct convert_model {
  struct source {
    std::string name;
    dtype type;
    std::vector<std::int64_t> shape;
    source_tensor t;
  };
  std::vector<source> sources;

  convert_model() {
    add("w_block", dtype::bf16, {300, 260}, 1);    // fp8 block128, partial edge blocks
    add("w_tensor", dtype::f32, {64, 100}, 2);     // fp8 per tensor
    add("w_cast", dtype::f32, {1000}, 3);          // bf16
    add("w_shard", dtype::bf16, {256, 300}, 4);    // two TP column shards, fp8 block128
    add("w_chunked", dtype::bf16, {512, 512}, 5);  // 256 KiB of fp8 over 64 KiB buffers
    add("w_plain", dtype::bf16, {33, 7}, 6);       // no conversion
  }
  void add(std::string name, dtype type, std::vector<std::int64_t> shape, std::uint32_t seed) {
    const auto n = static_cast<std::size_t>(*refit::checked_numel(shape));
    const std::size_t cols = static_cast<std::size_t>(shape.back());
    sources.push_back({std::move(name), type, shape, make_source(type, source_values(n / cols, cols, seed))});
  }
  const source& get(const std::string& name) const {
    for (const auto& s : sources)
      if (s.name == name) return s;
    throw std::runtime_error("no source " + name);
  }
  std::vector<refit::tensor_ref> refs() const {
    std::vector<refit::tensor_ref> out;
    for (const auto& s : sources)
      out.push_back(refit::tensor_ref{{s.name, s.type, s.shape}, s.t.bytes.data(), refit::device::cpu(), nullptr});
    return out;
  }
};

/// Serves until the parent says stop: a reply must be out before the receiver (and its socket) goes.
void serve_until_stop(refit::receiver& r, rt::signal_pipe& stop) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!stop.try_receive(0ms)) {
    r.serve_one(20ms);
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("the parent never said stop");
  }
}

/// Registers the converted destinations, serves one refit and checks every byte against the
/// reference; returns "" or what differs. Then serves until `stop`.
std::string serve_and_check(const std::string& endpoint, const convert_model& m, rt::signal_pipe& result,
                            rt::signal_pipe& stop, refit::stage_kind stage = refit::stage_kind::none) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = 5000ms;
  o.stage = stage;
  refit::receiver r(o);
  const auto& block = m.get("w_block");
  const auto& tens = m.get("w_tensor");
  const auto& cast = m.get("w_cast");
  const auto& shard = m.get("w_shard");
  const auto& chunked = m.get("w_chunked");
  const auto& plain = m.get("w_plain");

  std::vector<std::uint8_t> q_block(300 * 260), q_tensor(64 * 100), q_shard0(256 * 128), q_shard1(256 * 172),
      q_chunked(512 * 512), bf_cast(2000), plain_bytes(33 * 7 * 2);
  std::vector<float> s_block(9), s_tensor(1), s_shard0(2), s_shard1(2 * 2), s_chunked(16);

  const auto fp8 = [](const char* name, std::vector<std::int64_t> shape, std::vector<std::uint8_t>& mem,
                      std::vector<float>& scale, quant q) {
    refit::tensor_dest d{{name, dtype::f8_e4m3, std::move(shape)}, mem.data(), refit::device::cpu()};
    d.q = q;
    d.scale = scale.data();
    return d;
  };
  r.add_parameter(fp8("w_block", {300, 260}, q_block, s_block, quant::block128));
  r.add_parameter(fp8("w_tensor", {64, 100}, q_tensor, s_tensor, quant::tensor));
  r.add_parameter(refit::tensor_dest{{"w_cast", dtype::bf16, {1000}}, bf_cast.data(), refit::device::cpu()});
  refit::dest_layout l0, l1;
  l0.slice = refit::source_slice{1, 0, 128};
  l1.slice = refit::source_slice{1, 128, 172};  // ends at the source's end: a partial last block
  r.add_parameter(fp8("w_shard", {256, 128}, q_shard0, s_shard0, quant::block128), l0);
  r.add_parameter(fp8("w_shard", {256, 172}, q_shard1, s_shard1, quant::block128), l1);
  r.add_parameter(fp8("w_chunked", {512, 512}, q_chunked, s_chunked, quant::block128));
  r.add_parameter(refit::tensor_dest{{"w_plain", dtype::bf16, {33, 7}}, plain_bytes.data(), refit::device::cpu()});

  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    const auto e = r.serve_one(100ms);
    if (e == refit::receiver_event::committed) break;
    if (e == refit::receiver_event::prepared) {  // staged: the converted bytes wait in the stage
      if (!std::all_of(q_block.begin(), q_block.end(), [](std::uint8_t b) { return b == 0; })) {
        result.send("result the weights changed before apply_prepared()");
        serve_until_stop(r, stop);
        return {};
      }
      if (r.apply_prepared() != std::optional<std::uint64_t>{1}) return "apply_prepared() applied nothing";
      break;
    }
    if (e == refit::receiver_event::aborted || e == refit::receiver_event::refused) {
      result.send("result refit failed: " + r.last_error());
      serve_until_stop(r, stop);
      return {};
    }
    if (std::chrono::steady_clock::now() > deadline) return "no commit within 20 s";
  }
  std::string problems;
  const auto check = [&](const std::string& what, bool ok) {
    if (!ok) problems += what + " differs; ";
  };
  std::string first;
  const ref::quantised rb = ref::quantise(block.t.values, 1, 300, 260, true);
  check("w_block", differing(q_block, rb.q, first) == 0);
  check("w_block scale", same_floats(s_block, rb.scale_inv));
  const ref::quantised rt_ = ref::quantise(tens.t.values, 1, 64, 100, false);
  check("w_tensor", differing(q_tensor, rt_.q, first) == 0);
  check("w_tensor scale", same_floats(s_tensor, rt_.scale_inv));
  std::vector<std::uint8_t> want_cast(2000);
  for (std::size_t i = 0; i < 1000; ++i) {
    const std::uint16_t h = ref::bf16(cast.t.values[i]);
    std::memcpy(want_cast.data() + 2 * i, &h, 2);
  }
  check("w_cast", differing(bf_cast, want_cast, first) == 0);
  const ref::quantised rs = ref::quantise(shard.t.values, 1, 256, 300, true);
  std::size_t wrong = 0;
  for (std::size_t r_ = 0; r_ < 256; ++r_) {
    for (std::size_t c = 0; c < 128; ++c) wrong += q_shard0[r_ * 128 + c] != rs.q[r_ * 300 + c];
    for (std::size_t c = 0; c < 172; ++c) wrong += q_shard1[r_ * 172 + c] != rs.q[r_ * 300 + 128 + c];
  }
  check("w_shard", wrong == 0);
  check("w_shard scale 0", same_floats(s_shard0, {rs.scale_inv[0], rs.scale_inv[3]}));
  check("w_shard scale 1", same_floats(s_shard1, {rs.scale_inv[1], rs.scale_inv[2], rs.scale_inv[4], rs.scale_inv[5]}));
  const ref::quantised rc = ref::quantise(chunked.t.values, 1, 512, 512, true);
  check("w_chunked", differing(q_chunked, rc.q, first) == 0);
  check("w_chunked scale", same_floats(s_chunked, rc.scale_inv));
  check("w_plain", plain_bytes == plain.t.bytes);
  result.send("result " + problems);
  serve_until_stop(r, stop);
  return problems;
}

}  // namespace

TEST_CASE("a host_shm refit converts into fp8 block128, fp8 per-tensor, bf16 and TP-shard destinations bit for bit",
          "[convert]") {
  // In place, and into a stage (the converted bytes wait there until apply_prepared()).
  const auto stage = GENERATE(refit::stage_kind::none, refit::stage_kind::host);
  INFO("stage " << refit::to_string(stage));
  const convert_model model;
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe result, stop;
  rt::child rx([&] { (void)serve_and_check(endpoint.name, model, result, stop, stage); });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 64 << 10, refit::milliseconds{5000}));
  const auto refs = model.refs();
  const refit::refit_stats stats = s.refit(1, refs);
  CHECK(result.receive(30s) == "result ");
  CHECK(stats.tensors == refs.size() + 4);  // a scale tensor per quantised source (w_shard's two shards: one)
  CHECK(stats.batches > 4);                 // w_chunked took several
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}

TEST_CASE("a block128 shard that ends inside a block before the source's end fails the refit naming it", "[convert]") {
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe stop;
  std::vector<std::uint16_t> src(256 * 300, 0x3f80);
  rt::child rx([&] {
    refit::receiver_options o;
    o.endpoint = endpoint.name;
    refit::receiver r(o);
    std::vector<std::uint8_t> q(256 * 100);
    std::vector<float> scale(2);
    refit::tensor_dest d{{"w", dtype::f8_e4m3, {256, 100}}, q.data(), refit::device::cpu()};
    d.q = quant::block128;
    d.scale = scale.data();
    refit::dest_layout l;
    l.slice = refit::source_slice{1, 128, 100};
    r.add_parameter(d, l);
    serve_until_stop(r, stop);
  });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 1 << 20, refit::milliseconds{5000}));
  const refit::tensor_ref t{{"w", dtype::bf16, {256, 300}}, src.data(), refit::device::cpu(), nullptr};
  const auto f = rt::failure_of([&] { s.refit(1, std::span(&t, 1)); });
  REQUIRE(f);
  CHECK(f->code == "apply");
  CHECK_THAT(f->message, Catch::Contains("tensor 'w': the destination takes [128:228] of dimension 1 of a source of "
                                         "300 there; block128 scales are computed over the global tensor's 128 × 128 "
                                         "blocks, so a shard must end on a block boundary (a multiple of 128) or at "
                                         "the source's end, not at 228"));
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}

TEST_CASE("quantising a source refit cannot convert is refused naming both dtypes", "[convert]") {
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe stop;
  std::vector<std::int32_t> src(64 * 64, 1);
  rt::child rx([&] {
    refit::receiver_options o;
    o.endpoint = endpoint.name;
    refit::receiver r(o);
    std::vector<std::uint8_t> q(64 * 64);
    std::vector<float> scale(1);
    refit::tensor_dest d{{"w", dtype::f8_e4m3, {64, 64}}, q.data(), refit::device::cpu()};
    d.q = quant::tensor;
    d.scale = scale.data();
    r.add_parameter(d);
    serve_until_stop(r, stop);
  });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 1 << 20, refit::milliseconds{5000}));
  const refit::tensor_ref t{{"w", dtype::i32, {64, 64}}, src.data(), refit::device::cpu(), nullptr};
  const auto f = rt::failure_of([&] { s.refit(1, std::span(&t, 1)); });
  REQUIRE(f);
  CHECK(f->code == "apply");
  CHECK(f->message ==
        "tensor w i32[64, 64]: the receiver asks for it as f8_e4m3 quantised per tensor, but refit converts only from "
        "f32, bf16 and f16, not from i32: send it as f8_e4m3 or register the destination as i32");
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}

TEST_CASE("the CPU engine's fused block128 job writes a column shard and its scales like the reference", "[convert]") {
  // Two stacked [300, 260] matrices; columns [128, 260) into rows of 132 codes, scales into rows of 2.
  const source_tensor src = make_source(dtype::bf16, source_values(600, 260, 17));
  auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
  std::vector<std::uint8_t> q(600 * 132, 0);
  std::vector<float> scale(2 * 3 * 2, -1.0f);
  refit::copy::fused_job j;
  j.src = src.bytes.data();
  j.from = dtype::bf16;
  j.lead = 2;
  j.rows = 300;
  j.cols = 260;
  j.dst = q.data();
  j.dst_pitch = 132;
  j.col_lo = 128;
  j.col_hi = 260;
  j.scale = scale.data();
  j.scale_pitch = 2;
  copier->fused(std::span(&j, 1), nullptr);
  const ref::quantised want = ref::quantise(src.values, 2, 300, 260, true);
  std::size_t wrong = 0;
  for (std::size_t r = 0; r < 600; ++r)
    for (std::size_t c = 0; c < 132; ++c) wrong += q[r * 132 + c] != want.q[r * 260 + 128 + c];
  CHECK(wrong == 0);
  std::vector<float> want_scale;
  for (std::size_t g = 0; g < 6; ++g)
    for (std::size_t b = 1; b < 3; ++b) want_scale.push_back(want.scale_inv[g * 3 + b]);
  CHECK(same_floats(scale, want_scale));
}

TEST_CASE("a table that asks for new conversions between refits gets a new session, and the next refit converts",
          "[convert]") {
  const rt::scoped_endpoint endpoint;
  rt::signal_pipe result, stop;
  const source_tensor src = make_source(dtype::bf16, source_values(256, 256, 23));
  rt::child rx([&] {
    refit::receiver_options o;
    o.endpoint = endpoint.name;
    refit::receiver r(o);
    std::vector<std::uint8_t> plain(256 * 256 * 2), q(256 * 256);
    std::vector<float> scale(4);
    r.add_parameter(refit::tensor_dest{{"w", dtype::bf16, {256, 256}}, plain.data(), refit::device::cpu()});
    int commits = 0;
    std::vector<std::string> events;
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (commits < 2 && std::chrono::steady_clock::now() < deadline) {
      const auto e = r.serve_one(20ms);
      if (e == refit::receiver_event::idle) continue;
      events.push_back(std::string(refit::to_string(e)));
      if (e != refit::receiver_event::committed) continue;
      if (++commits == 1) {
        result.send(plain == src.bytes ? "plain ok" : "plain differs");
        // Between refits the engine switches the weight to fp8.
        r.clear_parameters();
        refit::tensor_dest d{{"w", dtype::f8_e4m3, {256, 256}}, q.data(), refit::device::cpu()};
        d.q = quant::block128;
        d.scale = scale.data();
        r.add_parameter(d);
      }
    }
    const ref::quantised want = ref::quantise(src.values, 1, 256, 256, true);
    std::string events_line;
    for (const auto& e : events) events_line += e + " ";
    result.send(std::string(q == want.q && same_floats(scale, want.scale_inv) ? "fp8 ok" : "fp8 differs") + " | " +
                events_line);
    serve_until_stop(r, stop);
  });
  refit::streamer s(rt::host_shm_streamer(endpoint.name, 1 << 20, refit::milliseconds{5000}));
  const refit::tensor_ref t{{"w", dtype::bf16, {256, 256}}, src.bytes.data(), refit::device::cpu(), nullptr};
  s.refit(1, std::span(&t, 1));
  CHECK(result.receive(30s) == "plain ok");
  s.refit(2, std::span(&t, 1));
  CHECK(result.receive(30s) == "fp8 ok | hello begin batch committed refused hello begin batch committed ");
  s.close();
  stop.send("stop");
  CHECK(rx.wait() == 0);
}
