"""NVFP4 and the swizzled 128 x 4 scale layout through refit.Receiver / refit.Streamer over
host_shm, bit for bit against a reference computed here with numpy from NVIDIA's definition
(TensorRT-Model-Optimizer's NVFP4QTensor): scale_2 = amax / (6 * 448) in float32, block scale
e4m3((amax_block / 6) / scale_2) (1.0 for an all-zero block), elements e2m1(x / (f32(block
scale) * scale_2)) by nearest-value search with ties to the even code, saturating at 6, element 2k
in the low nibble. The swizzle is vLLM's ``swizzle_blockscale`` (pad, reshape, permute). Torch
1.13 (Debian) has neither float4_e2m1fn_x2 nor float8_e4m3fn: destinations are uint8, and the
checks against torch's own dtypes skip where torch lacks them.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import pytest
import torch

import refit
from conftest import need_gpus, serve_loop, streamer
from test_convert import e4m3, E4M3

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(y: np.ndarray) -> np.ndarray:
    """float32 array → e2m1 codes (0..15), nearest, ties to the even code, saturating; the sign
    is y's; NaN → 0."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y.astype(np.float64))
    d = np.abs(a[..., None] - E2M1)
    best = d.min(axis=-1, keepdims=True)
    ties = d == best
    even = ties & (np.arange(8) % 2 == 0)
    code = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    code = np.where(a > 6.0, 7, code)
    code = code | np.where(np.signbit(y), 8, 0)
    return np.where(np.isnan(y), 0, code).astype(np.uint8)


def quantise_nvfp4(x: torch.Tensor) -> Tuple[np.ndarray, np.ndarray, np.float32]:
    """x (2-d, cols even) → (packed [rows, cols / 2], e4m3 scales [rows, ceil(cols / 16)], scale_2)."""
    v = x.float().numpy()
    rows, cols = v.shape
    fin = np.where(np.isfinite(v), np.abs(v), np.float32(0))
    scale_2 = np.float32(fin.max(initial=0)) / np.float32(2688.0)
    nb = math.ceil(cols / 16)
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((rows, nb), np.uint8)
    for b in range(nb):
        blk = v[:, b * 16:(b + 1) * 16]
        amax = fin[:, b * 16:(b + 1) * 16].max(axis=1)
        per_block = (amax / np.float32(6.0)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(per_block == 0, np.uint8(0x38), e4m3((per_block / scale_2).astype(np.float32)))
        scales[:, b] = s
        d = (E4M3[s & 0x7F].astype(np.float32) * scale_2).astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = e2m1((blk / d).astype(np.float32))
        zero = np.where(np.isnan(blk), 0, np.where(np.signbit(blk), 8, 0)).astype(np.uint8)
        codes[:, b * 16:(b + 1) * 16] = np.where(d == 0, zero, q)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales, scale_2


def swizzle(s: np.ndarray) -> np.ndarray:
    """vLLM's swizzle_blockscale of a 2-d scale grid: pad to 128 x 4, (R/128, 4, 32, C/4, 4) →
    (R/128, C/4, 32, 4, 4)."""
    rows, cols = s.shape
    pr, pc = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    p = np.zeros((pr, pc), s.dtype)
    p[:rows, :cols] = s
    return p.reshape(pr // 128, 4, 32, pc // 4, 4).transpose(0, 3, 2, 1, 4).reshape(pr, pc)


def nvfp4_state(version: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + version)
    a = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 96), generator=g).float())
    a[3] = 0  # an all-zero row
    a[4, 0], a[4, 1], a[4, 2] = float("nan"), float("inf"), float("-inf")
    b = torch.randn(40, 72, generator=g) * torch.exp2(torch.randint(-8, 8, (40, 72), generator=g).float())
    b[0, 64:] = 0  # an all-zero short last block
    return {"w_nv": a.to(torch.bfloat16), "w_swz": b}


def serve_nvfp4(chan) -> None:
    dests = {
        "w_nv": torch.zeros(64, 48, dtype=torch.uint8),
        "w_nv.scale": torch.zeros(64, 6, dtype=torch.uint8),
        "w_nv.scale_2": torch.zeros(1),
        "w_swz": torch.zeros(40, 36, dtype=torch.uint8),
        "w_swz.scale": torch.zeros(128, 8, dtype=torch.uint8),
        "w_swz.scale_2": torch.zeros(1),
    }
    with refit.Receiver() as rx:
        rx.add_parameter("w_nv", dests["w_nv"], quant="nvfp4", scale=dests["w_nv.scale"],
                         scale_2=dests["w_nv.scale_2"])
        rx.add_parameter("w_swz", dests["w_swz"], quant="nvfp4", dtype="f4_e2m1x2", scale=dests["w_swz.scale"],
                         scale_2=dests["w_swz.scale_2"], scale_layout="swizzled")
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: {k: (v.data_ptr(), v.numpy().tobytes())
                                                        for k, v in dests.items()}})


def test_two_refits_write_nvfp4_weights_block_scales_and_scale_2_in_place_bit_for_bit(peer):
    job = peer.run(serve_nvfp4)
    endpoint = job.recv()
    with streamer(endpoint, buffer_bytes=16 << 10) as st:
        seen = []
        for version in (1, 2):
            state = nvfp4_state(version)
            stats = st.refit(version, state)
            assert stats.tensors == 6  # two weights, each with two scale tensors
            got = job.request("state")
            seen.append({k: p for k, (p, _) in got.items()})
            q, s, s2 = quantise_nvfp4(state["w_nv"])
            assert got["w_nv"][1] == q.tobytes()
            assert got["w_nv.scale"][1] == s.tobytes()
            assert got["w_nv.scale_2"][1] == np.float32(s2).tobytes()
            assert s[3, 0] == 0x38
            q, s, s2 = quantise_nvfp4(state["w_swz"])
            assert got["w_swz"][1] == q.tobytes()
            assert got["w_swz.scale"][1] == swizzle(s).tobytes()
            assert got["w_swz.scale_2"][1] == np.float32(s2).tobytes()
    job.stop()
    assert seen[0] == seen[1]  # the addresses never moved


def test_torch_float4_and_float8_destinations_register_where_torch_has_them():
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float4_e2m1fn_x2 (torch 2.8+) or float8_e4m3fn")
    with refit.Receiver() as rx:
        w = torch.zeros(64, 48, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        s = torch.zeros(64, 6, dtype=torch.float8_e4m3fn)
        rx.add_parameter("w", w, quant="nvfp4", scale=s, scale_2=torch.zeros(1))


def test_the_e4m3_block_scales_agree_with_torch_where_torch_has_float8():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn (torch 2.1+)")
    y = torch.tensor([0.0, 1.0, 447.9, 300.1, 2.0**-9, 3.3e-3])
    assert e4m3(y.numpy()).tolist() == y.to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def test_the_reference_rounds_e2m1_midpoints_to_even():
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, float("inf"), float("nan")], np.float32)
    assert e2m1(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 7, 0]


def test_nvfp4_registrations_check_both_scales_and_the_layout():
    with refit.Receiver() as rx:
        w = torch.zeros(64, 48, dtype=torch.uint8)
        s = torch.zeros(64, 6, dtype=torch.uint8)
        with pytest.raises(TypeError, match="'w': scale must be float8_e4m3fn \\(or its bytes as uint8\\) for "
                                            "quant 'nvfp4', not f32"):
            rx.add_parameter("w", w, quant="nvfp4", scale=torch.zeros(64, 6), scale_2=torch.zeros(1))
        with pytest.raises(TypeError, match="'w': scale_2 must be one float32 element"):
            rx.add_parameter("w", w, quant="nvfp4", scale=s, scale_2=torch.zeros(2))
        with pytest.raises(ValueError, match="'w': scale has 384 elements, but quant 'nvfp4' of this destination "
                                             r"needs 1024 \(scales of shape \[128, 8\]\)"):
            rx.add_parameter("w", w, quant="nvfp4", scale=s, scale_2=torch.zeros(1), scale_layout="swizzled")
        with pytest.raises(ValueError, match="'w': scale_layout must be 'row_major' or 'swizzled'"):
            rx.add_parameter("w", w, quant="nvfp4", scale=s, scale_2=torch.zeros(1), scale_layout="tiled")
        with pytest.raises(refit.RefitError, match="has no scale_2"):
            rx.add_parameter("w", w, quant="nvfp4", scale=s)
        rx.add_parameter("w", w, quant="nvfp4", scale=s, scale_2=torch.zeros(1))


def serve_nvfp4_gpu(chan) -> None:
    """Job: the same two NVFP4 weights on cuda:0 (uint8 tensors: no float4 dtype needed)."""
    torch.cuda.set_device(0)
    dests = {
        "w_nv": torch.zeros(64, 48, dtype=torch.uint8, device="cuda:0"),
        "w_nv.scale": torch.zeros(64, 6, dtype=torch.uint8, device="cuda:0"),
        "w_nv.scale_2": torch.zeros(1, device="cuda:0"),
        "w_swz": torch.zeros(40, 36, dtype=torch.uint8, device="cuda:0"),
        "w_swz.scale": torch.zeros(128, 8, dtype=torch.uint8, device="cuda:0"),
        "w_swz.scale_2": torch.zeros(1, device="cuda:0"),
    }
    with refit.Receiver(device=0) as rx:
        rx.add_parameter("w_nv", dests["w_nv"], quant="nvfp4", scale=dests["w_nv.scale"],
                         scale_2=dests["w_nv.scale_2"])
        rx.add_parameter("w_swz", dests["w_swz"], quant="nvfp4", scale=dests["w_swz.scale"],
                         scale_2=dests["w_swz.scale_2"], scale_layout="swizzled")
        chan.send(rx.endpoint)

        def state():
            torch.cuda.synchronize(0)
            return {k: v.cpu().numpy().tobytes() for k, v in dests.items()}

        return serve_loop(rx, chan, {"state": state})


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_cuda_ipc_writes_nvfp4_like_the_reference(peer, direct):
    need_gpus(1)
    torch.cuda.set_device(0)
    job = peer.run(serve_nvfp4_gpu)
    endpoint = job.recv()
    with streamer(endpoint, transport="cuda_ipc", device=0, direct=direct, buffer_bytes=16 << 10) as st:
        for version in (1, 2):
            state = nvfp4_state(version)
            st.refit(version, {k: v.to("cuda:0") for k, v in state.items()})
            got = job.request("state")
            q, s, s2 = quantise_nvfp4(state["w_nv"])
            assert got["w_nv"] == q.tobytes() and got["w_nv.scale"] == s.tobytes()
            assert got["w_nv.scale_2"] == np.float32(s2).tobytes()
            q, s, s2 = quantise_nvfp4(state["w_swz"])
            assert got["w_swz"] == q.tobytes() and got["w_swz.scale"] == swizzle(s).tobytes()
            assert got["w_swz.scale_2"] == np.float32(s2).tobytes()
    job.stop()
