"""Subset and delta versions over host_shm: the trainer here, the receiver in a peer."""

import pytest
import torch

import refit
from conftest import serve_loop, spec_of, state_bytes, streamer, zeros_like_spec


def serve_delta_table(chan, spec, threads=0):
    """Job: a parameter table from ``spec`` (its deltas applied on ``threads`` threads); commands
    ``state``, ``status`` (with ``poisoned``) and ``flip`` (flips one byte of a weight behind refit's
    back)."""
    params = zeros_like_spec(spec)

    def status():
        return {"committed": rx.committed_version, "dirty": rx.dirty, "poisoned": rx.poisoned,
                "last_error": rx.last_error}

    def flip(name):
        params[name].view(torch.uint8).view(-1)[0] ^= 0xFF
        return True

    with refit.Receiver(delta_threads=threads) as rx:
        rx.add_parameters(params)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(params), "status": status, "flip": flip})


class Trainer:
    """fp32 masters, sent as their bf16 rounding; each step moves them by a small relative update so
    that about 2 % of the bf16 elements change."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.master = {
            "embed": torch.randn(4096, 64, generator=g) * 0.02,
            "layers.0.q": torch.randn(64, 64, generator=g) * 0.02,
            "layers.0.lora_a": torch.randn(8, 64, generator=g) * 0.02,
            "layers.0.lora_b": torch.randn(64, 8, generator=g) * 0.02,
            "norm": torch.ones(64),
        }

    def step(self, size=2.2e-4):
        for t in self.master.values():
            t += size * t.abs() * (torch.rand(t.shape, generator=self.g) * 2 - 1)

    def state(self):
        return {k: v.to(torch.bfloat16) for k, v in self.master.items()}


@pytest.fixture
def delta_peer(peer):
    def start(spec, threads=0):
        job = peer.run(serve_delta_table, spec, threads)
        return job, job.recv()

    return start


@pytest.mark.parametrize("threads", [0, 1, 3], ids=["default-threads", "one-thread", "three-threads"])
def test_delta_versions_are_bit_exact_after_20_steps_and_send_a_fraction(delta_peer, threads):
    t = Trainer()
    job, endpoint = delta_peer(spec_of(t.state()), threads)
    with streamer(endpoint, delta=True, delta_memory="host", delta_threads=threads) as st:
        first = st.refit(1, t.state())
        assert not first.delta and first.bytes == first.tensor_bytes
        assert first.base_bytes == first.tensor_bytes
        for version in range(2, 22):
            t.step()
            state = t.state()
            stats = st.refit(version, state)
            assert stats.delta and stats.base == version - 1 and stats.subset
            assert 0 < stats.changed < stats.elements * 0.1
            assert stats.bytes < stats.tensor_bytes / 4
            assert job.request("state") == state_bytes(state), f"version {version}"
        status = job.request("status")
        assert status["committed"] == 21 and not status["dirty"] and not status["poisoned"]
    job.stop()


def test_delta_batch_bytes_cuts_a_delta_into_more_batches_with_the_same_patches(delta_peer):
    """delta_batch_bytes: the tensor bytes a delta batch covers (default over host_shm max(32 MiB,
    buffer_bytes): this model in one batch). 64 KiB, with 128 KiB buffers (64 KiB spans): each of "embed"'s eight
    spans closes a batch; the patches and the result are the same."""
    t = Trainer()
    job, endpoint = delta_peer(spec_of(t.state()))
    sent = {}
    for batch_bytes, versions in ((0, (1, 2, 3)), (64 << 10, (4, 5, 6))):
        with streamer(endpoint, delta=True, delta_batch_bytes=batch_bytes, buffer_bytes=128 << 10) as st:
            for version in versions:
                t.step()
                state = t.state()
                stats = st.refit(version, state)
                assert stats.delta == (version not in (1, 4))  # a new streamer holds no base: whole
                assert job.request("state") == state_bytes(state), f"version {version}"
                if stats.delta:
                    sent[version] = stats
    assert all(sent[v].batches == 1 for v in (2, 3))
    assert all(sent[v].batches >= 8 for v in (5, 6))
    assert job.request("status")["committed"] == 6
    job.stop()


def test_subset_versions_keep_the_tensors_not_sent_and_need_a_whole_version_first(delta_peer):
    t = Trainer()
    job, endpoint = delta_peer(spec_of(t.state()))
    with streamer(endpoint) as st:
        adapters = {k: v for k, v in t.state().items() if "lora" in k}
        with pytest.raises(refit.RefitError) as e:
            st.refit(1, adapters, subset=True)
        assert e.value.code == refit.Errc.needs_whole
        assert "has not committed a whole version" in str(e.value)
        assert job.request("status")["committed"] is None

        st.refit(1, t.state())
        first = t.state()
        for version in range(2, 22):
            t.step(1e-2)
            adapters = {k: v for k, v in t.state().items() if "lora" in k}
            stats = st.refit(version, adapters, subset=True)
            assert stats.subset and stats.tensors == 2
            expected = {k: (adapters[k] if k in adapters else first[k]) for k in first}
            assert job.request("state") == state_bytes(expected), f"version {version}"
    job.stop()


def test_a_delta_to_another_base_is_sent_whole_and_a_bad_base_poisons_until_a_whole_version(delta_peer):
    t = Trainer()
    job, endpoint = delta_peer(spec_of(t.state()))
    with streamer(endpoint, delta=True) as st:
        st.refit(1, t.state())
        # Another trainer commits version 2: the delta streamer's base is stale.
        other = Trainer(seed=1)
        with streamer(endpoint) as o:
            o.refit(2, other.state())
        t.step()
        stats = st.refit(3, t.state())
        assert stats.whole_after_refusal and not stats.delta
        assert job.request("state") == state_bytes(t.state())

        # A weight changed behind refit's back: the next delta does not check out.
        job.request("flip", "embed")
        t.master["embed"].view(-1)[0] *= 1.5  # the flipped byte is overwritten by the patch
        t.step()
        with pytest.raises(refit.RefitError) as e:
            st.refit(4, t.state())
        assert e.value.code == refit.Errc.apply
        assert "does not check out" in str(e.value)
        status = job.request("status")
        assert status["committed"] == 3 and status["dirty"] and status["poisoned"]
        assert status["last_error"].startswith("poisoned: delta version 4 failed")

        # The next refit is whole (the streamer dropped its base) and cures the receiver.
        stats = st.refit(5, t.state())
        assert not stats.delta
        status = job.request("status")
        assert status["committed"] == 5 and not status["dirty"] and not status["poisoned"]
        assert job.request("state") == state_bytes(t.state())
    job.stop()


def test_delta_options_are_checked():
    with pytest.raises(ValueError, match="delta_memory must be 'host' or 'device'"):
        refit.Streamer("ipc:///nowhere", transport="host_shm", delta=True, delta_memory="disk")
    # (A build without CUDA refuses cuda_ipc itself first.)
    with pytest.raises(refit.RefitError, match="needs the host_shm transport|cuda_ipc is not built into this refit"):
        refit.Streamer("ipc:///nowhere", transport="cuda_ipc", delta=True)
    with pytest.raises(refit.RefitError, match="delta.threads is 257: the host diff takes at most 256 threads"):
        refit.Streamer("ipc:///nowhere", transport="host_shm", delta=True, delta_threads=257)
    with pytest.raises(refit.RefitError, match="delta_threads is 257: a host delta is applied on at most 256 threads"):
        refit.Receiver(delta_threads=257)
