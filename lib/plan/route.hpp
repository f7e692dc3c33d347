// refit — routes: which bytes of a source tensor go where in a destination view.
//
// Layer 2 (pure arithmetic, no I/O). A destination (refit::tensor_dest with its dest_layout) is a strided view that may
// take a slice of its source; both sides reduce it to a few `run`s — `rows` runs of `width` bytes
// with a source pitch and a destination pitch — and every transport moves those: the receiver
// applies them from its buffer, a direct streamer writes them into the mapped weights. A batch
// entry carries a byte range of its source, so runs are clipped to that range (clip()).
//
// Invariants: runs of one route never write the same destination byte twice (check_view refuses
// self-overlapping views), read source bytes in increasing order, and together cover each source
// byte they read exactly once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/model.hpp"

namespace refit::plan {

/// A registered destination: a tensor_dest with its dest_layout (empty for a dense one).
struct destination {
  tensor_meta meta;
  void* data = nullptr;
  device dev{};
  std::vector<std::int64_t> strides;
  std::optional<source_slice> slice;
  const void* alloc = nullptr;
  std::uint64_t alloc_bytes = 0;
  quant q = quant::none;  ///< how an f8_e4m3 destination is quantised (its scale is a destination of its own)
  scale_layout layout = scale_layout::row_major;  ///< where its block scales lie (mxfp8, nvfp4)

  destination() = default;
  destination(const tensor_dest& d, const dest_layout& l)
      : meta(d.meta),
        data(d.data),
        dev(d.dev),
        strides(l.strides),
        slice(l.slice),
        alloc(l.alloc),
        alloc_bytes(l.alloc_bytes),
        q(d.q),
        layout(d.layout) {}
};

/// `rows` runs of `width` bytes: run r reads source bytes [src + r·src_pitch, + width) and writes
/// destination bytes [dst + r·dst_pitch, + width). `src` counts from the source tensor's first
/// byte, `dst` from the destination view's (destination::data).
struct run {
  std::uint64_t src = 0;
  std::uint64_t src_pitch = 0;
  std::uint64_t dst = 0;
  std::uint64_t dst_pitch = 0;
  std::uint64_t width = 0;
  std::uint64_t rows = 1;
  friend bool operator==(const run&, const run&) = default;
};

/// At most this many runs describe one route; a view fragmented further is refused (it would be
/// copied element by element).
inline constexpr std::size_t max_runs = 1u << 16;

/// Bytes a destination's view spans from its first byte: the last byte written, plus one (0 for a
/// view with no elements).
struct extent {
  std::uint64_t bytes = 0;
};

/// Checks a destination on its own (at registration): strides one per dimension, non-negative, the
/// innermost dimension of size > 1 dense (stride 1), and not overlapping the view with itself; a slice whose dimension exists, start is non-negative
/// and length equals the view's size along it; the view inside [alloc, alloc + alloc_bytes) when
/// given. Throws refit::error(invalid_argument) naming the destination. Returns its extent.
extent check_view(const destination& d);

/// True when `d`'s view is one dense row-major range of memory (no strides, or the strides of its
/// shape, ignoring dimensions of size 1), whatever part of its source it takes: any run of its
/// source then lands in one range of it.
bool is_dense(const destination& d) noexcept;

/// True when `d` takes its whole source into a dense row-major view (no slice, is_dense): one
/// run, what every transport could move before views existed.
bool is_plain(const destination& d) noexcept;

/// The runs that move a source of `type` and `shape` into `d`. Throws refit::error(apply) naming
/// the tensor and both shapes when they do not fit: another dtype, another rank, a dimension
/// that differs (outside the slice's), or a slice past the source's end.
std::vector<run> route(const destination& d, dtype type, std::span<const std::int64_t> shape);

/// route() of one destination, kept for the source dtype and shape it was last asked for: a source
/// keeps its dtype and shape across refits, so both sides compute a destination's runs once, not
/// once per refit. Not thread-safe.
class route_cache {
 public:
  /// route(d, type, shape), recomputed only when `type` or `shape` differs from the last call's
  /// that succeeded (a misfit throws as route() does and leaves nothing cached). `d` must be the
  /// destination of every call (a destination registered again gets a new cache). The runs stay
  /// valid until the next call that recomputes them.
  std::span<const run> get(const destination& d, dtype type, std::span<const std::int64_t> shape) {
    if (valid_ && type == type_ && std::ranges::equal(shape, shape_)) return runs_;
    valid_ = false;
    runs_.clear();
    runs_ = route(d, type, shape);
    type_ = type;
    shape_.assign(shape.begin(), shape.end());
    valid_ = true;
    return runs_;
  }
  /// The runs of the last get() that succeeded (none before the first).
  [[nodiscard]] std::span<const run> runs() const noexcept { return runs_; }

 private:
  bool valid_ = false;
  dtype type_ = dtype::u8;
  std::vector<std::int64_t> shape_;
  std::vector<run> runs_;
};

/// The destination bytes `d` writes, as runs with only dst/dst_pitch/width/rows meaningful (for
/// overlap checks). Assumes check_view(d) passed.
std::vector<run> footprint(const destination& d);

/// True when the two footprints share a byte, their views starting at addresses `a` and `b`.
bool overlaps(std::uintptr_t a, std::span<const run> fa, std::uintptr_t b, std::span<const run> fb);

/// Appends to `out` the parts of `r` that read source bytes [from, to): at most three runs (a
/// partial first row, whole rows, a partial last row).
void clip(const run& r, std::uint64_t from, std::uint64_t to, std::vector<run>& out);

/// Source bytes the runs read, in total.
std::uint64_t bytes_of(std::span<const run> runs) noexcept;

/// Where the bytes the runs read (`source` true) or write (false) lie, when they form one range
/// taken in order: its first byte (a source or destination offset, as the runs count them); nullopt
/// when they are scattered (a column slice's rows, read from a row-major source), or for no bytes.
std::optional<std::uint64_t> contiguous(std::span<const run> runs, bool source) noexcept;

}  // namespace refit::plan
