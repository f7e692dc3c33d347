"""Receiver hooks: on_begin(version), on_commit(version), on_abort(version, reason)."""

import pytest
import torch

import refit
from conftest import serve_loop, streamer

NAME = "model.layers.0.self_attn.o_proj.weight"


def state(version: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(version)
    return {NAME: torch.randn(64, 64, generator=g).to(dtype), "model.norm.weight": torch.randn(64, generator=g)}


def record_hooks(chan, sink: str):
    """Job: a receiver (``table`` or ``on_batch`` sink) whose hooks record what they see.
    Commands: ``take`` (the records, cleared), ``refuse v`` (on_begin raises for version v),
    ``drop`` (removes the three hooks with None)."""
    records = []
    refused = set()
    with refit.Receiver() as rx:
        if sink == "table":
            rx.add_parameters({name: torch.zeros_like(t) for name, t in state(0).items()})
        else:

            @rx.on_batch
            def apply(views):
                records.append(("batch", sorted({v.name for v in views})))

        @rx.on_begin
        def begin(version):
            if version in refused:
                raise PermissionError(f"generation is busy, version {version} must wait")
            records.append(("begin", version))

        @rx.on_commit
        def commit(version):
            records.append(("commit", version, rx.committed_version))

        @rx.on_abort
        def abort(version, reason):
            records.append(("abort", version, reason))

        assert callable(begin) and callable(commit) and callable(abort)  # the decorators return fn

        def take():
            out = list(records)
            records.clear()
            return out

        def drop():
            assert rx.on_begin(None) is None
            rx.on_commit(None)
            rx.on_abort(None)

        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"take": take, "refuse": refused.add, "drop": drop})


def test_hooks_run_begin_then_commit_for_every_version_and_begin_then_abort_for_a_refused_one(peer):
    job = peer.run(record_hooks, "table")
    endpoint = job.recv()
    with streamer(endpoint) as st:
        for version in (1, 2, 3):
            st.refit(version, state(version))
        assert job.request("take") == [
            ("begin", 1), ("commit", 1, 1),
            ("begin", 2), ("commit", 2, 2),
            ("begin", 3), ("commit", 3, 3),
        ]
        with pytest.raises(refit.RefitError) as failure:
            st.refit(4, state(4, dtype=torch.float64))
        assert failure.value.code == refit.Errc.apply
        records = job.request("take")
        assert [r[:2] for r in records] == [("begin", 4), ("abort", 4)]
        assert NAME in records[1][2]  # the reason names the tensor
        assert job.request("status")["committed_version"] == 3

        job.request("drop")
        st.refit(5, state(5))
        assert job.request("take") == []  # removed hooks are not called
        assert job.request("status")["committed_version"] == 5
    job.stop()


def test_hooks_surround_the_batches_of_a_callback_sink(peer):
    job = peer.run(record_hooks, "on_batch")
    endpoint = job.recv()
    with streamer(endpoint, buffer_bytes=4 << 10) as st:  # 16 KiB tensor: several batches
        for version in (1, 2, 3):
            stats = st.refit(version, state(version))
            records = job.request("take")
            assert records[0] == ("begin", version)
            assert records[-1] == ("commit", version, version)
            batches = records[1:-1]
            assert len(batches) == stats.batches > 1
            assert all(r[0] == "batch" for r in batches)
            assert {name for _, names in batches for name in names} == set(state(0))
    job.stop()


def test_an_on_begin_hook_that_raises_refuses_the_refit(peer):
    job = peer.run(record_hooks, "table")
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, state(1))
        job.request("take")
        job.request("refuse", 2)
        with pytest.raises(refit.RefitError) as failure:
            st.refit(2, state(2))
        assert failure.value.code == refit.Errc.apply
        assert "PermissionError" in str(failure.value)
        assert "generation is busy, version 2 must wait" in str(failure.value)
        assert job.request("take") == []  # refused at BEGIN: no on_commit, no on_abort
        status = job.request("status")
        assert status["committed_version"] == 1
        assert status["dirty"] is False

        st.refit(3, state(3))
        assert job.request("take") == [("begin", 3), ("commit", 3, 3)]
    job.stop()


def commit_hook_raises(chan):
    """Job: on_commit and on_abort hooks that raise (logged, not raised)."""
    calls = []
    with refit.Receiver() as rx:
        rx.add_parameters({name: torch.zeros_like(t) for name, t in state(0).items()})

        def commit(version):
            calls.append(("commit", version))
            raise RuntimeError("the engine could not resume")

        def abort(version, reason):
            calls.append(("abort", version))
            raise RuntimeError("the engine could not roll back")

        rx.on_commit(commit)
        rx.on_abort(abort)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"calls": lambda: list(calls)})


def test_exceptions_of_on_commit_and_on_abort_are_not_raised_and_the_version_stays_committed(peer):
    job = peer.run(commit_hook_raises)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, state(1))
        with pytest.raises(refit.RefitError):
            st.refit(2, state(2, dtype=torch.float64))
        st.refit(3, state(3))
        assert job.request("calls") == [("commit", 1), ("abort", 2), ("commit", 3)]
        assert job.request("status")["committed_version"] == 3
    events = job.stop()
    assert events.count("committed") == 2 and events.count("aborted") == 1
