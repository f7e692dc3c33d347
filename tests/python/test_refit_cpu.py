"""Refits over host_shm between two processes: the trainer here, the receiver in a peer."""

import numpy as np
import pytest
import torch

import refit
from conftest import mixed_state, spec_of, state_bytes, streamer


def test_a_state_dict_of_mixed_dtypes_arrives_bit_exact_after_three_versions(table_peer):
    spec = spec_of(mixed_state(1))
    job, endpoint = table_peer(spec)
    with streamer(endpoint) as st:
        for version in (1, 2, 3):
            state = mixed_state(version)
            assert job.request("state") != state_bytes(state)  # each version brings new bytes
            st.refit(version, state)
            assert job.request("state") == state_bytes(state), f"version {version}"
            status = job.request("status")
            assert status["committed_version"] == version
            assert status["dirty"] is False
    events = job.stop()
    assert events.count("committed") == 3
    assert events[-1] == "bye"  # the streamer's close() ended the session


@pytest.mark.parametrize("streamer_lane,receiver_lane", [(True, True), (False, True), (True, False)])
def test_requests_go_through_the_control_lane_unless_either_side_says_no(table_peer, streamer_lane, receiver_lane):
    spec = spec_of(mixed_state(1))
    job, endpoint = table_peer(spec, control_lane=receiver_lane)
    with streamer(endpoint, control_lane=streamer_lane) as st:
        assert st.announce() == 0  # no session before the first refit: nobody to tell
        for version in (1, 2, 3):
            state = mixed_state(version)
            stats = st.refit(version, state)
            assert stats.control_lane is (streamer_lane and receiver_lane)
            assert job.request("state") == state_bytes(state), f"version {version}"
            # The next version announced: told through the lane only; it arrives all the same.
            assert st.announce(0.5) == (1 if streamer_lane and receiver_lane else 0)
    job.stop()


def test_announce_refuses_a_hold_outside_0_to_10_seconds_and_a_closed_streamer(table_peer):
    spec = spec_of(mixed_state(1))
    job, endpoint = table_peer(spec)
    st = streamer(endpoint)
    for hold in (-1.0, 10.5, float("nan")):
        with pytest.raises(refit.RefitError, match="hold is in seconds, from 0 to 10") as e:
            st.announce(hold)
        assert e.value.code == refit.Errc.invalid_argument
    st.close()
    with pytest.raises(refit.RefitError, match="closed") as e:
        st.announce()
    assert e.value.code == refit.Errc.invalid_argument
    job.stop()


def test_a_generator_source_is_streamed_lazily_and_arrives_bit_exact(table_peer):
    spec = spec_of(mixed_state(1))
    job, endpoint = table_peer(spec)
    with streamer(endpoint) as st:
        for version in (1, 2):
            state = mixed_state(version)
            pulled = []

            def tensors():
                for name, t in state.items():
                    pulled.append(name)
                    yield name, t

            stats = st.refit(version, tensors())
            assert pulled == list(state)  # each pair pulled once, in order
            assert stats.tensors == len(state)
            assert job.request("state") == state_bytes(state)
    job.stop()


def test_a_list_of_pairs_is_a_source(table_peer):
    state = mixed_state(7)
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        st.refit(7, list(state.items()))
        assert job.request("state") == state_bytes(state)
        st.refit(8, tuple(mixed_state(8).items()))
        assert job.request("state") == state_bytes(mixed_state(8))
    job.stop()


def test_numpy_arrays_are_sources_through_dlpack(table_peer):
    rng = np.random.default_rng(5)
    arrays = {
        "f32": rng.standard_normal((31, 7)).astype(np.float32),
        "f64": rng.standard_normal(100),
        "f16": rng.standard_normal((4, 4)).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, 50, dtype=np.int64),
        "i32": rng.integers(-(2**31), 2**31 - 1, (3, 3, 3), dtype=np.int32),
        "i8": rng.integers(-128, 127, 17, dtype=np.int8),
        "u8": rng.integers(0, 255, 1000, dtype=np.uint8),
    }
    spec = [(name, str(torch.from_numpy(a).dtype).replace("torch.", ""), a.shape) for name, a in arrays.items()]
    job, endpoint = table_peer(spec)
    with streamer(endpoint) as st:
        stats = st.refit(1, arrays)
        assert stats.bytes == sum(a.nbytes for a in arrays.values())
    state = job.request("state")
    for name, a in arrays.items():
        dtype, shape, raw = state[name]
        assert shape == a.shape, name
        assert raw == a.tobytes(), name
    job.stop()


def test_committed_version_dirty_and_last_stats_follow_the_refits(table_peer):
    state = mixed_state(1)
    job, endpoint = table_peer(spec_of(state))
    before = job.request("status")
    assert before["committed_version"] is None
    assert before["dirty"] is False
    assert before["last_error"] is None
    assert before["stats"]["version"] == 0 and before["stats"]["tensors"] == 0
    with streamer(endpoint) as st:
        st.refit(41, state)
        st.refit(42, mixed_state(2))
    after = job.request("status")
    assert after["committed_version"] == 42
    assert after["dirty"] is False
    stats = after["stats"]
    assert stats["version"] == 42
    assert stats["tensors"] == len(state)
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats["batches"] >= 1
    assert stats["seconds"] >= stats["apply_seconds"] >= 0
    job.stop()


def test_refit_stats_count_the_tensors_bytes_and_batches_of_the_refit(table_peer):
    state = mixed_state(3)
    job, endpoint = table_peer(spec_of(state))
    total = sum(t.numel() * t.element_size() for t in state.values())
    with streamer(endpoint) as st:
        stats = st.refit(3, state)
    assert isinstance(stats, refit.RefitStats)
    assert stats.version == 3
    assert stats.tensors == len(state)
    assert stats.bytes == total
    assert stats.batches >= 1
    assert stats.direct is False  # host_shm always stages
    assert stats.seconds > 0
    for part in (stats.source_seconds, stats.pack_seconds, stats.wait_seconds):
        assert 0 <= part <= stats.seconds
    assert "version=3" in repr(stats)
    remote = job.request("status")["stats"]
    assert (remote["version"], remote["tensors"], remote["bytes"]) == (3, len(state), total)
    job.stop()


def test_a_tensor_larger_than_buffer_bytes_arrives_bit_exact_in_chunks(table_peer):
    g = torch.Generator().manual_seed(11)
    state = {
        "small.before": torch.randn(10, generator=g),
        "big": torch.randn(1000, 1000, generator=g),  # 4 MB through 64 KiB buffers
        "odd": torch.randint(0, 255, (200_001,), generator=g, dtype=torch.uint8),  # not a multiple of anything
        "small.after": torch.randn(3, 3, generator=g).to(torch.bfloat16),
    }
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint, buffer_bytes=64 << 10) as st:
        stats = st.refit(1, state)
        assert stats.batches >= (4_000_000 + 200_001) // (64 << 10)
        assert job.request("state") == state_bytes(state)
        state = {k: v + 1 if v.dtype != torch.uint8 else v // 2 for k, v in state.items()}
        st.refit(2, state)
        assert job.request("state") == state_bytes(state)
    job.stop()


def test_a_tcp_endpoint_bound_to_port_0_is_read_back_and_works(table_peer):
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    job, endpoint = table_peer(spec_of(state), endpoint="tcp://127.0.0.1:0")
    assert endpoint.startswith("tcp://127.0.0.1:")
    assert int(endpoint.rsplit(":", 1)[1]) > 0
    with streamer(endpoint) as st:
        st.refit(1, state)
    assert job.request("state") == state_bytes(state)
    job.stop()


def test_the_default_endpoint_is_a_private_ipc_socket():
    with refit.Receiver() as a, refit.Receiver() as b:
        assert a.endpoint.startswith("ipc://")
        assert a.endpoint != b.endpoint
        assert "closed" not in repr(a)
