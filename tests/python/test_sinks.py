"""Callback sinks: on_tensor (whole tensors, chunks reassembled) and on_batch (views)."""

import pytest
import torch

import refit
from conftest import mixed_state, serve_loop, state_bytes, streamer, tensor_bytes


class BadWeights(Exception):
    """Raised by an engine's load_weights in these tests."""


def big_state(version: int):
    """A 1 MiB tensor and others, through 64 KiB buffers: several are chunked."""
    g = torch.Generator().manual_seed(version)
    state = {
        "first": torch.randn(5, generator=g),
        "big": torch.randn(512, 512, generator=g),  # 1 MiB
        "big.bf16": torch.randn(300, 701, generator=g).to(torch.bfloat16),  # 420,600 bytes
        "ids": torch.randint(-(2**62), 2**62, (9000,), generator=g),  # 72,000 bytes: just over a buffer
    }
    state.update(mixed_state(version))
    return state


# ------------------------------------------------------------------------- peer jobs


def collect_tensors(chan, fail_on=None):
    """on_tensor sink: keeps (name, tensor_bytes) of every call. Commands: ``take`` (and clear),
    ``arm name`` (the next call for that name raises BadWeights)."""
    got = []
    armed = set()
    with refit.Receiver() as rx:

        @rx.on_tensor
        def load_weights(name, tensor):
            if name in armed:
                armed.discard(name)
                raise BadWeights(f"scale of {name!r} is negative")
            assert isinstance(tensor, torch.Tensor)
            got.append((name, tensor_bytes(tensor)))

        def take():
            out = list(got)
            got.clear()
            return out

        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"take": take, "arm": armed.add})


def describe_views(chan):
    """on_batch sink: records every view's fields and bytes; keeps one view past its call.
    Commands: ``take``; ``stale`` (what reading the kept view's tensor raises)."""
    batches = []
    kept = []
    armed = []
    with refit.Receiver() as rx:

        @rx.on_batch
        def apply(views):
            if armed:
                armed.clear()
                raise BadWeights("the batch callback refused this batch")
            assert isinstance(views, list)
            batch = []
            for v in views:
                t = v.tensor
                assert isinstance(t, torch.Tensor)
                if v.whole:
                    assert t.dtype == v.dtype and tuple(t.shape) == v.shape, v
                else:  # a chunk: flat bytes
                    assert t.dtype == torch.uint8 and tuple(t.shape) == (v.nbytes,), v
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if v.nbytes else b""
                batch.append(
                    dict(name=v.name, offset=v.offset, nbytes=v.nbytes, total=v.total, whole=v.whole,
                         last=v.last, shape=tuple(v.shape), dtype=str(v.dtype), raw=raw)
                )
            kept[:] = [views[0]]
            batches.append(batch)

        def stale():
            try:
                kept[0].tensor
            except Exception as e:  # noqa: BLE001 - the test reads it
                return type(e).__name__, str(e)
            return None

        def take():
            out = list(batches)
            batches.clear()
            return out

        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"take": take, "stale": stale, "arm": lambda: armed.append(1)})


# ----------------------------------------------------------------------------- tests


def test_on_tensor_gets_every_tensor_once_with_chunks_reassembled(peer):
    job = peer.run(collect_tensors)
    endpoint = job.recv()
    with streamer(endpoint, buffer_bytes=64 << 10) as st:
        for version in (1, 2):
            state = big_state(version)
            stats = st.refit(version, state)
            assert stats.batches > (1 << 20) // (64 << 10)  # the 1 MiB tensor was chunked
            got = job.request("take")
            names = [name for name, _ in got]
            assert sorted(names) == sorted(state), "each tensor exactly once"
            assert dict(got) == state_bytes(state)  # dtype, shape and bytes
    assert job.request("status")["committed_version"] == 2
    job.stop()


def test_on_batch_views_describe_whole_tensors_and_chunks(peer):
    job = peer.run(describe_views)
    endpoint = job.recv()
    state = big_state(3)
    with streamer(endpoint, buffer_bytes=64 << 10) as st:
        stats = st.refit(3, state)
    batches = job.request("take")
    assert len(batches) == stats.batches
    views = [v for batch in batches for v in batch]
    for name, (dtype, shape, raw) in state_bytes(state).items():
        parts = [v for v in views if v["name"] == name]
        assert parts, name
        for v in parts:
            assert v["total"] == len(raw) and v["shape"] == shape and v["dtype"] == dtype, v
        offsets = [v["offset"] for v in parts]
        assert offsets == sorted(offsets) and offsets[0] == 0, name
        assert b"".join(v["raw"] for v in parts) == raw, name
        for a, b in zip(parts, parts[1:]):
            assert a["offset"] + a["nbytes"] == b["offset"], f"{name}: a gap or overlap between chunks"
        assert [v["last"] for v in parts] == [False] * (len(parts) - 1) + [True], name
        assert all(v["whole"] == (len(parts) == 1) for v in parts), name
    chunked = {v["name"] for v in views if not v["whole"]}
    assert {"big", "big.bf16", "ids"} <= chunked
    assert "first" not in chunked
    job.stop()


def test_a_view_used_after_its_call_raises_runtime_error(peer):
    job = peer.run(describe_views)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, {"w": torch.ones(8)})
    kind, message = job.request("stale")
    assert kind == "RuntimeError"
    assert "'w'" in message and "after" in message
    job.stop()


@pytest.mark.parametrize("sink", [collect_tensors, describe_views], ids=["on_tensor", "on_batch"])
def test_an_exception_in_a_callback_aborts_the_refit_and_the_receiver_keeps_serving(peer, sink):
    job = peer.run(sink)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, {"w": torch.ones(4), "b": torch.zeros(2)})
        job.request("take")
        if sink is collect_tensors:
            job.request("arm", "b")
            expected = "scale of 'b' is negative"
        else:
            job.request("arm")
            expected = "the batch callback refused this batch"
        with pytest.raises(refit.RefitError) as failure:
            st.refit(2, {"w": torch.full((4,), 2.0), "b": torch.ones(2)})
        assert failure.value.code == refit.Errc.apply
        assert "BadWeights" in str(failure.value)
        assert expected in str(failure.value)
        status = job.request("status")
        assert status["committed_version"] == 1
        assert expected in status["last_error"]
        job.request("take")

        st.refit(3, {"w": torch.full((4,), 3.0), "b": torch.full((2,), 3.0)})
        assert job.request("status")["committed_version"] == 3
    events = job.stop()
    assert events.count("aborted") == 1 and events.count("committed") == 2
