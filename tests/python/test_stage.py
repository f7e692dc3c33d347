"""Staged receivers (``Receiver(stage="host")``): versions land in a stage while the engine keeps
reading its weights; ``Event.prepared`` / ``on_prepared`` at END, ``apply()`` commits.

The receiver serves on a thread of this process and the streamer (host_shm) runs on another, so
that the test's own thread can act as the engine: read the weights, apply between two reads."""

import threading

import pytest
import torch

import refit
from conftest import streamer

NAMES = ("embed.weight", "layers.0.w", "layers.0.b")


def state(version: int):
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layers.0.w": torch.randn(128, 96, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(96, generator=g),
    }


def same(weights, version: int) -> bool:
    want = state(version)
    return all(torch.equal(weights[n], want[n]) for n in NAMES)


class Served:
    """A staged receiver serving on a thread, recording events and hooks."""

    def __init__(self, **options) -> None:
        self.rx = refit.Receiver(stage="host", **options)
        self.weights = {n: t.clone() for n, t in state(0).items()}
        self.rx.add_parameters(self.weights)
        self.log = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.rx.on_prepared(lambda v: self.add(("prepared", v)))
        self.rx.on_commit(lambda v: self.add(("commit", v)))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def add(self, what) -> None:
        with self.changed:
            self.log.append(what)
            self.changed.notify_all()

    def wait_for(self, what, timeout: float = 20.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: what in self.log, timeout)

    def _serve(self) -> None:
        while not self.stop.is_set():
            e = self.rx.serve_one(timeout=0.01)
            if e not in (refit.Event.idle, refit.Event.begin, refit.Event.batch):
                self.add(("event", e))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.rx.close()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def test_a_staged_receiver_prepares_at_end_and_apply_commits_that_version(served):
    rx = served.rx
    assert rx.stage == "host"
    with streamer(rx.endpoint, buffer_bytes=16 << 10) as st:
        st.refit(1, state(1))
    assert served.wait_for(("prepared", 1))
    assert rx.prepared_version == 1
    assert rx.committed_version is None
    assert same(served.weights, 0)  # untouched until the engine applies
    assert ("commit", 1) not in served.log
    assert rx.apply() == 1
    assert same(served.weights, 1)
    assert rx.committed_version == 1
    assert rx.prepared_version is None
    assert rx.last_stats.version == 1 and rx.last_stats.pause_seconds >= 0
    assert rx.apply() is None and rx.apply_prepared() is None
    assert served.wait_for(("event", refit.Event.prepared))
    assert ("commit", 1) in served.log
    assert not any(e == ("event", refit.Event.committed) for e in served.log)


def test_a_begin_while_a_version_is_prepared_is_refused_and_writes_nothing(served):
    rx = served.rx
    with streamer(rx.endpoint, buffer_bytes=16 << 10) as st:
        st.refit(1, state(1))
        assert served.wait_for(("prepared", 1))
        with pytest.raises(refit.RefitError) as failure:
            st.refit(2, state(2))
        assert failure.value.code == refit.Errc.apply
        assert "version 1 is prepared and waits for apply_prepared()" in str(failure.value)
        assert same(served.weights, 0)
        assert rx.apply() == 1
        st.refit(2, state(2))
        assert served.wait_for(("prepared", 2))
        assert same(served.weights, 1)
        assert rx.apply() == 2
        assert same(served.weights, 2)


def test_an_engine_reading_its_weights_during_staged_refits_sees_only_whole_versions(served):
    rx = served.rx
    versions = 5
    sums = [sum(float(t.double().sum()) for t in state(v).values()) for v in range(versions + 1)]
    failed = []

    def trainer():
        try:
            with streamer(rx.endpoint, buffer_bytes=16 << 10) as st:
                for v in range(1, versions + 1):
                    st.refit(v, state(v))
                    served.wait_for(("commit", v))  # the next BEGIN waits for the engine's apply
        except Exception as e:  # pragma: no cover - reported below
            failed.append(e)

    t = threading.Thread(target=trainer)
    t.start()
    applied, reads, seen = 0, 0, set()
    while True:
        total = sum(float(w.double().sum()) for w in served.weights.values())  # one generation step
        assert total == sums[applied], f"read a mix of versions after applying {applied}"
        seen.add(applied)
        reads += 1
        if not t.is_alive() and rx.prepared_version is None:
            break
        v = rx.apply()  # between two steps
        if v is not None:
            applied = v
    t.join()
    assert not failed, failed
    assert seen == set(range(versions + 1))
    assert same(served.weights, versions)


def test_a_version_larger_than_stage_bytes_is_refused_before_anything_is_written():
    s = Served(stage_bytes=4096)
    try:
        with streamer(s.rx.endpoint) as st:
            with pytest.raises(refit.RefitError) as failure:
                st.refit(1, state(1))
        assert failure.value.code == refit.Errc.invalid_argument
        assert "more than receiver_options::stage_bytes (4096 bytes)" in str(failure.value)
        assert same(s.weights, 0)
        assert s.rx.prepared_version is None and not s.rx.dirty
    finally:
        s.close()


def test_stage_names_are_checked():
    with pytest.raises(ValueError, match="stage must be None, 'host' or 'device'"):
        refit.Receiver(stage="gpu")
    try:  # a build with CUDA makes it (its sessions are checked at BEGIN); one without refuses it
        with refit.Receiver(stage="device") as rx:
            assert rx.stage == "device"
    except refit.RefitError as failure:
        assert failure.code == refit.Errc.invalid_argument
        assert "needs CUDA" in str(failure)
    with refit.Receiver() as rx:
        assert rx.stage == "none"
        assert rx.apply() is None and rx.prepared_version is None


def test_an_engine_wide_version_reaches_every_rank_at_commit_and_none_when_one_rank_fails():
    """Streamer(atomic=True) to two staged ranks: both prepare only at COMMIT; a rank whose table
    lacks a tensor fails the next version at END, and the other rank discards it, untouched."""
    ranks = [Served(), Served()]
    try:
        endpoints = [s.rx.endpoint for s in ranks]
        with refit.Streamer(receivers=endpoints, transport="host_shm", buffer_bytes=16 << 10, atomic=True,
                            timeout=20.0) as st:
            stats = st.refit(1, state(1))
            assert stats.commit_seconds > 0
            for s in ranks:
                assert s.wait_for(("prepared", 1))
                assert s.rx.apply() == 1 and same(s.weights, 1)
            # Rank 1 now also holds a tensor the trainer does not send: its END finds it missing.
            ranks[1].stop.set()
            ranks[1].thread.join()
            ranks[1].rx.add_parameter("only.on.rank1", torch.zeros(4))
            ranks[1].stop.clear()
            ranks[1].thread = threading.Thread(target=ranks[1]._serve, daemon=True)
            ranks[1].thread.start()
            with pytest.raises(refit.RefitError) as failure:
                st.refit(2, state(2))
            assert failure.value.code == refit.Errc.incomplete
            assert "only.on.rank1" in str(failure.value)
        for s in ranks:
            assert s.wait_for(("event", refit.Event.aborted))
            assert s.rx.committed_version == 1 and s.rx.prepared_version is None
            assert same(s.weights, 1) and not s.rx.dirty
        assert "another receiver of the engine-wide version failed it" in ranks[0].rx.last_error
    finally:
        for s in ranks:
            s.close()
