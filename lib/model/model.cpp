#include "refit/model.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cctype>

#include "refit/error.hpp"

namespace refit {
namespace {

struct dtype_info {
  dtype type;
  std::size_t size;
  std::string_view name;
};

constexpr std::array<dtype_info, 17> dtypes = {{
    {dtype::bool_, 1, "bool"},
    {dtype::u8, 1, "u8"},
    {dtype::i8, 1, "i8"},
    {dtype::i16, 2, "i16"},
    {dtype::i32, 4, "i32"},
    {dtype::i64, 8, "i64"},
    {dtype::f16, 2, "f16"},
    {dtype::bf16, 2, "bf16"},
    {dtype::f32, 4, "f32"},
    {dtype::f64, 8, "f64"},
    {dtype::f8_e4m3, 1, "f8_e4m3"},
    {dtype::f8_e5m2, 1, "f8_e5m2"},
    {dtype::u16, 2, "u16"},
    {dtype::u32, 4, "u32"},
    {dtype::u64, 8, "u64"},
    {dtype::f8_e8m0, 1, "f8_e8m0"},
    {dtype::f4_e2m1x2, 1, "f4_e2m1x2"},
}};

// Other spellings: safetensors (upper case of ours, plus BOOL), torch and numpy names.
struct alias {
  std::string_view name;
  dtype type;
};
constexpr std::array<alias, 25> aliases = {{
    {"bfloat16", dtype::bf16},
    {"float16", dtype::f16},
    {"half", dtype::f16},
    {"float32", dtype::f32},
    {"float", dtype::f32},
    {"float64", dtype::f64},
    {"double", dtype::f64},
    {"int8", dtype::i8},
    {"int16", dtype::i16},
    {"int32", dtype::i32},
    {"int64", dtype::i64},
    {"uint8", dtype::u8},
    {"uint16", dtype::u16},
    {"uint32", dtype::u32},
    {"uint64", dtype::u64},
    {"float8_e4m3fn", dtype::f8_e4m3},
    {"float8_e5m2", dtype::f8_e5m2},
    {"f8_e4m3fn", dtype::f8_e4m3},
    {"float8_e8m0fnu", dtype::f8_e8m0},
    {"f8_e8m0fnu", dtype::f8_e8m0},
    {"float4_e2m1fn_x2", dtype::f4_e2m1x2},
    {"boolean", dtype::bool_},
    {"short", dtype::i16},
    {"int", dtype::i32},
    {"long", dtype::i64},
}};

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

}  // namespace

std::size_t itemsize(dtype t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < dtypes.size() ? dtypes[i].size : 0;
}

std::string_view to_string(dtype t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < dtypes.size() ? dtypes[i].name : std::string_view("?");
}

std::optional<dtype> parse_dtype(std::string_view name) noexcept {
  try {
    std::string l = lower(name);
    if (l.starts_with("torch.")) l.erase(0, 6);
    for (const auto& d : dtypes)
      if (d.name == l) return d.type;
    for (const auto& a : aliases)
      if (a.name == l) return a.type;
  } catch (...) {
  }
  return std::nullopt;
}

std::optional<dtype> dtype_from_code(std::uint64_t code) noexcept {
  if (code < dtypes.size()) return dtypes[code].type;
  return std::nullopt;
}

std::string_view to_string(quant q) noexcept {
  switch (q) {
    case quant::none: return "none";
    case quant::tensor: return "tensor";
    case quant::block128: return "block128";
    case quant::channel: return "channel";
    case quant::mxfp8: return "mxfp8";
    case quant::nvfp4: return "nvfp4";
  }
  return "?";
}

std::string_view to_string(scale_layout l) noexcept {
  switch (l) {
    case scale_layout::row_major: return "row_major";
    case scale_layout::swizzled_128x4: return "swizzled_128x4";
  }
  return "?";
}

std::optional<scale_layout> parse_scale_layout(std::string_view name) noexcept {
  if (name == "row_major") return scale_layout::row_major;
  if (name == "swizzled_128x4" || name == "swizzled") return scale_layout::swizzled_128x4;
  return std::nullopt;
}

std::optional<quant> parse_quant(std::string_view name) noexcept {
  if (name == "none") return quant::none;
  if (name == "tensor" || name == "per_tensor") return quant::tensor;
  if (name == "block128" || name == "block") return quant::block128;
  if (name == "channel" || name == "per_channel") return quant::channel;
  if (name == "mxfp8" || name == "mx") return quant::mxfp8;
  if (name == "nvfp4") return quant::nvfp4;
  return std::nullopt;
}

std::optional<quant> quant_from_code(std::uint64_t code) noexcept {
  if (code <= static_cast<std::uint64_t>(quant::nvfp4)) return static_cast<quant>(code);
  return std::nullopt;
}

std::vector<std::int64_t> scale_shape(quant q, std::span<const std::int64_t> shape, scale_layout layout) {
  if (layout == scale_layout::swizzled_128x4 && (q == quant::mxfp8 || q == quant::nvfp4)) {
    // The row-major grid's last two dimensions padded to whole 128 × 4 tiles (a 1-d one is a row).
    std::vector<std::int64_t> s = scale_shape(q, shape);
    if (s.size() < 2) s.insert(s.begin(), 1);
    s[s.size() - 2] = (s[s.size() - 2] + 127) / 128 * 128;
    s[s.size() - 1] = (s[s.size() - 1] + 3) / 4 * 4;
    return s;
  }
  switch (q) {
    case quant::none: return {};
    case quant::tensor: return {1};
    case quant::block128: {
      std::vector<std::int64_t> s(shape.begin(), shape.end());
      for (std::size_t k = s.size() >= 2 ? s.size() - 2 : 0; k < s.size(); ++k) s[k] = (s[k] + 127) / 128;
      return s;
    }
    case quant::channel:
    case quant::mxfp8:
    case quant::nvfp4: {
      std::vector<std::int64_t> s(shape.begin(), shape.end());
      if (s.empty()) return {1};
      const auto b = static_cast<std::int64_t>(block_cols(q));
      s.back() = b == 0 ? 1 : (s.back() + b - 1) / b;
      return s;
    }
  }
  return {};
}

dtype scale_dtype(quant q) noexcept {
  return q == quant::mxfp8 ? dtype::f8_e8m0 : q == quant::nvfp4 ? dtype::f8_e4m3 : dtype::f32;
}

dtype quant_dtype(quant q) noexcept { return q == quant::nvfp4 ? dtype::f4_e2m1x2 : dtype::f8_e4m3; }

std::vector<std::int64_t> element_shape(dtype t, std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> s(shape.begin(), shape.end());
  if (t == dtype::f4_e2m1x2 && !s.empty()) s.back() *= 2;
  return s;
}

std::vector<std::int64_t> storage_shape(dtype t, std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> s(shape.begin(), shape.end());
  if (t == dtype::f4_e2m1x2 && !s.empty()) s.back() /= 2;
  return s;
}

std::uint64_t block_rows(quant q) noexcept {
  switch (q) {
    case quant::block128: return 128;
    case quant::channel:
    case quant::mxfp8:
    case quant::nvfp4: return 1;
    case quant::none:
    case quant::tensor: break;
  }
  return 0;
}

std::uint64_t block_cols(quant q) noexcept {
  switch (q) {
    case quant::block128: return 128;
    case quant::mxfp8: return 32;
    case quant::nvfp4: return 16;
    case quant::none:
    case quant::tensor:
    case quant::channel: break;
  }
  return 0;
}

std::size_t min_rank(quant q) noexcept {
  switch (q) {
    case quant::block128: return 2;
    case quant::channel:
    case quant::mxfp8:
    case quant::nvfp4: return 1;
    case quant::none:
    case quant::tensor: break;
  }
  return 0;
}

std::optional<std::uint64_t> checked_numel(std::span<const std::int64_t> shape) noexcept {
  std::uint64_t n = 1;
  for (const std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

std::optional<std::uint64_t> checked_nbytes(dtype t, std::span<const std::int64_t> shape) noexcept {
  const auto n = checked_numel(shape);
  const std::size_t size = itemsize(t);
  std::uint64_t bytes = 0;
  if (!n || size == 0 || __builtin_mul_overflow(*n, static_cast<std::uint64_t>(size), &bytes)) return std::nullopt;
  return bytes;
}

std::uint64_t tensor_meta::numel() const {
  const auto n = checked_numel(shape);
  if (!n)
    throw error(errc::invalid_argument,
                fmt::format("tensor {}: shape has a negative dimension or too many elements", describe(*this)));
  return *n;
}

std::uint64_t tensor_meta::nbytes() const {
  const auto n = checked_nbytes(type, shape);
  if (!n)
    throw error(errc::invalid_argument,
                fmt::format("tensor {}: shape has a negative dimension or too many bytes", describe(*this)));
  return *n;
}

std::string describe(const tensor_meta& meta) {
  return fmt::format("{} {}[{}]", meta.name, to_string(meta.type), fmt::join(meta.shape, ", "));
}

}  // namespace refit
