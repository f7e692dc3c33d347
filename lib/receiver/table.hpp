// refit — the receiver's parameter table: the destinations registered by source name, and how a
// source's bytes reach each (internal to lib/receiver).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "plan/route.hpp"
#include "refit/receiver.hpp"

namespace refit::receiver_detail {

/// One registered destination and how its source's bytes reach it.
struct slot {
  plan::destination dest;
  std::vector<plan::run> foot;  ///< the bytes it writes, for overlap checks
  plan::route_cache routes;     ///< computed once: a source keeps its dtype and shape across refits
  /// A staged receiver (receiver_options::stage): where the copy of this destination's bytes starts
  /// in the stage (its bytes from its first byte, laid out by impl::lay_out_stage()), and the refit
  /// that last wrote it there (impl::stage_serial), so that apply_prepared() copies each once.
  std::uint64_t stage_at = 0;
  std::uint64_t staged_in = 0;
  /// Its CUDA allocation is larger than copy::engines_slow_above: its copies go by the kernel
  /// (copy::op::kernel_only). Set at every HELLO, with the check that the allocation is still there.
  bool kernel_only = false;

  /// Makes runs() those of a source of this dtype and shape. Throws errc::apply when it does not fit.
  void route(dtype type, const std::vector<std::int64_t>& shape) { (void)routes.get(dest, type, shape); }
  /// The runs of the source last routed.
  [[nodiscard]] std::span<const plan::run> runs() const noexcept { return routes.runs(); }
};

/// The parameter table: destinations by source name, with an index of the bytes they write.
class table_t {
 public:
  [[nodiscard]] bool empty() const noexcept { return by_name_.empty(); }
  [[nodiscard]] std::size_t names() const noexcept { return by_name_.size(); }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] auto begin() { return by_name_.begin(); }
  [[nodiscard]] auto end() { return by_name_.end(); }
  [[nodiscard]] auto begin() const { return by_name_.begin(); }
  [[nodiscard]] auto end() const { return by_name_.end(); }
  std::vector<slot>* find(const std::string& name) {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &it->second;
  }

  void clear() {
    by_name_.clear();
    spans_.clear();
    count_ = 0;
    longest_ = 0;
  }

  /// A destination checked against the table, ready to insert.
  struct prepared {
    slot s;
    std::uintptr_t lo = 0;
    std::uint64_t reach = 0;
  };

  /// Registers `d` (checked: see receiver::add_parameter). Throws errc::invalid_argument.
  void add(plan::destination d) { insert(prepare(std::move(d))); }

  /// Registers a quantised destination and its scale together, or neither. Throws
  /// errc::invalid_argument.
  void add_pair(plan::destination d, plan::destination scale);
  /// add_pair, and nvfp4's per-tensor scale `scale_2` beside them (no two of the three overlap).
  void add_triple(plan::destination d, plan::destination scale, plan::destination scale_2);

  /// Checks `d` against itself and the table; throws errc::invalid_argument.
  prepared prepare(plan::destination d);

  void insert(prepared p);

 private:
  struct span {
    std::uintptr_t hi;
    std::string name;
    std::size_t index;
  };

  /// A registered destination sharing a byte with `s` (whose bytes lie in [lo, hi)), or nullopt.
  std::optional<plan::destination> overlapping(const slot& s, std::uintptr_t lo, std::uintptr_t hi) const;

  std::unordered_map<std::string, std::vector<slot>> by_name_;
  std::multimap<std::uintptr_t, span> spans_;  ///< by first byte
  std::uint64_t longest_ = 0;
  std::size_t count_ = 0;
};

/// The conversion a destination asks for must be one refit does (see tensor_dest). Throws
/// errc::invalid_argument naming the tensor.
void check_conversion(const tensor_dest& d, const dest_layout& layout);

/// The hidden destination of a quantised destination's scales: dense, of scale_dtype(d.q), at
/// `d.scale`, taking the part of the source's scale grid that the destination's slice takes of the
/// source.
plan::destination scale_destination(const tensor_dest& d, const dest_layout& layout);
/// The hidden destination of an nvfp4 destination's per-tensor scale: one f32 at `d.scale_2`.
plan::destination scale_2_destination(const tensor_dest& d);

/// The size of the groups of `q` along dimension `dim` of a tensor of `rank` dimensions, where a
/// slice along it must start (and end, unless at the source's end) on a group's edge: 128 for the
/// last two dimensions of block128, 32 for the last of mxfp8; 1 where groups do not span it
/// (leading dimensions, channel's rows); 0 where one group spans all of it (channel's row, which
/// a slice takes whole: its one scale is the global row's).
std::uint64_t slice_block(quant q, std::size_t rank, std::size_t dim);
/// The blocks of `q` (block128, mxfp8), for messages: "128 × 128 blocks", ...
std::string_view blocks_of(quant q);

}  // namespace refit::receiver_detail
