"""Refusals and failures: the right exception, the exact code, the tensor's name, nothing committed."""

import math
import os
import pickle
import signal
import time

import numpy as np
import pytest
import torch

import refit
from conftest import spec_of, state_bytes, streamer

NAME = "model.layers.3.mlp.down_proj.weight"


def good_state(version: int):
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        NAME: torch.randn(8, 16, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


@pytest.fixture
def served(table_peer):
    """A peer serving good_state's table, already at version 1: (job, streamer)."""
    job, endpoint = table_peer(spec_of(good_state(1)))
    with streamer(endpoint) as st:
        st.refit(1, good_state(1))
        yield job, st
    job.stop()


def assert_still_at_version_1(job, st):
    """Nothing was committed, and the receiver takes the next good refit."""
    assert job.request("status")["committed_version"] == 1
    st.refit(2, good_state(2))
    assert job.request("state") == state_bytes(good_state(2))
    assert job.request("status")["committed_version"] == 2


# -------------------------------------------------------------------- receiver refusals


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(8, 17), torch.zeros(16, 8), torch.zeros(128), torch.zeros(())],
    ids=["wider", "transposed", "flat", "scalar"],
)
def test_a_shape_mismatch_raises_refit_error_apply_naming_the_tensor(served, bad):
    job, st = served
    state = good_state(2)
    state[NAME] = bad
    with pytest.raises(refit.RefitError) as failure:
        st.refit(2, state)
    assert failure.value.code == refit.Errc.apply
    assert f"'{NAME}'" in str(failure.value)
    assert type(failure.value) is refit.RefitError
    assert NAME in job.request("status")["last_error"]
    assert_still_at_version_1(job, st)


# float16 and bfloat16 sources of a float32 destination are cast on the way (the
# destination's dtype is a conversion request); dtypes refit does not convert still fail.
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_a_dtype_mismatch_raises_refit_error_apply_naming_the_tensor(served, dtype):
    job, st = served
    state = good_state(2)
    state[NAME] = state[NAME].to(dtype)
    with pytest.raises(refit.RefitError) as failure:
        st.refit(2, state)
    assert failure.value.code == refit.Errc.apply
    assert f"'{NAME}'" in str(failure.value)
    assert_still_at_version_1(job, st)


def test_an_unknown_tensor_raises_refit_error_apply_naming_it(served):
    job, st = served
    state = good_state(2)
    state["lm_head.weight"] = torch.zeros(4)
    with pytest.raises(refit.RefitError) as failure:
        st.refit(2, state)
    assert failure.value.code == refit.Errc.apply
    assert "'lm_head.weight'" in str(failure.value)
    assert_still_at_version_1(job, st)


def test_a_missing_tensor_raises_refit_error_incomplete(served):
    job, st = served
    state = good_state(2)
    del state["model.norm.weight"]
    with pytest.raises(refit.RefitError) as failure:
        st.refit(2, state)
    assert failure.value.code == refit.Errc.incomplete
    assert "model.norm.weight" in str(failure.value)
    assert_still_at_version_1(job, st)


def test_a_version_not_newer_than_the_committed_one_is_refused(served):
    job, st = served
    for version in (1, 0):
        with pytest.raises(refit.RefitError) as failure:
            st.refit(version, good_state(5))
        assert failure.value.code == refit.Errc.protocol
    assert job.request("state") == state_bytes(good_state(1))
    assert_still_at_version_1(job, st)


def test_a_refit_refused_after_some_batches_leaves_the_receiver_dirty_until_the_next_commit(table_peer):
    g = torch.Generator().manual_seed(4)
    state = {"big": torch.randn(64 << 10, generator=g), "late": torch.randn(4, generator=g)}  # 256 KiB first
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint, buffer_bytes=16 << 10) as st:
        st.refit(1, state)
        assert job.request("status")["dirty"] is False
        bad = {"big": state["big"] + 1, "late": state["late"].double()}  # refused in the last batch
        with pytest.raises(refit.RefitError) as failure:
            st.refit(2, bad)
        assert failure.value.code == refit.Errc.apply
        assert "'late'" in str(failure.value)
        status = job.request("status")
        assert status["committed_version"] == 1
        assert status["dirty"] is True  # earlier batches of "big" were written
        assert "'late'" in status["last_error"]
        assert job.request("state") != state_bytes(state)
        st.refit(3, state)
        status = job.request("status")
        assert (status["committed_version"], status["dirty"]) == (3, False)
        assert job.request("state") == state_bytes(state)
    job.stop()


# ----------------------------------------------------------------------- a dead peer


def serve_then_die(chan):
    """Job: a receiver that kills itself (SIGKILL) in its first batch: mid-refit."""
    with refit.Receiver() as rx:
        rx.on_batch(lambda views: os.kill(os.getpid(), signal.SIGKILL))
        chan.send(rx.endpoint)
        while True:
            rx.serve_one(timeout=0.05)
            if chan.poll() is not None:
                return


def test_a_receiver_killed_mid_refit_is_a_dead_peer_seen_at_once_not_a_timeout(fresh_peer):
    # Through the control lane (same host, the default) the streamer sees the receiver's process
    # end: that is Errc.peer, so that code retrying on RefitTimeout does not retry a dead engine.
    job = fresh_peer.run(serve_then_die)
    endpoint = job.recv()
    timeout = 30.0
    state = {f"w{i}": torch.randn(64 << 10) for i in range(8)}  # 2 MiB through 64 KiB buffers
    with streamer(endpoint, timeout=timeout, buffer_bytes=64 << 10) as st:
        start = time.monotonic()
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, state)
        elapsed = time.monotonic() - start
        fresh_peer.process.join(10)
        assert fresh_peer.process.exitcode == -signal.SIGKILL  # it died in its batch callback
    assert not isinstance(failure.value, refit.RefitTimeout)
    assert failure.value.code == refit.Errc.peer
    assert "process ended" in str(failure.value) and "start a new one" in str(failure.value)
    assert elapsed < timeout / 2  # seen through the lane, not at the deadline


def test_a_receiver_killed_mid_refit_without_the_lane_gives_refit_timeout_within_the_deadline(fresh_peer):
    # Over ZeroMQ alone a dead receiver and a slow one look the same: the deadline decides.
    job = fresh_peer.run(serve_then_die)
    endpoint = job.recv()
    timeout, margin = 3.0, 4.0
    state = {f"w{i}": torch.randn(64 << 10) for i in range(8)}
    with streamer(endpoint, timeout=timeout, buffer_bytes=64 << 10, control_lane=False) as st:
        start = time.monotonic()
        with pytest.raises(refit.RefitTimeout) as failure:
            st.refit(1, state)
        elapsed = time.monotonic() - start
        fresh_peer.process.join(10)
        assert fresh_peer.process.exitcode == -signal.SIGKILL
    assert isinstance(failure.value, TimeoutError)
    assert isinstance(failure.value, refit.RefitError)
    assert failure.value.code == refit.Errc.timeout
    assert elapsed < timeout + margin


# --------------------------------------------------------------------------- tokens


def test_a_wrong_token_is_refused_and_the_receiver_stays_usable(table_peer):
    state = good_state(1)
    job, endpoint = table_peer(spec_of(state), token="s3cret")
    with streamer(endpoint, token="guess") as intruder:
        with pytest.raises(refit.RefitError) as failure:
            intruder.refit(1, state)
    assert failure.value.code == refit.Errc.unauthorized
    status = job.request("status")
    assert status["committed_version"] is None
    assert job.request("state") != state_bytes(state)
    with streamer(endpoint, token="s3cret") as st:
        st.refit(1, state)
    assert job.request("state") == state_bytes(state)
    assert job.request("status")["committed_version"] == 1
    events = job.stop()
    assert "refused" in events and "committed" in events


# ------------------------------------------------------------------------ bad sources


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(16, 8).t(), torch.zeros(8, 32)[:, ::2], np.zeros((8, 32), np.float32)[:, ::2]],
    ids=["transposed", "strided", "numpy-strided"],
)
def test_a_non_contiguous_source_raises_value_error_naming_it(served, bad):
    job, st = served
    state = good_state(2)
    state[NAME] = bad
    with pytest.raises(ValueError, match=f"'{NAME}'.*contiguous"):
        st.refit(2, state)
    assert_still_at_version_1(job, st)


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(8, 16, dtype=torch.complex64), np.zeros((8, 16), np.complex64)],
    ids=["torch", "numpy"],
)
def test_an_unsupported_dtype_raises_type_error_naming_it(served, bad):
    job, st = served
    state = good_state(2)
    state[NAME] = bad
    with pytest.raises(TypeError, match=f"'{NAME}'"):
        st.refit(2, state)
    assert_still_at_version_1(job, st)


@pytest.mark.parametrize("bad", [[1.0, 2.0], "weights", None, 3.5], ids=["list", "str", "None", "float"])
def test_a_non_tensor_raises_type_error_naming_it(served, bad):
    job, st = served
    state = good_state(2)
    state[NAME] = bad
    with pytest.raises(TypeError, match=f"'{NAME}'"):
        st.refit(2, state)
    assert_still_at_version_1(job, st)


@pytest.mark.parametrize(
    "bad",
    [[torch.zeros(2)], [("w", torch.zeros(2), "extra")], [(7, torch.zeros(2))], 42],
    ids=["not-a-pair", "triple", "int-name", "not-iterable"],
)
def test_a_source_that_is_not_pairs_raises_type_error(served, bad):
    job, st = served
    with pytest.raises(TypeError):
        st.refit(2, bad)
    assert_still_at_version_1(job, st)


def test_a_generators_own_exception_is_raised_again_as_it_is(served):
    job, st = served
    raised = KeyError("model.layers.9.self_attn.q_proj.weight")

    def tensors():
        state = good_state(2)
        yield "model.embed_tokens.weight", state["model.embed_tokens.weight"]
        raise raised

    with pytest.raises(KeyError) as failure:
        st.refit(2, tensors())
    assert failure.value is raised
    assert_still_at_version_1(job, st)


# ---------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "options, error, code",
    [
        (dict(transport="carrier-pigeon"), ValueError, None),
        (dict(timeout=0), ValueError, None),
        (dict(timeout=-1.0), ValueError, None),
        (dict(timeout=math.nan), ValueError, None),
        (dict(buffers=1), refit.RefitError, refit.Errc.invalid_argument),
        (dict(buffer_bytes=0), refit.RefitError, refit.Errc.invalid_argument),
        (dict(alignment=3), refit.RefitError, refit.Errc.invalid_argument),
        (dict(engine="warp-drive"), ValueError, None),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else None,
)
def test_bad_streamer_arguments_are_refused(options, error, code):
    with pytest.raises(error) as failure:
        refit.Streamer("ipc:///nonexistent/refit-test.sock", **{"transport": "host_shm", **options})
    if code is not None:
        assert failure.value.code == code


def test_a_streamer_without_an_endpoint_is_refused():
    with pytest.raises(ValueError):
        refit.Streamer(transport="host_shm")


@pytest.mark.parametrize(
    "args, options, error, code",
    [
        ((), dict(idle_timeout=0), ValueError, None),
        ((), dict(engine="warp-drive"), ValueError, None),
        (("carrier-pigeon://coop",), {}, refit.RefitError, refit.Errc.invalid_argument),
        (("ipc:///nonexistent/dir/refit-test.sock",), {}, refit.RefitError, refit.Errc.io),
    ],
    ids=["idle_timeout", "engine", "scheme", "missing-dir"],
)
def test_bad_receiver_arguments_are_refused(args, options, error, code):
    with pytest.raises(error) as failure:
        refit.Receiver(*args, **options)
    if code is not None:
        assert failure.value.code == code


def test_bad_registrations_are_refused_naming_the_tensor():
    with refit.Receiver() as rx:
        w = torch.zeros(4)
        rx.add_parameter("w", w)
        with pytest.raises(refit.RefitError) as failure:
            rx.add_parameter("w", w)  # the same memory twice (another tensor would be a tied weight)
        assert failure.value.code == refit.Errc.invalid_argument
        assert "'w'" in str(failure.value)
        with pytest.raises(ValueError, match="'t'.*contiguous"):
            rx.add_parameter("t", torch.zeros(4, 4).t())
        with pytest.raises(TypeError, match="'c'"):
            rx.add_parameter("c", torch.zeros(4, dtype=torch.complex64))
        with pytest.raises(TypeError, match="'l'"):
            rx.add_parameters({"l": [0.0, 1.0]})
        with pytest.raises(TypeError):
            rx.serve(42)


def test_methods_of_a_closed_receiver_raise_refit_error():
    rx = refit.Receiver()
    rx.close()
    rx.close()  # twice is fine
    calls = [
        lambda: rx.endpoint,
        lambda: rx.committed_version,
        lambda: rx.dirty,
        lambda: rx.last_stats,
        lambda: rx.serve_one(timeout=0.01),
        lambda: rx.serve(lambda: True),
        lambda: rx.add_parameter("w", torch.zeros(2)),
        lambda: rx.on_batch(lambda views: None),
    ]
    for call in calls:
        with pytest.raises(refit.RefitError) as failure:
            call()
        assert failure.value.code == refit.Errc.invalid_argument
        assert "closed" in str(failure.value)
    assert "closed" in repr(rx)


def test_refit_on_a_closed_streamer_raises_refit_error():
    st = streamer("ipc:///nonexistent/refit-test.sock")
    st.close()
    st.close()
    with pytest.raises(refit.RefitError) as failure:
        st.refit(1, {"w": torch.zeros(2)})
    assert failure.value.code == refit.Errc.invalid_argument
    assert "closed" in str(failure.value)


# --------------------------------------------------------------------- the exceptions


def make_real_error(chan):
    """Job: a RefitError raised by the native core, handed over the pipe as it is."""
    try:
        refit.Streamer("ipc:///nonexistent/refit-test.sock", transport="host_shm", buffers=1)
    except refit.RefitError as e:
        return e
    return None


def test_refit_errors_pickle_with_their_code_across_processes(peer):
    e = peer.run(make_real_error).result()
    assert type(e) is refit.RefitError
    assert e.code == refit.Errc.invalid_argument
    assert "buffer" in str(e)


def test_refit_error_and_refit_timeout_pickle_with_their_code():
    for cls, code in [(refit.RefitError, refit.Errc.apply), (refit.RefitTimeout, refit.Errc.timeout)]:
        e = pickle.loads(pickle.dumps(cls("tensor 'w': no", code)))
        assert type(e) is cls
        assert e.code == code
        assert str(e) == "tensor 'w': no"
    assert isinstance(pickle.loads(pickle.dumps(refit.RefitTimeout("late", refit.Errc.timeout))), TimeoutError)
    assert issubclass(refit.RefitTimeout, refit.RefitError)
    assert not issubclass(refit.RefitError, TimeoutError)
