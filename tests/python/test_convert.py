"""Conversion on the fly through refit.Receiver / refit.Streamer over host_shm: f8_e4m3
destinations quantised per 128 x 128 block and per tensor, a bf16 destination of an f32 source,
a tensor-parallel shard of a block-quantised weight, and the registration errors.

The reference is computed here with numpy and torch, independently of refit: amax per group in
float32 over finite values, clamped to 1e-4; multiplier 448 / amax as a true float32 division;
the product in float32; e4m3 by nearest-value search over the 127 finite codes (ties to even,
saturating at 448). Torch 1.13 (Debian) has no float8 dtype: destinations are uint8 tensors
registered with ``dtype="f8_e4m3"``.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import pytest
import torch

import refit
from conftest import serve_loop, streamer


# ------------------------------------------------------------------------------ the reference

def _e4m3_values() -> np.ndarray:
    vals = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_values()


def e4m3(y: np.ndarray) -> np.ndarray:
    """float32 array → e4m3fn codes (uint8), round to nearest even, saturating; NaN → 0x7F."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3, a), 1, len(E4M3) - 1)
    lo = hi - 1
    dlo = np.abs(a - E4M3[lo])
    dhi = np.abs(E4M3[hi] - a)
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= 448.0, 0x7E, code)
    code = code | np.where(np.signbit(y), 0x80, 0)
    code = np.where(np.isnan(y), 0x7F, code)
    return code.astype(np.uint8)


def quantise(x: torch.Tensor, per_block: bool) -> Tuple[np.ndarray, np.ndarray]:
    """x (any float dtype, 2-d) → (codes, scale_inv) as refit defines them."""
    v = x.float().numpy()
    rows, cols = v.shape
    a = np.abs(v)
    a = np.where(np.isfinite(a), a, np.float32(0))
    if per_block:
        br, bc = math.ceil(rows / 128), math.ceil(cols / 128)
        amax = np.zeros((br, bc), np.float32)
        for i in range(br):
            for j in range(bc):
                amax[i, j] = a[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].max(initial=0)
    else:
        amax = np.array([a.max(initial=0)], np.float32)
    amax = np.maximum(amax, np.float32(1e-4))
    mul = np.float32(448.0) / amax  # numpy: a true float32 division
    inv = amax / np.float32(448.0)
    if per_block:
        m = np.repeat(np.repeat(mul, 128, 0), 128, 1)[:rows, :cols]
    else:
        m = np.full_like(v, mul[0])
    return e4m3((v * m).astype(np.float32)), inv


def source_state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    block = torch.randn(300, 260, generator=g) * torch.exp2(torch.randint(-10, 10, (300, 260), generator=g).float())
    block[:128, 128:256] = 0  # an all-zero block: amax clamped
    block[129, 0] = float("nan")
    block[129, 1] = float("inf")
    block[130, 2] = float("-inf")
    block[5, 5] = 1e6  # beyond ±448 before scaling
    return {
        "w_block": block.to(torch.bfloat16),
        "w_tensor": torch.randn(64, 100, generator=g) * 3,
        "w_cast": torch.randn(1000, generator=g) * 1e3,
        "w_shard": torch.randn(256, 300, generator=g).to(torch.bfloat16),
        "w_plain": torch.randn(33, 7, generator=g).to(torch.bfloat16),
    }


# ------------------------------------------------------------------------------ the peer's job

def serve_converted(chan) -> None:
    """Job: a Receiver whose table converts; ``state`` answers every destination's bytes."""
    dests = {
        "w_block": torch.zeros(300, 260, dtype=torch.uint8),
        "w_block.scale": torch.zeros(3, 3),
        "w_tensor": torch.zeros(64, 100, dtype=torch.uint8),
        "w_tensor.scale": torch.zeros(1),
        "w_cast": torch.zeros(1000, dtype=torch.bfloat16),
        "w_shard": torch.zeros(256, 172, dtype=torch.uint8),
        "w_shard.scale": torch.zeros(2, 2),
        "w_plain": torch.zeros(33, 7, dtype=torch.bfloat16),
    }
    with refit.Receiver() as rx:
        rx.add_parameter("w_block", dests["w_block"], scale=dests["w_block.scale"], quant="block128", dtype="f8_e4m3")
        rx.add_parameter("w_tensor", dests["w_tensor"], scale=dests["w_tensor.scale"], quant="tensor",
                         dtype="f8_e4m3")
        rx.add_parameter("w_cast", dests["w_cast"])
        rx.add_parameter("w_shard", dests["w_shard"], source_slice=(1, 128, 172), scale=dests["w_shard.scale"],
                         quant="block128", dtype="f8_e4m3")
        rx.add_parameter("w_plain", dests["w_plain"])
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: {k: v.view(torch.uint8).numpy().tobytes() if v.dtype ==
                                                        torch.bfloat16 else v.numpy().tobytes()
                                                        for k, v in dests.items()}})


# ------------------------------------------------------------------------------ end to end

def test_a_refit_converts_into_fp8_block_tensor_shard_and_bf16_destinations_bit_for_bit(peer):
    job = peer.run(serve_converted)
    endpoint = job.recv()
    state = source_state()
    with streamer(endpoint, buffer_bytes=64 << 10) as st:  # w_block's 76 KiB of fp8 takes two batches
        stats = st.refit(1, state)
        assert stats.tensors == len(state) + 3  # three scale tensors
        got = job.request("state")
    job.stop()

    q, inv = quantise(state["w_block"], per_block=True)
    assert got["w_block"] == q.tobytes()
    assert got["w_block.scale"] == inv.tobytes()
    assert inv[0, 1] == np.float32(1e-4) / np.float32(448)
    q, inv = quantise(state["w_tensor"], per_block=False)
    assert got["w_tensor"] == q.tobytes()
    assert got["w_tensor.scale"] == inv.tobytes()
    assert got["w_cast"] == state["w_cast"].to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    q, inv = quantise(state["w_shard"], per_block=True)
    assert got["w_shard"] == np.ascontiguousarray(q[:, 128:]).tobytes()
    assert got["w_shard.scale"] == np.ascontiguousarray(inv[:, 1:]).tobytes()
    assert got["w_plain"] == state["w_plain"].view(torch.uint8).numpy().tobytes()


def test_the_reference_agrees_with_torch_on_the_e4m3_grid():
    # Codes of the values themselves, the midpoints between neighbours (ties) and beyond 448.
    vals = E4M3.astype(np.float32)
    assert (e4m3(vals) == np.arange(0x7F)).all()
    mids = ((E4M3[:-1] + E4M3[1:]) / 2).astype(np.float32)
    codes = e4m3(mids)
    assert all(c % 2 == 0 for c in codes)
    assert e4m3(np.array([500, -1e30, np.inf, np.nan], np.float32)).tolist() == [0x7E, 0xFE, 0x7E, 0x7F]


# ------------------------------------------------------------------------------ registration errors

def test_bad_conversion_registrations_raise_naming_the_tensor():
    with refit.Receiver() as rx:
        w = torch.zeros(256, 256, dtype=torch.uint8)
        s = torch.zeros(2, 2)
        with pytest.raises(ValueError, match="'w': quant must be 'tensor', 'block128', 'channel', 'mxfp8', 'nvfp4' or 'none', "
                                             "not 'blocks'"):
            rx.add_parameter("w", w, scale=s, quant="blocks", dtype="f8_e4m3")
        with pytest.raises(ValueError, match="'w': scale has 1 elements, but quant 'block128' of this destination "
                                             r"needs 4 \(scales of shape \[2, 2\]\)"):
            rx.add_parameter("w", w, scale=torch.zeros(1), quant="block128", dtype="f8_e4m3")
        with pytest.raises(TypeError, match="'w': scale must be float32, not f64"):
            rx.add_parameter("w", w, scale=s.double(), quant="block128", dtype="f8_e4m3")
        with pytest.raises(ValueError, match="dtype='bf16' has 2-byte elements, but the tensor's u8 has 1"):
            rx.add_parameter("w", w, dtype="bf16")
        with pytest.raises(refit.RefitError, match="asks for quant block128, which quantises to f8_e4m3") as e:
            rx.add_parameter("w", torch.zeros(256, 256, dtype=torch.bfloat16), scale=s, quant="block128")
        assert e.value.code == refit.Errc.invalid_argument
        with pytest.raises(refit.RefitError, match="is quantised \\(block128\\) but has no scale"):
            rx.add_parameter("w", w, quant="block128", dtype="f8_e4m3")
        with pytest.raises(refit.RefitError, match="has a scale but no quant"):
            rx.add_parameter("w", w, scale=s, dtype="f8_e4m3")
        with pytest.raises(refit.RefitError, match="must start on a block boundary .* starts at 64"):
            rx.add_parameter("w", w[:, :128], source_slice=(1, 64, 128), scale=torch.zeros(2, 1),
                             quant="block128", dtype="f8_e4m3")
        rx.add_parameter("w", w, scale=s, quant="block128", dtype="f8_e4m3")  # and the good one passes


# ------------------------------------------------------------------------------ per channel and MXFP8

def quantise_channel(x: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """x (2-d) → (codes, scale_inv [rows, 1]): one group per row, as block128's rule."""
    v = x.float().numpy()
    a = np.abs(v)
    a = np.where(np.isfinite(a), a, np.float32(0))
    amax = np.maximum(a.max(axis=1, keepdims=True, initial=0), np.float32(1e-4))
    mul = np.float32(448.0) / amax
    return e4m3((v * mul).astype(np.float32)), amax / np.float32(448.0)


def quantise_mxfp8(x: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """x (2-d) → (codes, E8M0 codes [rows, ceil(cols / 32)]): OCP MX v1.0, X = 2^(floor(log2(amax)) - 8)."""
    v = x.float().numpy().astype(np.float64)
    rows, cols = v.shape
    nb = math.ceil(cols / 32)
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((rows, nb), np.uint8)
    for r in range(rows):
        for b in range(nb):
            blk = v[r, b * 32:(b + 1) * 32]
            fin = np.abs(blk[np.isfinite(blk)])
            amax = fin.max(initial=0.0)
            e = 0 if amax == 0 else min(max(math.floor(math.log2(amax)) - 8 + 127, 0), 254)
            scales[r, b] = e
            codes[r, b * 32:(b + 1) * 32] = e4m3((blk / 2.0 ** (e - 127)).astype(np.float32))
    return codes, scales


def row_state(version: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + version)
    ch = torch.randn(64, 100, generator=g) * torch.exp2(torch.randint(-10, 10, (64, 100), generator=g).float())
    ch[3] = 0  # an all-zero row
    ch[4, 0], ch[4, 1] = float("nan"), float("inf")
    mx = torch.randn(48, 70, generator=g) * torch.exp2(torch.randint(-20, 20, (48, 70), generator=g).float())
    mx[0, 32:64] = 0  # an all-zero block
    mx[1, 0], mx[1, 2] = float("-inf"), float("nan")
    return {"w_ch": ch.to(torch.bfloat16), "w_mx": mx}


def serve_row_formats(chan) -> None:
    """Job: weights quantised per channel and as MXFP8 with their scales (uint8: torch 1.13 has no
    float8_e8m0fnu), registered once; ``state`` answers their bytes and addresses."""
    dests = {
        "w_ch": torch.zeros(64, 100, dtype=torch.uint8),
        "w_ch.scale": torch.zeros(64, 1),
        "w_mx": torch.zeros(48, 70, dtype=torch.uint8),
        "w_mx.scale": torch.zeros(48, 3, dtype=torch.uint8),
    }
    with refit.Receiver() as rx:
        rx.add_parameter("w_ch", dests["w_ch"], scale=dests["w_ch.scale"], quant="channel", dtype="f8_e4m3")
        rx.add_parameter("w_mx", dests["w_mx"], scale=dests["w_mx.scale"], quant="mxfp8", dtype="f8_e4m3")
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: {k: (v.data_ptr(), v.numpy().tobytes())
                                                        for k, v in dests.items()}})


def test_two_refits_write_per_channel_and_mxfp8_weights_and_scales_in_place_bit_for_bit(peer):
    job = peer.run(serve_row_formats)
    endpoint = job.recv()
    with streamer(endpoint, buffer_bytes=16 << 10) as st:
        seen = []
        for version in (1, 2):
            state = row_state(version)
            stats = st.refit(version, state)
            assert stats.tensors == 4  # two weights, two scale tensors
            got = job.request("state")
            seen.append({k: p for k, (p, _) in got.items()})
            q, inv = quantise_channel(state["w_ch"])
            assert got["w_ch"][1] == q.tobytes()
            assert got["w_ch.scale"][1] == inv.tobytes()
            assert inv[3, 0] == np.float32(1e-4) / np.float32(448)
            q, e = quantise_mxfp8(state["w_mx"])
            assert got["w_mx"][1] == q.tobytes()
            assert got["w_mx.scale"][1] == e.tobytes()
            assert e[0, 1] == 0
    job.stop()
    assert seen[0] == seen[1]  # the addresses never moved


def test_row_format_registrations_check_the_scale_dtype_and_size():
    with refit.Receiver() as rx:
        w = torch.zeros(64, 100, dtype=torch.uint8)
        with pytest.raises(TypeError, match="'w': scale must be float8_e8m0fnu \\(or its bytes as uint8\\) for "
                                            "quant 'mxfp8', not f32"):
            rx.add_parameter("w", w, scale=torch.zeros(64, 4), quant="mxfp8", dtype="f8_e4m3")
        with pytest.raises(TypeError, match="'w': scale must be float32, not u8"):
            rx.add_parameter("w", w, scale=torch.zeros(64, 1, dtype=torch.uint8), quant="channel", dtype="f8_e4m3")
        with pytest.raises(ValueError, match="'w': scale has 64 elements, but quant 'mxfp8' of this destination "
                                             r"needs 256 \(scales of shape \[64, 4\]\)"):
            rx.add_parameter("w", w, scale=torch.zeros(64, 1, dtype=torch.uint8), quant="mxfp8", dtype="f8_e4m3")
        rx.add_parameter("w", w, scale=torch.zeros(64, 4, dtype=torch.uint8), quant="mxfp8", dtype="f8_e4m3")
