// An independent scalar reference of refit's conversions (refit::quant's definition), for the
// tests: written apart from lib/copy/convert.hpp on purpose — nearest values are found by search
// over the candidate codes in double precision, f16 by the compiler's _Float16 — so that a bug in
// the library's bit tricks cannot hide in both.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "refit/model.hpp"

namespace refit::test::ref {

inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// The value of e4m3fn code c (0x00..0x7E and their negatives; 0x7F / 0xFF are NaN).
inline double e4m3_value(std::uint8_t c) {
  const int e = (c >> 3) & 0xf;
  const int m = c & 7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (c & 0x80) != 0 ? -mag : mag;
}

/// Nearest e4m3fn code, ties to the even code, saturating to ±448; NaN → 0x7F.
inline std::uint8_t e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7e;
  std::uint8_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3_value(static_cast<std::uint8_t>(c)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = static_cast<std::uint8_t>(c);
      best_d = d;
    }
  }
  return sign | best;
}

/// Nearest bf16, ties to even; NaN → 0x7FC0; past the largest finite value by half an ulp → inf.
inline std::uint16_t bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  if (std::isinf(x)) return static_cast<std::uint16_t>(bits(x) >> 16);
  const std::uint32_t u = bits(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);  // toward zero
  const auto value = [](std::uint16_t h) {
    if ((h & 0x7fff) == 0x7f80) return std::ldexp(1.0, 128) * ((h & 0x8000) ? -1 : 1);  // where inf starts
    return static_cast<double>(from_bits(static_cast<std::uint32_t>(h) << 16));
  };
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);  // next away from zero
  const double dlo = std::fabs(static_cast<double>(x) - value(lo));
  const double dhi = std::fabs(value(hi) - static_cast<double>(x));
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

/// Nearest f16 through the compiler's conversion (correctly rounded); NaN → 0x7E00.
inline std::uint16_t f16(float x) {
  if (std::isnan(x)) return 0x7e00;
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}

inline float f16_value(std::uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}
inline float bf16_value(std::uint16_t h) { return from_bits(static_cast<std::uint32_t>(h) << 16); }

/// DeepGEMM's per_block_cast_to_fp8 (and its per-tensor form) over `x` (already f32) of shape
/// [lead..., rows, cols]: codes and scale_inv, with refit's NaN / inf rule (amax over finite
/// values only). `block` = 0: one group for the whole tensor.
struct quantised {
  std::vector<std::uint8_t> q;
  std::vector<float> scale_inv;
};

inline quantised quantise(std::span<const float> x, std::size_t lead, std::size_t rows, std::size_t cols,
                          bool per_block) {
  const std::size_t br = per_block ? (rows + 127) / 128 : 1;
  const std::size_t bc = per_block ? (cols + 127) / 128 : 1;
  quantised out;
  out.q.resize(x.size());
  out.scale_inv.resize(per_block ? lead * br * bc : 1);
  std::vector<float> amax(out.scale_inv.size(), 0.0f);
  const auto group = [&](std::size_t l, std::size_t r, std::size_t c) {
    return per_block ? (l * br + r / 128) * bc + c / 128 : 0;
  };
  for (std::size_t l = 0; l < lead; ++l)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) {
        const float a = std::fabs(x[(l * rows + r) * cols + c]);
        float& m = amax[group(l, r, c)];
        if (std::isfinite(a)) m = std::max(m, a);
      }
  std::vector<float> mul(amax.size());
  for (std::size_t g = 0; g < amax.size(); ++g) {
    const float a = std::max(amax[g], 1e-4f);
    out.scale_inv[g] = a / 448.0f;
    mul[g] = 448.0f / a;
  }
  for (std::size_t l = 0; l < lead; ++l)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) {
        const std::size_t i = (l * rows + r) * cols + c;
        const float scaled = x[i] * mul[group(l, r, c)];
        out.q[i] = e4m3(scaled);
      }
  return out;
}

// ------------------------------------------------------------------ inputs and comparisons

/// A source tensor as stored in `type` (f32, bf16 or f16), and its exact f32 values.
struct source_tensor {
  std::vector<std::uint8_t> bytes;
  std::vector<float> values;
};

inline source_tensor make_source(refit::dtype type, const std::vector<float>& x) {
  source_tensor s;
  s.values.resize(x.size());
  s.bytes.resize(x.size() * refit::itemsize(type));
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (type == refit::dtype::f32) {
      std::memcpy(s.bytes.data() + 4 * i, &x[i], 4);
      s.values[i] = x[i];
    } else {
      const std::uint16_t h = type == refit::dtype::bf16 ? bf16(x[i]) : f16(x[i]);
      std::memcpy(s.bytes.data() + 2 * i, &h, 2);
      s.values[i] = type == refit::dtype::bf16 ? bf16_value(h) : f16_value(h);
    }
  }
  return s;
}

/// Bytes where `a` and `b` differ (a length difference counts each missing byte); `first` names the
/// first differing byte.
inline std::size_t differing(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                             std::string& first) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i] && n++ == 0)
      first = "byte " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return n + (a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
}

}  // namespace refit::test::ref
