// Engine layouts (--layout): where each source tensor lands in the receiver's own tensors.
//
// The streamer sends the checkpoint's tensors whatever the layout; the receiver registers each as
// a view of an engine tensor (receiver::add_parameter(dest, dest_layout)) and checksums the bytes
// of each view (roles.cpp), so the verification is the same as for a plain layout.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>

#include "bench/bench.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

[[noreturn]] void bad(const std::string& what) { throw error(errc::invalid_argument, "refit-bench: " + what); }

// Row-major strides (elements) of a dense tensor of this shape.
std::vector<std::int64_t> dense_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

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

class layout_builder {
 public:
  layout_builder(const manifest& m, layout_kind kind) : m_(m) {
    l_.kind = kind;
    l_.tensors.name = m.name;
    l_.of_source.resize(m.entries.size());
    for (std::size_t i = 0; i < m.entries.size(); ++i) index_.emplace(m.entries[i].meta.name, i);
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
      view(i, tensor(t.name, t.type, t.shape), 0);
      done[i] = true;
    }
    // A tied embedding: the checkpoint has no lm_head, the engine has one, written from the embedding.
    const auto embed = index_.find("model.embed_tokens.weight");
    if (kind != layout_kind::plain && embed != index_.end() && !index_.count("lm_head.weight")) {
      const tensor_meta& t = m_.entries[embed->second].meta;
      view(embed->second, tensor("lm_head.weight", t.type, t.shape), 0);
    }
    return std::move(l_);
  }

 private:
  std::size_t tensor(std::string name, dtype type, std::vector<std::int64_t> shape) {
    l_.tensors.entries.push_back({tensor_meta{std::move(name), type, std::move(shape)}, -1, 0});
    return l_.tensors.entries.size() - 1;
  }

  // Source i lands in engine tensor k from byte `offset`: a run of whole rows (or all of it), so
  // the view's strides are the engine tensor's own along its last dimensions.
  void view(std::size_t i, std::size_t k, std::uint64_t offset) {
    const tensor_meta& src = m_.entries[i].meta;
    const auto engine = dense_strides(l_.tensors.entries[k].meta.shape);
    layout_view v;
    v.source = i;
    v.tensor = k;
    v.offset = offset;
    v.bytes = src.nbytes();
    v.shape = src.shape;
    v.strides.assign(engine.end() - static_cast<std::ptrdiff_t>(src.shape.size()), engine.end());
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
    const tensor_meta& first = m_.entries[members.front()].meta;
    std::int64_t rows = 0;
    for (const auto k : members) {
      const tensor_meta& t = m_.entries[k].meta;
      if (t.type != first.type || t.shape.empty() ||
          !std::equal(t.shape.begin() + 1, t.shape.end(), first.shape.begin() + 1, first.shape.end()))
        return false;
      rows += t.shape[0];
    }
    auto shape = first.shape;
    shape[0] = rows;
    const std::size_t k = tensor(g->fused, first.type, shape);
    std::uint64_t offset = 0;
    for (const auto m : members) {
      view(m, k, offset);
      offset += m_.entries[m].meta.nbytes();
      done[m] = true;
    }
    return true;
  }

  // Every expert's tensors, by layer (prefix), expert and role.
  void find_experts() {
    for (std::size_t i = 0; i < m_.entries.size(); ++i)
      if (const auto p = expert_of(m_.entries[i].meta.name)) experts_[p->prefix][p->expert][static_cast<std::size_t>(p->role)] = i;
    if (experts_.empty())
      bad(fmt::format("--layout ep stacks the experts of a mixture-of-experts model and {} has none "
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
        bad(fmt::format("--layout ep: {}: the experts of {} do not stack: expert {} is missing ({} experts, numbered up "
                        "to {})", m_.name, prefix, e, count, experts.rbegin()->first));
      for (std::size_t r = 0; r < 3; ++r)
        if (!it->second[r])
          bad(fmt::format("--layout ep: {}: the experts of {} do not stack: expert {} has no {} tensor", m_.name, prefix,
                          e, role_names[r]));
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
  }
  return "?";
}

std::optional<layout_kind> parse_layout(std::string_view name) noexcept {
  for (const auto k : {layout_kind::plain, layout_kind::fused, layout_kind::ep})
    if (layout_name(k) == name) return k;
  return std::nullopt;
}

engine_layout make_layout(const manifest& m, layout_kind kind) { return layout_builder(m, kind).build(); }

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

}  // namespace refit::bench
