"""refit.record: an engine's loader run once on metadata becomes a table of routes.

The engine is tests/python/engine_like.py (vLLM-style layers and load_weights). Each refit case
registers a recorded table in one spawned receiver per rank and streams over host_shm; every rank's
parameters must equal, bit for bit, what that rank's own ``load_weights`` makes of the same tensors
(run here on a fresh engine), and no parameter may have moved.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import pytest
import torch

import refit
from conftest import Peer, claim_nccl_host, serve_loop, state_bytes, streamer
from engine_like import LLAMA3_8B, Config, LlamaForCausalLM, Parallel, hf_spec, hf_state

BROKEN = "model.norm.weight"


def make_loader(engine: LlamaForCausalLM, broken: Optional[str]):
    """The engine's load_weights, except that ``broken`` is loaded through arithmetic (``* 1.0``)
    or a dtype round trip (``.to(float64)``): bit-exact, but nothing a route can express."""
    if broken is None:
        return engine.load_weights
    params = dict(engine.named_parameters())

    def load(weights):
        for name, w in weights:
            if name == BROKEN and broken == "mul":
                params[name].data.copy_(w * 1.0)
            elif name == BROKEN and broken == "to":
                params[name].data.copy_(w.to(torch.float64).to(torch.float32))
            else:
                engine.load_weights([(name, w)])

    return load


# ------------------------------------------------------------------------------ the peer's job


def serve_recorded(chan, cfg: Config, par: Parallel, broken: Optional[str] = None,
                   own_nccl_host: bool = False) -> List[str]:
    """Job: records the engine's loader, registers the table (with the fallback when something is
    unrecorded), sends (endpoint, needed names, unrecorded), serves. ``state``: the parameters;
    ``moved``: names of parameters whose data_ptr changed since before recording.
    ``own_nccl_host``: an NCCL rank on its streamer's GPU (conftest.claim_nccl_host)."""
    claim_nccl_host(own_nccl_host)
    engine = LlamaForCausalLM(cfg, par)
    params = dict(engine.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    loader = make_loader(engine, broken)
    table = refit.record(engine.named_parameters(), loader, hf_spec(cfg))
    with refit.Receiver(layout=table) as rx:  # a streamer recorded for another layout is refused at HELLO
        fallback = table.register(rx, engine.named_parameters(), allow_fallback=bool(table.unrecorded), loader=loader)
        if fallback:
            rx.on_commit(fallback)
        chan.send((rx.endpoint, table.needed(), dict(table.unrecorded)))
        return serve_loop(rx, chan, {
            "state": lambda: state_bytes(engine.named_parameters()),
            "moved": lambda: [n for n, p in params.items() if p.data_ptr() != ptrs[n]],
            "digest": table.digest,
        })


def reference(cfg: Config, par: Parallel, state: Dict[str, torch.Tensor]):
    """What the rank's own load_weights makes of ``state``, on a fresh engine."""
    engine = LlamaForCausalLM(cfg, par)
    engine.load_weights(state.items())
    return state_bytes(engine.named_parameters())


def refit_ranks(peers: List[Peer], cfg: Config, pars: List[Parallel], versions=(1, 2, 3), broken=None, only_needed=False,
                transport: str = "host_shm"):
    """Refits recorded engines, one per rank of ``pars``, each from a streamer of its own over
    ``transport`` (cuda_ipc: the engines' parameters and the trainer's tensors on the GPU, written
    directly; nccl: the same GPU, each engine a rank with an NCCL host of its own, its views applied
    from the buffers); compares every rank with what its own load_weights makes of the same tensors."""
    nccl = transport == "nccl"
    jobs = [p.run(serve_recorded, cfg, par, broken, nccl) for p, par in zip(peers, pars)]
    hellos = [job.recv() for job in jobs]
    # The trainer's side knows the table's digest (shipped with the table, as JSON): HELLO compares it.
    streamers = [streamer(None if nccl else endpoint, receivers=[endpoint] if nccl else None,
                          layout=job.request("digest"), transport=transport)
                 for job, (endpoint, _, _) in zip(jobs, hellos)]
    pars = [par._replace(device="cpu") for par in pars]  # the references are made on the CPU
    try:
        for version in versions:
            state = hf_state(cfg, version)
            sent = {n: t.cuda() for n, t in state.items()} if transport != "host_shm" else state
            sends = [{n: sent[n] for n in needed} if only_needed else sent for _, needed, _ in hellos]
            with ThreadPoolExecutor(len(streamers)) as pool:
                for f in [pool.submit(st.refit, version, s) for st, s in zip(streamers, sends)]:
                    f.result()
            for rank, (job, par) in enumerate(zip(jobs, pars)):
                assert job.request("state") == reference(cfg, par, state), f"rank {rank}, version {version}"
        for rank, job in enumerate(jobs):
            assert job.request("moved") == [], f"rank {rank}: parameters moved"
    finally:
        for st in streamers:
            st.close()
    for job in jobs:
        assert job.stop().count("committed") == len(versions)
    return hellos


# ------------------------------------------------------------------------------ refits


@pytest.mark.parametrize("tp, cfg", [
    (1, Config()),
    (2, Config(tie=True, qkv_bias=True)),
    (4, Config()),  # 2 kv heads on 4 ranks: replicated k/v, padded vocabulary rows on rank 3
    (2, Config(experts=4, qk_norm=True)),  # Qwen3-MoE: experts split by their intermediate dimension
], ids=["tp1", "tp2-tied-bias", "tp4", "tp2-moe-qk-norm"])
def test_recorded_tp_ranks_refit_bit_exact_like_their_own_load_weights(ranks, tp, cfg):
    pars = [Parallel(tp_rank=r, tp_size=tp) for r in range(tp)]
    hellos = refit_ranks(ranks(tp), cfg, pars)
    for _, needed, unrecorded in hellos:
        assert unrecorded == {}
        assert set(needed) == set(hf_spec(cfg))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_gpu(transport: str, nccl_ranks) -> None:
    """Before a GPU refit over ``transport``: over nccl the engines are on the streamer's GPU
    (cuda:0) whatever the GPUs, so each claims an NCCL host of its own (refit_ranks)."""
    if transport == "nccl":
        nccl_ranks(2)


@needs_cuda
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("tp, cfg", [
    (1, Config()),
    (2, Config(tie=True, qkv_bias=True)),
    (4, Config()),
], ids=["tp1", "tp2-tied-bias", "tp4"])
def test_recorded_tp_ranks_refit_bit_exact_on_the_gpu(ranks, nccl_ranks, tp, cfg, transport):
    """The same with the engines on the GPU: over cuda_ipc every recorded view written directly;
    over nccl each engine rank served by a streamer of its own, its views applied from the buffers."""
    on_gpu(transport, nccl_ranks)
    pars = [Parallel(tp_rank=r, tp_size=tp, device="cuda") for r in range(tp)]
    hellos = refit_ranks(ranks(tp), cfg, pars, transport=transport)
    for _, needed, unrecorded in hellos:
        assert unrecorded == {}
        assert set(needed) == set(hf_spec(cfg))


@needs_cuda
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_recorded_ep_ranks_get_only_their_experts_on_the_gpu(ranks, nccl_ranks, transport):
    on_gpu(transport, nccl_ranks)
    cfg = Config(experts=4)
    pars = [Parallel(ep_rank=r, ep_size=2, device="cuda") for r in range(2)]
    hellos = refit_ranks(ranks(2), cfg, pars, versions=(1, 2), only_needed=True, transport=transport)
    for rank, (_, needed, _) in enumerate(hellos):
        experts = {n.split(".experts.")[1].split(".")[0] for n in needed if ".experts." in n}
        assert experts == {str(2 * rank), str(2 * rank + 1)}, needed


def test_recorded_ep_ranks_get_only_their_experts(ranks):
    cfg = Config(experts=4)
    pars = [Parallel(ep_rank=r, ep_size=2) for r in range(2)]
    hellos = refit_ranks(ranks(2), cfg, pars, versions=(1, 2), only_needed=True)
    for rank, (_, needed, unrecorded) in enumerate(hellos):
        assert unrecorded == {}
        experts = {n.split(".experts.")[1].split(".")[0] for n in needed if ".experts." in n}
        assert experts == {str(2 * rank), str(2 * rank + 1)}, needed


@pytest.mark.parametrize("broken", ["mul", "to"])
def test_an_unrecordable_source_is_loaded_by_the_fallback_after_commit(ranks, broken):
    cfg = Config()
    hellos = refit_ranks(ranks(1), cfg, [Parallel()], versions=(1, 2), broken=broken)
    (_, needed, unrecorded), = hellos
    assert list(unrecorded) == [BROKEN]
    assert BROKEN in needed


def test_a_trainer_with_another_layout_digest_is_refused_before_any_byte_moves(ranks):
    cfg = Config()
    (peer,) = ranks(1)
    job = peer.run(serve_recorded, cfg, Parallel())
    endpoint, _, _ = job.recv()
    digest = job.request("digest")
    state = hf_state(cfg, 1)
    with streamer(endpoint, layout="0" * len(digest)) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, state)
    assert failure.value.code == refit.Errc.invalid_argument
    assert "engine layout mismatch" in str(failure.value) and digest in str(failure.value)
    assert job.request("status")["committed_version"] is None
    with streamer(endpoint, layout=digest) as st:
        st.refit(1, state)
    assert job.request("state") == reference(cfg, Parallel(), state)
    assert job.stop().count("committed") == 1


# ------------------------------------------------------------------------------ recording


def test_an_unrecordable_step_marks_exactly_that_source_with_a_reason():
    cfg = Config()
    for broken, words in (("mul", "mul"), ("to", "float64")):
        engine = LlamaForCausalLM(cfg)
        table = refit.record(engine.named_parameters(), make_loader(engine, broken), hf_spec(cfg))
        assert list(table.unrecorded) == [BROKEN], table.unrecorded
        assert words in table.unrecorded[BROKEN]
        assert all(table.entries[n] for n in hf_spec(cfg) if n != BROKEN)
        with refit.Receiver() as rx:
            with pytest.raises(ValueError) as failure:
                table.register(rx, engine.named_parameters())
        assert BROKEN in str(failure.value) and words in str(failure.value)


def record_one(param_shape, source_shape, load):
    """Records ``load(param, w)`` for one parameter and one source 'w'."""
    p = torch.nn.Parameter(torch.zeros(param_shape), requires_grad=False)

    def loader(weights):
        for _, w in weights:
            load(p, w)

    return refit.record({"p": p}, loader, {"w": (torch.float32, source_shape)})


RECORDABLE = {
    "narrow-rows": ((2, 8), (6, 8), lambda p, w: p.data.copy_(w.narrow(0, 2, 2)), (0, 2, 2)),
    "columns": ((4, 3), (4, 9), lambda p, w: p.copy_(w[:, 3:6]), (1, 3, 3)),
    "chunk": ((4, 8), (8, 8), lambda p, w: p.data.copy_(w.chunk(2)[1]), (0, 4, 4)),
    "split-then-view": ((16,), (4, 8), lambda p, w: p.copy_(w.split(2)[0].reshape(-1)), (0, 0, 2)),
    "transposed-back": ((3, 8), (3, 8), lambda p, w: p.copy_(w.t().contiguous().t()), None),
    "setitem-into-view": ((4, 8), (2, 8), lambda p, w: p.__setitem__(slice(1, 3), w), None),
    "select-expert": ((2, 4, 8), (4, 8), lambda p, w: p.data[1].copy_(w), None),
    "to-same-dtype": ((4, 8), (4, 8), lambda p, w: p.data.copy_(w.to(torch.float32)), None),
}


@pytest.mark.parametrize("case", list(RECORDABLE), ids=list(RECORDABLE))
def test_views_of_a_source_copied_into_a_parameter_are_recorded(case):
    pshape, sshape, load, source_slice = RECORDABLE[case]
    table = record_one(pshape, sshape, load)
    assert table.unrecorded == {}
    (route,) = table.entries["w"]
    assert route.source_slice == (None if source_slice is None else tuple(source_slice))
    # the route does what the loader does, on real tensors
    w = torch.randn(sshape)
    expected, got = torch.zeros(pshape), torch.zeros(pshape)
    load(expected, w)
    src = w if route.source_slice is None else w.narrow(*route.source_slice)
    got.as_strided(route.shape, route.stride, route.offset).copy_(src)
    assert torch.equal(got, expected)


UNRECORDABLE = {
    "transposed": ((8, 3), (3, 8), lambda p, w: p.copy_(w.t()), "transposed"),
    "item": ((1,), (1,), lambda p, w: p.data.fill_(w.item()), "item"),
    "tolist": ((2,), (2,), lambda p, w: p.data.copy_(torch.tensor(w.tolist())), "tolist"),
    "float64": ((4,), (4,), lambda p, w: p.data.copy_(w.double()), "float64"),
    "arithmetic": ((4,), (4,), lambda p, w: p.data.copy_(w + 1), "add"),
    "two-narrows": ((4,), (4, 4), lambda p, w: p.copy_(w[1:3, 1:3].reshape(-1)), "copy"),
    "written-twice": ((4,), (8,), lambda p, w: (p.copy_(w[:4]), p.copy_(w[4:])), "same bytes"),
    "into-a-temporary": ((4,), (4,), lambda p, w: torch.zeros(4).copy_(w), "not a parameter"),
    "scaled-after": ((4,), (4,), lambda p, w: (p.copy_(w), p.mul_(2)), "mul_"),
    "advanced-index": ((4,), (4,), lambda p, w: p.copy_(w[[0, 1, 2, 3]]), "not a view"),
    "raises": ((4,), (4,), lambda p, w: (p.copy_(w), {}["missing"]), "raised KeyError"),
}


@pytest.mark.parametrize("case", list(UNRECORDABLE), ids=list(UNRECORDABLE))
def test_what_a_copy_cannot_express_marks_the_source_unrecorded_without_raising(case):
    pshape, sshape, load, words = UNRECORDABLE[case]
    table = record_one(pshape, sshape, load)
    assert list(table.unrecorded) == ["w"]
    assert words in table.unrecorded["w"], table.unrecorded["w"]
    assert table.entries["w"] == []


def test_recording_never_writes_a_parameter():
    engine = LlamaForCausalLM(Config())
    for p in engine.parameters():
        p.data.fill_(3.0)
    before = state_bytes(engine.named_parameters())
    refit.record(engine.named_parameters(), engine.load_weights, hf_spec(Config()))
    assert state_bytes(engine.named_parameters()) == before


# ------------------------------------------------------------------------------ the table


def test_a_table_survives_json_and_its_digest_follows_its_content():
    cfg = Config(experts=4, qkv_bias=True)
    engine = LlamaForCausalLM(cfg, Parallel(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2))
    table = refit.record(engine.named_parameters(), engine.load_weights, hf_spec(cfg))
    again = refit.RouteTable.from_json(table.to_json())
    assert again == table and again.digest() == table.digest()
    assert again.entries == table.entries and again.unrecorded == table.unrecorded
    assert len(table.digest()) == 64

    obj = json.loads(table.to_json())
    name = "model.layers.1.self_attn.o_proj.weight"
    obj["entries"][name][0]["source_slice"][1] += 1
    changed = refit.RouteTable.from_json(json.dumps(obj))
    assert changed != table and changed.digest() != table.digest()
    with pytest.raises(ValueError):
        refit.RouteTable.from_json(json.dumps({"format": "something else"}))


def test_register_refuses_parameters_of_another_layout():
    cfg = Config()
    engine = LlamaForCausalLM(cfg, Parallel(tp_size=2))
    table = refit.record(engine.named_parameters(), engine.load_weights, hf_spec(cfg))
    with refit.Receiver() as rx:
        with pytest.raises(ValueError, match="recorded for"):
            table.register(rx, LlamaForCausalLM(cfg, Parallel(tp_size=1)).named_parameters())


def test_recording_llama3_8b_metadata_on_the_meta_device_is_fast():
    cfg = LLAMA3_8B
    engine = LlamaForCausalLM(cfg, Parallel(tp_rank=1, tp_size=2, device="meta"))
    spec = hf_spec(cfg)
    assert len(spec) == 291
    start = time.perf_counter()
    table = refit.record(engine.named_parameters(), engine.load_weights, spec)
    seconds = time.perf_counter() - start
    print(f"recorded llama3-8b tp2 rank 1: {len(spec)} tensors in {seconds * 1e3:.1f} ms")
    assert table.unrecorded == {}
    assert sum(len(r) for r in table.entries.values()) == 291
    assert table.entries["model.layers.0.self_attn.o_proj.weight"][0].source_slice == (1, 2048, 2048)
    assert seconds < 5.0
