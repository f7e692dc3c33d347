// refit — data model: dtypes, tensor metadata, references to tensor memory.
//
// Layer 1: no dependencies. Everything here is a plain value type; nothing owns tensor memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/export.hpp"

namespace refit {

/// Element types. The numeric values are the wire codes and never change.
enum class dtype : std::uint8_t {
  bool_ = 0,
  u8 = 1,
  i8 = 2,
  i16 = 3,
  i32 = 4,
  i64 = 5,
  f16 = 6,
  bf16 = 7,
  f32 = 8,
  f64 = 9,
  f8_e4m3 = 10,
  f8_e5m2 = 11,
  u16 = 12,
  u32 = 13,
  u64 = 14,
  f8_e8m0 = 15,    ///< OCP E8M0: an unsigned power-of-two exponent, bias 127, 0xFF = NaN (torch float8_e8m0fnu)
  f4_e2m1x2 = 16,  ///< two OCP e2m1 values a byte, element 2k in the low nibble (torch float4_e2m1fn_x2)
};

/// Bytes per element.
REFIT_API std::size_t itemsize(dtype t) noexcept;
/// Canonical lower-case name: "bool", "u8", ..., "bf16", "f8_e4m3", "f8_e8m0", "f4_e2m1x2".
REFIT_API std::string_view to_string(dtype t) noexcept;
/// Parses a canonical name, a safetensors name ("BF16", "F8_E4M3", "BOOL") or a torch name
/// ("bfloat16", "float16", "float32", "int64", "uint8", "float8_e4m3fn", ...). nullopt if unknown.
REFIT_API std::optional<dtype> parse_dtype(std::string_view name) noexcept;
/// The dtype with this wire code, nullopt if none.
REFIT_API std::optional<dtype> dtype_from_code(std::uint64_t code) noexcept;

/// Number of elements of a shape; nullopt if a dimension is negative or the product overflows.
REFIT_API std::optional<std::uint64_t> checked_numel(std::span<const std::int64_t> shape) noexcept;
/// Bytes of a tensor of this dtype and shape; nullopt on a negative dimension or overflow.
REFIT_API std::optional<std::uint64_t> checked_nbytes(dtype t, std::span<const std::int64_t> shape) noexcept;

/// Where memory lives.
enum class device_kind : std::uint8_t { cpu = 0, cuda = 1 };

struct device {
  device_kind kind = device_kind::cpu;
  int index = 0;  ///< CUDA ordinal; 0 for the CPU

  static constexpr device cpu() noexcept { return {}; }
  static constexpr device cuda(int ordinal) noexcept { return {device_kind::cuda, ordinal}; }
  friend constexpr bool operator==(const device&, const device&) noexcept = default;
};

/// Name, element type and shape of a tensor (dense, contiguous, row-major).
struct REFIT_API tensor_meta {
  std::string name;
  dtype type = dtype::u8;
  std::vector<std::int64_t> shape;

  /// Elements; throws refit::error(invalid_argument) on a negative dimension or overflow.
  [[nodiscard]] std::uint64_t numel() const;
  /// Bytes (numel × itemsize); throws like numel().
  [[nodiscard]] std::uint64_t nbytes() const;
  friend bool operator==(const tensor_meta&, const tensor_meta&) = default;
};

/// "name bf16[4096, 4096]" — for error messages.
REFIT_API std::string describe(const tensor_meta& meta);

/// A tensor that is part of a larger one (tensor_ref::shard): what a trainer rank holds of a
/// parameter under FSDP (`Shard(0)`: a range of rows) or a Megatron TP slice along dimension 0.
/// The tensor_ref's `meta.shape` is the shard's; `global_shape` the whole tensor's, which equals it
/// except along `dim`, where the shard takes [start, start + meta.shape[dim]). The shard must be
/// one contiguous byte range of the whole tensor: `dim` 0, or a dimension all of whose leading
/// dimensions have size 1 (errc::invalid_argument otherwise, at refit()).
struct tensor_shard {
  std::vector<std::int64_t> global_shape;
  int dim = 0;
  std::int64_t start = 0;
  friend bool operator==(const tensor_shard&, const tensor_shard&) = default;
};

/// A tensor the streamer reads (policy side). The memory must stay valid and unchanged until the
/// refit that reads it returns (or throws). `data` may be null only for a tensor with no elements
/// (a 0 in its shape); a 0-d tensor (shape {}) is a scalar of one element and needs memory.
struct tensor_ref {
  tensor_meta meta;
  const void* data = nullptr;
  device dev{};
  /// For CUDA tensors: the cudaStream_t the tensor is produced on (nullptr: the legacy default
  /// stream's work is assumed complete). The streamer orders its copies after the work enqueued
  /// on this stream so far, with an event — never with a device-wide synchronisation.
  void* stream = nullptr;
  /// Set when this tensor is one shard of the tensor `meta.name` (see tensor_shard): the streamer
  /// sends it as its byte range of the whole tensor, and the receivers assemble the whole from the
  /// shards of every streamer of the group (streamer_options::group_size).
  std::optional<tensor_shard> shard{};
};

/// `source[..., start:start + length, ...]` along dimension `dim`: the part of a source tensor a
/// destination takes (see tensor_dest).
struct source_slice {
  int dim = 0;
  std::int64_t start = 0;
  std::int64_t length = 0;
  friend bool operator==(const source_slice&, const source_slice&) = default;
};

/// How a destination of dtype f8_e4m3 is quantised from its source (tensor_dest::q). The numeric
/// values are the wire codes and never change. A format is data: its groups (the whole tensor, or
/// blocks of block_rows × block_cols of the last two dimensions), the dtype of its scale tensor
/// and the rule that makes a group's scale (block_rows, block_cols, scale_dtype below).
///
/// The exact definition, bit for bit (DeepGEMM's `per_block_cast_to_fp8`, and its per-tensor form):
/// - every source element x (f32, bf16 or f16) is first widened to f32 (exactly);
/// - a group is the whole tensor (`tensor`), one 128 × 128 block of its last two dimensions
///   (`block128`), one row of its last dimension (`channel`: one scale per index of dimension -2,
///   the output channel of a [out, in] weight, compressed-tensors' "channel" strategy), or 32
///   consecutive elements of a row (`mxfp8`, OCP Microscaling v1.0 MXFP8: blocks along the last,
///   reduction, dimension). Leading dimensions index separate grids; blocks at the right and
///   bottom edges may be partial (a row of 40 has an mxfp8 block of 32 and one of 8);
/// - amax = max |x| over the group's finite elements (NaN and ±inf are ignored, in every format);
/// - f32 scales (`tensor`, `block128`, `channel`): amax = max(amax, 1e-4f); s = 448.0f / amax (f32
///   division, rounded to nearest); the scale tensor holds scale_inv = amax / 448.0f (f32);
/// - E8M0 scales (`mxfp8`, OCP v1.0 §6.3): X = 2^(floor(log2(amax)) - 8) (8: e4m3's largest
///   exponent), its code e = floor(log2(amax)) - 8 + 127 clamped to [0, 254] (an all-zero or
///   all-non-finite block, amax 0, and every amax below 2^-119 give 0x00, X = 2^-127; 0xFF, NaN,
///   is never written); s = 1 / X, exact (a power of two);
/// - q = e4m3(x · s), the product in f32, then rounded to the nearest e4m3fn value (ties to even,
///   subnormals included) and saturated: |x · s| ≥ 448 gives ±448 (so ±inf gives ±448, and an
///   mxfp8 block's largest elements, up to 2^9 · X, saturate as OCP's conversion does); NaN gives
///   0x7F; -0 gives 0x80;
/// - the scale tensor is dense row-major: shape {1} for `tensor`;
///   shape[:-2] + {ceil(rows / 128), ceil(cols / 128)} for `block128` (rows, cols: the last two
///   dimensions); shape[:-1] + {ceil(cols / block_cols)} for the row formats, so {out, 1} for
///   `channel` of [out, in] (compressed-tensors' weight_scale) and {out, ceil(in / 32)} for `mxfp8`.
/// - NVFP4 (`nvfp4`, f4_e2m1x2 destinations; NVIDIA's definition, TensorRT-Model-Optimizer's
///   `NVFP4QTensor` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py:
///   get_weights_scaling_factor_2, get_weights_scaling_factor, quantize, _cast_fp4), the
///   `weight`, `weight_scale`, `weight_scale_2` of NVFP4 checkpoints): groups of 16 consecutive
///   elements of a row (short last block as mxfp8), two scales. A pass over the whole tensor first:
///   A = max |x| over its finite elements, the per-tensor scale (`scale_2`, f32, shape {1})
///   g = A / 2688.0f (2688 = 6 · 448: e2m1's largest value times e4m3's). Then per block, with a
///   its amax: the block scale (`scale`, f8_e4m3) is e4m3((a / 6.0f) / g) (two f32 divisions,
///   rounded to nearest even and saturated as above), or e4m3(1.0) = 0x38 for a block with a = 0
///   (all zero, or only non-finite: modelopt's `per_block_scale == 0 → 1.0`); the divisor
///   d = f32(block scale) · g (f32 product); element q = e2m1(x / d) (f32 division, then rounded to
///   the nearest e2m1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even, saturated: |x / d| > 6,
///   ±inf included, gives ±6; the sign is x's, so -0 gives 0x8). NaN gives 0x0 (e2m1 has no NaN:
///   refit sends +0, which is what the element is worth; the block's scale ignores it). Where
///   d = 0 (an all-zero tensor, g = 0; or a block whose scale underflows e4m3's smallest
///   subnormal 2^-9, so dequantised to 0 whatever its codes) every element is written as ±0.
///   Dequantised: x ≈ e2m1 · f32(scale) · scale_2. Two elements a byte: element 2k of a row in the
///   low nibble, 2k + 1 in the high one (modelopt's `q[..., 1::2] << 4 | q[..., 0::2]`, torch's
///   float4_e2m1fn_x2), so a destination of [..., out, in] elements is an f4_e2m1x2 tensor of
///   shape [..., out, in / 2] (its storage shape, as torch and the checkpoints hold it; `in` must
///   be even), its block scales [..., out, ceil(in / 16)];
/// - a scale layout (refit::scale_layout) places mxfp8's and nvfp4's block scales either dense
///   row-major (above) or in the 128 × 4 tiles block-scaled GEMMs read (`swizzled_128x4`).
/// For finite inputs `tensor`/`block128`/`channel` are what
/// `(x.float() * (448 / amax)).to(torch.float8_e4m3fn)` gives.
/// Casts among f32, bf16 and f16 (quant none, another destination dtype) round to nearest even
/// (NaN becomes the canonical quiet NaN: 0x7FC0 in bf16, 0x7E00 in f16; f16 overflows to ±inf).
/// A peer of an older refit refuses the codes it does not know (`channel`, `mxfp8`, `nvfp4`) by
/// name in HELLO's validation (and a swizzled scale layout by its descriptor's length); the
/// protocol version is unchanged.
enum class quant : std::uint8_t {
  none = 0,      ///< no quantisation (a plain copy, or a cast among f32 / bf16 / f16)
  tensor = 1,    ///< f8_e4m3 with one f32 scale for the whole tensor
  block128 = 2,  ///< f8_e4m3 with one f32 scale per 128 × 128 block of the last two dimensions
  channel = 3,   ///< f8_e4m3 with one f32 scale per row (output channel) of the last two dimensions
  mxfp8 = 4,     ///< f8_e4m3 with one f8_e8m0 scale per 32 elements of a row (OCP MXFP8)
  nvfp4 = 5,     ///< f4_e2m1x2 with one f8_e4m3 scale per 16 elements of a row and one f32 per tensor
};
/// "none", "tensor", "block128", "channel", "mxfp8", "nvfp4".
REFIT_API std::string_view to_string(quant q) noexcept;
/// Parses "none", "tensor" (also "per_tensor"), "block128" (also "block"), "channel" (also
/// "per_channel"), "mxfp8" (also "mx"), "nvfp4"; nullopt if unknown.
REFIT_API std::optional<quant> parse_quant(std::string_view name) noexcept;
/// The quant with this wire code, nullopt if none.
REFIT_API std::optional<quant> quant_from_code(std::uint64_t code) noexcept;
/// Where a block format's scales lie in its scale tensor (tensor_dest::layout). The numeric
/// values are the wire codes and never change.
/// - `row_major`: dense, shape[:-1] + {ceil(cols / block_cols)} (refit::quant).
/// - `swizzled_128x4`: the layout cuBLAS's and CUTLASS's block-scaled GEMMs read (cuBLAS docs,
///   "1D Block Scaling Factors Layout"; vLLM's `swizzle_blockscale`, FlashInfer's
///   `pad_and_swizzle`): each matrix of the last two dimensions' scales, R rows × C block
///   columns, is padded with zeros to R' = ceil(R / 128) · 128 rows and C' = ceil(C / 4) · 4
///   columns and cut into 128 × 4 tiles, stored tile after tile (row of tiles major); the scale
///   of row r, column c lies at byte
///   ((r / 128) · (C' / 4) + c / 4) · 512 + (r % 32) · 16 + (r % 128 / 32) · 4 + c % 4
///   of its matrix. Shape: shape[:-2] + {R', C'} (a 1-d tensor is one row). Padding is written
///   as 0 on every refit. mxfp8 and nvfp4 only.
enum class scale_layout : std::uint8_t {
  row_major = 0,
  swizzled_128x4 = 1,
};
/// "row_major", "swizzled_128x4".
REFIT_API std::string_view to_string(scale_layout l) noexcept;
/// Parses "row_major", "swizzled_128x4" (also "swizzled"); nullopt if unknown.
REFIT_API std::optional<scale_layout> parse_scale_layout(std::string_view name) noexcept;
/// The shape of the scale tensor of a `q`-quantised tensor of `shape` ({} for quant::none), in
/// `layout`. `shape` counts elements, not bytes: for nvfp4 the source's shape, [out, in], not the
/// packed destination's [out, in / 2] (see element_shape).
REFIT_API std::vector<std::int64_t> scale_shape(quant q, std::span<const std::int64_t> shape,
                                                scale_layout layout = scale_layout::row_major);
/// The shape in elements of a tensor of dtype `t` whose storage shape is `shape`: the last
/// dimension doubled for f4_e2m1x2 (two elements a byte), `shape` otherwise.
REFIT_API std::vector<std::int64_t> element_shape(dtype t, std::span<const std::int64_t> shape);
/// The storage shape of a tensor of dtype `t` with `shape` elements: the last dimension halved for
/// f4_e2m1x2 (its caller makes sure it is even), `shape` otherwise.
REFIT_API std::vector<std::int64_t> storage_shape(dtype t, std::span<const std::int64_t> shape);
/// The dtype of the destination `q` writes: f4_e2m1x2 for nvfp4, f8_e4m3 for the others (none: any).
REFIT_API dtype quant_dtype(quant q) noexcept;
/// The dtype of the scale tensor of `q`: f32, f8_e8m0 for mxfp8, f8_e4m3 for nvfp4's block scales
/// (f32 for none, unused).
REFIT_API dtype scale_dtype(quant q) noexcept;
/// Rows of the last-two-dims matrix that one group of `q` spans: 128 for block128, 1 for channel,
/// mxfp8 and nvfp4, 0 (all of them) for tensor and none.
REFIT_API std::uint64_t block_rows(quant q) noexcept;
/// Columns that one group of `q` spans: 128 for block128, 32 for mxfp8, 16 for nvfp4, 0 (the whole
/// row) for channel, tensor and none.
REFIT_API std::uint64_t block_cols(quant q) noexcept;
/// The fewest dimensions a tensor quantised as `q` has: 2 for block128, 1 for channel, mxfp8 and
/// nvfp4, 0 otherwise.
REFIT_API std::size_t min_rank(quant q) noexcept;
/// Appended to a tensor's name to name its scale tensor on the wire and in the receiver's table
/// ("\x1fscale_inv": a control character, so no user name collides; add_parameter refuses names
/// that contain it).
inline constexpr std::string_view scale_suffix = "\x1fscale_inv";
/// Appended to a tensor's name to name its second scale tensor (nvfp4's per-tensor f32 scale_2).
inline constexpr std::string_view scale_2_suffix = "\x1fscale_2";

/// A destination the receiver writes (generation side, parameter table). The memory must stay
/// valid, at its address, while it is registered and, after it is removed, until the receiver's
/// next refit has committed or its session has ended (GPU copies are asynchronous; cuda_ipc direct
/// writes map it for a whole session): see refit::receiver. `data` may be null only for a tensor
/// with no elements; a 0-d tensor is one element and needs memory. Alone it is a dense row-major
/// tensor that takes all of the source of the same name, dtype and shape; with a dest_layout it
/// is a view that may take part of it.
///
/// Conversion: `meta.type` is the destination's dtype and may differ from the source's: a cast
/// among f32, bf16 and f16, or f8_e4m3 (f4_e2m1x2 for nvfp4) quantised as `q` says (see
/// refit::quant for the exact definition), with its scales written to `scale` (of scale_dtype(q),
/// on the same device as `data`, of scale_shape(q, element shape, layout): for a view with a
/// slice, the part of the scale grid its slice takes). nvfp4 has a second scale, `scale_2` (one
/// f32, the per-tensor scale; the same version writes the codes and both scales). An nvfp4
/// destination's `meta.shape` is its storage shape ([out, in / 2] for a source of [out, in]).
/// The streamer converts once, before the bytes leave it, so every transport carries converted
/// bytes; each scale travels as a tensor of its own (name + scale_suffix, name + scale_2_suffix),
/// already in `layout`.
struct tensor_dest {
  tensor_meta meta;
  void* data = nullptr;
  device dev{};
  quant q = quant::none;                          ///< f8_e4m3 / f4_e2m1x2 destinations only: how to quantise
  void* scale = nullptr;                          ///< the scale tensor of a quantised destination (see above)
  void* scale_2 = nullptr;                        ///< nvfp4 only: its f32 per-tensor scale (one element)
  scale_layout layout = scale_layout::row_major;  ///< where `scale` holds the block scales (mxfp8, nvfp4)
};

/// A destination in the engine's own layout (receiver::add_parameter(dest, layout)): a view into a
/// larger engine tensor that may take only part of its source (fused q/k/v or gate/up,
/// tensor-parallel shards, stacked experts, tied weights).
/// - The tensor_dest's `meta.name` names the source tensor, `meta.type` its dtype and
///   `meta.shape` the shape of the view (what lands here); `data` is the view's first element.
/// - `strides` (elements, one per dimension; empty: dense row-major) describe the view as torch's
///   `tensor.stride()` does: `qkv.narrow(0, q, kv)` or `w[:, a:b]`. Strides must be non-negative,
///   the last dimension (of size > 1) must have stride 1 (refit writes rows of elements), and the
///   view must not overlap itself; a view split into more than 65,536 separate strided blocks is
///   refused.
/// - `slice` takes `source[..., start:start + length, ...]` along `dim` (a TP shard, a vocab
///   range, one of q/k/v out of a fused source): the source's shape must equal the view's except
///   along `dim`, where it may be longer; `length` is the view's size there.
/// - `alloc` and `alloc_bytes`, when given, bound the allocation the view lies in (torch:
///   `untyped_storage()`): a view that leaves it is refused at registration.
/// Several destinations may take the same source (tied weights, a source split between fused
/// tensors) and several sources may land in one allocation; no two destinations may write the
/// same byte (refused at registration, errc::invalid_argument, naming both).
struct dest_layout {
  std::vector<std::int64_t> strides;  ///< of the view, in elements; empty: dense
  std::optional<source_slice> slice;  ///< the part of the source this view takes; none: all of it
  const void* alloc = nullptr;        ///< first byte of the allocation holding the view (optional)
  std::uint64_t alloc_bytes = 0;      ///< its size (0: unknown, not checked)
};

/// What a batch callback sees of one entry: a byte range of a tensor, in the receiver's buffer.
/// `data` points at the first byte of the range; it is valid only during the callback.
struct tensor_view {
  const tensor_meta* meta = nullptr;
  const void* data = nullptr;
  std::uint64_t offset = 0;  ///< first byte of the range within the tensor
  std::uint64_t bytes = 0;   ///< length of the range
  std::uint64_t total = 0;   ///< bytes of the whole tensor
  device dev{};

  /// True when the view covers the whole tensor (it was not split into chunks).
  [[nodiscard]] bool whole() const noexcept { return offset == 0 && bytes == total; }
  /// True for the last chunk of a tensor (also for a whole tensor).
  [[nodiscard]] bool last() const noexcept { return offset + bytes == total; }
};

}  // namespace refit
