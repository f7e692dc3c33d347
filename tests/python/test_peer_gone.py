"""A peer that is gone, or was never there: the engine sees its trainer die between versions
(``Event.lost``) and mid-version (``aborted``, then ``lost``); a trainer whose engine is not
listening hears it within a second (``Errc.peer``), not at HELLO's timeout."""

import os
import signal
import socket
import tempfile
import time

import pytest
import torch

import refit
from conftest import STREAMER_TIMEOUT, WAIT

SHAPE = (64, 64)
LARGE = (256, 64)  # four of stream_and_block's 16 KiB buffers


def stream_then_wait(chan, endpoint, control_lane):
    """Job (the trainer): commits version 1, says so, then waits between refits until killed."""
    with refit.Streamer(endpoint, transport="host_shm", control_lane=control_lane, timeout=STREAMER_TIMEOUT) as st:
        st.refit(1, {"w": torch.ones(SHAPE)})
        chan.send("committed")
        chan.recv()


def stream_and_block(chan, endpoint):
    """Job (the trainer): commits version 1, then blocks in version 2 after its first tensor."""
    with refit.Streamer(endpoint, transport="host_shm", buffer_bytes=1 << 14, timeout=STREAMER_TIMEOUT) as st:
        st.refit(1, {"w": torch.ones(LARGE), "v": torch.ones(SHAPE)})

        def tensors():
            yield "w", torch.full(LARGE, 2.0)  # its first batches go while the next is awaited
            chan.send("blocked")
            chan.recv()
            yield "v", torch.full(SHAPE, 2.0)

        st.refit(2, tensors())


def serve_until(rx, wanted, limit=WAIT):
    """serve_one() until it reports ``wanted``; the events before it."""
    events = []
    deadline = time.monotonic() + limit
    while True:
        e = rx.serve_one(timeout=0.05)
        if e == wanted:
            return events
        if e != refit.Event.idle:
            events.append(e)
        assert time.monotonic() < deadline, f"no {wanted} within {limit} s: {events}"


def readme_loop_until_it_ends(rx, killed, limit=10.0):
    """The README's loop, as it ends now: at bye or lost. Returns (the event, seconds since killed)."""
    while True:
        e = rx.serve_one(timeout=1.0)
        if e in (refit.Event.bye, refit.Event.lost):
            return e, time.monotonic() - killed
        assert time.monotonic() - killed < limit, f"serve_one still returns {e} {limit} s after the kill"


@pytest.mark.parametrize("control_lane", [True, False], ids=["lane", "zmq"])
def test_a_trainer_killed_between_refits_is_lost_within_a_second(fresh_peer, control_lane):
    w = torch.zeros(SHAPE)
    with refit.Receiver(idle_timeout=60.0) as rx:  # no deadline runs between versions
        rx.add_parameter("w", w)
        job = fresh_peer.run(stream_then_wait, rx.endpoint, control_lane)
        serve_until(rx, refit.Event.committed)
        assert job.recv() == "committed"
        killed = time.monotonic()
        os.kill(fresh_peer.pid, signal.SIGKILL)
        event, seconds = readme_loop_until_it_ends(rx, killed)
        fresh_peer.process.join(10)
        print(f"lost {seconds * 1e3:.1f} ms after the kill")
        assert event == refit.Event.lost
        assert seconds < 1.0
        assert rx.committed_version == 1 and not rx.dirty
        assert torch.equal(w, torch.ones(SHAPE))
        assert rx.serve_one(timeout=0.05) == refit.Event.idle  # reported once: the session is gone


def test_a_trainer_killed_mid_version_is_aborted_then_lost_in_pythons_words(fresh_peer):
    w, v = torch.zeros(LARGE), torch.zeros(SHAPE)
    with refit.Receiver(idle_timeout=60.0) as rx:
        rx.add_parameters({"w": w, "v": v})
        job = fresh_peer.run(stream_and_block, rx.endpoint)
        serve_until(rx, refit.Event.committed)
        while job.recv() != "blocked":
            pass
        serve_until(rx, refit.Event.begin)  # version 2 is in progress
        killed = time.monotonic()
        os.kill(fresh_peer.pid, signal.SIGKILL)
        events = serve_until(rx, refit.Event.lost, limit=10.0)
        seconds = time.monotonic() - killed
        fresh_peer.process.join(10)
        print(f"aborted, then lost {seconds * 1e3:.1f} ms after the kill")
        assert refit.Event.aborted in events
        assert seconds < 1.0
        assert rx.committed_version == 1
        text = rx.last_error
        assert "is gone during version 2" in text
        # Python's spelling of the C++ option and its duration.
        assert "refit.Receiver's idle_timeout= (60 s)" in text
        assert "receiver_options" not in text and " ms" not in text


def test_a_missing_ipc_socket_is_reported_within_a_second_naming_it():
    path = os.path.join(tempfile.mkdtemp(), "receiver.sock")
    with refit.Streamer(f"ipc://{path}", transport="host_shm", timeout=30.0) as st:
        start = time.monotonic()
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, {"w": torch.ones(4)})
        seconds = time.monotonic() - start
    assert failure.value.code == refit.Errc.peer
    assert not isinstance(failure.value, refit.RefitTimeout)
    assert f"ipc://{path}" in str(failure.value) and "does not exist" in str(failure.value)
    assert seconds < 2.0  # a second for a receiver binding meanwhile, not HELLO's 30 s


def test_a_refused_tcp_port_is_reported_within_a_second_naming_it():
    with socket.socket() as s:  # a port nobody listens on: bound, then closed without listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    with refit.Streamer(endpoint, transport="host_shm", timeout=30.0) as st:
        start = time.monotonic()
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, {"w": torch.ones(4)})
        seconds = time.monotonic() - start
    assert failure.value.code == refit.Errc.peer
    assert endpoint in str(failure.value) and "refused" in str(failure.value)
    assert seconds < 2.0


def test_a_hello_timeout_speaks_seconds():
    with refit.Receiver() as rx:  # bound, never served
        with refit.Streamer(rx.endpoint, transport="host_shm", timeout=1.0) as st:
            with pytest.raises(refit.RefitTimeout) as failure:
                st.refit(1, {"w": torch.ones(4)})
    text = str(failure.value)
    assert "within 1 s" in text and " ms" not in text
