#include "copy/copy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <deque>

#include "config/config.hpp"
#include "copy/bus_guard.hpp"
#include "refit/error.hpp"
#if REFIT_HAVE_CUDA
#include "copy/copy_cuda.hpp"
#endif

namespace refit::copy {

static_assert(cvt::f16 == static_cast<std::uint8_t>(dtype::f16) &&
              cvt::bf16 == static_cast<std::uint8_t>(dtype::bf16) &&
              cvt::f32 == static_cast<std::uint8_t>(dtype::f32) &&
              cvt::f8_e4m3 == static_cast<std::uint8_t>(dtype::f8_e4m3));
static_assert(cvt::quant_none == static_cast<std::uint8_t>(quant::none) &&
              cvt::quant_tensor == static_cast<std::uint8_t>(quant::tensor) &&
              cvt::quant_block128 == static_cast<std::uint8_t>(quant::block128) &&
              cvt::quant_channel == static_cast<std::uint8_t>(quant::channel) &&
              cvt::quant_mxfp8 == static_cast<std::uint8_t>(quant::mxfp8));
static_assert(cvt::f8_e8m0 == static_cast<std::uint8_t>(dtype::f8_e8m0) &&
              cvt::f4_e2m1x2 == static_cast<std::uint8_t>(dtype::f4_e2m1x2) &&
              cvt::quant_nvfp4 == static_cast<std::uint8_t>(quant::nvfp4));
static_assert(cvt::layout_row_major == static_cast<std::uint8_t>(scale_layout::row_major) &&
              cvt::layout_swizzled == static_cast<std::uint8_t>(scale_layout::swizzled_128x4));

namespace {

/// Elements [from, to) of a stretch with one multiplier, the dtypes fixed at compile time so that
/// the loop has no switch in it.
template <std::uint8_t From, std::uint8_t To>
void convert_stretch(const void* src, void* dst, std::uint64_t from, std::uint64_t to, float mul) {
  if constexpr (To == cvt::f4_e2m1x2) {
    // Pairs: a stretch starts on an even element and is even long (rows and NVFP4 blocks are).
    for (std::uint64_t k = from; k + 1 < to; k += 2)
      cvt::store_pair(dst, k / 2, cvt::load(src, From, k), cvt::load(src, From, k + 1), mul);
  } else {
    for (std::uint64_t k = from; k < to; ++k) cvt::store(dst, To, k, cvt::load(src, From, k), mul);
  }
}

using stretch_fn = void (*)(const void*, void*, std::uint64_t, std::uint64_t, float);

template <std::uint8_t From>
stretch_fn stretch_to(std::uint8_t to) {
  switch (to) {
    case cvt::f32: return convert_stretch<From, cvt::f32>;
    case cvt::bf16: return convert_stretch<From, cvt::bf16>;
    case cvt::f16: return convert_stretch<From, cvt::f16>;
    case cvt::f4_e2m1x2: return convert_stretch<From, cvt::f4_e2m1x2>;
    default: return convert_stretch<From, cvt::f8_e4m3>;
  }
}

stretch_fn stretch_for(std::uint8_t from, std::uint8_t to) {
  switch (from) {
    case cvt::f32: return stretch_to<cvt::f32>(to);
    case cvt::bf16: return stretch_to<cvt::bf16>(to);
    default: return stretch_to<cvt::f16>(to);
  }
}

/// One row of a converting copy: `n` elements from element `e` of the tensor on.
void convert_row(const convert_op& o, const void* src, void* dst, std::uint64_t e, std::uint64_t n) {
  const cvt::conversion& c = o.cv;
  const stretch_fn run = stretch_for(c.from, c.to);
  if (c.q == cvt::quant_none || c.q == cvt::quant_tensor) {
    run(src, dst, 0, n, c.q == cvt::quant_tensor ? c.mul[0] : 1.0f);
    return;
  }
  // Groups change at block edges and row ends: look the group up once per stretch.
  for (std::uint64_t i = 0; i < n;) {
    const std::uint64_t col = (e + i) % c.cols;
    const std::uint64_t stretch = std::min(n - i, cvt::group_stretch(c, col));
    run(src, dst, i, i + stretch, c.mul[cvt::group_of(c, e + i)]);
    i += stretch;
  }
}

/// Writes the scales of groups whose amaxes are `amax` (row-major) through the job's layout;
/// nvfp4's per-tensor scale first (the largest block amax is the tensor's).
void write_scales(const scale_job& j, const cvt::conversion& c, std::span<const float> amax) {
  const auto q = static_cast<std::uint8_t>(j.q);
  const auto layout = static_cast<std::uint8_t>(j.layout);
  const std::uint64_t bc = cvt::group_cols(q, c.cols);
  const std::uint64_t grid_cols = (c.cols + bc - 1) / bc;
  if (j.layout == scale_layout::swizzled_128x4 && j.scale != nullptr)
    std::memset(j.scale, 0, *checked_numel(scale_shape(j.q, j.shape, j.layout)));  // the padding
  if (j.q != quant::nvfp4) {
    for (std::uint64_t g = 0; g < amax.size(); ++g)
      cvt::write_scale(q, amax[g], j.scale, cvt::scale_index(layout, g, c.rows, grid_cols), j.mul, g);
    return;
  }
  float tensor_amax = 0.0f;
  for (const float a : amax) tensor_amax = std::max(tensor_amax, a);
  const float global = cvt::nvfp4_global(tensor_amax);
  if (j.scale_2 != nullptr) *j.scale_2 = global;
  for (std::uint64_t g = 0; g < amax.size(); ++g)
    cvt::write_nvfp4_scale(amax[g], global, j.scale, cvt::scale_index(layout, g, c.rows, grid_cols), j.mul, g);
}

void cpu_scales(const scale_job& j) {
  const auto from = static_cast<std::uint8_t>(j.from);
  const std::uint64_t n = *checked_numel(j.shape);
  const cvt::conversion c =
      conversion_of(j.from, j.q == quant::nvfp4 ? dtype::f4_e2m1x2 : dtype::f8_e4m3, j.q, j.shape, nullptr);
  const std::uint64_t groups = *checked_numel(scale_shape(j.q, j.shape));
  std::vector<float> amax(groups, 0.0f);
  if (j.q == quant::tensor) {
    float m = 0.0f;
    for (std::uint64_t i = 0; i < n; ++i) {
      const float a = std::fabs(cvt::load(j.src, from, i));
      if (cvt::counts(a) && a > m) m = a;
    }
    for (float& g : amax) g = m;
  } else {
    for (std::uint64_t e = 0; e < n;) {
      const std::uint64_t stretch = cvt::group_stretch(c, e % c.cols);
      float& m = amax[cvt::group_of(c, e)];
      for (std::uint64_t k = e; k < e + stretch; ++k) {
        const float a = std::fabs(cvt::load(j.src, from, k));
        if (cvt::counts(a) && a > m) m = a;
      }
      e += stretch;
    }
  }
  write_scales(j, c, amax);
}

/// The CPU engine's copies of a batch (`ops` points at a std::span<const op>). Run inside
/// guarded(): nothing here has a destructor, takes a lock or allocates.
void copy_ops(const void* ops) {
  for (const op& o : *static_cast<const std::span<const op>*>(ops)) {
    if (o.bytes == 0) continue;
    for (std::uint64_t r = 0; r < o.rows; ++r)
      std::memcpy(static_cast<std::byte*>(o.dst) + r * o.dst_pitch,
                  static_cast<const std::byte*>(o.src) + r * o.src_pitch, o.bytes);
  }
}

class cpu_copier final : public copier {
 public:
  /// A receiver's host_shm apply reads the streamer's mapped buffers here, once per batch: while
  /// such memory is mapped (bus_guard.hpp), one sigsetjmp per call turns a SIGBUS reading it (a
  /// streamer that truncated its segment) into errc::transport instead of the end of the process.
  void run(std::span<const op> ops, void* /*stream*/) override {
    if (!peer_memory_mapped()) {
      copy_ops(&ops);
      return;
    }
    if (const auto fault = guarded(copy_ops, &ops)) throw error(errc::transport, "host_shm: " + *fault);
  }
  void convert(std::span<const convert_op> ops, void* /*stream*/) override {
    for (const convert_op& o : ops) {
      const std::uint32_t si = cvt::item(o.cv.from);
      for (std::uint64_t r = 0; r < o.rows && o.count != 0; ++r)
        convert_row(o, static_cast<const std::byte*>(o.src) + r * o.src_pitch * si,
                    static_cast<std::byte*>(o.dst) + cvt::bytes_of(o.cv.to, r * o.dst_pitch), o.first + r * o.src_pitch,
                    o.count);
    }
  }
  void scales(std::span<const scale_job> jobs, void* /*stream*/) override {
    for (const scale_job& j : jobs) cpu_scales(j);
  }
  void fused(std::span<const fused_job> jobs, void* /*stream*/) override {
    // The same result as the GPU's one pass, in two: scales of the whole tensor, then the columns.
    for (const fused_job& j : jobs) {
      const std::vector<std::int64_t> shape{static_cast<std::int64_t>(j.lead), static_cast<std::int64_t>(j.rows),
                                            static_cast<std::int64_t>(j.cols)};
      const std::uint64_t groups = *checked_numel(scale_shape(quant::block128, shape));
      std::vector<float> inv(groups), mul(groups);  // block128: f32 scales
      cpu_scales(scale_job{j.src, j.from, shape, quant::block128, inv.data(), mul.data()});
      const cvt::conversion c = conversion_of(j.from, dtype::f8_e4m3, quant::block128, shape, mul.data());
      const std::uint64_t si = cvt::item(c.from);
      for (std::uint64_t row = 0; row < j.lead * j.rows && j.col_hi > j.col_lo; ++row) {
        const convert_op o{static_cast<const std::byte*>(j.src) + (row * j.cols + j.col_lo) * si,
                           j.dst + row * j.dst_pitch,
                           j.col_hi - j.col_lo,
                           1,
                           0,
                           0,
                           row * j.cols + j.col_lo,
                           c};
        convert_row(o, o.src, o.dst, o.first, o.count);
      }
      if (j.scale == nullptr) continue;
      const std::uint64_t grid_rows = (j.rows + 127) / 128;
      const std::uint64_t grid_cols = (j.cols + 127) / 128;
      const std::uint64_t b_lo = j.col_lo / 128;
      const std::uint64_t b_hi = (j.col_hi + 127) / 128;
      for (std::uint64_t g = 0; g < j.lead * grid_rows; ++g)
        for (std::uint64_t b = b_lo; b < b_hi; ++b) j.scale[g * j.scale_pitch + (b - b_lo)] = inv[g * grid_cols + b];
    }
  }
  float* scratch(std::size_t n) override { return scratch_.emplace_back(n).data(); }
  void reset_scratch() noexcept override { scratch_.clear(); }
  [[nodiscard]] engine kind() const noexcept override { return engine::cpu; }

 private:
  std::deque<std::vector<float>> scratch_;
};

}  // namespace

std::uint64_t checksum(const void* p, std::uint64_t bytes, device dev) {
  if (dev.kind == device_kind::cuda) {
#if REFIT_HAVE_CUDA
    return cuda_checksum(p, bytes, dev.index);
#else
    throw error(errc::invalid_argument, "checksum of CUDA memory needs a build with CUDA");
#endif
  }
  const auto* b = static_cast<const unsigned char*>(p);
  const std::uint64_t words = bytes / 8;
  std::uint64_t sum = bytes;
  for (std::uint64_t k = 0; k < words; ++k) {
    std::uint64_t w;
    std::memcpy(&w, b + 8 * k, 8);  // little-endian hosts only (x86-64, aarch64)
    sum += w * (2 * k + 1);
  }
  for (std::uint64_t j = 0; j < bytes % 8; ++j)
    sum += static_cast<std::uint64_t>(b[8 * words + j]) * (2 * j + 3) * 0x100000001b3ull;
  return sum;
}

std::string_view to_string(engine e) noexcept {
  switch (e) {
    case engine::cpu: return "cpu";
    case engine::kernel: return "kernel";
    case engine::memcpy_batch: return "memcpy_batch";
    case engine::memcpy_each: return "memcpy_each";
  }
  return "?";
}

engine choose(engine preferred, copy_engine requested) noexcept {
  if (preferred == engine::cpu || requested == copy_engine::automatic) return preferred;
  switch (requested) {
    case copy_engine::kernel: return engine::kernel;
    case copy_engine::memcpy_batch: return engine::memcpy_batch;
    case copy_engine::memcpy_each: return engine::memcpy_each;
    case copy_engine::automatic: break;
  }
  return preferred;
}

cvt::conversion conversion_of(dtype from, dtype to, quant q, std::span<const std::int64_t> shape,
                              const float* mul) noexcept {
  cvt::conversion c;
  c.from = static_cast<std::uint8_t>(from);
  c.to = static_cast<std::uint8_t>(to);
  c.q = static_cast<std::uint8_t>(q);
  c.mul = mul;
  const std::size_t rank = shape.size();
  c.cols = rank >= 1 && shape[rank - 1] > 0 ? static_cast<std::uint64_t>(shape[rank - 1]) : 1;
  c.rows = rank >= 2 && shape[rank - 2] > 0 ? static_cast<std::uint64_t>(shape[rank - 2]) : 1;
  return c;
}

bool append_convert_route(std::span<const plan::run> runs, std::uint64_t from, std::uint64_t bytes, const void* src,
                          std::byte* dst, const cvt::conversion& cv, std::vector<convert_op>& ops,
                          std::vector<plan::run>& scratch) {
  scratch.clear();
  for (const plan::run& r : runs) plan::clip(r, from, from + bytes, scratch);
  const std::uint64_t si = cvt::item(cv.from);
  for (const plan::run& r : scratch) {
    // Byte counts of the converted tensor, as elements (two a byte for f4_e2m1x2).
    const std::uint64_t first = cvt::elements_of(cv.to, r.src);
    ops.push_back(convert_op{static_cast<const std::byte*>(src) + first * si, dst + r.dst,
                             cvt::elements_of(cv.to, r.width), r.rows, cvt::elements_of(cv.to, r.src_pitch),
                             cvt::elements_of(cv.to, r.dst_pitch), first, cv});
  }
  return !scratch.empty();
}

bool append_route(std::span<const plan::run> runs, std::uint64_t from, std::uint64_t bytes, const std::byte* src,
                  std::byte* dst, std::vector<op>& ops, std::vector<plan::run>& scratch, bool kernel_only) {
  scratch.clear();
  for (const plan::run& r : runs) plan::clip(r, from, from + bytes, scratch);
  for (const plan::run& r : scratch) {
    ops.emplace_back(src + (r.src - from), dst + r.dst, r.width, r.rows, r.src_pitch, r.dst_pitch);
    ops.back().kernel_only = kernel_only;
  }
  return !scratch.empty();
}

#if !REFIT_HAVE_CUDA
std::optional<allocation> cuda_allocation_of(const void* /*p*/, int /*device*/) {
  throw error(errc::invalid_argument, "CUDA memory needs a build with CUDA, and this refit was built without it");
}

std::uint64_t cuda_allocation_id(const void* /*p*/, int /*device*/) {
  throw error(errc::invalid_argument, "CUDA memory needs a build with CUDA, and this refit was built without it");
}

struct device_area::impl {};
device_area::device_area(std::uint64_t bytes, int device, bool /*pinned_host*/) {
  throw error(errc::invalid_argument,
              fmt::format("a device stage of {} bytes on cuda:{} needs CUDA, and this refit was built without it",
                          bytes, device));
}
device_area::~device_area() = default;
std::byte* device_area::data() const noexcept { return nullptr; }
std::uint64_t device_area::bytes() const noexcept { return 0; }
int device_area::device() const noexcept { return 0; }
void* device_area::stream() const noexcept { return nullptr; }
void device_area::synchronize(milliseconds /*timeout*/) const {}
void device_area::read_on(void* /*stream*/) {}
void device_area::wait_readers(milliseconds /*timeout*/) {}

void enable_peer_access(int device, int peer) {
  throw error(
      errc::invalid_argument,
      fmt::format("copies between cuda:{} and cuda:{} need CUDA, and this refit was built without it", device, peer));
}
#endif

std::uint64_t offload_for(copy_engine requested) noexcept {
  return requested == copy_engine::automatic ? offload_from_automatic : 0;
}

std::unique_ptr<copier> make_copier(engine e, int device, milliseconds timeout, std::uint64_t offload_from) {
  if (e == engine::cpu) return std::make_unique<cpu_copier>();
#if REFIT_HAVE_CUDA
  return make_cuda_copier(e, device, timeout, offload_from);
#else
  (void)device, (void)timeout, (void)offload_from;
  throw error(errc::invalid_argument,
              fmt::format("copy engine {} needs CUDA, and this refit was built without it", to_string(e)));
#endif
}

}  // namespace refit::copy
