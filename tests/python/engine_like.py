"""A tiny engine written the way vLLM's layers are, for refit.record's tests.

Every parameter has a ``weight_loader(param, loaded_weight, shard_id=None)``; tensor parallelism
(rank, size) and expert parallelism are constructor arguments; ``load_weights(weights)`` walks
``(name, tensor)`` pairs with a ``stacked_params_mapping`` as vLLM's Llama and Qwen-MoE do. The
parameters start as zeros (or on the meta device: no memory), so that two engines built alike
hold the same bytes before any load.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch import nn


class Parallel(NamedTuple):
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    device: str = "cpu"
    dtype: torch.dtype = torch.float32


def _param(shape, par: Parallel, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=par.dtype, device=par.device), requires_grad=False)
    p.weight_loader = loader
    return p


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    assert param.size() == loaded_weight.size(), (param.size(), loaded_weight.size())
    param.data.copy_(loaded_weight)


class ColumnParallelLinear(nn.Module):
    """Output rows split across ranks."""

    def __init__(self, inp: int, out: int, par: Parallel, bias: bool = False) -> None:
        super().__init__()
        self.par = par
        self.weight = _param((out // par.tp_size, inp), par, self.weight_loader)
        self.bias = _param((out // par.tp_size,), par, self.weight_loader) if bias else None

    def weight_loader(self, param, loaded_weight, shard_id=None):
        n = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.par.tp_rank * n, n))


class MergedColumnParallelLinear(nn.Module):
    """gate_up: shards 0 and 1 stacked by rows, each split across ranks."""

    def __init__(self, inp: int, sizes: List[int], par: Parallel) -> None:
        super().__init__()
        self.par, self.sizes = par, sizes
        self.weight = _param((sum(sizes) // par.tp_size, inp), par, self.weight_loader)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        tp = self.par.tp_size
        offset = sum(self.sizes[:shard_id]) // tp
        size = self.sizes[shard_id] // tp
        shard = loaded_weight.narrow(0, self.par.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(nn.Module):
    """Fused q/k/v with GQA: each rank takes its q heads and its kv heads (replicated when there
    are fewer kv heads than ranks)."""

    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, par: Parallel, bias: bool = False) -> None:
        super().__init__()
        tp = par.tp_size
        self.par, self.head_dim = par, head_dim
        self.q_heads = heads // tp
        self.kv_heads = max(1, kv_heads // tp)
        self.kv_replicas = max(1, tp // kv_heads)
        rows = (self.q_heads + 2 * self.kv_heads) * head_dim
        self.weight = _param((rows, hidden), par, self.weight_loader)
        self.bias = _param((rows,), par, self.weight_loader) if bias else None

    def weight_loader(self, param, loaded_weight, shard_id=None):
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        rank = self.par.tp_rank
        if shard_id == "q":
            offset, size, start = 0, q, rank * q
        elif shard_id == "k":
            offset, size, start = q, kv, (rank // self.kv_replicas) * kv
        else:
            offset, size, start = q + kv, kv, (rank // self.kv_replicas) * kv
        param_data = param.data.narrow(0, offset, size)
        loaded_weight = loaded_weight.narrow(0, start, size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)


class RowParallelLinear(nn.Module):
    """Input columns split across ranks."""

    def __init__(self, inp: int, out: int, par: Parallel) -> None:
        super().__init__()
        self.par = par
        self.weight = _param((out, inp // par.tp_size), par, self.weight_loader)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        n = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.par.tp_rank * n, n))


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks, padded to ceil(vocab / tp) rows each; padding rows
    are zeroed by the loader (as vLLM's is)."""

    def __init__(self, vocab: int, hidden: int, par: Parallel) -> None:
        super().__init__()
        self.par = par
        self.per_rank = -(-vocab // par.tp_size)
        self.start = par.tp_rank * self.per_rank
        self.rows = max(0, min(vocab - self.start, self.per_rank))
        self.weight = _param((self.per_rank, hidden), par, self.weight_loader)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        loaded_weight = loaded_weight.narrow(0, self.start, self.rows)
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, par: Parallel) -> None:
        super().__init__()
        self.weight = _param((hidden,), par, default_weight_loader)


class FusedMoE(nn.Module):
    """Stacked experts ``w13[E_local, 2I/tp, H]`` (gate rows, then up rows) and ``w2[E_local, H, I/tp]``;
    rank r of ep holds experts [r*E/ep, (r+1)*E/ep); rank t of tp holds rows (w13) and columns
    (w2) [t*I/tp, (t+1)*I/tp) of each expert's intermediate dimension, as vLLM's FusedMoE does."""

    def __init__(self, experts: int, hidden: int, inter: int, par: Parallel) -> None:
        super().__init__()
        local = experts // par.ep_size
        inter //= par.tp_size
        self.inter = inter
        self.tp_rank = par.tp_rank
        self.expert_map = {e: e - par.ep_rank * local for e in range(par.ep_rank * local, (par.ep_rank + 1) * local)}
        self.w13_weight = _param((local, 2 * inter, hidden), par, self.weight_loader)
        self.w2_weight = _param((local, hidden, inter), par, self.weight_loader)

    def weight_loader(self, param, loaded_weight, weight_name=None, shard_id=None, expert_id=None):
        local = self.expert_map.get(expert_id)
        if local is None:
            return  # another rank's expert
        expert_data = param.data[local]
        if shard_id in ("w1", "w3"):
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * self.inter, self.inter)
        else:
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * self.inter, self.inter)
        if shard_id == "w1":
            expert_data.narrow(0, 0, self.inter).copy_(loaded_weight)
        elif shard_id == "w3":
            expert_data.narrow(0, self.inter, self.inter).copy_(loaded_weight)
        else:
            expert_data.copy_(loaded_weight)


class Config(NamedTuple):
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    inter: int = 64
    vocab: int = 98
    layers: int = 2
    tie: bool = False
    qkv_bias: bool = False
    experts: int = 0  # > 0: a Qwen-MoE-like MLP
    moe_inter: int = 16
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (replicated on every rank)


LLAMA3_8B = Config(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256, layers=32)
QWEN3_30B_A3B = Config(hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, layers=48, experts=128,
                       moe_inter=768, qk_norm=True)


class Attention(nn.Module):
    def __init__(self, cfg: Config, par: Parallel) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, par, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.heads * cfg.head_dim, cfg.hidden, par)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, par)
            self.k_norm = RMSNorm(cfg.head_dim, par)


class MLP(nn.Module):
    def __init__(self, cfg: Config, par: Parallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden, [cfg.inter, cfg.inter], par)
        self.down_proj = RowParallelLinear(cfg.inter, cfg.hidden, par)


class MoE(nn.Module):
    def __init__(self, cfg: Config, par: Parallel) -> None:
        super().__init__()
        self.gate = nn.Module()
        self.gate.weight = _param((cfg.experts, cfg.hidden), par, default_weight_loader)  # the router, replicated
        self.experts = FusedMoE(cfg.experts, cfg.hidden, cfg.moe_inter, par)


class Layer(nn.Module):
    def __init__(self, cfg: Config, par: Parallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, par)
        self.mlp = MoE(cfg, par) if cfg.experts else MLP(cfg, par)
        self.input_layernorm = RMSNorm(cfg.hidden, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, par)


class Decoder(nn.Module):
    def __init__(self, cfg: Config, par: Parallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, par)
        self.layers = nn.ModuleList([Layer(cfg, par) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, par)


STACKED = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


class LlamaForCausalLM(nn.Module):
    """vLLM's Llama, in miniature: HF names in, fused and sharded parameters."""

    def __init__(self, cfg: Config = Config(), par: Parallel = Parallel()) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg, par)
        if cfg.tie:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(cfg.vocab, cfg.hidden, par)

    def expert_mapping(self) -> List[Tuple[str, str, int, str]]:
        out = []
        for e in range(self.cfg.experts):
            for shard, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                param = "experts.w13_" if shard in ("w1", "w3") else "experts.w2_"
                out.append((param, f"experts.{e}.{name}.", e, shard))
        return out

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set:
        params = dict(self.named_parameters())
        loaded = set()
        experts = self.expert_mapping()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or (self.cfg.tie and name == "lm_head.weight"):
                continue
            for param_name, weight_name, shard_id in STACKED:
                if weight_name not in name or "experts." in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in experts:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = params[name]
                    param.weight_loader(param, loaded_weight, name, shard_id=shard_id, expert_id=expert_id)
                    break
                else:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            loaded.add(name)
        return loaded


def hf_spec(cfg: Config) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]:
    """The trainer's (HF) tensors of ``cfg``: name -> (dtype, shape)."""
    H, D = cfg.hidden, cfg.head_dim
    spec: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, H)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        spec[p + "self_attn.q_proj.weight"] = (cfg.heads * D, H)
        spec[p + "self_attn.k_proj.weight"] = (cfg.kv_heads * D, H)
        spec[p + "self_attn.v_proj.weight"] = (cfg.kv_heads * D, H)
        if cfg.qkv_bias:
            spec[p + "self_attn.q_proj.bias"] = (cfg.heads * D,)
            spec[p + "self_attn.k_proj.bias"] = (cfg.kv_heads * D,)
            spec[p + "self_attn.v_proj.bias"] = (cfg.kv_heads * D,)
        spec[p + "self_attn.o_proj.weight"] = (H, cfg.heads * D)
        if cfg.qk_norm:
            spec[p + "self_attn.q_norm.weight"] = (D,)
            spec[p + "self_attn.k_norm.weight"] = (D,)
        if cfg.experts:
            spec[p + "mlp.gate.weight"] = (cfg.experts, H)
            for e in range(cfg.experts):
                spec[p + f"mlp.experts.{e}.gate_proj.weight"] = (cfg.moe_inter, H)
                spec[p + f"mlp.experts.{e}.up_proj.weight"] = (cfg.moe_inter, H)
                spec[p + f"mlp.experts.{e}.down_proj.weight"] = (H, cfg.moe_inter)
        else:
            spec[p + "mlp.gate_proj.weight"] = (cfg.inter, H)
            spec[p + "mlp.up_proj.weight"] = (cfg.inter, H)
            spec[p + "mlp.down_proj.weight"] = (H, cfg.inter)
        spec[p + "input_layernorm.weight"] = (H,)
        spec[p + "post_attention_layernorm.weight"] = (H,)
    spec["model.norm.weight"] = (H,)
    if not cfg.tie:
        spec["lm_head.weight"] = (cfg.vocab, H)
    return {n: (torch.float32, s) for n, s in spec.items()}


def hf_state(cfg: Config, version: int) -> Dict[str, torch.Tensor]:
    """A trainer state_dict of ``cfg``, different bytes per version."""
    g = torch.Generator().manual_seed(7919 * version + 13)
    return {n: torch.randn(s, generator=g, dtype=d) for n, (d, s) in hf_spec(cfg).items()}
