"""Conversion on the fly on the GPU (skipped without CUDA or without torch.float8_e4m3fn):
bf16/f32 sources into float8_e4m3fn destinations (block128, a TP column shard, per tensor) and a
bf16 destination of an f32 source, over cuda_ipc (direct: the fused kernel; staged) and nccl
(buffered and in place; the receiver on a second GPU, or on the streamer's where it is the only
one: see conftest.nccl_ranks), compared bit for bit with torch's own conversion after the same
scaling: ``(x.float() * (448 / amax)).to(torch.float8_e4m3fn)``, ``scale_inv = amax / 448``.

The reference divides tensor by tensor (true float32 division), as refit::quant defines it: torch
evaluates ``448.0 / amax`` (a Python number over a tensor) as ``amax.reciprocal() * 448``, which
differs in the last bit for about a quarter of amax values, and on CUDA ``amax / 448.0`` as
``amax * (1 / 448)``. The data is finite (NaN and inf are refit's own rule, tested on the CPU).
"""

import math
import os

import pytest
import torch

import refit
from conftest import claim_nccl_host, need_gpus, rank_gpu, serve_loop, streamer

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8_e4m3fn")


def quantise(x: torch.Tensor, per_block: bool):
    """Codes (uint8 view) and scale_inv of x (2-d), with torch's conversion."""
    rows, cols = x.shape
    v = x.float()
    if per_block:
        br, bc = math.ceil(rows / 128), math.ceil(cols / 128)
        padded = torch.zeros(br * 128, bc * 128, device=x.device)
        padded[:rows, :cols] = v.abs()
        amax = padded.view(br, 128, bc, 128).amax(dim=(1, 3)).clamp(min=1e-4)
        mul = torch.full_like(amax, 448.0) / amax
        m = mul.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    else:
        amax = v.abs().amax().clamp(min=1e-4).reshape(1)
        mul = torch.full_like(amax, 448.0) / amax
        m = mul
    q = (v * m).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, amax / torch.full_like(amax, 448.0)


def sources(device):
    g = torch.Generator(device="cpu").manual_seed(13)
    block = torch.randn(300, 260, generator=g) * torch.exp2(torch.randint(-8, 8, (300, 260), generator=g).float())
    block[:128, 128:256] = 0
    block[5, 5] = 1e6
    return {
        "w_block": block.to(torch.bfloat16).to(device),
        "w_shard": torch.randn(256, 300, generator=g).to(torch.bfloat16).to(device),
        "w_tensor": (torch.randn(64, 100, generator=g) * 3).to(device),
        "w_cast": (torch.randn(1000, generator=g) * 1e3).to(device),
        "w_big": torch.randn(2048, 4096, generator=g).to(torch.bfloat16).to(device),
    }


def serve_fp8(chan, device: int, nccl: bool, shared: bool = False, names=None):
    """Job: float8 destinations on ``device`` (those of ``names``, default all); ``state``
    answers their bytes. ``shared``: what nccl_ranks() returned (a host of this peer's own)."""
    if nccl:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    claim_nccl_host(nccl and shared)
    torch.cuda.set_device(device)
    d = f"cuda:{device}"
    f8 = torch.float8_e4m3fn
    dests = {
        "w_block": torch.zeros(300, 260, dtype=f8, device=d),
        "w_block.scale": torch.zeros(3, 3, device=d),
        "w_shard": torch.zeros(256, 172, dtype=f8, device=d),
        "w_shard.scale": torch.zeros(2, 2, device=d),
        "w_tensor": torch.zeros(64, 100, dtype=f8, device=d),
        "w_tensor.scale": torch.zeros(1, device=d),
        "w_cast": torch.zeros(1000, dtype=torch.bfloat16, device=d),
        "w_big": torch.zeros(2048, 4096, dtype=f8, device=d),
        "w_big.scale": torch.zeros(16, 32, device=d),
    }
    regs = {
        "w_block": lambda rx: rx.add_parameter("w_block", dests["w_block"], scale=dests["w_block.scale"],
                                               quant="block128"),
        "w_shard": lambda rx: rx.add_parameter("w_shard", dests["w_shard"], source_slice=(1, 128, 172),
                                               scale=dests["w_shard.scale"], quant="block128"),
        "w_tensor": lambda rx: rx.add_parameter("w_tensor", dests["w_tensor"], scale=dests["w_tensor.scale"],
                                                quant="tensor"),
        "w_cast": lambda rx: rx.add_parameter("w_cast", dests["w_cast"]),
        "w_big": lambda rx: rx.add_parameter("w_big", dests["w_big"], scale=dests["w_big.scale"], quant="block128"),
    }
    with refit.Receiver(device=device) as rx:
        for name in names or regs:
            regs[name](rx)
        chan.send(rx.endpoint)

        def state():
            torch.cuda.synchronize(device)
            return {k: (v.view(torch.uint8) if v.dtype in (f8, torch.bfloat16) else v).cpu() for k, v in dests.items()}

        return serve_loop(rx, chan, {"state": state})


def check(got, src):
    if "w_block" in src:
        q, inv = quantise(src["w_block"], True)
        assert torch.equal(got["w_block"], q.cpu())
        assert torch.equal(got["w_block.scale"], inv.cpu())
    if "w_shard" in src:
        q, inv = quantise(src["w_shard"], True)
        assert torch.equal(got["w_shard"], q[:, 128:].cpu())
        assert torch.equal(got["w_shard.scale"], inv[:, 1:].cpu())
    if "w_tensor" in src:
        q, inv = quantise(src["w_tensor"], False)
        assert torch.equal(got["w_tensor"], q.cpu())
        assert torch.equal(got["w_tensor.scale"], inv.cpu())
    if "w_cast" in src:
        assert torch.equal(got["w_cast"], src["w_cast"].to(torch.bfloat16).view(torch.uint8).cpu())
    if "w_big" in src:
        q, inv = quantise(src["w_big"], True)
        assert torch.equal(got["w_big"], q.cpu())
        assert torch.equal(got["w_big.scale"], inv.cpu())


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_cuda_ipc_converts_like_torch(peer, direct):
    need_gpus(1)
    torch.cuda.set_device(0)
    job = peer.run(serve_fp8, 0, False)
    endpoint = job.recv()
    src = sources("cuda:0")
    with streamer(endpoint, transport="cuda_ipc", device=0, direct=direct, buffer_bytes=1 << 20) as st:
        for version in (1, 2):
            stats = st.refit(version, src)
            assert stats.direct is direct
            check(job.request("state"), src)
    job.stop()


def test_nccl_buffered_sends_converted_bytes_like_torch(peer, nccl_ranks):
    shared = nccl_ranks(2)
    torch.cuda.set_device(0)
    job = peer.run(serve_fp8, rank_gpu(1), True, shared)
    endpoint = job.recv()
    src = sources("cuda:0")
    with streamer(None, transport="nccl", receivers=[endpoint], device=0, direct=False, buffer_bytes=1 << 20) as st:
        stats = st.refit(1, src)
        # What crossed the link: fp8 codes and f32 scales, not the bf16/f32 sources.
        converted = 300 * 260 + 256 * 300 + 64 * 100 + 2 * 1000 + 2048 * 4096 + 4 * (9 + 6 + 1 + 512)
        assert stats.bytes == converted
        check(job.request("state"), src)
    job.stop()


def test_nccl_in_place_converts_into_staging_buffers_and_receives_in_place(peer, nccl_ranks):
    shared = nccl_ranks(2)
    torch.cuda.set_device(0)
    names = ["w_block", "w_tensor", "w_cast", "w_big"]  # plain destinations: received in place
    job = peer.run(serve_fp8, rank_gpu(1), True, shared, names)
    endpoint = job.recv()
    src = {k: v for k, v in sources("cuda:0").items() if k in names}
    with streamer(None, transport="nccl", receivers=[endpoint], device=0, direct=True) as st:
        for version in (1, 2):
            stats = st.refit(version, src)
            assert stats.direct is True  # in place: the converted bytes leave from staging buffers
            check(job.request("state"), src)
    job.stop()


@pytest.mark.parametrize("direct", [True, False])
def test_nccl_with_a_shard_destination_converts_and_sends_only_its_part(peer, nccl_ranks, direct):
    shared = nccl_ranks(2)
    torch.cuda.set_device(0)
    job = peer.run(serve_fp8, rank_gpu(1), True, shared)  # w_shard takes columns 128..299 of its source
    endpoint = job.recv()
    src = sources("cuda:0")
    with streamer(None, transport="nccl", receivers=[endpoint], device=0, direct=direct) as st:
        for version in (1, 2):
            stats = st.refit(version, src)
            # In place, every destination one dense range: the receiver is sent only what it takes,
            # converted (the shard's columns gathered from the converted tensor, its scales' too).
            # Buffered: whole tensors broadcast, the views applied on the receiver.
            assert stats.direct is direct
            if direct:
                dests = {"w_block": (300 * 260, 3 * 3), "w_shard": (256 * 172, 2 * 2), "w_tensor": (64 * 100, 1),
                         "w_big": (2048 * 4096, 16 * 32)}
                want = sum(codes + 4 * scales for codes, scales in dests.values()) + 1000 * 2  # w_cast: bf16
                assert stats.parts_bytes == want
            else:
                assert stats.parts_bytes == 0
            check(job.request("state"), src)
    job.stop()
