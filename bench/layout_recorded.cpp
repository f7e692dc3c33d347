// --layout recorded:FILE: the engine layout a route table of refit.record() describes
// (RouteTable.to_json()), checked against the model as it is read. layout.cpp makes the other layouts.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.hpp"
#include "bench/json_outline.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

[[noreturn]] void bad(const std::string& what) { throw error(errc::invalid_argument, "refit-bench: " + what); }

/// recorded_layout()'s reader of one route table: the table parsed, then its params (the engine
/// tensors) and every route of every entry (a view each), each checked against the model as read.
class route_table_reader {
 public:
  using doc = nlohmann::json;

  route_table_reader(const manifest& m, std::string_view text, const std::string& file)
      : m_(m), what_("--layout recorded:" + file), o_(outline_json(text, {"entries", "params"}, 64)) {
    // The order of the params and of the entries is kept from the text (json_outline.hpp).
    if (o_.invalid) bad(fmt::format("{}: not JSON: {}", what_, *o_.invalid));
    if (o_.too_deep) bad(fmt::format("{}: nests deeper than 64 levels (a route table needs 5)", what_));
    if (o_.repeated)
      bad(fmt::format("{}: '{}' is a key twice{}", what_, o_.repeated->first,
                      o_.repeated->second.empty() ? std::string() : fmt::format(" in \"{}\"", o_.repeated->second)));
    try {
      t_ = doc::parse(text);
    } catch (const std::exception& e) {
      bad(fmt::format("{}: not JSON: {}", what_, e.what()));
    }
    check_table();
  }

  engine_layout read(int rank, int tp) {
    l_.kind = layout_kind::recorded;
    l_.tp = tp;
    l_.rank = rank;
    l_.tensors.name = m_.name;
    l_.of_source.resize(m_.entries.size());
    l_.slices.resize(m_.entries.size());
    read_params();
    for (std::size_t i = 0; i < m_.entries.size(); ++i) index_.emplace(m_.entries[i].meta.name, i);
    for (const std::string& name : o_.keys_under("entries")) read_entry(name);
    for (std::size_t i = 0; i < m_.entries.size(); ++i)
      if (l_.of_source[i].empty())
        bad(fmt::format("{}: {} has {}, which the table does not route", what_, m_.name, m_.entries[i].meta.name));
    return std::move(l_);
  }

 private:
  std::vector<std::int64_t> shape_of(const doc& j, const std::string& where) const {
    std::vector<std::int64_t> v;
    if (!j.is_array()) bad(fmt::format("{}: {}: not a list of integers", what_, where));
    for (const auto& d : j) {
      if (!d.is_number_integer() || d.get<std::int64_t>() < 0)
        bad(fmt::format("{}: {}: not a list of integers", what_, where));
      v.push_back(d.get<std::int64_t>());
    }
    return v;
  }

  dtype dtype_of(const doc& j, const std::string& where) const {
    const auto d = j.is_string() ? parse_dtype(j.get<std::string>()) : std::nullopt;
    if (!d) bad(fmt::format("{}: {}: unknown dtype {}", what_, where, j.dump()));
    return *d;
  }

  void check_table() const {
    if (!t_.is_object() || !t_.contains("entries") || !t_.contains("params") || !t_.contains("unrecorded") ||
        !t_["entries"].is_object() || !t_["params"].is_object() || !t_["unrecorded"].is_object())
      bad(fmt::format("{}: not a refit route table (RouteTable.to_json(): entries, params, unrecorded)", what_));
    if (!t_["unrecorded"].empty()) {
      std::vector<std::string> names;
      for (const auto& [name, why] : t_["unrecorded"].items()) names.push_back(name);
      bad(
          fmt::format("{}: the table has {} unrecorded source{} (refit.record could not follow the loader): {}; "
                      "a recorded layout needs every source routed",
                      what_, names.size(), names.size() == 1 ? "" : "s", fmt::join(names, ", ")));
    }
  }

  /// The params: the engine tensors, dense.
  void read_params() {
    for (const std::string& name : o_.keys_under("params")) {
      const doc& p = t_["params"][name];
      const std::string where = "parameter " + name;
      if (!p.is_object() || !p.contains("dtype") || !p.contains("shape"))
        bad(fmt::format("{}: {}: no dtype or shape", what_, where));
      tensor_meta meta{name, dtype_of(p["dtype"], where), shape_of(p["shape"], where)};
      if (p.contains("stride") && shape_of(p["stride"], where) != dense_strides(meta.shape))
        bad(fmt::format("{}: {} has strides {} and the bench allocates dense parameters ({})", what_, describe(meta),
                        p["stride"].dump(), fmt::join(dense_strides(meta.shape), ", ")));
      params_.emplace(name, l_.tensors.entries.size());
      l_.tensors.entries.push_back({std::move(meta), -1, 0});
    }
  }

  /// The routes of source `name`: one view each, all taking the same part of it.
  void read_entry(const std::string& name) {
    const doc& routes = t_["entries"][name];
    const auto at = index_.find(name);
    if (at == index_.end())
      bad(fmt::format("{}: the table routes {}, which {} lacks; give the model the table was recorded for", what_, name,
                      m_.name));
    const std::size_t i = at->second;
    const tensor_meta& src = m_.entries[i].meta;
    if (t_.contains("sources") && t_["sources"].contains(name)) {
      const auto& s = t_["sources"][name];
      const tensor_meta rec{name, dtype_of(s.value("dtype", doc()), "source " + name),
                            shape_of(s.value("shape", doc()), "source " + name)};
      if (rec.type != src.type || rec.shape != src.shape)
        bad(fmt::format("{}: the table was recorded with {} and {} has {}", what_, describe(rec), m_.name,
                        describe(src)));
    }
    if (!routes.is_array() || routes.empty()) bad(fmt::format("{}: {} has no route", what_, name));
    bool first = true;
    for (const auto& r : routes) {
      layout_view v = read_route(r, i, first);
      first = false;
      l_.of_source[i].push_back(l_.views.size());
      l_.views.push_back(std::move(v));
    }
  }

  /// One route of source i: the view it lands in, checked to be one contiguous run of its param and
  /// (unless it is the `first`) to take the part of the source its routes before took.
  layout_view read_route(const doc& r, std::size_t i, bool first) {
    const tensor_meta& src = m_.entries[i].meta;
    const std::string& name = src.name;
    const std::string param = r.value("param", std::string());
    const auto p = params_.find(param);
    if (p == params_.end())
      bad(fmt::format("{}: {} is routed to {}, which is not among the table's params", what_, name, param));
    const tensor_meta& engine = l_.tensors.entries[p->second].meta;
    if (engine.type != src.type)
      bad(fmt::format("{}: {} is routed to {}, of another dtype", what_, describe(src), describe(engine)));
    std::optional<source_slice> slice;
    auto shape = src.shape;
    if (r.contains("source_slice") && !r["source_slice"].is_null()) {
      const auto sl = shape_of(r["source_slice"], name + "'s source_slice");
      if (sl.size() != 3 || sl[0] >= static_cast<std::int64_t>(src.shape.size()) ||
          sl[1] + sl[2] > src.shape[static_cast<std::size_t>(sl[0])])
        bad(fmt::format("{}: {}: source_slice {} does not fit {}", what_, name, r["source_slice"].dump(),
                        describe(src)));
      slice = source_slice{static_cast<int>(sl[0]), sl[1], sl[2]};
      shape[static_cast<std::size_t>(sl[0])] = sl[2];
    }
    if (!first && slice != l_.slices[i])
      bad(fmt::format("{}: the routes of {} take different parts of it; the bench checks one slice per source", what_,
                      name));
    l_.slices[i] = slice;
    const auto vshape = shape_of(r.value("shape", doc()), name + "'s view shape");
    const auto vstrides = shape_of(r.value("stride", doc()), name + "'s view strides");
    if (!r.contains("offset") || !r["offset"].is_number_unsigned())
      bad(fmt::format("{}: {}: a route without an offset", what_, name));
    const std::uint64_t offset = r["offset"].get<std::uint64_t>();
    if (vshape != shape)
      bad(fmt::format("{}: {} lands in {} as [{}], and {} of it is [{}]", what_, name, param, fmt::join(vshape, ", "),
                      slice ? "the slice" : "all", fmt::join(shape, ", ")));
    const std::uint64_t numel = tensor_meta{"", src.type, shape}.nbytes() / itemsize(src.type);
    if (vstrides.size() != vshape.size() || (numel > 1 && vstrides != dense_strides(vshape)))
      bad(fmt::format(
          "{}: {} lands in {} with strides [{}]: not one contiguous run of it (the bench checks those only)", what_,
          name, param, fmt::join(vstrides, ", ")));
    const std::uint64_t engine_numel = engine.nbytes() / itemsize(engine.type);
    if (offset + numel > engine_numel)
      bad(fmt::format("{}: {} lands in {} from element {}: {} elements do not fit its {}", what_, name,
                      describe(engine), offset, numel, engine_numel));
    layout_view v;
    v.source = i;
    v.tensor = p->second;
    v.offset = offset * itemsize(src.type);
    v.bytes = numel * itemsize(src.type);
    v.shape = vshape;
    v.strides = vstrides;
    v.slice = slice;
    return v;
  }

  const manifest& m_;
  const std::string what_;
  const json_outline o_;
  doc t_;
  engine_layout l_;
  std::unordered_map<std::string, std::size_t> params_;  ///< engine tensor of each param
  std::unordered_map<std::string, std::size_t> index_;   ///< source of each name
};

}  // namespace

engine_layout recorded_layout(const manifest& m, std::string_view text, const std::string& file, int rank, int tp) {
  return route_table_reader(m, text, file).read(rank, tp);
}

}  // namespace refit::bench
