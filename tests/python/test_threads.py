"""Threads, the GIL, Ctrl-C, serve() and the context managers."""

import os
import signal
import sys
import threading
import time
import traceback

import pytest
import torch

import refit
from conftest import WAIT, serve_loop, state_bytes, streamer

STATE = {"w": torch.arange(16, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}


def zeros():
    return {name: torch.zeros_like(t) for name, t in STATE.items()}


# ------------------------------------------------------------------------- peer jobs


def serve_until_event(chan):
    """Job: serve(threading.Event); a thread sets the event when the test says so."""
    params = zeros()
    stop = threading.Event()
    with refit.Receiver() as rx:
        rx.add_parameters(params)

        def watch():
            try:
                assert chan.recv() == "stop serving"
            finally:
                stop.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        chan.send(rx.endpoint)
        rx.serve(stop, poll=0.05)
        watcher.join(WAIT)
        return rx.committed_version, state_bytes(params)


def serve_until_version(chan, last: int):
    """Job: serve(callable) until ``last`` is committed; returns how often stop was asked."""
    asked = []
    with refit.Receiver() as rx:
        rx.add_parameters(zeros())

        def stop():
            asked.append(rx.committed_version)
            return rx.committed_version == last

        chan.send(rx.endpoint)
        rx.serve(stop, poll=0.05)
        return rx.committed_version, len(asked), asked[-1]


def hold_first_batch(chan):
    """Job: the first batch callback waits for the test's "go" (sent by a Python thread of the
    test while its main thread is inside refit())."""
    held = []
    with refit.Receiver() as rx:

        @rx.on_batch
        def apply(views):
            if not held:
                held.append(True)
                chan.send("in the first batch")
                assert chan.recv(timeout=15) == "go"

        chan.send(rx.endpoint)
        return serve_loop(rx, chan)


def serve_until_interrupted(chan):
    """Job: serve() with no stop, until SIGINT."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive engine
    with refit.Receiver() as rx:
        rx.add_parameters(zeros())
        chan.send((rx.endpoint, os.getpid()))
        try:
            rx.serve(poll=0.1)
        except KeyboardInterrupt:
            frames = [f.name for f in traceback.extract_tb(sys.exc_info()[2])]
            return "KeyboardInterrupt", frames, rx.committed_version
    return "serve returned", [], None


def interrupted_in_a_callback(chan):
    """Job: the batch callback raises KeyboardInterrupt (Ctrl-C while it runs)."""
    with refit.Receiver() as rx:

        @rx.on_batch
        def apply(views):
            raise KeyboardInterrupt()

        chan.send(rx.endpoint)
        try:
            rx.serve(poll=0.05)
        except KeyboardInterrupt:
            return "KeyboardInterrupt", rx.committed_version, rx.last_error
    return "serve returned", None, None


# ----------------------------------------------------------------------------- serve()


def test_serve_stops_when_its_threading_event_is_set(peer):
    job = peer.run(serve_until_event)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, zeros())
        st.refit(2, STATE)
    job.send("stop serving")
    version, state = job.result()
    assert version == 2
    assert state == state_bytes(STATE)


def test_serve_stops_when_its_callable_returns_true(peer):
    job = peer.run(serve_until_version, 3)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        for version in (1, 2, 3):
            st.refit(version, STATE)
    version, asked, last_seen = job.result()
    assert version == 3 and last_seen == 3
    assert asked >= 4  # asked before serving and after each refit at least


def test_an_exception_in_the_stop_callable_comes_out_of_serve():
    def stop():
        raise LookupError("stop() failed")

    with refit.Receiver() as rx:
        with pytest.raises(LookupError, match="stop"):
            rx.serve(stop)


# --------------------------------------------------------------------------------- GIL


def test_refit_releases_the_gil_while_the_receiver_works(peer):
    # The receiver holds its first batch until a Python thread of this process answers: if
    # refit() kept the GIL, that thread could not run and the refit would fail, not pass.
    job = peer.run(hold_first_batch)
    endpoint = job.recv()
    seen = {}
    refit_returned = threading.Event()

    def other_thread():
        seen["message"] = job.recv()
        count = 0
        for _ in range(100_000):  # Python bytecode: needs the GIL
            count += 1
        seen["count"] = count
        seen["during_refit"] = not refit_returned.is_set()
        job.send("go")

    t = threading.Thread(target=other_thread, daemon=True)
    t.start()
    with streamer(endpoint) as st:
        stats = st.refit(1, STATE)
        refit_returned.set()
    t.join(WAIT)
    assert not t.is_alive()
    assert seen == {"message": "in the first batch", "count": 100_000, "during_refit": True}
    assert stats.version == 1
    assert job.request("status")["committed_version"] == 1
    job.stop()


def test_serve_one_releases_the_gil_while_it_waits():
    # A streamer in a Python thread of this process can only say HELLO while the main thread
    # waits inside serve_one() if that wait released the GIL.
    params = zeros()
    with refit.Receiver() as rx:
        rx.add_parameters(params)
        outcome = {}

        def trainer():
            try:
                with streamer(rx.endpoint) as st:
                    outcome["stats"] = st.refit(1, STATE)
            except BaseException as e:  # noqa: BLE001 - reported below
                outcome["error"] = e

        t = threading.Thread(target=trainer, daemon=True)
        t.start()
        events = [rx.serve_one(timeout=WAIT / 2)]
        assert events[0] == refit.Event.hello
        while events[-1] != refit.Event.committed and len(events) < 100:
            events.append(rx.serve_one(timeout=WAIT / 2))
        events.append(rx.serve_one(timeout=WAIT / 2))  # the streamer's close()
        t.join(WAIT)
        assert "error" not in outcome, outcome.get("error")
        assert [e.name for e in events] == ["hello", "begin", "batch", "committed", "bye"]
        assert outcome["stats"].version == 1
        assert state_bytes(params) == state_bytes(STATE)


# ------------------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_interrupts_serve_within_a_few_poll_intervals(fresh_peer):
    job = fresh_peer.run(serve_until_interrupted)
    endpoint, pid = job.recv()
    assert pid == fresh_peer.pid
    with streamer(endpoint) as st:
        st.refit(1, STATE)  # committed: the peer is inside serve()
    os.kill(pid, signal.SIGINT)
    sent = time.monotonic()
    outcome, frames, version = job.result()
    elapsed = time.monotonic() - sent
    assert outcome == "KeyboardInterrupt"
    assert "serve" in frames
    assert version == 1
    assert elapsed < 5.0  # serve() polls every 0.1 s; generous for a loaded CI machine


def test_ctrl_c_inside_a_callback_aborts_the_refit_and_comes_out_of_serve(peer):
    # The callback's error reaches the streamer with the reply to END: serve() must not leave
    # before answering it (a short timeout keeps a failure of that quick).
    job = peer.run(interrupted_in_a_callback)
    endpoint = job.recv()
    with streamer(endpoint, timeout=5) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, STATE)
    assert failure.value.code == refit.Errc.apply
    assert "KeyboardInterrupt" in str(failure.value)
    outcome, version, last_error = job.result()
    assert outcome == "KeyboardInterrupt"
    assert version is None
    assert "KeyboardInterrupt" in last_error


# ------------------------------------------------------------------ context managers


def test_the_receiver_context_manager_closes_it():
    with refit.Receiver() as rx:
        assert rx.endpoint.startswith("ipc://")
    with pytest.raises(refit.RefitError, match="closed"):
        rx.endpoint


def test_the_receiver_context_manager_closes_it_when_the_block_raises():
    with pytest.raises(ZeroDivisionError):
        with refit.Receiver() as rx:
            1 / 0
    with pytest.raises(refit.RefitError, match="closed"):
        rx.serve_one(timeout=0.01)


def test_the_streamer_context_manager_says_bye_and_closes(peer):
    job = peer.run(serve_until_event)
    endpoint = job.recv()
    with streamer(endpoint) as st:
        st.refit(1, STATE)
    with pytest.raises(refit.RefitError, match="closed"):
        st.refit(2, STATE)
    job.send("stop serving")
    version, state = job.result()
    assert version == 1 and state == state_bytes(STATE)
