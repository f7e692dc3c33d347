#include "plan/route.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>

#include "refit/error.hpp"

namespace refit::plan {
namespace {

/// One dimension of a copy: its size and the strides (elements) of the source and the destination.
struct axis {
  std::uint64_t size = 0;
  std::uint64_t ss = 0;
  std::uint64_t ds = 0;
};

std::vector<std::int64_t> view_strides(const destination& d) {
  if (!d.strides.empty()) return d.strides;
  std::vector<std::int64_t> s(d.meta.shape.size(), 1);
  for (std::size_t k = s.size(); k-- > 1;) s[k - 1] = s[k] * d.meta.shape[k];
  return s;
}

std::string where(const destination& d) {
  std::string s = fmt::format("'{}' ({})", d.meta.name, describe(d.meta));
  if (!d.strides.empty()) s += fmt::format(" with strides ({})", fmt::join(d.strides, ", "));
  if (d.slice) {
    // A hostile or mistaken start near the top must not overflow here either.
    std::int64_t end = 0;
    const bool overflows = __builtin_add_overflow(d.slice->start, d.slice->length, &end);
    s += fmt::format(" taking [{}:{}] of dimension {} of the source", d.slice->start,
                     overflows ? std::string("overflow") : std::to_string(end), d.slice->dim);
  }
  return s;
}

/// Merges neighbouring axes that are contiguous with each other on both sides (outer first in,
/// outer first out), so a dense block is one axis however many dimensions it spans.
std::vector<axis> collapse(const std::vector<axis>& axes) {
  std::vector<axis> inner_first;
  for (std::size_t k = axes.size(); k-- > 0;) {
    const axis& a = axes[k];
    if (!inner_first.empty()) {
      axis& top = inner_first.back();
      if (a.ss == top.size * top.ss && a.ds == top.size * top.ds) {
        top.size *= a.size;
        continue;
      }
    }
    inner_first.push_back(a);
  }
  return {inner_first.rbegin(), inner_first.rend()};
}

/// The runs of the (collapsed) axes, starting at source element `base`.
std::vector<run> runs_of(std::vector<axis> axes, std::uint64_t base, std::uint64_t item, const destination& d) {
  axes = collapse(axes);
  std::uint64_t width = item;
  if (!axes.empty() && axes.back().ss == 1 && axes.back().ds == 1) {
    width = axes.back().size * item;
    axes.pop_back();
  }
  if (axes.empty()) return {run{base * item, 0, 0, 0, width, 1}};
  const axis rows = axes.back();
  axes.pop_back();
  std::uint64_t count = 1;
  for (const axis& a : axes) count *= a.size;
  if (count > max_runs)
    throw error(errc::invalid_argument,
                fmt::format("{}: the view is split into {} separate blocks (at most {}); register a view with at "
                            "most two strided dimensions, or stage it through a callback",
                            where(d), count * rows.size, max_runs * rows.size));
  std::vector<run> out;
  out.reserve(count);
  std::vector<std::uint64_t> index(axes.size(), 0);
  for (std::uint64_t n = 0; n < count; ++n) {
    std::uint64_t s = base;
    std::uint64_t t = 0;
    for (std::size_t k = 0; k < axes.size(); ++k) {
      s += index[k] * axes[k].ss;
      t += index[k] * axes[k].ds;
    }
    out.push_back(run{s * item, rows.ss * item, t * item, rows.ds * item, width, rows.size});
    for (std::size_t k = axes.size(); k-- > 0;) {  // odometer, innermost first
      if (++index[k] < axes[k].size) break;
      index[k] = 0;
    }
  }
  return out;
}

/// The strides' count and signs, and the slice's dimension and range.
void check_strides_and_slice(const destination& d) {
  const std::size_t rank = d.meta.shape.size();
  if (!d.strides.empty() && d.strides.size() != rank)
    throw error(errc::invalid_argument,
                fmt::format("{}: {} strides for a view of {} dimensions", where(d), d.strides.size(), rank));
  for (const std::int64_t s : d.strides)
    if (s < 0) throw error(errc::invalid_argument, fmt::format("{}: negative strides are not supported", where(d)));
  if (d.slice) {
    const source_slice& s = *d.slice;
    if (s.dim < 0 || static_cast<std::size_t>(s.dim) >= rank)
      throw error(
          errc::invalid_argument,
          fmt::format("{}: the slice's dimension {} is not one of the view's {} dimensions", where(d), s.dim, rank));
    if (s.start < 0)
      throw error(errc::invalid_argument,
                  fmt::format("{}: the slice starts at {}, before the source's first element", where(d), s.start));
    if (s.length != d.meta.shape[static_cast<std::size_t>(s.dim)])
      throw error(errc::invalid_argument,
                  fmt::format("{}: the slice takes {} of dimension {}, but the view has {} there", where(d), s.length,
                              s.dim, d.meta.shape[static_cast<std::size_t>(s.dim)]));
    if (s.start > std::numeric_limits<std::int64_t>::max() - s.length)
      throw error(errc::invalid_argument,
                  fmt::format("{}: the slice's end ({} + {}) overflows a 64-bit index", where(d), s.start, s.length));
  }
}

/// Rows of bytes: the innermost dimension (of size > 1) must be dense.
void check_rows_dense(const destination& d) {
  const std::size_t rank = d.meta.shape.size();
  // Otherwise a copy would move one element at a time.
  for (std::size_t k = rank; k-- > 0 && !d.strides.empty();) {
    if (d.meta.shape[k] == 1) continue;
    if (d.strides[k] != 1)
      throw error(errc::invalid_argument,
                  fmt::format("{}: the view is not contiguous in its last dimension (stride {}): refit writes rows of "
                              "elements; register a view whose last dimension has stride 1",
                              where(d), d.strides[k]));
    break;
  }
}

/// Elements from the view's first to one past its last; throws when the view overlaps itself.
std::uint64_t view_span(const destination& d) {
  const std::size_t rank = d.meta.shape.size();
  // Not overlapping itself: ordered by stride, each dimension steps past everything inside it.
  const std::vector<std::int64_t> strides = view_strides(d);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dims;  // (stride, size) of sizes > 1
  for (std::size_t k = 0; k < rank; ++k)
    if (d.meta.shape[k] > 1)
      dims.emplace_back(static_cast<std::uint64_t>(strides[k]), static_cast<std::uint64_t>(d.meta.shape[k]));
  std::sort(dims.begin(), dims.end());
  std::uint64_t span = 1;  // elements from the first to one past the last, of the dimensions so far
  for (const auto& [stride, size] : dims) {
    if (stride < span)
      throw error(errc::invalid_argument,
                  fmt::format("{}: the view overlaps itself (a stride of {} inside a block of {} elements); register "
                              "a view whose elements are distinct",
                              where(d), stride, span));
    std::uint64_t reach = 0;
    if (__builtin_mul_overflow(stride, size - 1, &reach) || __builtin_add_overflow(reach, span, &span))
      throw error(errc::invalid_argument, fmt::format("{}: the view's strides overflow", where(d)));
  }
  return span;
}

/// The view's `bytes` lie inside its allocation, when one was given.
void check_allocation(const destination& d, const extent& e) {
  if (d.alloc_bytes != 0) {
    const auto lo = reinterpret_cast<std::uintptr_t>(d.alloc);
    const auto p = reinterpret_cast<std::uintptr_t>(d.data);
    if (p < lo || p - lo > d.alloc_bytes || e.bytes > d.alloc_bytes - (p - lo))
      throw error(errc::invalid_argument,
                  fmt::format("{}: the view spans bytes [{}, {}) of its allocation of {} bytes: it leaves the "
                              "allocation",
                              where(d), static_cast<std::int64_t>(p - lo),
                              static_cast<std::int64_t>(p - lo) + static_cast<std::int64_t>(e.bytes), d.alloc_bytes));
  }
}

}  // namespace

extent check_view(const destination& d) {
  const std::uint64_t numel = d.meta.numel();  // throws invalid_argument for a bad shape
  check_strides_and_slice(d);
  if (numel == 0) return {};
  check_rows_dense(d);
  const std::uint64_t span = view_span(d);
  extent e;
  if (__builtin_mul_overflow(span, itemsize(d.meta.type), &e.bytes))
    throw error(errc::invalid_argument, fmt::format("{}: the view's strides overflow", where(d)));
  check_allocation(d, e);
  return e;
}

bool is_dense(const destination& d) noexcept {
  if (d.strides.empty()) return true;
  std::int64_t expected = 1;
  for (std::size_t k = d.meta.shape.size(); k-- > 0;) {
    if (d.meta.shape[k] != 1 && d.strides[k] != expected) return false;
    expected *= d.meta.shape[k];
  }
  return true;
}

bool is_plain(const destination& d) noexcept { return !d.slice && is_dense(d); }

std::vector<run> route(const destination& d, dtype type, std::span<const std::int64_t> shape) {
  const std::vector<std::int64_t>& view = d.meta.shape;
  bool fits = type == d.meta.type && shape.size() == view.size();
  for (std::size_t k = 0; fits && k < view.size(); ++k) {
    if (d.slice && static_cast<std::size_t>(d.slice->dim) == k)
      fits = d.slice->start >= 0 && d.slice->length <= shape[k] && d.slice->start <= shape[k] - d.slice->length;
    else
      fits = shape[k] == view[k];
  }
  if (!fits) {
    const tensor_meta sent{d.meta.name, type, {shape.begin(), shape.end()}};
    if (!d.slice)
      throw error(errc::apply, fmt::format("tensor '{}': the streamer sends {} but the parameter table holds {}",
                                           d.meta.name, describe(sent), describe(d.meta)));
    throw error(errc::apply,
                fmt::format("tensor '{}': the streamer sends {} but the parameter table takes {}: the slice is outside "
                            "the source, or another dimension or the dtype differs",
                            d.meta.name, describe(sent), where(d)));
  }
  if (d.meta.numel() == 0) return {};
  std::vector<std::uint64_t> ss(shape.size(), 1);  // the source is dense row-major
  for (std::size_t k = ss.size(); k-- > 1;) ss[k - 1] = ss[k] * static_cast<std::uint64_t>(shape[k]);
  const std::vector<std::int64_t> ds = view_strides(d);
  std::vector<axis> axes;
  for (std::size_t k = 0; k < view.size(); ++k)
    if (view[k] != 1)
      axes.push_back(axis{static_cast<std::uint64_t>(view[k]), ss[k], static_cast<std::uint64_t>(ds[k])});
  const std::uint64_t base =
      d.slice ? static_cast<std::uint64_t>(d.slice->start) * ss[static_cast<std::size_t>(d.slice->dim)] : 0;
  return runs_of(std::move(axes), base, itemsize(type), d);
}

std::vector<run> footprint(const destination& d) {
  if (d.meta.numel() == 0) return {};
  const std::vector<std::int64_t> ds = view_strides(d);
  std::vector<axis> axes;
  for (std::size_t k = 0; k < d.meta.shape.size(); ++k)
    if (d.meta.shape[k] != 1) {
      const auto s = static_cast<std::uint64_t>(ds[k]);
      axes.push_back(axis{static_cast<std::uint64_t>(d.meta.shape[k]), s, s});  // merged by the view alone
    }
  return runs_of(std::move(axes), 0, itemsize(d.meta.type), d);
}

namespace {

/// True when byte range [lo, hi) meets a row of `r` placed at `base`.
bool meets(std::uint64_t lo, std::uint64_t hi, std::uint64_t base, const run& r) {
  const std::uint64_t first = base + r.dst;
  if (r.rows == 0 || r.width == 0 || hi <= first) return false;
  const std::uint64_t last_end = first + (r.rows - 1) * r.dst_pitch + r.width;
  if (lo >= last_end) return false;
  if (r.rows == 1 || r.dst_pitch == 0) return true;
  // Rows i with first + i·pitch < hi and first + i·pitch + width > lo.
  const std::uint64_t i_hi = std::min((hi - 1 - first) / r.dst_pitch, r.rows - 1);
  const std::uint64_t i_lo = lo < first + r.width ? 0 : (lo - first - r.width) / r.dst_pitch + 1;
  return i_lo <= i_hi;
}

}  // namespace

bool overlaps(std::uintptr_t a, std::span<const run> fa, std::uintptr_t b, std::span<const run> fb) {
  for (const run& x : fa) {
    for (std::uint64_t i = 0; i < x.rows; ++i) {
      const std::uint64_t lo = a + x.dst + i * x.dst_pitch;
      for (const run& y : fb)
        if (meets(lo, lo + x.width, b, y)) return true;
      if (x.dst_pitch == 0) break;
    }
  }
  return false;
}

void clip(const run& r, std::uint64_t from, std::uint64_t to, std::vector<run>& out) {
  if (r.rows == 0 || r.width == 0 || from >= to) return;
  const std::uint64_t pitch = r.rows == 1 ? r.width : r.src_pitch;
  if (to <= r.src) return;
  const std::uint64_t i_lo = from < r.src + r.width ? 0 : (from - r.src - r.width) / pitch + 1;
  const std::uint64_t i_hi = std::min((to - 1 - r.src) / pitch, r.rows - 1);
  if (i_lo > i_hi || i_lo >= r.rows) return;
  const auto row = [&](std::uint64_t i, std::uint64_t lo, std::uint64_t hi) {
    // Bytes [lo, hi) of row i (offsets within the row).
    out.push_back(
        run{r.src + i * r.src_pitch + lo, r.src_pitch, r.dst + i * r.dst_pitch + lo, r.dst_pitch, hi - lo, 1});
  };
  const std::uint64_t first_lo = from > r.src + i_lo * pitch ? from - (r.src + i_lo * pitch) : 0;
  const std::uint64_t last_hi = std::min(r.width, to - (r.src + i_hi * pitch));
  if (i_lo == i_hi) {
    row(i_lo, first_lo, last_hi);
    return;
  }
  std::uint64_t whole_lo = i_lo;
  std::uint64_t whole_hi = i_hi + 1;  // rows [whole_lo, whole_hi) are taken whole
  if (first_lo != 0) {
    row(i_lo, first_lo, r.width);
    ++whole_lo;
  }
  const bool last_partial = last_hi != r.width;
  if (last_partial) --whole_hi;
  if (whole_hi > whole_lo)
    out.push_back(run{r.src + whole_lo * r.src_pitch, r.src_pitch, r.dst + whole_lo * r.dst_pitch, r.dst_pitch, r.width,
                      whole_hi - whole_lo});
  if (last_partial) row(i_hi, 0, last_hi);
}

std::uint64_t bytes_of(std::span<const run> runs) noexcept {
  std::uint64_t n = 0;
  for (const run& r : runs) n += r.width * r.rows;
  return n;
}

std::optional<std::uint64_t> contiguous(std::span<const run> runs, bool source) noexcept {
  std::optional<std::uint64_t> first;
  std::uint64_t next = 0;
  for (const run& r : runs) {
    if (r.width == 0 || r.rows == 0) continue;
    const std::uint64_t at = source ? r.src : r.dst;
    const std::uint64_t pitch = source ? r.src_pitch : r.dst_pitch;
    if (r.rows > 1 && pitch != r.width) return std::nullopt;
    if (first && at != next) return std::nullopt;
    if (!first) first = at;
    next = at + r.width * r.rows;
  }
  return first;
}

}  // namespace refit::plan
