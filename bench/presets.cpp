// Built-in models: real parameter names and shapes, computed from each model's published
// config.json (Hugging Face). Totals are checked against the published parameter counts by the
// unit tests.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "bench/bench.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

struct dense_config {
  std::int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool tied = false;      ///< tie_word_embeddings: no lm_head
  bool qkv_bias = false;  ///< Qwen2 has q/k/v biases
  bool qk_norm = false;   ///< Qwen3 normalises q and k per head
  // Mixture of experts (experts == 0: dense MLP).
  std::int64_t experts = 0;
  std::int64_t expert_intermediate = 0;
  bool mixtral_names = false;  ///< block_sparse_moe.experts.E.w1/w2/w3 (Mixtral) vs mlp.experts.E.*
};

class builder {
 public:
  builder(manifest& m, dtype t) : m_(m), t_(t) {}
  void add(std::string name, std::vector<std::int64_t> shape) {
    m_.entries.push_back({tensor_meta{std::move(name), t_, std::move(shape)}, -1, 0});
  }

 private:
  manifest& m_;
  dtype t_;
};

manifest build(std::string name, const dense_config& c, dtype t) {
  manifest m;
  m.name = std::move(name);
  m.head_dim = c.head_dim;
  builder b(m, t);
  const std::int64_t q = c.heads * c.head_dim;
  const std::int64_t kv = c.kv_heads * c.head_dim;
  b.add("model.embed_tokens.weight", {c.vocab, c.hidden});
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    b.add(p + "input_layernorm.weight", {c.hidden});
    b.add(p + "self_attn.q_proj.weight", {q, c.hidden});
    if (c.qkv_bias) b.add(p + "self_attn.q_proj.bias", {q});
    b.add(p + "self_attn.k_proj.weight", {kv, c.hidden});
    if (c.qkv_bias) b.add(p + "self_attn.k_proj.bias", {kv});
    b.add(p + "self_attn.v_proj.weight", {kv, c.hidden});
    if (c.qkv_bias) b.add(p + "self_attn.v_proj.bias", {kv});
    b.add(p + "self_attn.o_proj.weight", {c.hidden, q});
    if (c.qk_norm) {
      b.add(p + "self_attn.q_norm.weight", {c.head_dim});
      b.add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    b.add(p + "post_attention_layernorm.weight", {c.hidden});
    if (c.experts == 0) {
      b.add(p + "mlp.gate_proj.weight", {c.intermediate, c.hidden});
      b.add(p + "mlp.up_proj.weight", {c.intermediate, c.hidden});
      b.add(p + "mlp.down_proj.weight", {c.hidden, c.intermediate});
    } else if (c.mixtral_names) {
      b.add(p + "block_sparse_moe.gate.weight", {c.experts, c.hidden});
      for (std::int64_t e = 0; e < c.experts; ++e) {
        const std::string x = fmt::format("{}block_sparse_moe.experts.{}.", p, e);
        b.add(x + "w1.weight", {c.expert_intermediate, c.hidden});
        b.add(x + "w2.weight", {c.hidden, c.expert_intermediate});
        b.add(x + "w3.weight", {c.expert_intermediate, c.hidden});
      }
    } else {
      b.add(p + "mlp.gate.weight", {c.experts, c.hidden});
      for (std::int64_t e = 0; e < c.experts; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        b.add(x + "gate_proj.weight", {c.expert_intermediate, c.hidden});
        b.add(x + "up_proj.weight", {c.expert_intermediate, c.hidden});
        b.add(x + "down_proj.weight", {c.hidden, c.expert_intermediate});
      }
    }
  }
  b.add("model.norm.weight", {c.hidden});
  if (!c.tied) b.add("lm_head.weight", {c.vocab, c.hidden});
  return m;
}

struct named_config {
  std::string_view name;
  dense_config config;
  std::string_view note;
};

// vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied, qkv_bias, qk_norm,
// experts, expert_intermediate, mixtral_names
const named_config presets[] = {
    {"qwen2.5-0.5b",
     {151936, 896, 4864, 24, 14, 2, 64, true, true, false, 0, 0, false},
     "Qwen/Qwen2.5-0.5B: 494,032,768 params"},
    {"qwen2.5-7b",
     {152064, 3584, 18944, 28, 28, 4, 128, false, true, false, 0, 0, false},
     "Qwen/Qwen2.5-7B: 7,615,616,512 params"},
    {"llama3-8b",
     {128256, 4096, 14336, 32, 32, 8, 128, false, false, false, 0, 0, false},
     "meta-llama/Meta-Llama-3-8B: 8,030,261,248 params"},
    {"qwen3-30b-a3b",
     {151936, 2048, 6144, 48, 32, 4, 128, false, false, true, 128, 768, false},
     "Qwen/Qwen3-30B-A3B: 30,532,122,624 params, 128 experts"},
    {"mixtral-8x7b",
     {32000, 4096, 14336, 32, 32, 8, 128, false, false, false, 8, 14336, true},
     "mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 params, 8 experts"},
    // Not a real model: a few MB of llama-shaped tensors for smoke tests.
    {"tiny",
     {1000, 256, 704, 2, 4, 2, 64, false, true, false, 0, 0, false},
     "a 2-layer llama-shaped toy (1.3 M params) for smoke tests"},
};

}  // namespace

std::uint64_t manifest::bytes() const {
  std::uint64_t n = 0;
  for (const auto& e : entries) n += e.meta.nbytes();
  return n;
}

std::uint64_t manifest::params() const {
  std::uint64_t n = 0;
  for (const auto& e : entries) n += e.meta.numel();
  return n;
}

std::uint64_t manifest::largest() const {
  std::uint64_t n = 0;
  for (const auto& e : entries) n = std::max(n, e.meta.nbytes());
  return n;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets) names.emplace_back(p.name);
  return names;
}

manifest preset(std::string_view name, dtype type) {
  for (const auto& p : presets)
    if (p.name == name) return build(std::string(p.name), p.config, type);
  throw error(errc::invalid_argument, fmt::format("unknown model '{}': built-in models are {}; or give --manifest FILE "
                                                  "(a .safetensors file or a JSON {{name: {{dtype, shape}}}})",
                                                  name, fmt::join(preset_names(), ", ")));
}

}  // namespace refit::bench
