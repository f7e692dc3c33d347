"""A fleet that changes: receivers dropped when they die (on_receiver_failure="drop"), added back
and removed between versions, through the Python API. Each receiver is a spawned peer of its own;
one is SIGKILLed and a new process takes its endpoint."""

import time

import pytest

import refit
from conftest import Peer, mixed_state, serve_table, spec_of, state_bytes, streamer

TIMEOUT = 2.0
#: What a version with one receiver dead may take beyond the reply timeout (its transfer, a
#: loaded 2-core machine).
SLACK = 2.0


def test_a_dead_receiver_is_dropped_a_restarted_one_added_back_and_a_removed_one_keeps_its_version():
    spec = spec_of(mixed_state(1))
    peers = [Peer() for _ in range(3)]
    try:
        jobs = [p.run(serve_table, spec) for p in peers]
        eps = [j.recv() for j in jobs]
        with streamer(eps[0], receivers=eps, timeout=TIMEOUT, buffer_bytes=64 << 10,
                      on_receiver_failure="drop") as st:
            assert st.receivers == eps
            first = st.refit(1, mixed_state(1))
            assert first.dropped == []
            for j in jobs:
                assert j.request("state") == state_bytes(mixed_state(1))

            peers[0].process.kill()
            peers[0].process.join(10)
            start = time.monotonic()
            second = st.refit(2, mixed_state(2))
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT + SLACK
            assert [d.endpoint for d in second.dropped] == [eps[0]]
            assert second.dropped[0].code in (refit.Errc.peer, refit.Errc.timeout)
            assert eps[0] in second.dropped[0].reason
            assert st.receivers == eps[1:]
            for j in jobs[1:]:
                assert j.request("state") == state_bytes(mixed_state(2))

            # A new process on the same endpoint, added back: it holds the next version.
            peers[0].close()
            peers[0] = Peer()
            jobs[0] = peers[0].run(serve_table, spec, endpoint=eps[0])
            assert jobs[0].recv() == eps[0]
            st.add_receiver(eps[0])
            assert st.receivers == eps[1:] + eps[:1]
            third = st.refit(3, mixed_state(3))
            assert third.dropped == []
            for j in jobs:
                assert j.request("state") == state_bytes(mixed_state(3))

            # Removed: it keeps version 3 while the others take 4.
            st.remove_receiver(eps[1])
            assert st.receivers == [eps[2], eps[0]]
            st.refit(4, mixed_state(4))
            assert jobs[1].request("state") == state_bytes(mixed_state(3))
            assert jobs[1].request("status")["committed_version"] == 3
            for j in (jobs[0], jobs[2]):
                assert j.request("state") == state_bytes(mixed_state(4))
            with pytest.raises(refit.RefitError) as failure:
                st.remove_receiver(eps[1])
            assert failure.value.code == refit.Errc.invalid_argument
            assert "no such receiver" in str(failure.value)
    finally:
        for p in peers:
            p.settle()
            p.close()


def test_the_receivers_change_only_between_versions(table_peer):
    state = mixed_state(1)
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        st.refit(1, state)

        def pairs():
            st.add_receiver("ipc:///nowhere/else.sock")
            yield from state.items()

        with pytest.raises(refit.RefitError) as failure:
            st.refit(2, pairs())
        assert failure.value.code == refit.Errc.invalid_argument
        assert "add_receiver() during a refit" in str(failure.value)
        assert st.receivers == [endpoint]
        with pytest.raises(refit.RefitError) as failure:
            st.add_receiver(endpoint)
        assert "served already" in str(failure.value)
        with pytest.raises(refit.RefitError) as failure:
            st.remove_receiver(endpoint)
        assert "last receiver" in str(failure.value)
        assert st.refit(3, state).dropped == []
    assert job.request("status")["committed_version"] == 3


def test_on_receiver_failure_takes_fail_or_drop():
    with pytest.raises(ValueError, match="on_receiver_failure must be 'fail' or 'drop'"):
        refit.Streamer("ipc:///nowhere.sock", transport="host_shm", on_receiver_failure="ignore")
    with pytest.raises(refit.RefitError, match="min_receivers is 0"):
        refit.Streamer("ipc:///nowhere.sock", transport="host_shm", on_receiver_failure="drop", min_receivers=0)


def test_an_engine_that_loses_a_rank_is_dropped_whole_while_the_other_engine_commits():
    spec = spec_of(mixed_state(1))
    peers = [Peer() for _ in range(4)]
    try:
        jobs = [p.run(serve_table, spec) for p in peers]
        eps = [j.recv() for j in jobs]
        a, b = eps[:2], eps[2:]
        with streamer(eps[0], receiver_groups=[a, b], timeout=TIMEOUT, buffer_bytes=64 << 10,
                      on_receiver_failure="drop") as st:
            assert st.receivers == eps
            assert st.refit(1, mixed_state(1)).dropped == []

            peers[1].process.kill()  # rank 1 of engine a
            peers[1].process.join(10)
            second = st.refit(2, mixed_state(2))
            assert [d.endpoint for d in second.dropped] == [a[1], a[0]]
            assert second.dropped[0].code == second.dropped[1].code
            assert "dropped with its engine" in second.dropped[1].reason
            assert st.receivers == b
            for j in jobs[2:]:
                assert j.request("state") == state_bytes(mixed_state(2))
            # Its other rank heard ABORT before anything was written: version 1, every byte, clean.
            assert jobs[0].request("state") == state_bytes(mixed_state(1))
            status = jobs[0].request("status")
            assert status["committed_version"] == 1
            assert status["dirty"] is False
    finally:
        for p in peers:
            p.settle()
            p.close()


def test_receiver_groups_must_name_the_receivers():
    with pytest.raises(refit.RefitError) as failure:
        refit.Streamer("ipc:///tmp/refit-groups-a", transport="host_shm",
                       receiver_groups=[["ipc:///tmp/refit-groups-a"], []])
    assert failure.value.code == refit.Errc.invalid_argument
    assert "receiver_groups[1] is empty" in str(failure.value)
