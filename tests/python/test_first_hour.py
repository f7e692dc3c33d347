"""What a Python user meets in a first hour with refit on a machine without a GPU: the default
transport, the words of the errors (Python's names, hints at the usual mistakes, no C++ source
paths), and the small things that printed or behaved surprisingly (enums as numbers, last_error
after a commit, a callback silently replacing a table, an endpoint without its scheme)."""

from __future__ import annotations

import inspect
import logging
import threading

import pytest
import torch

import refit
from refit import _refit

from conftest import STREAMER_TIMEOUT, WAIT


class Served:
    """A receiver serving on a thread of this process (host_shm works within one process)."""

    def __init__(self, rx: refit.Receiver) -> None:
        self.rx = rx
        self.stop = threading.Event()
        self.thread = threading.Thread(target=rx.serve, args=(self.stop,), kwargs={"poll": 0.01}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()
        self.rx.close()


@pytest.fixture
def served():
    made = []

    def make(rx: refit.Receiver) -> refit.Receiver:
        made.append(Served(rx))
        return rx

    yield make
    for s in made:
        s.close()


def state(value: float = 1.0):
    return {"a": torch.full((4,), value), "b": torch.full((3, 2), value)}


def table(rx: refit.Receiver):
    weights = {k: torch.zeros_like(v) for k, v in state().items()}
    rx.add_parameters(weights)
    return weights


# ------------------------------------------------------------------------------ transport


def test_the_default_transport_is_auto():
    assert inspect.signature(refit.Streamer).parameters["transport"].default == "auto"


def test_auto_sends_cpu_tensors_over_host_shm_and_says_so_once(served, caplog):
    rx = refit.Receiver()
    weights = table(rx)
    served(rx)
    caplog.set_level(logging.INFO, logger="refit")
    with refit.Streamer(rx.endpoint, timeout=STREAMER_TIMEOUT) as st:
        assert st.transport is None  # chosen at the first refit, from its tensors
        st.refit(1, state(1.0))
        st.refit(2, state(2.0))
        assert st.transport == "host_shm"
    chosen = [r.getMessage() for r in caplog.records if "transport='auto'" in r.getMessage()]
    assert chosen == ["refit.Streamer(transport='auto'): using host_shm (the tensors are in host memory); "
                      "pass transport= to choose"]
    assert torch.equal(weights["b"], state(2.0)["b"])


def test_a_named_transport_is_the_streamers_transport_from_the_start():
    st = refit.Streamer("ipc:///nonexistent/refit-test.sock", transport="host_shm")
    assert st.transport == "host_shm"
    st.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_cuda_ipc_on_a_machine_without_a_gpu_says_which_transport_would_work():
    # A build with CUDA fails in cudaGetDevice, one without it at the transport's lookup; either
    # way the message names host_shm and auto, and no source file.
    with pytest.raises(refit.RefitError) as failure:
        refit.Streamer("ipc:///nonexistent/refit-test.sock", transport="cuda_ipc")
    text = str(failure.value)
    assert "host_shm" in text and "transport='auto'" in text, text
    assert ".hpp:" not in text and ".cpp:" not in text, text


def test_an_unknown_transport_lists_auto_among_the_choices():
    with pytest.raises(ValueError, match="'auto', 'host_shm', 'cuda_ipc' or 'nccl'"):
        refit.Streamer("ipc:///nonexistent/refit-test.sock", transport="shm")


# ------------------------------------------------------------------------ error messages


def test_cpp_source_locations_never_reach_python_messages():
    code, text = _refit._python_message(
        int(refit.Errc.cuda),
        "cudaGetDevice: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
        "version (../lib/copy/cuda_check.hpp:40); creating buffers (../lib/transport/cuda_ipc.cpp:123) failed")
    assert code == refit.Errc.cuda
    assert text == ("cudaGetDevice: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
                    "runtime version; creating buffers failed")
    # Parentheses that are not source locations stay.
    assert _refit._python_message(int(refit.Errc.apply), "tensor 'w' (f32[4]) differs (see rank 1)")[1] == \
        "tensor 'w' (f32[4]) differs (see rank 1)"


def test_a_dead_receiver_seen_through_the_lane_is_errc_peer():
    code, text = _refit._python_message(
        int(refit.Errc.timeout), "receiving the reply to BATCH 1 failed: the receiver's process ended before it "
        "answered; the session was reset")
    assert code == refit.Errc.peer
    assert "start a new one" in text
    # A real deadline stays a timeout.
    assert _refit._python_message(int(refit.Errc.timeout), "no reply within 30000 ms")[0] == refit.Errc.timeout


def test_a_wrong_token_names_the_python_argument(served):
    rx = refit.Receiver(token="s3cret")
    table(rx)
    served(rx)
    with refit.Streamer(rx.endpoint, token="guess", timeout=STREAMER_TIMEOUT) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, state())
    assert failure.value.code == refit.Errc.unauthorized
    text = str(failure.value)
    assert "token= of refit.Receiver and refit.Streamer" in text and "options.token" not in text, text


def test_a_receiver_without_a_sink_names_the_python_methods(served):
    rx = served(refit.Receiver())
    with refit.Streamer(rx.endpoint, timeout=STREAMER_TIMEOUT) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, state())
    text = str(failure.value)
    assert "rx.add_parameters" in text and "rx.on_tensor" in text, text


@pytest.mark.parametrize("method", ["on_tensor", "on_batch"])
def test_a_callback_that_raises_is_named_as_registered(served, method):
    rx = refit.Receiver()

    def fail(*args):
        raise KeyError("emb.weight")

    getattr(rx, method)(fail)
    served(rx)
    with refit.Streamer(rx.endpoint, timeout=STREAMER_TIMEOUT) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, state())
    assert failure.value.code == refit.Errc.apply
    assert f"the {method} callback raised KeyError: 'emb.weight'" in str(failure.value)
    assert f"the {method} callback raised KeyError" in rx.last_error


def test_registering_a_table_twice_hints_at_clear_parameters():
    with refit.Receiver() as rx:
        weights = table(rx)
        with pytest.raises(refit.RefitError) as failure:
            rx.add_parameters(weights)
        assert failure.value.code == refit.Errc.invalid_argument
        assert "'a' is already registered" in str(failure.value)
        assert "rx.clear_parameters() first" in str(failure.value)
        rx.clear_parameters()
        rx.add_parameters(weights)


def test_a_partial_state_hints_at_subset(served):
    rx = refit.Receiver()
    weights = table(rx)
    served(rx)
    with refit.Streamer(rx.endpoint, timeout=STREAMER_TIMEOUT) as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, {"a": torch.ones(4)})
        assert failure.value.code == refit.Errc.incomplete
        assert "missing 1 of the 2 registered tensors" in str(failure.value)
        assert "subset=True" in str(failure.value)
        st.refit(2, state(2.0))
        st.refit(3, {"a": torch.full((4,), 3.0)}, subset=True)  # what the hint says works
    assert torch.equal(weights["a"], torch.full((4,), 3.0))


# ------------------------------------------------------------------------- API surprises


def test_events_and_codes_print_as_names():
    assert str(refit.Event.committed) == "Event.committed"
    assert f"event {refit.Event.hello}" == "event Event.hello"
    assert f"code={refit.Errc.incomplete}" == "code=Errc.incomplete"
    assert f"{refit.Event.ended:>15}" == "    Event.ended"
    # Still numbers where numbers are asked for.
    assert refit.Errc.timeout == 4 and int(refit.Event.ended) == 8 and refit.Errc(11) is refit.Errc.incomplete
    assert str(refit.RefitError("x", 5).code) == "Errc.peer"


def test_last_error_is_cleared_by_a_later_commit(served):
    rx = refit.Receiver()
    table(rx)
    served(rx)
    assert rx.last_error is None
    with refit.Streamer(rx.endpoint, timeout=STREAMER_TIMEOUT) as st:
        with pytest.raises(refit.RefitError):
            st.refit(1, {"a": torch.ones(4)})
        assert "missing 1 of the 2" in rx.last_error
        st.refit(2, state())
        assert rx.committed_version == 2
        assert rx.last_error is None
        with pytest.raises(refit.RefitError):  # the same failure again is reported again
            st.refit(3, {"a": torch.ones(4)})
        assert "missing 1 of the 2" in rx.last_error


@pytest.mark.parametrize("method", ["on_tensor", "on_batch"])
def test_a_callback_after_a_table_is_refused_until_the_table_is_cleared(method):
    with refit.Receiver() as rx:
        table(rx)
        with pytest.raises(refit.RefitError) as failure:
            getattr(rx, method)(lambda *args: None)
        assert failure.value.code == refit.Errc.invalid_argument
        assert str(failure.value).startswith(f"{method}: this receiver has a parameter table (2 destination(s)")
        assert "rx.clear_parameters() first" in str(failure.value)
        rx.clear_parameters()
        getattr(rx, method)(lambda *args: None)


@pytest.mark.parametrize("endpoint", ["localhost:5555", "/tmp/refit.sock", "udp://127.0.0.1:5555"])
def test_an_endpoint_without_ipc_or_tcp_is_refused_when_the_streamer_is_made(endpoint):
    with pytest.raises(ValueError) as failure:
        refit.Streamer(endpoint)
    assert f"endpoint {endpoint!r} is not an endpoint refit can connect to" in str(failure.value)
    assert "ipc://" in str(failure.value) and "tcp://" in str(failure.value)
    with pytest.raises(ValueError, match=r"receivers\[1\] 'host:1'"):
        refit.Streamer(receivers=["ipc:///tmp/a.sock", "host:1"], transport="nccl")
