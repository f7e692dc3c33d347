// refit — element conversions of the converting copies: f32 / bf16 / f16 casts and f8_e4m3
// quantisation (per tensor, per 128 × 128 block, per row, per 32 elements of a row with an E8M0
// scale). A format is data: its block shape (group_rows, group_cols) and its scale rule
// (write_scale); every path finds a group and makes its scale the same way. The exact definition is refit::quant's
// (include/refit/model.hpp); this file is its one implementation, shared by the CPU engine
// (copy.cpp) and the CUDA kernels (copy_kernel.cu), so both produce the same bits.
//
// Plain integer arithmetic on the bit patterns (no floating-point environment, no flush to zero,
// no intrinsics whose rounding differs between host and device): the only floating-point
// operations are the f32 product x · s and, in the scale pass, 448 / amax and amax / 448, which
// IEEE defines exactly (round to nearest) on both. Dtype and quant codes are refit::dtype's and
// refit::quant's wire codes, so nvcc needs no library header.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define REFIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define REFIT_HOST_DEVICE inline
#endif

namespace refit::copy::cvt {

// refit::dtype and refit::quant codes (static_asserts in copy.cpp keep them in step).
inline constexpr std::uint8_t f16 = 6;
inline constexpr std::uint8_t bf16 = 7;
inline constexpr std::uint8_t f32 = 8;
inline constexpr std::uint8_t f8_e4m3 = 10;
inline constexpr std::uint8_t quant_none = 0;
inline constexpr std::uint8_t quant_tensor = 1;
inline constexpr std::uint8_t quant_block128 = 2;
inline constexpr std::uint8_t quant_channel = 3;
inline constexpr std::uint8_t quant_mxfp8 = 4;
inline constexpr std::uint8_t quant_nvfp4 = 5;
inline constexpr std::uint8_t f8_e8m0 = 15;
inline constexpr std::uint8_t f4_e2m1x2 = 16;
inline constexpr std::uint8_t layout_row_major = 0;
inline constexpr std::uint8_t layout_swizzled = 1;

/// Side of a quantisation block (block128).
inline constexpr std::uint64_t block = 128;
/// Elements of an MX block (OCP Microscaling v1.0: k = 32).
inline constexpr std::uint64_t mx_block = 32;
/// Elements of an NVFP4 block (one e4m3 scale each).
inline constexpr std::uint64_t nv_block = 16;
/// NVFP4's per-tensor scale is amax / (6 · 448): e2m1's largest value times e4m3's.
inline constexpr float nvfp4_range = 6.0f * 448.0f;
/// e2m1's largest value.
inline constexpr float e2m1_max = 6.0f;
/// e4m3's largest exponent (448 = 1.75 · 2^8): OCP's emax_elem.
inline constexpr int e4m3_emax = 8;
/// The largest finite e4m3fn value, the target of amax.
inline constexpr float e4m3_max = 448.0f;
/// amax is clamped to at least this (an all-zero group gets a finite scale).
inline constexpr float amax_floor = 1e-4f;

REFIT_HOST_DEVICE std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

REFIT_HOST_DEVICE float float_of(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// Bytes of one item of `type` (f4_e2m1x2: one byte, two elements).
REFIT_HOST_DEVICE std::uint32_t item(std::uint8_t type) {
  return type == f32 ? 4u : type == f8_e4m3 || type == f4_e2m1x2 ? 1u : 2u;
}

/// Elements one item of `type` holds: 2 for f4_e2m1x2, 1 otherwise.
REFIT_HOST_DEVICE std::uint32_t per_item(std::uint8_t type) { return type == f4_e2m1x2 ? 2u : 1u; }

/// Elements in `bytes` bytes of `type`.
REFIT_HOST_DEVICE std::uint64_t elements_of(std::uint8_t type, std::uint64_t bytes) {
  return bytes / item(type) * per_item(type);
}

/// Bytes of `n` elements of `type` (n even for f4_e2m1x2).
REFIT_HOST_DEVICE std::uint64_t bytes_of(std::uint8_t type, std::uint64_t n) { return n / per_item(type) * item(type); }

/// m · 2^-shift rounded to nearest, ties to even (shift ≥ 1).
REFIT_HOST_DEVICE std::uint32_t round_shift(std::uint32_t m, std::uint32_t shift) {
  if (shift > 25) return 0;  // m < 2^24: m · 2^-shift < 1/2
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1);
  const std::uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  return q;
}

REFIT_HOST_DEVICE float bf16_to_f32(std::uint16_t h) { return float_of(static_cast<std::uint32_t>(h) << 16); }

REFIT_HOST_DEVICE float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return float_of(sign);
    // A subnormal: m · 2^-24, exact in f32 (normalised by hand: no FTZ can touch it).
    std::uint32_t shift = 0;
    std::uint32_t mm = m;
    while ((mm & 0x400u) == 0) {
      mm <<= 1;
      ++shift;
    }
    return float_of(sign | ((113u - shift) << 23) | ((mm & 0x3ffu) << 13));
  }
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

/// Round to nearest even; NaN → 0x7FC0.
REFIT_HOST_DEVICE std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// Round to nearest even, subnormals included; overflow → ±inf; NaN → 0x7E00.
REFIT_HOST_DEVICE std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7e00u;
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // ≥ 65520: rounds past 65504
  if (a >= 0x38800000u) {                                                   // ≥ 2^-14: normal
    const std::uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  const std::uint32_t e = a >> 23;
  if (e == 0) return sign;  // an f32 subnormal is far below half of f16's smallest subnormal
  // Units of 2^-24: (mantissa with its hidden bit) · 2^(e - 150 + 24).
  return static_cast<std::uint16_t>(sign | round_shift((a & 0x7fffffu) | 0x800000u, 126u - e));
}

/// Round to nearest even, subnormals included, saturating: |f| ≥ 448 (inf too) → ±448 (0x7E /
/// 0xFE); NaN → 0x7F.
REFIT_HOST_DEVICE std::uint8_t f32_to_e4m3(float f) {
  const std::uint32_t u = bits_of(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fu;
  if (a >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // 448 and beyond
  if (a >= 0x3c800000u) {                                                // ≥ 2^-6: normal
    const std::uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return static_cast<std::uint8_t>(sign | ((r >> 20) - (120u << 3)));
  }
  const std::uint32_t e = a >> 23;
  if (e == 0) return sign;
  // Units of 2^-9; a result of 8 is the smallest normal, whose code is 0x08 too.
  return static_cast<std::uint8_t>(sign | round_shift((a & 0x7fffffu) | 0x800000u, 141u - e));
}

/// Element i of a tensor of type `type` (f32, bf16 or f16), widened to f32.
REFIT_HOST_DEVICE float load(const void* base, std::uint8_t type, std::uint64_t i) {
  if (type == f32) return static_cast<const float*>(base)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(base)[i];
  return type == bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/// True for a value that counts in amax (finite; NaN and ±inf do not).
REFIT_HOST_DEVICE bool counts(float a) { return (bits_of(a) & 0x7fffffffu) < 0x7f800000u; }

/// What a converting copy needs to convert element e of its tensor: the dtypes, the quantisation,
/// and for f8_e4m3 the multipliers s = 448 / amax of its groups (`mul`, one per group in the
/// scale tensor's order) and the tensor's last two dimensions (block128).
struct conversion {
  std::uint8_t from = f32;
  std::uint8_t to = f32;
  std::uint8_t q = quant_none;
  const float* mul = nullptr;
  std::uint64_t rows = 1;  ///< second-to-last dimension (1 for a tensor of rank < 2)
  std::uint64_t cols = 1;  ///< last dimension
};

/// Rows of the last-two-dims matrix that one group of quantisation q spans (refit::block_rows;
/// `rows` for the whole-tensor and unquantised cases).
REFIT_HOST_DEVICE std::uint64_t group_rows(std::uint8_t q, std::uint64_t rows) {
  return q == quant_block128 ? block : q == quant_channel || q == quant_mxfp8 || q == quant_nvfp4 ? 1 : rows;
}

/// Columns that one group of quantisation q spans (refit::block_cols; `cols`: the whole row).
REFIT_HOST_DEVICE std::uint64_t group_cols(std::uint8_t q, std::uint64_t cols) {
  return q == quant_block128 ? block : q == quant_mxfp8 ? mx_block : q == quant_nvfp4 ? nv_block : cols;
}

/// The group (index into the scale tensor) of element e of the tensor: the grid of
/// group_rows × group_cols blocks of each matrix of its last two dimensions, row-major, matrices
/// one after another (one group for the whole tensor: quant tensor, none).
REFIT_HOST_DEVICE std::uint64_t group_of(const conversion& c, std::uint64_t e) {
  if (c.q == quant_none || c.q == quant_tensor) return 0;
  const std::uint64_t br = group_rows(c.q, c.rows);
  const std::uint64_t bc = group_cols(c.q, c.cols);
  const std::uint64_t row = e / c.cols;
  const std::uint64_t col = e - row * c.cols;
  const std::uint64_t lead = row / c.rows;
  const std::uint64_t r = row - lead * c.rows;
  const std::uint64_t grid_rows = (c.rows + br - 1) / br;
  const std::uint64_t grid_cols = (c.cols + bc - 1) / bc;
  return (lead * grid_rows + r / br) * grid_cols + col / bc;
}

/// Elements from column `col` on that share its group, at most to the end of the row.
REFIT_HOST_DEVICE std::uint64_t group_stretch(const conversion& c, std::uint64_t col) {
  const std::uint64_t bc = group_cols(c.q, c.cols);
  const std::uint64_t to_edge = bc - col % bc;
  return to_edge < c.cols - col ? to_edge : c.cols - col;
}

/// Stores x (already widened to f32) as element i of `dst` of type c.to; `mul` is the group's
/// multiplier (f8_e4m3 only).
REFIT_HOST_DEVICE void store(void* dst, std::uint8_t to, std::uint64_t i, float x, float mul) {
  switch (to) {
    case f32: static_cast<float*>(dst)[i] = x; break;
    case bf16: static_cast<std::uint16_t*>(dst)[i] = f32_to_bf16(x); break;
    case f16: static_cast<std::uint16_t*>(dst)[i] = f32_to_f16(x); break;
    default: static_cast<std::uint8_t*>(dst)[i] = f32_to_e4m3(x * mul); break;
  }
}

/// amax of a group, given the largest counted |x| seen (0 if none): clamped to amax_floor.
REFIT_HOST_DEVICE float clamp_amax(float amax) { return amax < amax_floor ? amax_floor : amax; }

/// floor(log2(a)) of a finite a > 0, from its bits (subnormals included); -150 for 0.
REFIT_HOST_DEVICE int floor_log2(float a) {
  const std::uint32_t u = bits_of(a) & 0x7fffffffu;
  if (u >= 0x00800000u) return static_cast<int>(u >> 23) - 127;
  int top = -1;
  for (std::uint32_t m = u; m != 0; m >>= 1) ++top;
  return top < 0 ? -150 : top - 149;
}

/// The E8M0 code of an MX block's shared scale (OCP Microscaling v1.0, §6.3): X =
/// 2^(floor(log2(amax)) - emax_elem), its biased exponent clamped to [0, 254] (0xFF is NaN and never
/// written; an amax of 0 gives 0).
REFIT_HOST_DEVICE std::uint8_t e8m0_of(float amax) {
  const int e = floor_log2(amax) - e4m3_emax + 127;
  return static_cast<std::uint8_t>(e < 0 ? 0 : e > 254 ? 254 : e);
}

/// 1 / X of an E8M0 code (0..254): 2^(127 - code), exact in f32 (2^-127 is a subnormal).
REFIT_HOST_DEVICE float e8m0_multiplier(std::uint8_t code) {
  return code <= 253 ? float_of(static_cast<std::uint32_t>(254 - code) << 23) : float_of(1u << 22);
}

/// Writes the scale of group g of quantisation q, whose largest counted |x| is `amax`: into
/// `scale` (of the format's scale dtype: E8M0 codes for mxfp8, f32 scale_inv = amax / 448
/// otherwise) and the multiplier s into mul[g] (when mul is not null).
/// The scale goes to scale[at] (at: where group g lies in the scale tensor's layout, scale_index).
REFIT_HOST_DEVICE void write_scale(std::uint8_t q, float amax, void* scale, std::uint64_t at, float* mul,
                                   std::uint64_t g) {
  if (q == quant_mxfp8) {
    const std::uint8_t code = e8m0_of(amax);
    if (scale != nullptr) static_cast<std::uint8_t*>(scale)[at] = code;
    if (mul != nullptr) mul[g] = e8m0_multiplier(code);
    return;
  }
  const float a = clamp_amax(amax);
  if (scale != nullptr) static_cast<float*>(scale)[at] = a / e4m3_max;
  if (mul != nullptr) mul[g] = e4m3_max / a;
}

REFIT_HOST_DEVICE void write_scale(std::uint8_t q, float amax, void* scale, float* mul, std::uint64_t g) {
  write_scale(q, amax, scale, g, mul, g);
}

/// The f32 value of an e4m3fn code (exact; 0x7F / 0xFF, NaN, never occur as a scale).
REFIT_HOST_DEVICE float e4m3_to_f32(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t e = (code >> 3) & 0xfu;
  const std::uint32_t m = code & 0x7u;
  if (e != 0) return float_of(sign | ((e + 120u) << 23) | (m << 20));
  if (m == 0) return float_of(sign);
  // A subnormal, m · 2^-9: normalised by hand (m < 8), exact.
  std::uint32_t shift = 0;
  std::uint32_t mm = m;
  while ((mm & 0x8u) == 0) {
    mm <<= 1;
    ++shift;
  }
  return float_of(sign | ((121u - shift) << 23) | ((mm & 0x7u) << 20));
}

/// The e2m1 code (a nibble) of q: round to nearest, ties to even, saturating (|q| > 6 and ±inf
/// give ±6); the sign is q's (-0 gives 0x8); NaN gives 0x0. By the bits of |q| against the
/// midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (a midpoint goes to the even code: the ones at
/// 0.75, 1.75, 3.5 round up, as modelopt's `_cast_fp4`).
REFIT_HOST_DEVICE std::uint8_t f32_to_e2m1(float q) {
  const std::uint32_t u = bits_of(q);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;
  const auto sign = static_cast<std::uint8_t>((u >> 28) & 0x8u);
  std::uint8_t code = 7;
  if (a <= 0x3e800000u)  // 0.25
    code = 0;
  else if (a < 0x3f400000u)  // 0.75
    code = 1;
  else if (a <= 0x3fa00000u)  // 1.25
    code = 2;
  else if (a < 0x3fe00000u)  // 1.75
    code = 3;
  else if (a <= 0x40200000u)  // 2.5
    code = 4;
  else if (a < 0x40600000u)  // 3.5
    code = 5;
  else if (a <= 0x40a00000u)  // 5
    code = 6;
  return static_cast<std::uint8_t>(sign | code);
}

/// x / d (f32 division, rounded to nearest) as an e2m1 code; ±0 where d is 0 (the block
/// dequantises to 0 whatever its codes). Device code divides with __fdiv_rn: IEEE whatever the
/// compiler's flags.
REFIT_HOST_DEVICE std::uint8_t nvfp4_code(float x, float d) {
  if (d == 0.0f)
    return (bits_of(x) & 0x7fffffffu) > 0x7f800000u ? 0 : static_cast<std::uint8_t>((bits_of(x) >> 28) & 0x8u);
#if defined(__CUDA_ARCH__)
  return f32_to_e2m1(__fdiv_rn(x, d));
#else
  return f32_to_e2m1(x / d);
#endif
}

/// NVFP4's per-tensor scale (scale_2) of a tensor whose largest counted |x| is `amax`:
/// amax / (6 · 448), f32 (modelopt NVFP4QTensor.get_weights_scaling_factor_2).
REFIT_HOST_DEVICE float nvfp4_global(float amax) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(amax, nvfp4_range);
#else
  return amax / nvfp4_range;
#endif
}

/// The e4m3 code of an NVFP4 block scale: e4m3((amax / 6) / global), 1.0 (0x38) for a block with
/// amax 0 (modelopt NVFP4QTensor.get_weights_scaling_factor: per_block_scale == 0 → 1.0, clamped
/// to e4m3's range, then cast).
REFIT_HOST_DEVICE std::uint8_t nvfp4_block_code(float amax, float global) {
  if (amax == 0.0f) return 0x38u;
#if defined(__CUDA_ARCH__)
  return f32_to_e4m3(__fdiv_rn(__fdiv_rn(amax, e2m1_max), global));
#else
  return f32_to_e4m3(amax / e2m1_max / global);
#endif
}

/// Where group g (row-major over [lead, rows, cols] of the scale grid) lies in a scale tensor of
/// `layout`: g itself row-major; in the swizzled 128 × 4 tiles (refit::scale_layout), its byte
/// within the padded grid.
REFIT_HOST_DEVICE std::uint64_t scale_index(std::uint8_t layout, std::uint64_t g, std::uint64_t rows,
                                            std::uint64_t cols) {
  if (layout != layout_swizzled) return g;
  const std::uint64_t padded_rows = (rows + 127) / 128 * 128;
  const std::uint64_t padded_cols = (cols + 3) / 4 * 4;
  const std::uint64_t row = g / cols;
  const std::uint64_t c = g - row * cols;
  const std::uint64_t lead = row / rows;
  const std::uint64_t r = row - lead * rows;
  return lead * padded_rows * padded_cols + ((r / 128) * (padded_cols / 4) + c / 4) * 512 + (r % 32) * 16 +
         (r % 128 / 32) * 4 + c % 4;
}

/// Writes the scale of NVFP4 block g, whose largest counted |x| is `amax`, in a tensor whose
/// per-tensor scale is `global`: its e4m3 code at scale[at] and its divisor f32(code) · global
/// at mul[g] (when mul is not null; the converting copies divide by it).
REFIT_HOST_DEVICE void write_nvfp4_scale(float amax, float global, void* scale, std::uint64_t at, float* mul,
                                         std::uint64_t g) {
  const std::uint8_t code = nvfp4_block_code(amax, global);
  if (scale != nullptr) static_cast<std::uint8_t*>(scale)[at] = code;
#if defined(__CUDA_ARCH__)
  if (mul != nullptr) mul[g] = __fmul_rn(e4m3_to_f32(code), global);
#else
  if (mul != nullptr) mul[g] = e4m3_to_f32(code) * global;
#endif
}

/// Stores elements x0, x1 (2k and 2k + 1 of a row, widened to f32) of an NVFP4 tensor as byte k of
/// `dst`, their block's divisor d: x0 in the low nibble.
REFIT_HOST_DEVICE void store_pair(void* dst, std::uint64_t k, float x0, float x1, float d) {
  static_cast<std::uint8_t*>(dst)[k] = static_cast<std::uint8_t>(nvfp4_code(x0, d) | (nvfp4_code(x1, d) << 4));
}

}  // namespace refit::copy::cvt
