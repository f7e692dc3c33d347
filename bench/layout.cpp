// Engine layouts (--layout): where each source tensor lands in the receiver's own tensors.
//
// The streamer sends the checkpoint's tensors whatever the layout; the receiver registers each as
// a view of an engine tensor (receiver::add_parameter(dest, dest_layout)) and checksums the bytes
// of each view (role_receiver.cpp), so the verification is the same as for a plain layout.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>

#include "bench/bench.hpp"
#include "bench/json_outline.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

[[noreturn]] void bad(const std::string& what) { throw error(errc::invalid_argument, "refit-bench: " + what); }

// A fused group: `fused` is the engine tensor's name, `members` the sources in row order.
struct fused_group {
  std::string fused;
  std::vector<std::string> members;
};

// The fused group `name` belongs to by its name: PREFIX.{q,k,v}_proj.SUFFIX → PREFIX.qkv_proj.SUFFIX,
// PREFIX.{gate,up}_proj.SUFFIX → PREFIX.gate_up_proj.SUFFIX.
std::optional<fused_group> group_of(const std::string& name) {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kinds{
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}}, {"gate_up_proj", {"gate_proj", "up_proj"}}};
  for (const auto& [fused, parts] : kinds)
    for (const auto& part : parts) {
      const std::string token = "." + part + ".";
      const auto at = name.rfind(token);
      if (at == std::string::npos) continue;
      const std::string prefix = name.substr(0, at + 1), suffix = name.substr(at + token.size() - 1);
      fused_group g{prefix + fused + suffix, {}};
      for (const auto& p : parts) g.members.push_back(prefix + p + suffix);
      return g;
    }
  return std::nullopt;
}

// An expert's tensor: PREFIX.experts.E.{gate,up,down}_proj.weight (Qwen MoE) or
// PREFIX.experts.E.{w1,w3,w2}.weight (Mixtral). `prefix` ends with "experts.".
struct expert_part {
  std::string prefix;
  std::int64_t expert = 0;
  int role = 0;  // 0 gate, 1 up, 2 down
};

std::optional<expert_part> expert_of(const std::string& name) {
  const std::string token = ".experts.";
  const auto at = name.rfind(token);
  if (at == std::string::npos) return std::nullopt;
  const std::size_t digits = at + token.size();
  std::size_t end = digits;
  while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
  if (end == digits || end - digits > 9 || end >= name.size() || name[end] != '.') return std::nullopt;
  static const std::pair<std::string_view, int> roles[] = {{"gate_proj.weight", 0}, {"up_proj.weight", 1},
                                                           {"down_proj.weight", 2}, {"w1.weight", 0},
                                                           {"w3.weight", 1},        {"w2.weight", 2}};
  const std::string_view rest = std::string_view(name).substr(end + 1);
  for (const auto& [suffix, role] : roles)
    if (rest == suffix) return expert_part{name.substr(0, digits), std::stoll(name.substr(digits, end - digits)), role};
  return std::nullopt;
}

// How tpN splits a tensor, by its name: column-parallel (rows), row-parallel (columns),
// vocab-parallel (rows) or replicated.
enum class split : std::uint8_t { replicated, column, row, vocab };

split split_of(const tensor_meta& t) {
  const std::string& name = t.name;
  const auto has = [&](std::string_view part) { return name.find(part) != std::string::npos; };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight")
    return t.shape.size() == 2 ? split::vocab : split::replicated;
  if (has(".q_proj.") || has(".k_proj.") || has(".v_proj.") || has(".gate_proj.") || has(".up_proj.") ||
      (has(".experts.") && (name.ends_with(".w1.weight") || name.ends_with(".w3.weight"))))
    return t.shape.empty() ? split::replicated : split::column;  // weights and their biases
  if ((has(".o_proj.") || has(".down_proj.") || (has(".experts.") && name.ends_with(".w2.weight"))) &&
      t.shape.size() == 2)
    return split::row;  // a row-parallel bias is added once, after the reduction: replicated
  return split::replicated;
}

// What rank `rank` of `tp` takes of t: nothing for a replicated tensor (all of it). Refuses a
// size that does not divide (with the heads, when the model says how long one is).
std::optional<source_slice> shard_of(const manifest& m, const tensor_meta& t, int tp, int rank) {
  const split how = tp > 1 ? split_of(t) : split::replicated;
  if (how == split::replicated) return std::nullopt;
  const int dim = how == split::row ? 1 : 0;
  const std::int64_t size = t.shape[static_cast<std::size_t>(dim)];
  const bool heads = m.head_dim > 0 && how == split::column &&
                     (t.name.find(".q_proj.") != std::string::npos || t.name.find(".k_proj.") != std::string::npos ||
                      t.name.find(".v_proj.") != std::string::npos);
  if (heads && (size % m.head_dim != 0 || size / m.head_dim % tp != 0))
    bad(
        fmt::format("--layout tp{}: {}: {} has {} heads of {} ({} rows), which do not split over {} ranks; use a tp "
                    "degree that divides the q and kv heads",
                    tp, m.name, describe(t), size / m.head_dim, m.head_dim, size, tp));
  if (size % tp != 0) {
    static const char* what[] = {"", "rows (column-parallel)", "columns (row-parallel)", "rows (vocab-parallel)"};
    bad(fmt::format("--layout tp{}: {}: {} has {} {}, which do not divide by {}; use a tp degree that divides them", tp,
                    m.name, describe(t), size, what[static_cast<int>(how)], tp));
  }
  const std::int64_t n = size / tp;
  return source_slice{dim, rank * n, n};
}

class layout_builder {
 public:
  layout_builder(const manifest& m, const layout_spec& spec, int rank) : m_(m) {
    l_.kind = spec.kind;
    l_.tp = spec.tp;
    l_.rank = rank;
    l_.tensors.name = m.name;
    l_.of_source.resize(m.entries.size());
    if (spec.tp < 1 || (spec.tp > 1 && spec.kind != layout_kind::fused))
      bad(fmt::format("--layout: tensor parallelism (degree {}) shards the fused layout only", spec.tp));
    if (rank < 0 || rank >= spec.tp)
      bad(fmt::format("--rank {}: out of range for --layout {} (ranks 0 to {})", rank, layout_name(spec), spec.tp - 1));
    for (std::size_t i = 0; i < m.entries.size(); ++i) {
      index_.emplace(m.entries[i].meta.name, i);
      l_.slices.push_back(shard_of(m, m.entries[i].meta, spec.tp, rank));
    }
  }

  engine_layout build() {
    const layout_kind kind = l_.kind;
    std::vector<bool> done(m_.entries.size(), false);
    if (kind == layout_kind::ep) find_experts();
    for (std::size_t i = 0; i < m_.entries.size(); ++i) {
      if (done[i]) continue;
      if (kind == layout_kind::ep)
        if (const auto p = expert_of(m_.entries[i].meta.name)) {
          stack_experts(p->prefix, done);  // the layer's experts, where its first one comes
          continue;
        }
      if (kind != layout_kind::plain && fuse(i, done)) continue;
      const tensor_meta& t = m_.entries[i].meta;
      view(i, tensor(t.name, t.type, landing(i)), 0);
      done[i] = true;
    }
    // A tied embedding: the checkpoint has no lm_head, the engine has one, written from the embedding.
    const auto embed = index_.find("model.embed_tokens.weight");
    if (kind != layout_kind::plain && embed != index_.end() && !index_.count("lm_head.weight")) {
      const tensor_meta& t = m_.entries[embed->second].meta;
      view(embed->second, tensor("lm_head.weight", t.type, landing(embed->second)), 0);
    }
    return std::move(l_);
  }

 private:
  std::size_t tensor(std::string name, dtype type, std::vector<std::int64_t> shape) {
    l_.tensors.entries.push_back({tensor_meta{std::move(name), type, std::move(shape)}, -1, 0});
    return l_.tensors.entries.size() - 1;
  }

  // The shape of what lands of source i: its own, or its slice's (tpN).
  std::vector<std::int64_t> landing(std::size_t i) const {
    auto shape = m_.entries[i].meta.shape;
    if (const auto& s = l_.slices[i]) shape[static_cast<std::size_t>(s->dim)] = s->length;
    return shape;
  }

  // Source i (or its slice) lands in engine tensor k from byte `offset`: a run of whole rows (or
  // all of it), so the view's strides are the engine tensor's own along its last dimensions.
  void view(std::size_t i, std::size_t k, std::uint64_t offset) {
    const tensor_meta& src = m_.entries[i].meta;
    const auto engine = dense_strides(l_.tensors.entries[k].meta.shape);
    layout_view v;
    v.source = i;
    v.tensor = k;
    v.offset = offset;
    v.shape = landing(i);
    v.bytes = tensor_meta{src.name, src.type, v.shape}.nbytes();
    v.strides.assign(engine.end() - static_cast<std::ptrdiff_t>(v.shape.size()), engine.end());
    v.slice = l_.slices[i];
    l_.of_source[i].push_back(l_.views.size());
    l_.views.push_back(std::move(v));
  }

  // Source i and the rest of its group, fused along dimension 0 when they all fit; false: not fused.
  bool fuse(std::size_t i, std::vector<bool>& done) {
    const auto g = group_of(m_.entries[i].meta.name);
    if (!g) return false;
    std::vector<std::size_t> members;
    for (const auto& name : g->members) {
      const auto it = index_.find(name);
      if (it == index_.end() || done[it->second]) return false;
      members.push_back(it->second);
    }
    if (index_.count(g->fused)) return false;  // the checkpoint has a tensor of that name already
    // Alike as they land (tpN: the rank's rows of each).
    const tensor_meta& first = m_.entries[members.front()].meta;
    const auto first_shape = landing(members.front());
    std::int64_t rows = 0;
    for (const auto k : members) {
      const tensor_meta& t = m_.entries[k].meta;
      const auto shape = landing(k);
      if (t.type != first.type || shape.empty() ||
          !std::equal(shape.begin() + 1, shape.end(), first_shape.begin() + 1, first_shape.end()))
        return false;
      rows += shape[0];
    }
    auto shape = first_shape;
    shape[0] = rows;
    const std::size_t k = tensor(g->fused, first.type, shape);
    std::uint64_t offset = 0;
    for (const auto m : members) {
      view(m, k, offset);
      offset += layout_bytes(m);
      done[m] = true;
    }
    return true;
  }

  // Every expert's tensors, by layer (prefix), expert and role.
  void find_experts() {
    for (std::size_t i = 0; i < m_.entries.size(); ++i)
      if (const auto p = expert_of(m_.entries[i].meta.name))
        experts_[p->prefix][p->expert][static_cast<std::size_t>(p->role)] = i;
    if (experts_.empty())
      bad(
          fmt::format("--layout ep stacks the experts of a mixture-of-experts model and {} has none "
                      "(PREFIX.experts.E.gate_proj/up_proj/down_proj.weight, or w1/w3/w2); use --layout fused or plain",
                      m_.name));
  }

  // The experts of one layer into w13_weight[E, 2I, H] and w2_weight[E, H, I].
  void stack_experts(const std::string& prefix, std::vector<bool>& done) {
    static const char* role_names[] = {"gate (gate_proj/w1)", "up (up_proj/w3)", "down (down_proj/w2)"};
    const auto& experts = experts_.at(prefix);
    const auto count = static_cast<std::int64_t>(experts.size());
    const auto& e0 = experts.begin()->second;
    for (std::int64_t e = 0; e < count; ++e) {
      const auto it = experts.find(e);
      if (it == experts.end())
        bad(fmt::format(
            "--layout ep: {}: the experts of {} do not stack: expert {} is missing ({} experts, numbered up "
            "to {})",
            m_.name, prefix, e, count, experts.rbegin()->first));
      for (std::size_t r = 0; r < 3; ++r)
        if (!it->second[r])
          bad(fmt::format("--layout ep: {}: the experts of {} do not stack: expert {} has no {} tensor", m_.name,
                          prefix, e, role_names[r]));
    }
    const tensor_meta& gate = m_.entries[*e0[0]].meta;
    const tensor_meta& down = m_.entries[*e0[2]].meta;
    const bool shaped = gate.shape.size() == 2 && down.shape.size() == 2 && down.shape[0] == gate.shape[1] &&
                        down.shape[1] == gate.shape[0];
    if (!shaped)
      bad(fmt::format("--layout ep: {}: the experts of {} do not stack: gate {} and down {} are not [I, H] and [H, I]",
                      m_.name, prefix, describe(gate), describe(down)));
    for (const auto& [e, parts] : experts)
      for (std::size_t r = 0; r < 3; ++r) {
        const tensor_meta& t = m_.entries[*parts[r]].meta;
        const tensor_meta& like = r == 2 ? down : gate;
        if (t.type != like.type || t.shape != like.shape)
          bad(fmt::format("--layout ep: {}: the experts of {} do not stack: {} is unlike {}", m_.name, prefix,
                          describe(t), describe(like)));
      }
    const std::int64_t inter = gate.shape[0], hidden = gate.shape[1];
    const std::size_t w13 = tensor(prefix + "w13_weight", gate.type, {count, 2 * inter, hidden});
    const std::size_t w2 = tensor(prefix + "w2_weight", down.type, {count, hidden, inter});
    const std::uint64_t half = gate.nbytes(), slot = down.nbytes();
    for (const auto& [e, parts] : experts) {
      const auto ue = static_cast<std::uint64_t>(e);
      view(*parts[0], w13, ue * 2 * half);
      view(*parts[1], w13, ue * 2 * half + half);
      view(*parts[2], w2, ue * slot);
      for (const auto& p : parts) done[*p] = true;
    }
  }

  std::uint64_t layout_bytes(std::size_t i) const {
    return tensor_meta{"", m_.entries[i].meta.type, landing(i)}.nbytes();
  }

  const manifest& m_;
  engine_layout l_;
  // prefix ("....experts.") → expert → {gate, up, down} source indices (ep).
  std::map<std::string, std::map<std::int64_t, std::array<std::optional<std::size_t>, 3>>> experts_;
  std::unordered_map<std::string, std::size_t> index_;
};

}  // namespace

std::string_view layout_name(layout_kind k) noexcept {
  switch (k) {
    case layout_kind::plain: return "plain";
    case layout_kind::fused: return "fused";
    case layout_kind::ep: return "ep";
    case layout_kind::recorded: return "recorded";
  }
  return "?";
}

std::string layout_name(const layout_spec& l) {
  if (l.kind == layout_kind::recorded) return fmt::format("recorded:{}", fmt::join(l.files, ","));
  if (l.tp > 1) return fmt::format("tp{}", l.tp);
  return std::string(layout_name(l.kind));
}

std::optional<layout_spec> parse_layout(std::string_view name) noexcept {
  for (const auto k : {layout_kind::plain, layout_kind::fused, layout_kind::ep})
    if (layout_name(k) == name) return layout_spec{k};
  if (name.starts_with("recorded:")) {
    try {
      layout_spec spec{layout_kind::recorded};
      std::string_view rest = name.substr(9);
      while (true) {
        const auto comma = rest.find(',');
        const std::string_view file = rest.substr(0, comma);
        if (file.empty()) return std::nullopt;
        spec.files.emplace_back(file);
        if (comma == std::string_view::npos) break;
        rest = rest.substr(comma + 1);
      }
      if (spec.files.size() > 64) return std::nullopt;
      spec.tp = static_cast<int>(spec.files.size());
      return spec;
    } catch (...) {
      return std::nullopt;
    }
  }
  if (name.size() < 3 || name.size() > 4 || !name.starts_with("tp")) return std::nullopt;
  int n = 0;
  for (const char ch : name.substr(2)) {
    if (ch < '0' || ch > '9') return std::nullopt;
    n = n * 10 + (ch - '0');
  }
  if (n < 2 || n > 64 || name[2] == '0') return std::nullopt;
  return layout_spec{layout_kind::fused, n};
}

byte_region region_of(const tensor_meta& t, const std::optional<source_slice>& slice) {
  const std::uint64_t all = t.nbytes();
  if (!slice) return {0, all, all, 1};
  const auto dim = static_cast<std::size_t>(slice->dim);
  std::uint64_t inner = itemsize(t.type), outer = 1;
  for (std::size_t d = dim + 1; d < t.shape.size(); ++d) inner *= static_cast<std::uint64_t>(t.shape[d]);
  for (std::size_t d = 0; d < dim; ++d) outer *= static_cast<std::uint64_t>(t.shape[d]);
  const std::uint64_t pitch = static_cast<std::uint64_t>(t.shape[dim]) * inner;
  const std::uint64_t width = static_cast<std::uint64_t>(slice->length) * inner;
  if (outer == 1 || width == pitch)
    return {static_cast<std::uint64_t>(slice->start) * inner, width * outer, width * outer, 1};
  return {static_cast<std::uint64_t>(slice->start) * inner, width, pitch, outer};
}

std::optional<std::uint64_t> region_position(const byte_region& r, std::uint64_t offset) noexcept {
  if (offset < r.offset || r.width == 0) return std::nullopt;
  const std::uint64_t rel = offset - r.offset;
  const std::uint64_t pitch = r.rows <= 1 ? r.width : r.pitch;
  const std::uint64_t row = rel / pitch, col = rel % pitch;
  if (row >= r.rows || col >= r.width) return std::nullopt;
  return row * r.width + col;
}

std::uint64_t engine_layout::needed_bytes(const manifest& m) const {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < m.entries.size(); ++i) n += region_of(m.entries[i].meta, slices[i]).bytes();
  return n;
}

std::vector<std::int64_t> dense_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

engine_layout make_layout(const manifest& m, const layout_spec& spec, int rank) {
  if (spec.kind == layout_kind::recorded) {
    if (rank < 0 || rank >= static_cast<int>(spec.files.size()))
      bad(fmt::format("--rank {}: out of range for --layout {} (ranks 0 to {})", rank, layout_name(spec),
                      static_cast<int>(spec.files.size()) - 1));
    const std::string& file = spec.files[static_cast<std::size_t>(rank)];
    std::ifstream in(file, std::ios::binary);
    if (!in) throw error(errc::io, fmt::format("refit-bench: --layout recorded:{}: cannot read the file", file));
    std::ostringstream text;
    text << in.rdbuf();
    return recorded_layout(m, text.str(), file, rank, spec.tp);
  }
  return layout_builder(m, spec, rank).build();
}

std::uint64_t fold_view_checksums(const std::vector<std::uint64_t>& sums) noexcept {
  if (sums.empty()) return 0;
  const std::uint64_t first = sums.front();
  if (std::all_of(sums.begin(), sums.end(), [&](std::uint64_t s) { return s == first; })) return first;
  // The views disagree, so one at least is wrong: report a value none of them has (~first, else
  // first ^ 1, else counting up), so that the streamer's comparison fails whichever view is right.
  const auto unused = [&](std::uint64_t v) { return std::find(sums.begin(), sums.end(), v) == sums.end(); };
  if (unused(~first)) return ~first;
  if (unused(first ^ 1)) return first ^ 1;
  for (std::uint64_t v = first + 2;; ++v)
    if (unused(v)) return v;
}

std::optional<conversion_spec> parse_conversion(std::string_view name) {
  if (name == "bf16:fp8-block128")
    return conversion_spec{std::string(name), dtype::bf16, dtype::f8_e4m3, quant::block128};
  if (name == "bf16:fp8-tensor") return conversion_spec{std::string(name), dtype::bf16, dtype::f8_e4m3, quant::tensor};
  if (name == "bf16:fp8-channel")
    return conversion_spec{std::string(name), dtype::bf16, dtype::f8_e4m3, quant::channel};
  if (name == "bf16:mxfp8") return conversion_spec{std::string(name), dtype::bf16, dtype::f8_e4m3, quant::mxfp8};
  if (name == "f32:bf16") return conversion_spec{std::string(name), dtype::f32, dtype::bf16, quant::none};
  return std::nullopt;
}

std::optional<std::uint64_t> converted_scale_offset(const conversion_spec& s, const tensor_meta& meta) {
  if (meta.type != s.from || meta.numel() == 0) return std::nullopt;
  if (s.q == quant::none) return 0;
  if (meta.shape.size() != 2) return std::nullopt;  // norms and biases stay as they are, as in engines
  const std::uint64_t codes = meta.numel() * itemsize(s.to);
  const std::uint64_t at = (codes + 255) / 256 * 256;
  const std::uint64_t scale = itemsize(scale_dtype(s.q)) * *checked_numel(scale_shape(s.q, meta.shape));
  if (at + scale > meta.nbytes()) return std::nullopt;
  return at;
}

std::uint64_t converted_bytes(const conversion_spec& s, const tensor_meta& meta) {
  if (!converted_scale_offset(s, meta)) return meta.nbytes();
  return meta.numel() * itemsize(s.to) +
         (s.q == quant::none ? 0 : itemsize(scale_dtype(s.q)) * *checked_numel(scale_shape(s.q, meta.shape)));
}

}  // namespace refit::bench
