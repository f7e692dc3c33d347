"""Engine layouts: destinations that are strided views of the engine's own tensors, sources taken
in slices (``source_slice``), one name written into several destinations.

Every case compares the receiver's tensors, bit for bit, with a pure-torch reference of the
mapping (``*_reference``: the trainer's state_dict in, the engine's tensors out), written with
``torch.cat`` / indexing and independent of how the receiver registers its views (``build_*``).
The receiver runs in a spawned peer (``serve_layout``); tensor parallelism runs one peer per rank.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch

import refit
from conftest import Peer, serve_loop, state_bytes, streamer

Registration = Tuple[str, torch.Tensor, Optional[Tuple[int, int, int]]]
Engine = Dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ the peer's job


def serve_layout(chan, build: Callable[..., Tuple[Engine, List[Registration]]], *args: Any) -> List[str]:
    """Job: builds the engine's tensors and their registrations with ``build(*args)``, registers
    them (in order), sends the endpoint, serves. ``state`` answers the engine's *whole* tensors
    (every byte, not only the registered views)."""
    engine, regs = build(*args)
    with refit.Receiver() as rx:
        for name, view, source_slice in regs:
            rx.add_parameter(name, view, source_slice=source_slice)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(engine)})


@pytest.fixture
def layout_peer(peer):
    """``job, endpoint = layout_peer(build, *args)``: serve_layout in the shared peer."""

    def start(build, *args):
        job = peer.run(serve_layout, build, *args)
        return job, job.recv()

    return start


def start_ranks(peers: List[Peer], build, *args) -> Tuple[list, List[str]]:
    """serve_layout(build, *args, rank, world) in each peer: (jobs, endpoints)."""
    jobs = [p.run(serve_layout, build, *args, rank, len(peers)) for rank, p in enumerate(peers)]
    return jobs, [job.recv() for job in jobs]


def refit_all(streamers, version: int, states) -> None:
    """Refits every rank at once (one streamer per rank), each with its own source."""
    with ThreadPoolExecutor(len(streamers)) as pool:
        for f in [pool.submit(st.refit, version, s) for st, s in zip(streamers, states)]:
            f.result()


def expect_refusal(code, *names: str, quoted: bool = True):
    """pytest.raises(RefitError) that also checks the code and that the message names each tensor
    (in quotes, as refit's apply/incomplete messages do, unless ``quoted`` is False)."""

    @contextlib.contextmanager
    def check():
        with pytest.raises(refit.RefitError) as failure:
            yield failure
        assert failure.value.code == code, str(failure.value)
        for name in names:
            assert (f"'{name}'" if quoted else name) in str(failure.value), str(failure.value)

    return check()


# --------------------------------------------------------------- a dense decoder (GQA, tied)


class Dense(NamedTuple):
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 8
    inter: int = 128
    vocab: int = 96
    layers: int = 2


def dense_state(cfg: Dense, version: int, dtype: torch.dtype = torch.float32) -> Engine:
    """The trainer's state_dict (Hugging Face names); new bytes each version, NaN and -0.0 too."""
    g = torch.Generator().manual_seed(7919 * version + 1)
    H, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def w(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": w(cfg.vocab, H)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w(H)
        sd[p + "self_attn.q_proj.weight"] = w(q, H)
        sd[p + "self_attn.k_proj.weight"] = w(kv, H)
        sd[p + "self_attn.v_proj.weight"] = w(kv, H)
        sd[p + "self_attn.o_proj.weight"] = w(H, q)
        sd[p + "post_attention_layernorm.weight"] = w(H)
        sd[p + "mlp.gate_proj.weight"] = w(cfg.inter, H)
        sd[p + "mlp.up_proj.weight"] = w(cfg.inter, H)
        sd[p + "mlp.down_proj.weight"] = w(H, cfg.inter)
    sd["model.norm.weight"] = w(H)
    sd["model.layers.0.self_attn.k_proj.weight"][0, :2] = torch.tensor([float("nan"), -0.0])
    return sd


class Shard(NamedTuple):
    """Rank ``rank`` of ``world`` in tensor parallelism: its row/column ranges of each source."""

    q: Tuple[int, int]  # rows of q_proj, columns of o_proj
    kv: Tuple[int, int]  # rows of k_proj / v_proj (a kv head is replicated when world > kv_heads)
    inter: Tuple[int, int]  # rows of gate/up, columns of down
    vocab: Tuple[int, int]  # rows of embed_tokens


def shard_of(cfg: Dense, rank: int, world: int) -> Shard:
    qn = cfg.heads * cfg.head_dim // world
    kvn = max(1, cfg.kv_heads // world) * cfg.head_dim
    kv0 = rank * cfg.kv_heads // world * cfg.head_dim
    inn, vn = cfg.inter // world, cfg.vocab // world
    return Shard((rank * qn, qn), (kv0, kvn), (rank * inn, inn), (rank * vn, vn))


def dense_reference(sd: Engine, cfg: Dense, rank: int = 0, world: int = 1) -> Engine:
    """The engine's tensors of one rank, from the trainer's state_dict, by slicing and torch.cat."""
    s = shard_of(cfg, rank, world)

    def rows(t, r):
        return t[r[0] : r[0] + r[1]]

    def cols(t, r):
        return t[:, r[0] : r[0] + r[1]]

    emb = rows(sd["model.embed_tokens.weight"], s.vocab)
    out = {"embed": emb, "lm_head": emb}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.qkv"] = torch.cat(
            [rows(sd[p + "self_attn.q_proj.weight"], s.q), rows(sd[p + "self_attn.k_proj.weight"], s.kv),
             rows(sd[p + "self_attn.v_proj.weight"], s.kv)]
        )
        out[f"layers.{i}.o"] = cols(sd[p + "self_attn.o_proj.weight"], s.q)
        out[f"layers.{i}.gate_up"] = torch.cat(
            [rows(sd[p + "mlp.gate_proj.weight"], s.inter), rows(sd[p + "mlp.up_proj.weight"], s.inter)]
        )
        out[f"layers.{i}.down"] = cols(sd[p + "mlp.down_proj.weight"], s.inter)
        out[f"layers.{i}.input_norm"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_norm"] = sd[p + "post_attention_layernorm.weight"]
    out["norm"] = sd["model.norm.weight"]
    return out


def build_dense(cfg: Dense, dtype_name: str, rank: int = 0, world: int = 1) -> Tuple[Engine, List[Registration]]:
    """The engine of one rank (vLLM-like fused tensors) and its registrations: narrow views for the
    fused parts, source_slice for the shard (None when world == 1: the whole source)."""
    dtype = getattr(torch, dtype_name)
    s = shard_of(cfg, rank, world)
    H = cfg.hidden

    def take(dim, r):
        return None if world == 1 else (dim, r[0], r[1])

    def new(*shape):
        return torch.full(shape, -5.0, dtype=dtype)  # not what any source holds

    engine: Engine = {"embed": new(s.vocab[1], H), "lm_head": new(s.vocab[1], H)}
    regs: List[Registration] = [
        ("model.embed_tokens.weight", engine["embed"], take(0, s.vocab)),
        ("model.embed_tokens.weight", engine["lm_head"], take(0, s.vocab)),  # tied
    ]
    for i in range(cfg.layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        qkv = engine[e + "qkv"] = new(s.q[1] + 2 * s.kv[1], H)
        engine[e + "o"] = new(H, s.q[1])
        gate_up = engine[e + "gate_up"] = new(2 * s.inter[1], H)
        engine[e + "down"] = new(H, s.inter[1])
        engine[e + "input_norm"] = new(H)
        engine[e + "post_norm"] = new(H)
        q, kv, n = s.q[1], s.kv[1], s.inter[1]
        regs += [
            (p + "self_attn.q_proj.weight", qkv.narrow(0, 0, q), take(0, s.q)),
            (p + "self_attn.k_proj.weight", qkv.narrow(0, q, kv), take(0, s.kv)),
            (p + "self_attn.v_proj.weight", qkv.narrow(0, q + kv, kv), take(0, s.kv)),
            (p + "self_attn.o_proj.weight", engine[e + "o"], take(1, s.q)),
            (p + "mlp.gate_proj.weight", gate_up.narrow(0, 0, n), take(0, s.inter)),
            (p + "mlp.up_proj.weight", gate_up.narrow(0, n, n), take(0, s.inter)),
            (p + "mlp.down_proj.weight", engine[e + "down"], take(-1, s.inter)),  # dim counted from the end
            (p + "input_layernorm.weight", engine[e + "input_norm"], None),
            (p + "post_attention_layernorm.weight", engine[e + "post_norm"], None),
        ]
    engine["norm"] = new(H)
    regs.append(("model.norm.weight", engine["norm"], None))
    return engine, regs


@pytest.mark.parametrize(
    "dtype, buffer_bytes", [(torch.float32, 4096), (torch.bfloat16, 64 << 10)], ids=["f32-4KiB", "bf16-64KiB"]
)
def test_fused_qkv_gate_up_and_tied_embeddings_arrive_bit_exact_over_three_versions(layout_peer, dtype, buffer_bytes):
    cfg = Dense()
    job, endpoint = layout_peer(build_dense, cfg, str(dtype).replace("torch.", ""))
    assert job.request("state") != state_bytes(dense_reference(dense_state(cfg, 1, dtype), cfg))
    with streamer(endpoint, buffer_bytes=buffer_bytes) as st:
        for version in (1, 2, 3):
            state = dense_state(cfg, version, dtype)
            stats = st.refit(version, state)
            assert stats.tensors == len(state)  # the tied source travels once
            assert job.request("state") == state_bytes(dense_reference(state, cfg)), f"version {version}"
            status = job.request("status")
            assert (status["committed_version"], status["dirty"]) == (version, False)
    assert job.stop().count("committed") == 3


@pytest.mark.parametrize("world", [2, 4])
def test_each_tensor_parallel_rank_receives_its_shard_bit_exact(ranks, world):
    cfg = Dense()  # 2 kv heads: with 4 ranks each kv head is replicated on two of them
    shards = [dense_reference(dense_state(cfg, 1), cfg, r, world) for r in range(world)]
    whole = dense_state(cfg, 1)  # the reference shards partition the model
    assert torch.equal(torch.cat([s["layers.0.o"] for s in shards], 1), whole["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(torch.cat([s["embed"] for s in shards]), whole["model.embed_tokens.weight"])

    jobs, endpoints = start_ranks(ranks(world), build_dense, cfg, "float32")
    with contextlib.ExitStack() as stack:
        streamers = [stack.enter_context(streamer(ep, buffer_bytes=4096)) for ep in endpoints]
        for version in (1, 2):
            state = dense_state(cfg, version)
            refit_all(streamers, version, [state] * world)  # every rank gets the full state_dict
            for rank, job in enumerate(jobs):
                expected = state_bytes(dense_reference(state, cfg, rank, world))
                assert job.request("state") == expected, f"rank {rank}, version {version}"
                assert job.request("status")["committed_version"] == version
    for job in jobs:
        assert job.stop().count("committed") == 2


# ------------------------------------------------------------------------------ stacked experts


class Moe(NamedTuple):
    hidden: int = 32
    inter: int = 16
    experts: int = 4
    layers: int = 2


def expert_name(i: int, e: int, proj: str) -> str:
    return f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"


def moe_state(cfg: Moe, version: int) -> Engine:
    g = torch.Generator().manual_seed(104729 * version + 3)
    sd = {}
    for i in range(cfg.layers):
        sd[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(cfg.experts, cfg.hidden, generator=g)  # the router
        for e in range(cfg.experts):
            sd[expert_name(i, e, "gate")] = torch.randn(cfg.inter, cfg.hidden, generator=g)
            sd[expert_name(i, e, "up")] = torch.randn(cfg.inter, cfg.hidden, generator=g)
            sd[expert_name(i, e, "down")] = torch.randn(cfg.hidden, cfg.inter, generator=g)
    return sd


def local_experts(cfg: Moe, rank: int, world: int) -> range:
    n = cfg.experts // world
    return range(rank * n, (rank + 1) * n)


def is_local(name: str, cfg: Moe, rank: int, world: int) -> bool:
    if ".experts." not in name:
        return True
    return int(name.split(".experts.")[1].split(".")[0]) in local_experts(cfg, rank, world)


def moe_reference(sd: Engine, cfg: Moe, rank: int = 0, world: int = 1) -> Engine:
    out = {}
    mine = local_experts(cfg, rank, world)
    for i in range(cfg.layers):
        out[f"layers.{i}.router"] = sd[f"model.layers.{i}.mlp.gate.weight"]
        out[f"layers.{i}.w13"] = torch.stack(
            [torch.cat([sd[expert_name(i, e, "gate")], sd[expert_name(i, e, "up")]]) for e in mine]
        )
        out[f"layers.{i}.w2"] = torch.stack([sd[expert_name(i, e, "down")] for e in mine])
    return out


def build_moe(cfg: Moe, rank: int = 0, world: int = 1) -> Tuple[Engine, List[Registration]]:
    """w13[E_local, 2I, H] (gate_e, up_e in w13[e]) and w2[E_local, H, I] of the local experts."""
    engine: Engine = {}
    regs: List[Registration] = []
    n, H, I = cfg.experts // world, cfg.hidden, cfg.inter
    for i in range(cfg.layers):
        router = engine[f"layers.{i}.router"] = torch.full((cfg.experts, H), -5.0)
        w13 = engine[f"layers.{i}.w13"] = torch.full((n, 2 * I, H), -5.0)
        w2 = engine[f"layers.{i}.w2"] = torch.full((n, H, I), -5.0)
        regs.append((f"model.layers.{i}.mlp.gate.weight", router, None))
        for le, e in enumerate(local_experts(cfg, rank, world)):
            regs += [
                (expert_name(i, e, "gate"), w13[le].narrow(0, 0, I), None),
                (expert_name(i, e, "up"), w13[le].narrow(0, I, I), None),
                (expert_name(i, e, "down"), w2[le], None),
            ]
    return engine, regs


def test_stacked_experts_arrive_bit_exact_in_w13_and_w2(layout_peer):
    cfg = Moe()
    job, endpoint = layout_peer(build_moe, cfg)
    with streamer(endpoint, buffer_bytes=4096) as st:
        for version in (1, 2):
            state = moe_state(cfg, version)
            st.refit(version, state)
            assert job.request("state") == state_bytes(moe_reference(state, cfg)), f"version {version}"
    assert job.stop().count("committed") == 2


def test_an_expert_parallel_rank_refuses_other_ranks_experts_and_commits_its_own(ranks):
    cfg, world = Moe(), 2
    jobs, endpoints = start_ranks(ranks(world), build_moe, cfg)
    with contextlib.ExitStack() as stack:
        streamers = [stack.enter_context(streamer(ep)) for ep in endpoints]

        def local(state, rank):
            return {k: v for k, v in state.items() if is_local(k, cfg, rank, world)}

        v1 = moe_state(cfg, 1)
        refit_all(streamers, 1, [local(v1, r) for r in range(world)])
        for rank, job in enumerate(jobs):
            assert job.request("state") == state_bytes(moe_reference(v1, cfg, rank, world))

        v2 = moe_state(cfg, 2)
        for rank, (st, job) in enumerate(zip(streamers, jobs)):
            first_foreign = next(k for k in v2 if not is_local(k, cfg, rank, world))
            with expect_refusal(refit.Errc.apply, first_foreign):
                st.refit(2, v2)  # every expert: the other rank's are not in this table
            status = job.request("status")
            assert (status["committed_version"], status["dirty"]) == (1, False)
            assert first_foreign in status["last_error"]
            assert job.request("state") == state_bytes(moe_reference(v1, cfg, rank, world))  # one batch, refused whole

        refit_all(streamers, 2, [local(v2, r) for r in range(world)])
        for rank, job in enumerate(jobs):
            assert job.request("state") == state_bytes(moe_reference(v2, cfg, rank, world))
            assert job.request("status")["committed_version"] == 2
    for job in jobs:
        job.stop()


def build_stacked_source(cfg: Moe) -> Tuple[Engine, List[Registration]]:
    """Sources already stacked ([E, 2I, H] and [E, H, I]) taken in slices along dims 0, 1 and -1."""
    E, H, I = cfg.experts, cfg.hidden, cfg.inter
    e = {
        "w13.ep": torch.full((E // 2, 2 * I, H), -5.0),  # experts 2, 3 (expert parallel)
        "w13.up": torch.full((E, I, H), -5.0),  # the up halves of every expert (a middle dim)
        "w2.tp": torch.full((E, H, I // 2), -5.0),  # the second half of I (tensor parallel, row-parallel)
        "w2.padded": torch.full((E, H + 2, I + 3), -5.0),  # into a view with two strided dims
    }
    return e, [
        ("w13", e["w13.ep"], (0, E // 2, E // 2)),
        ("w13", e["w13.up"], (1, I, I)),
        ("w2", e["w2.tp"], (-1, I // 2, I // 2)),
        ("w2", e["w2.padded"][:, 1 : H + 1, 2 : 2 + I // 2], (2, 0, I // 2)),
    ]


def stacked_reference(sd: Engine, cfg: Moe) -> Engine:
    E, H, I = cfg.experts, cfg.hidden, cfg.inter
    padded = torch.full((E, H + 2, I + 3), -5.0)
    padded[:, 1 : H + 1, 2 : 2 + I // 2] = sd["w2"][:, :, : I // 2]
    return {
        "w13.ep": sd["w13"][E // 2 :],
        "w13.up": sd["w13"][:, I:],
        "w2.tp": sd["w2"][:, :, I // 2 :],
        "w2.padded": padded,
    }


def test_stacked_sources_sliced_along_any_dimension_arrive_bit_exact(layout_peer):
    cfg = Moe()
    job, endpoint = layout_peer(build_stacked_source, cfg)
    with streamer(endpoint, buffer_bytes=256) as st:  # rows of 64 and 128 bytes, chunks of 256
        for version in (1, 2):
            g = torch.Generator().manual_seed(version)
            state = {
                "w13": torch.randn(cfg.experts, 2 * cfg.inter, cfg.hidden, generator=g),
                "w2": torch.randn(cfg.experts, cfg.hidden, cfg.inter, generator=g),
            }
            st.refit(version, state)
            assert job.request("state") == state_bytes(stacked_reference(state, cfg)), f"version {version}"
    job.stop()


# ------------------------------------------------------------------------ strided destinations


def strided_engine() -> Engine:
    """Whole tensors prefilled with a pattern that no source holds (negative, distinct)."""

    def pattern(*shape):
        n = 1
        for d in shape:
            n *= d
        return -1.0 - torch.arange(n, dtype=torch.float32).reshape(shape)

    return {"big": pattern(6, 8), "wide": pattern(64, 256), "cube": pattern(4, 6, 8), "rows": pattern(10, 16)}


def build_strided() -> Tuple[Engine, List[Registration]]:
    e = strided_engine()
    return e, [
        ("patch", e["big"][:, 2:5], None),  # row stride 8, 3 columns
        ("cols", e["wide"][:, 100:200], None),  # rows of 400 bytes: split across 4 KiB chunks
        ("cols.sliced", e["wide"][:, 0:50], (1, 25, 50)),  # strided on both sides
        ("block", e["cube"][:, 1:4, 2:6], None),  # two strided dimensions
        ("even", e["rows"][0::2], None),  # interleaved rows: disjoint, both accepted
        ("odd", e["rows"][1::2], (0, 3, 5)),
    ]


def strided_state(version: int) -> Engine:
    g = torch.Generator().manual_seed(31 * version)
    return {
        "patch": torch.randn(6, 3, generator=g),
        "cols": torch.randn(64, 100, generator=g),
        "cols.sliced": torch.randn(64, 80, generator=g),
        "block": torch.randn(4, 3, 4, generator=g),
        "even": torch.randn(5, 16, generator=g),
        "odd": torch.randn(9, 16, generator=g),
    }


def strided_reference(sd: Engine) -> Engine:
    e = strided_engine()
    e["big"][:, 2:5] = sd["patch"]
    e["wide"][:, 100:200] = sd["cols"]
    e["wide"][:, 0:50] = sd["cols.sliced"][:, 25:75]
    e["cube"][:, 1:4, 2:6] = sd["block"]
    e["rows"][0::2] = sd["even"]
    e["rows"][1::2] = sd["odd"][3:8]
    return e


@pytest.mark.parametrize("buffer_bytes", [256, 4096, 1 << 20], ids=["256B", "4KiB", "1MiB"])
def test_strided_views_receive_their_source_and_every_other_byte_stays(layout_peer, buffer_bytes):
    job, endpoint = layout_peer(build_strided)
    assert job.request("state") == state_bytes(strided_engine())
    with streamer(endpoint, buffer_bytes=buffer_bytes) as st:
        for version in (1, 2):
            state = strided_state(version)
            st.refit(version, state)
            assert job.request("state") == state_bytes(strided_reference(state)), f"version {version}"
    job.stop()


def build_split() -> Tuple[Engine, List[Registration]]:
    """One fused source ``qkv`` [12, 8] split into three engine tensors (v into a strided view)."""
    e = {"q": torch.zeros(8, 8), "k": torch.zeros(2, 8), "kv_cache_like": torch.full((2, 16), -5.0)}
    return e, [
        ("qkv", e["q"], (0, 0, 8)),
        ("qkv", e["k"], (0, 8, 2)),
        ("qkv", e["kv_cache_like"][:, 4:12], (0, 10, 2)),
    ]


def test_one_source_split_across_several_destinations_arrives_whole(layout_peer):
    job, endpoint = layout_peer(build_split)
    with streamer(endpoint, buffer_bytes=256) as st:
        for version in (1, 2):
            src = torch.randn(12, 8, generator=torch.Generator().manual_seed(version))
            st.refit(version, {"qkv": src})
            expected = {"q": src[:8], "k": src[8:10], "kv_cache_like": torch.full((2, 16), -5.0)}
            expected["kv_cache_like"][:, 4:12] = src[10:]
            assert job.request("state") == state_bytes(expected)
    job.stop()


# ------------------------------------------------------------------------ registration errors


@pytest.fixture
def rx():
    with refit.Receiver() as r:
        yield r


def refused_registration(rx, name, view, source_slice=None, *names):
    """add_parameter raises RefitError(invalid_argument) naming ``names`` (default: ``name``). Names
    are looked for unquoted: check_view's messages start with the bare name (``w f32[5]: ...``), so
    the tests use names that cannot appear by accident."""
    with expect_refusal(refit.Errc.invalid_argument, *(names or (name,)), quoted=False) as failure:
        rx.add_parameter(name, view, source_slice=source_slice)
    return str(failure.value)


def test_a_view_outside_its_storage_is_refused(rx):
    base = torch.zeros(10)
    view = base[5:]
    base.storage().resize_(4)  # the view now reaches past its storage's end
    message = refused_registration(rx, "model.layers.0.w", view)
    assert "allocation" in message


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda t: t.narrow(0, 0, 10), lambda t: t.narrow(0, 8, 4)),  # rows 8, 9 shared
        (lambda t: t[:, 0:3], lambda t: t[:, 2:4]),  # column 2 of every row shared
        (lambda t: t[0::2], lambda t: t[2:3]),  # row 2 shared with an interleaved view
        (lambda t: t, lambda t: t[3:4, 5:6]),  # one element
    ],
    ids=["rows", "columns", "interleaved", "one-element"],
)
def test_overlapping_destinations_are_refused_naming_both(rx, first, second):
    qkv = torch.zeros(12, 8)
    rx.add_parameter("layers.0.q_proj", first(qkv))
    refused_registration(rx, "layers.0.k_proj", second(qkv), None, "'layers.0.k_proj'", "'layers.0.q_proj'")


def test_the_same_name_into_the_same_bytes_twice_is_refused(rx):
    w = torch.zeros(4, 8)
    rx.add_parameter("model.w", w)
    refused_registration(rx, "model.w", w)  # plain: already registered
    v = torch.zeros(4, 8)
    rx.add_parameter("model.v", v[:, 0:2])
    refused_registration(rx, "model.v", v[:, 1:3], (1, 0, 2))  # a strided one sharing a column


def test_adjacent_and_interleaved_views_are_accepted(rx):
    t = torch.zeros(12, 8)
    rx.add_parameter("a", t[0:4, 0:3])
    rx.add_parameter("b", t[0:4, 3:8])
    rx.add_parameter("c", t[4::2])
    rx.add_parameter("d", t[5::2])


@pytest.mark.parametrize("dim", [2, -3, 7])
def test_a_slice_dimension_outside_the_view_is_a_value_error_naming_the_tensor(rx, dim):
    with pytest.raises(ValueError) as failure:
        rx.add_parameter("model.o_proj", torch.zeros(4, 2), source_slice=(dim, 0, 2))
    assert "model.o_proj" in str(failure.value)


def test_a_negative_slice_start_is_refused(rx):
    refused_registration(rx, "model.o_proj", torch.zeros(4, 2), (1, -1, 2))


@pytest.mark.parametrize("length", [1, 3, 0])
def test_a_slice_length_other_than_the_views_size_is_refused(rx, length):
    refused_registration(rx, "model.o_proj", torch.zeros(8, 4)[:, 1:3], (-1, 0, length))


def test_a_name_registered_again_with_another_dtype_is_refused(rx):
    rx.add_parameter("model.embed", torch.zeros(10, 4))
    message = refused_registration(rx, "model.embed", torch.zeros(10, 4, dtype=torch.bfloat16))
    assert "bf16" in message


def test_a_view_that_overlaps_itself_is_refused(rx):
    refused_registration(rx, "model.broadcast", torch.zeros(1, 8).expand(4, 8))


def test_a_view_whose_last_dimension_is_not_dense_is_a_value_error_naming_it(rx):
    with pytest.raises(ValueError) as failure:
        rx.add_parameter("w.t", torch.zeros(4, 6).t())
    assert "w.t" in str(failure.value)


def register_with_refusals(chan):
    """Job: a table (qkv) plus one refused registration of each kind; sends the refusals' codes,
    then serves: the refused ones must have left no trace in the table."""
    qkv, other = torch.zeros(12, 8), torch.full((4, 8), -5.0)
    with refit.Receiver() as rx:
        rx.add_parameter("q", qkv.narrow(0, 0, 8))
        rx.add_parameter("kv", qkv.narrow(0, 8, 4))
        codes = []
        for name, view, sl in [
            ("x", qkv.narrow(0, 6, 4), None),  # overlaps q and kv
            ("q", other.to(torch.float64), None),  # another dtype
            ("kv", other, (0, -1, 4)),  # negative start
            ("kv", other, (0, 0, 3)),  # wrong length
        ]:
            try:
                rx.add_parameter(name, view, source_slice=sl)
                codes.append(None)
            except refit.RefitError as e:
                codes.append(int(e.code))
        chan.send(codes)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes({"qkv": qkv, "other": other})})


def test_refused_registrations_leave_the_table_as_it_was(peer):
    job = peer.run(register_with_refusals)
    assert job.recv() == [int(refit.Errc.invalid_argument)] * 4
    endpoint = job.recv()
    src = {"q": torch.randn(8, 8), "kv": torch.randn(4, 8)}
    with streamer(endpoint) as st:
        st.refit(1, src)  # "x" is not required: it was never registered
    expected = {"qkv": torch.cat([src["q"], src["kv"]]), "other": torch.full((4, 8), -5.0)}
    assert job.request("state") == state_bytes(expected)
    job.stop()


# ------------------------------------------------------------------------ refit-time misfits


H = 8


def build_misfit() -> Tuple[Engine, List[Registration]]:
    e = {"qkv": torch.zeros(12, H), "o_local": torch.zeros(H, 6), "embed": torch.zeros(10, H)}
    e["head"] = torch.zeros(5, H)
    return e, [
        ("q", e["qkv"].narrow(0, 0, 8), None),
        ("k", e["qkv"].narrow(0, 8, 2), None),
        ("v", e["qkv"].narrow(0, 10, 2), None),
        ("o", e["o_local"], (1, 6, 6)),  # columns 6..11 of o [H, 12]
        ("emb", e["embed"], None),
        ("emb", e["head"], (0, 5, 5)),  # tied, and a vocab shard
    ]


def misfit_state(version: int) -> Engine:
    g = torch.Generator().manual_seed(11 * version)
    return {
        "q": torch.randn(8, H, generator=g),
        "o": torch.randn(H, 12, generator=g),  # in the middle of the batch
        "k": torch.randn(2, H, generator=g),
        "v": torch.randn(2, H, generator=g),
        "emb": torch.randn(10, H, generator=g),
    }


def misfit_reference(sd: Engine) -> Engine:
    return {
        "qkv": torch.cat([sd["q"], sd["k"], sd["v"]]),
        "o_local": sd["o"][:, 6:12],
        "embed": sd["emb"],
        "head": sd["emb"][5:10],
    }


MISFITS = {
    "slice-past-the-end": ("o", lambda t: t[:, :11].contiguous()),  # 6 + 6 > 11
    "other-dim-differs": ("o", lambda t: torch.cat([t, t[:1]])),  # [H + 1, 12]
    "dtype-differs": ("o", lambda t: t.double()),
    "rank-differs": ("o", lambda t: t.reshape(-1)),
    "view-rows-differ": ("k", lambda t: torch.cat([t, t[:1]])),  # [3, H] into a 2-row view
    "tied-shard-past-the-end": ("emb", lambda t: t[:9].contiguous()),  # head takes rows 5..9
}


@pytest.mark.parametrize("misfit", list(MISFITS), ids=list(MISFITS))
def test_a_source_that_does_not_fit_its_view_fails_the_refit_and_writes_nothing(layout_peer, misfit):
    name, spoil = MISFITS[misfit]
    job, endpoint = layout_peer(build_misfit)
    with streamer(endpoint) as st:  # 1 MiB: the whole refit is one batch
        st.refit(1, misfit_state(1))
        before = job.request("state")
        assert before == state_bytes(misfit_reference(misfit_state(1)))

        bad = misfit_state(2)
        bad[name] = spoil(bad[name])
        with expect_refusal(refit.Errc.apply, name):
            st.refit(2, bad)
        assert job.request("state") == before  # not one byte, of any tensor of the batch
        status = job.request("status")
        assert (status["committed_version"], status["dirty"]) == (1, False)
        assert f"'{name}'" in status["last_error"]

        st.refit(2, misfit_state(2))
        assert job.request("state") == state_bytes(misfit_reference(misfit_state(2)))
        assert job.request("status")["committed_version"] == 2
    job.stop()


# ------------------------------------------------------------------------ missing destinations


@pytest.mark.parametrize("omitted", ["v", "emb"])
def test_a_registered_source_left_out_gives_incomplete_and_no_commit(layout_peer, omitted):
    job, endpoint = layout_peer(build_misfit)
    with streamer(endpoint) as st:
        st.refit(1, misfit_state(1))
        partial = {k: v for k, v in misfit_state(2).items() if k != omitted}
        with expect_refusal(refit.Errc.incomplete, omitted):
            st.refit(2, partial)
        status = job.request("status")
        assert (status["committed_version"], status["dirty"]) == (1, True)  # the others were written
        assert omitted in status["last_error"]
        st.refit(3, misfit_state(3))
        assert job.request("state") == state_bytes(misfit_reference(misfit_state(3)))
        assert (job.request("status")["committed_version"], job.request("status")["dirty"]) == (3, False)
    events = job.stop()
    assert events.count("committed") == 2
    assert "aborted" in events


# ------------------------------------------------------------------------ known defects


def serve_or_refuse(chan, build) -> Optional[List[str]]:
    """Job: like serve_layout, but a refused registration is reported, not raised: sends
    ("refused", code, message) and returns, or ("serving", endpoint) and serves."""
    engine, regs = build()
    with refit.Receiver() as rx:
        try:
            for name, view, source_slice in regs:
                rx.add_parameter(name, view, source_slice=source_slice)
        except refit.RefitError as e:
            chan.send(("refused", int(e.code), str(e)))
            return None
        chan.send(("serving", rx.endpoint))
        return serve_loop(rx, chan, {"state": lambda: state_bytes(engine)})


def build_huge_start() -> Tuple[Engine, List[Registration]]:
    o = torch.full((4, 2), -5.0)
    return {"o": o}, [("model.o_proj", o, (1, 2**63 - 1, 2))]


def test_a_slice_start_near_int64_max_is_refused_at_registration_or_at_refit(peer):
    job = peer.run(serve_or_refuse, build_huge_start)
    kind, *rest = job.recv()
    if kind == "refused":
        code, message = rest
        assert code == int(refit.Errc.invalid_argument) and "model.o_proj" in message
        assert job.result() is None
        return
    (endpoint,) = rest
    with streamer(endpoint) as st:
        with expect_refusal(refit.Errc.apply, "model.o_proj"):
            st.refit(1, {"model.o_proj": torch.randn(4, 6)})
    assert job.request("status")["committed_version"] is None
    job.stop()
