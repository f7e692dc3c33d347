// refit — the receiver's parameter table (table.hpp): registering destinations, checked against
// each other, and what the table asks of the streamer (conversions, memory still allocated).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "copy/copy.hpp"
#include "receiver/impl.hpp"

namespace refit {
namespace receiver_detail {

void table_t::add_pair(plan::destination d, plan::destination scale) {
  prepared a = prepare(std::move(d));
  prepared b = prepare(std::move(scale));
  if (a.reach != 0 && b.reach != 0 && a.s.dest.dev == b.s.dest.dev && plan::overlaps(a.lo, a.s.foot, b.lo, b.s.foot))
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: the scale of '{}' shares bytes with its destination ({})",
                            a.s.dest.meta.name, describe(a.s.dest.meta)));
  insert(std::move(a));
  insert(std::move(b));
}

void table_t::add_triple(plan::destination d, plan::destination scale, plan::destination scale_2) {
  prepared a = prepare(std::move(d));
  prepared b = prepare(std::move(scale));
  prepared c = prepare(std::move(scale_2));
  const auto share = [](const prepared& x, const prepared& y) {
    return x.reach != 0 && y.reach != 0 && x.s.dest.dev == y.s.dest.dev &&
           plan::overlaps(x.lo, x.s.foot, y.lo, y.s.foot);
  };
  if (share(a, b) || share(a, c) || share(b, c))
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: the destination of '{}' ({}), its scale and its scale_2 share bytes",
                            a.s.dest.meta.name, describe(a.s.dest.meta)));
  insert(std::move(a));
  insert(std::move(b));
  insert(std::move(c));
}

table_t::prepared table_t::prepare(plan::destination d) {
  std::uint64_t reach = 0;
  try {
    reach = plan::check_view(d).bytes;
  } catch (const error& e) {
    throw error(e.code(), fmt::format("add_parameter: {}", e.what()));
  }
  slot s{std::move(d), {}, {}, 0, 0};
  s.foot = plan::footprint(s.dest);
  std::vector<slot>* same = find(s.dest.meta.name);
  if (same != nullptr) {
    const plan::destination& first = same->front().dest;
    if (first.meta.type != s.dest.meta.type || first.q != s.dest.q)
      throw error(errc::invalid_argument,
                  fmt::format("add_parameter: '{}' is registered as {}{} and again as {}{}: every destination of "
                              "one source has its dtype and quant",
                              s.dest.meta.name, to_string(first.meta.type),
                              first.q == quant::none ? "" : fmt::format(" ({})", to_string(first.q)),
                              to_string(s.dest.meta.type),
                              s.dest.q == quant::none ? "" : fmt::format(" ({})", to_string(s.dest.q))));
    if (plan::is_plain(first) && plan::is_plain(s.dest) && first.meta.shape == s.dest.meta.shape &&
        first.data == s.dest.data)
      throw error(errc::invalid_argument, fmt::format("add_parameter: '{}' is already registered", s.dest.meta.name));
  }
  const auto lo = reinterpret_cast<std::uintptr_t>(s.dest.data);
  if (reach != 0) {
    if (const auto clash = overlapping(s, lo, lo + reach))
      throw error(errc::invalid_argument,
                  fmt::format("add_parameter: the destination of '{}' ({}) writes bytes that the destination of '{}' "
                              "({}) writes too: no two destinations may share a byte",
                              s.dest.meta.name, describe(s.dest.meta), clash->meta.name, describe(clash->meta)));
  }
  return prepared{std::move(s), lo, reach};
}

void table_t::insert(prepared p) {
  const std::string name = p.s.dest.meta.name;
  auto& slots = by_name_[name];
  slots.push_back(std::move(p.s));
  ++count_;
  if (p.reach != 0) {
    spans_.emplace(p.lo, span{p.lo + p.reach, name, slots.size() - 1});
    longest_ = std::max(longest_, p.reach);
  }
}

std::optional<plan::destination> table_t::overlapping(const slot& s, std::uintptr_t lo, std::uintptr_t hi) const {
  auto it = spans_.lower_bound(lo > longest_ ? lo - longest_ : 0);
  for (; it != spans_.end() && it->first < hi; ++it) {
    if (it->second.hi <= lo) continue;
    const slot& other = by_name_.at(it->second.name)[it->second.index];
    if (!(other.dest.dev == s.dest.dev)) continue;
    if (plan::overlaps(lo, s.foot, it->first, other.foot)) return other.dest;
  }
  return std::nullopt;
}

std::string_view blocks_of(quant q) {
  return q == quant::mxfp8   ? "MX blocks of 32 elements of a row"
         : q == quant::nvfp4 ? "NVFP4 blocks of 16 elements of a row"
                             : "128 × 128 blocks";
}

std::uint64_t slice_block(quant q, std::size_t rank, std::size_t dim) {
  if (dim + 1 == rank) return block_cols(q) != 0 ? block_cols(q) : q == quant::channel ? 0 : 1;
  if (dim + 2 == rank && block_rows(q) > 1) return block_rows(q);
  return 1;
}

void check_nvfp4(const tensor_dest& d, const dest_layout& layout, const std::string& what);

void check_conversion(const tensor_dest& d, const dest_layout& layout) {
  const std::string what = fmt::format("add_parameter: '{}' ({})", d.meta.name, describe(d.meta));
  if (d.q == quant::none) {
    if (d.scale != nullptr || d.scale_2 != nullptr)
      throw error(errc::invalid_argument,
                  fmt::format("{} has a scale but no quant: a scale belongs to an f8_e4m3 destination quantised per "
                              "tensor or per 128 × 128 block, channel or MX block of 32 (set quant)",
                              what));
    return;
  }
  if (static_cast<std::uint8_t>(d.q) > static_cast<std::uint8_t>(quant::nvfp4))
    throw error(errc::invalid_argument,
                fmt::format("{} has an unknown quant (code {})", what, static_cast<unsigned>(d.q)));
  check_nvfp4(d, layout, what);
  if (d.meta.type != quant_dtype(d.q))
    throw error(
        errc::invalid_argument,
        fmt::format("{} asks for quant {}, which quantises to {}: register the destination as {}, not {}", what,
                    to_string(d.q), to_string(quant_dtype(d.q)), to_string(quant_dtype(d.q)), to_string(d.meta.type)));
  const std::size_t rank = d.meta.shape.size();
  if (rank < min_rank(d.q))
    throw error(
        errc::invalid_argument,
        fmt::format("{} asks for quant {}, which quantises {}: it needs at least {} dimension{}, not {}", what,
                    to_string(d.q),
                    d.q == quant::block128 ? "128 × 128 blocks of the last two dimensions" : "along the last dimension",
                    min_rank(d.q), min_rank(d.q) == 1 ? "" : "s", rank));
  const std::vector<std::int64_t> elements = element_shape(d.meta.type, d.meta.shape);
  const auto scale_numel = checked_numel(scale_shape(d.q, elements, d.layout));
  if (d.scale == nullptr && scale_numel.value_or(0) != 0)
    throw error(
        errc::invalid_argument,
        fmt::format(
            "{} is quantised ({}) but has no scale: pass its {} tensor of shape [{}]", what, to_string(d.q),
            scale_dtype(d.q) == dtype::f32 ? "f32 scale_inv" : fmt::format("{} scale", to_string(scale_dtype(d.q))),
            fmt::join(scale_shape(d.q, elements, d.layout), ", ")));
  if (!layout.slice || layout.slice->dim < 0) return;
  const auto dim = static_cast<std::size_t>(layout.slice->dim);
  const std::uint64_t b = slice_block(d.q, rank, dim);
  if (b > 1 && layout.slice->start % static_cast<std::int64_t>(b) != 0)
    // Blocks are those of the global tensor: a shard starting inside one would need the amax of
    // elements it does not hold.
    throw error(errc::invalid_argument,
                fmt::format("{}: {} scales are computed over the global tensor's {}, so a slice of dimension {} "
                            "must start on a block boundary (a multiple of {}); this one starts at {}",
                            what, to_string(d.q), blocks_of(d.q), layout.slice->dim, b, layout.slice->start));
}

/// What nvfp4 and the scale layouts ask beyond the other formats: a per-tensor scale, an even
/// row, no slice (the per-tensor scale is the global tensor's, and a swizzled grid is laid out
/// over the whole matrix).
void check_nvfp4(const tensor_dest& d, const dest_layout& layout, const std::string& what) {
  if (d.layout != scale_layout::row_major && d.q != quant::mxfp8 && d.q != quant::nvfp4)
    throw error(errc::invalid_argument,
                fmt::format("{} asks for scale layout {} with quant {}: only mxfp8 and nvfp4 scales are swizzled", what,
                            to_string(d.layout), to_string(d.q)));
  if (d.layout != scale_layout::row_major && layout.slice)
    throw error(errc::invalid_argument,
                fmt::format("{} takes a slice of its source, but its scales are {}: a swizzled scale grid "
                            "covers the whole matrix; register the whole tensor, or row-major scales",
                            what, to_string(d.layout)));
  if (d.q != quant::nvfp4) {
    if (d.scale_2 != nullptr)
      throw error(errc::invalid_argument,
                  fmt::format("{} has a scale_2, which only nvfp4 destinations have (their per-tensor scale)", what));
    return;
  }
  if (d.scale_2 == nullptr)
    throw error(errc::invalid_argument,
                fmt::format("{} is quantised (nvfp4) but has no scale_2: pass its f32 per-tensor scale (one element, "
                            "a checkpoint's weight_scale_2)",
                            what));
  if (layout.slice)
    throw error(errc::invalid_argument,
                fmt::format("{} takes a slice of its source, but nvfp4's per-tensor scale is the whole source's: "
                            "register the whole tensor",
                            what));
}

plan::destination scale_destination(const tensor_dest& d, const dest_layout& layout) {
  plan::destination s;
  s.meta = tensor_meta{d.meta.name + std::string(scale_suffix), scale_dtype(d.q),
                       scale_shape(d.q, element_shape(d.meta.type, d.meta.shape), d.layout)};
  s.data = d.scale;
  s.dev = d.dev;
  if (d.q != quant::tensor && layout.slice) {
    source_slice sl = *layout.slice;
    const auto dim = static_cast<std::size_t>(sl.dim);
    const std::uint64_t b = slice_block(d.q, d.meta.shape.size(), dim);
    sl.start = b == 0 ? 0 : sl.start / static_cast<std::int64_t>(b);
    sl.length = s.meta.shape[dim];
    s.slice = sl;
  }
  return s;
}

plan::destination scale_2_destination(const tensor_dest& d) {
  plan::destination s;
  s.meta = tensor_meta{d.meta.name + std::string(scale_2_suffix), dtype::f32, {1}};
  s.data = d.scale_2;
  s.dev = d.dev;
  return s;
}

}  // namespace receiver_detail

/// What the table asks the streamer to send each name as: every name whose destinations have a
/// float dtype the streamer can convert into (f32, bf16, f16, or f8_e4m3 with a quant), since
/// the source's dtype is only known when it arrives. Scale tensors are never listed.
std::vector<wire::conversion> receiver::impl::conversions() const {
  std::vector<wire::conversion> out;
  for (const auto& [name, slots] : table) {
    const plan::destination& d = slots.front().dest;
    if (name.find('\x1f') != std::string::npos) continue;  // a scale (scale_suffix, scale_2_suffix)
    const bool cast =
        d.q == quant::none && (d.meta.type == dtype::f32 || d.meta.type == dtype::bf16 || d.meta.type == dtype::f16);
    if (cast || d.q != quant::none) out.push_back(wire::conversion{name, d.meta.type, d.q, d.layout});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

/// Why a registered CUDA destination cannot be written any more (its allocation was freed, or
/// is not the one it was registered in), or nullopt. Asked at every HELLO: engines capture CUDA
/// graphs over their weights, so refit writes only where they were registered. Notes on the way
/// which destinations lie in allocations the copy engines write slowly (slot::kernel_only).
std::optional<std::string> receiver::impl::memory_gone() {
  for (auto& [name, slots] : table) {
    for (slot& sl : slots) {
      const plan::destination& d = sl.dest;
      if (d.dev.kind != device_kind::cuda || sl.foot.empty()) continue;
      std::optional<copy::allocation> a;
      try {
        a = copy::cuda_allocation_of(d.data, d.dev.index);
      } catch (const error& e) {
        // The driver cannot tell (an old driver): nothing is known to be wrong; say so once.
        REFIT_WARN("cannot check that the CUDA memory of '{}' is still allocated: {}", name, e.what());
        return std::nullopt;
      }
      const auto lo = reinterpret_cast<std::uintptr_t>(d.alloc_bytes != 0 ? d.alloc : d.data);
      const std::uint64_t need = d.alloc_bytes != 0 ? d.alloc_bytes : 1;
      if (!a || lo < a->base || lo - a->base > a->bytes || need > a->bytes - (lo - a->base))
        return fmt::format(
            "the CUDA memory of '{}' ({}) on cuda:{} is {} since it was registered: refit writes only "
            "where a parameter was registered; register the parameters again (clear_parameters, "
            "add_parameter) after the engine reallocates them",
            name, describe(d.meta), d.dev.index, a ? "in another allocation" : "not allocated any more (freed)");
      sl.kernel_only = a->bytes > copy::engines_slow_above;
    }
  }
  return std::nullopt;
}

}  // namespace refit
