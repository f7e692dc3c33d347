"""Sharded trainers from Python: every trainer rank streams its refit.Shard of each tensor
(FSDP's Shard(0) rows), and the receivers assemble and commit one version.

The receiver serves on a thread and each rank's streamer runs on a thread of its own: refit
releases the GIL while it waits and moves bytes."""

import os
import signal
import threading
import time

import pytest
import torch

import refit


def full_state(version: int):
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 24, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.bias": torch.randn(3, generator=g),  # fewer rows than ranks: some shards are empty
    }


def shard_state(state, rank: int, world: int):
    """What FSDP's Shard(0) gives rank ``rank``: torch.chunk rows of every parameter."""
    out = {}
    for name, t in state.items():
        rows = (t.shape[0] + world - 1) // world
        start = min(t.shape[0], rank * rows)
        stop = min(t.shape[0], start + rows)
        out[name] = refit.Shard(t[start:stop], t.shape, 0, start)
    return out


class Serving:
    """A receiver serving on a thread until the block ends."""

    def __init__(self, rx):
        self.rx = rx
        self.events = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            e = self.rx.serve_one(timeout=0.01)
            if e != refit.Event.idle:
                self.events.append(e)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def each_rank(world: int, body):
    """Runs body(rank) on a thread per rank; returns what each one raised (None when it returned)."""
    raised = [None] * world

    def run(r):
        try:
            body(r)
        except Exception as e:  # noqa: BLE001 - handed back to the test
            raised[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_shard0_rows_commit_bit_exact_versions_into_a_parameter_table(world):
    rx = refit.Receiver(streamers=world)
    weights = {name: torch.zeros_like(t) for name, t in full_state(0).items()}
    rx.add_parameters(weights)
    assert len(rx.endpoints) == world and rx.endpoints[0] == rx.endpoint
    streamers = [
        refit.Streamer(rx.endpoints[r], transport="host_shm", buffer_bytes=1 << 10, group_rank=r, group_size=world)
        for r in range(world)
    ]
    with Serving(rx) as s:
        for version in (1, 2):
            state = full_state(version)
            stats = [None] * world

            def send(r):
                stats[r] = streamers[r].refit(version, shard_state(state, r, world))

            assert each_rank(world, send) == [None] * world
            assert rx.committed_version == version
            assert not rx.dirty
            for name, t in state.items():
                assert torch.equal(weights[name], t), name
            assert sum(st.bytes for st in stats) == sum(t.numel() * t.element_size() for t in state.values())
        for st in streamers:
            st.close()
    # The serving thread has stopped: every event serve_one() returned is in the list (a streamer's
    # refit() returns once the last END is answered, which serve_one() reports a moment later).
    assert refit.Event.ended in s.events
    assert s.events.count(refit.Event.committed) == 2
    rx.close()


def test_on_tensor_sees_each_tensor_once_assembled_from_every_rank():
    world = 2
    rx = refit.Receiver(streamers=world)
    seen = {}

    @rx.on_tensor
    def load_weights(name, tensor):
        assert name not in seen, f"{name} delivered twice"
        seen[name] = tensor.clone()

    streamers = [
        refit.Streamer(rx.endpoints[r], transport="host_shm", buffer_bytes=1 << 10, group_rank=r, group_size=world)
        for r in range(world)
    ]
    state = full_state(3)
    with Serving(rx):
        assert each_rank(world, lambda r: streamers[r].refit(3, shard_state(state, r, world))) == [None, None]
        for st in streamers:
            st.close()
    assert rx.committed_version == 3
    assert set(seen) == set(state)
    for name, t in state.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), name
    rx.close()


def test_rows_sent_twice_fail_the_version_on_every_rank_and_the_next_commits():
    world = 2
    rx = refit.Receiver(streamers=world)
    w = torch.zeros(8, 4)
    rx.add_parameter("w", w)
    streamers = [
        refit.Streamer(rx.endpoints[r], transport="host_shm", group_rank=r, group_size=world) for r in range(world)
    ]
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    with Serving(rx):
        # Rank 1 claims rows [3, 8): row 3 is rank 0's too.
        parts = [refit.Shard(full[0:4], (8, 4), 0, 0), refit.Shard(full[3:8], (8, 4), 0, 3)]
        raised = each_rank(world, lambda r: streamers[r].refit(1, {"w": parts[r]}))
        for e in raised:
            assert isinstance(e, refit.RefitError)
            assert e.code == refit.Errc.invalid_argument
            assert "tensor 'w': rows [3, 4) were sent by rank 0 and by rank 1 (their shards overlap)" in str(e)
        assert rx.committed_version is None
        assert rx.dirty
        parts = [refit.Shard(full[0:4], (8, 4), 0, 0), refit.Shard(full[4:8], (8, 4), 0, 4)]
        assert each_rank(world, lambda r: streamers[r].refit(2, {"w": parts[r]})) == [None, None]
        for st in streamers:
            st.close()
    assert rx.committed_version == 2
    assert torch.equal(w, full)
    rx.close()


def test_a_shard_without_a_group_is_refused_before_anything_moves():
    rx = refit.Receiver()
    w = torch.zeros(8, 4)
    rx.add_parameter("w", w)
    with Serving(rx), refit.Streamer(rx.endpoint, transport="host_shm") as st:
        with pytest.raises(refit.RefitError) as failure:
            st.refit(1, {"w": refit.Shard(torch.ones(4, 4), (8, 4), 0, 0)})
        assert failure.value.code == refit.Errc.invalid_argument
        assert "this streamer is alone (streamer_options::group_size 1)" in str(failure.value)
        # A whole tensor given as its own only shard goes as it is.
        st.refit(2, {"w": refit.Shard(torch.ones(8, 4), (8, 4))})
    assert rx.committed_version == 2
    assert torch.equal(w, torch.ones(8, 4))
    assert repr(refit.Shard(torch.ones(4, 4), (8, 4), -2, 4)) == "refit.Shard((4, 4) of (8, 4), dim=0, start=4)"
    rx.close()


def test_a_receiver_of_a_group_needs_an_endpoint_per_rank():
    with pytest.raises(refit.RefitError) as failure:
        refit.Receiver("ipc:///tmp/refit-one-endpoint", streamers=2)
    assert failure.value.code == refit.Errc.invalid_argument
    assert "binds one endpoint per streamer" in str(failure.value)
    with refit.Receiver("tcp://*:0", streamers=3) as rx:
        assert len(set(rx.endpoints)) == 3
        assert all(e.startswith("tcp://127.0.0.1:") for e in rx.endpoints)


# ------------------------------------------------------------------------------------- GPU


def group_table(chan, spec, device: int, streamers: int, shared_nccl: bool = False, idle_timeout: float = 60.0):
    """Job (peer process): a parameter table of CUDA tensors on ``device`` served for a group of
    ``streamers``; sends its endpoints. ``shared_nccl``: nccl ranks share a GPU (conftest.nccl_ranks).
    Commands: ``state``."""
    from conftest import claim_nccl_host, serve_loop, state_bytes, zeros_like_spec

    claim_nccl_host(shared_nccl)
    torch.cuda.set_device(device)
    params = zeros_like_spec(spec, device=f"cuda:{device}")
    with refit.Receiver(device=device, streamers=streamers, idle_timeout=idle_timeout) as rx:
        rx.add_parameters(params)
        chan.send(rx.endpoints)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(params)})


def mixed_shards(state, rank: int, world: int):
    """Shard(0) rows of every tensor with rows; a 0-d tensor goes whole from rank 0 alone."""
    out = {}
    for name, t in state.items():
        if t.dim() == 0:
            if rank == 0:
                out[name] = t
            continue
        rows = (t.shape[0] + world - 1) // world
        start = min(t.shape[0], rank * rows)
        out[name] = refit.Shard(t[start : min(t.shape[0], start + rows)], t.shape, 0, start)
    return out


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("gpus", [1, 2], ids=["one-gpu", "two-gpus"])
def test_two_ranks_on_cuda_commit_their_shards_bit_exact_over_cuda_ipc(peer, direct, gpus):
    from conftest import mixed_state, need_gpus, spec_of, state_bytes

    need_gpus(gpus)
    world = 2
    receiver_gpu = gpus - 1  # two GPUs: rank 1's shards are local, rank 0's cross NVLink
    job = peer.run(group_table, spec_of(mixed_state(1)), receiver_gpu, world)
    endpoints = job.recv()
    rank_gpu = [0, gpus - 1]
    streamers = [
        refit.Streamer(endpoints[r], transport="cuda_ipc", device=rank_gpu[r], direct=direct, buffer_bytes=64 << 10,
                       timeout=20.0, group_rank=r, group_size=world)
        for r in range(world)
    ]
    for version in (1, 2, 3):
        state = mixed_state(version)
        per_rank = [{k: v.to(f"cuda:{rank_gpu[r]}") for k, v in state.items()} for r in range(world)]
        stats = [None] * world

        def send(r):
            torch.cuda.set_device(rank_gpu[r])
            stats[r] = streamers[r].refit(version, mixed_shards(per_rank[r], r, world))

        assert each_rank(world, send) == [None, None]
        assert job.request("state") == state_bytes(state), f"version {version}"
        assert job.request("status")["committed_version"] == version
        assert all(s.direct is direct for s in stats)
    for st in streamers:
        st.close()
    job.stop()


def group_gpus(nccl_ranks, world: int, receivers: int):
    """GPUs of an nccl group test: (shared, the trainer ranks' GPUs, the receivers' GPUs). Each
    trainer rank has a communicator of its own with every receiver (1 + receivers NCCL ranks), so
    no two ranks of one communicator share a GPU where there are enough: the receivers on the last
    GPUs, the trainer ranks spread over the others. With fewer GPUs the ranks share them (each peer
    an NCCL host of its own, conftest.nccl_ranks). Sharing is decided per communicator, not for the
    world's ranks: the session's peer keeps the NCCL host it first joined with (NCCL reads it
    once), so every nccl test on a machine must come out the same (on 4 GPUs, four trainer ranks
    and a receiver once shared a GPU here, and the peer, which had joined as itself, could not)."""
    from conftest import cuda_devices, rank_gpu

    shared = nccl_ranks(1 + receivers)
    if shared:
        return True, [rank_gpu(0)] * world, [rank_gpu(1 + j) for j in range(receivers)]
    found = cuda_devices()
    trainers = found - receivers
    return False, [r % trainers for r in range(world)], [trainers + j for j in range(receivers)]


@pytest.mark.parametrize("direct", [True, False], ids=["in-place", "buffered"])
@pytest.mark.parametrize("world", [2, 4], ids=["two-ranks", "four-ranks"])
def test_ranks_commit_their_shards_bit_exact_over_nccl(peer, nccl_ranks, world, direct):
    """Each rank has a communicator of its own with the receiver and broadcasts only its rows."""
    from conftest import mixed_state, spec_of, state_bytes

    shared, gpu_of, (receiver_gpu,) = group_gpus(nccl_ranks, world, 1)
    job = peer.run(group_table, spec_of(mixed_state(1)), receiver_gpu, world, shared)
    endpoints = job.recv()
    streamers = [
        refit.Streamer(None, transport="nccl", receivers=[endpoints[r]], device=gpu_of[r], direct=direct,
                       buffer_bytes=64 << 10, timeout=30.0, group_rank=r, group_size=world)
        for r in range(world)
    ]
    for version in (1, 2, 3):
        state = mixed_state(version)
        per_rank = [{k: v.to(f"cuda:{gpu_of[r]}") for k, v in state.items()} for r in range(world)]
        stats = [None] * world

        def send(r):
            torch.cuda.set_device(gpu_of[r])
            stats[r] = streamers[r].refit(version, mixed_shards(per_rank[r], r, world))

        assert each_rank(world, send) == [None] * world
        assert job.request("state") == state_bytes(state), f"version {version}"
        assert job.request("status")["committed_version"] == version
        # A rank sends its rows, not the tensors: together they cover each tensor once.
        assert sum(s.bytes for s in stats) == sum(t.numel() * t.element_size() for t in state.values())
    for st in streamers:
        st.close()
    job.stop()


def group_tp_rank(chan, device: int, streamers: int, tp_rank: int, shared_nccl: bool):
    """Job: TP rank ``tp_rank`` of 2 served for a group of ``streamers``: half of "col"'s rows
    (column-parallel), half of "row"'s columns (row-parallel: a strided slice of the source) and all
    of "norm", on ``device``. Commands: ``state``."""
    from conftest import claim_nccl_host, serve_loop, state_bytes

    claim_nccl_host(shared_nccl)
    torch.cuda.set_device(device)
    held = {
        "col": torch.zeros(6, 16, dtype=torch.bfloat16, device=f"cuda:{device}"),
        "row": torch.zeros(10, 4, dtype=torch.float32, device=f"cuda:{device}"),
        "norm": torch.zeros(9, dtype=torch.float32, device=f"cuda:{device}"),
    }
    with refit.Receiver(device=device, streamers=streamers) as rx:
        rx.add_parameter("col", held["col"], source_slice=(0, 6 * tp_rank, 6))
        rx.add_parameter("row", held["row"], source_slice=(1, 4 * tp_rank, 4))
        rx.add_parameter("norm", held["norm"])
        chan.send(rx.endpoints)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(held)})


@pytest.mark.parametrize("direct", [True, False], ids=["in-place-asked", "buffered"])
def test_two_ranks_fill_a_tp2_pair_over_nccl(ranks, nccl_ranks, direct):
    """Each trainer rank holds Shard(0) rows of every tensor; each engine rank takes a slice, of
    "row" a column slice that needs rows of both trainer ranks. One communicator per trainer rank
    with both engine ranks. In place, every pair moves only its intersection (the rows of the
    rank's shard the engine rank's views take), straight into the views; buffered, whole shards
    are broadcast and the slices applied from the buffers."""
    from conftest import state_bytes

    world = 2
    shared, gpu_of, engine_gpus = group_gpus(nccl_ranks, world, 2)
    jobs = [p.run(group_tp_rank, engine_gpus[j], world, j, shared) for j, p in enumerate(ranks(2))]
    endpoints = [job.recv() for job in jobs]
    streamers = [
        refit.Streamer(None, transport="nccl", receivers=[endpoints[0][r], endpoints[1][r]], device=gpu_of[r],
                       direct=direct, buffer_bytes=64 << 10, timeout=30.0, group_rank=r, group_size=world)
        for r in range(world)
    ]
    for version in (3, 4):
        g = torch.Generator().manual_seed(version)
        whole = {
            "col": torch.randn(12, 16, generator=g).to(torch.bfloat16),
            "row": torch.randn(10, 8, generator=g),
            "norm": torch.randn(9, generator=g),
        }

        def send(r):
            torch.cuda.set_device(gpu_of[r])
            shards = {}
            for name, t in whole.items():
                rows = (t.shape[0] + world - 1) // world
                start = r * rows
                shards[name] = refit.Shard(t[start:start + rows].to(f"cuda:{gpu_of[r]}"), t.shape, 0, start)
            sent[r] = streamers[r].refit(version, shards).parts_bytes

        sent = [None] * world
        assert each_rank(world, send) == [None] * world
        # Trainer rank r's rows of each tensor, to each engine rank, only where its slice takes them:
        # col (bf16 [12, 16], rows 6j..6j+5): rank r's 6 rows reach engine rank r alone, 192 bytes;
        # row (f32 [10, 8], columns 4j..4j+3): rank r's 5 rows × 4 columns to each, 2 × 80 bytes;
        # norm (f32 [9], whole): rank 0's 5 elements, rank 1's 4, to each.
        assert sent == ([192 + 160 + 2 * 20, 192 + 160 + 2 * 16] if direct else [0, 0])
        for j, job in enumerate(jobs):
            expect = {"col": whole["col"][6 * j:6 * j + 6], "row": whole["row"][:, 4 * j:4 * j + 4].contiguous(),
                      "norm": whole["norm"]}
            assert job.request("state") == state_bytes(expect), f"TP rank {j}, version {version}"
    for st in streamers:
        st.close()
    for job in jobs:
        job.stop()


def held_state(version: int):
    """Six 128 KiB tensors: with 64 KiB buffers each rank's Shard(0) half of one fills a batch."""
    base = torch.arange(32 * 1024, dtype=torch.float32).reshape(32, 1024)
    return {f"layers.{i}.weight": base + (version * 100 + i) for i in range(6)}


def group_dies_mid_refit(chan, endpoints, gpu_of, world: int, shared: bool):
    """Job (a peer the test kills): the group's ranks commit version 1 over nccl (buffered), then
    start version 2 from tensors whose producer stream (torch's current one) is held by a sleep
    kernel, so every rank's broadcasts are enqueued but cannot run. Each rank says ("held", rank)
    once the receiver has answered its first BATCH (that batch's receives are posted on the
    receiver's GPU and wait for this process), then waits to be killed."""
    from conftest import claim_nccl_host

    claim_nccl_host(shared)
    streamers = [
        refit.Streamer(None, transport="nccl", receivers=[endpoints[r]], device=gpu_of[r], direct=False,
                       buffer_bytes=64 << 10, timeout=30.0, group_rank=r, group_size=world)
        for r in range(world)
    ]
    said = threading.Lock()  # the ranks' threads share the channel

    def send(version: int, r: int, hold: bool):
        torch.cuda.set_device(gpu_of[r])
        state = {k: v.to(f"cuda:{gpu_of[r]}") for k, v in held_state(version).items()}
        shards = list(mixed_shards(state, r, world).items())

        def tensors():
            if hold:
                torch.cuda._sleep(1 << 40)  # minutes of spinning, on the stream the tensors came from
            for i, item in enumerate(shards):
                # Asked for the fourth shard, the streamer has heard the reply to its first BATCH
                # (each is collected when the next one is sent).
                if hold and i == 3:
                    with said:
                        chan.send(("held", r))
                    threading.Event().wait()
                yield item

        streamers[r].refit(version, tensors())

    assert each_rank(world, lambda r: send(1, r, False)) == [None] * world
    chan.send("committed")
    each_rank(world, lambda r: send(2, r, True))  # never returns: the test kills this process


def test_a_group_whose_ranks_all_die_mid_broadcast_frees_the_receiver_and_a_new_group_commits(fresh_peer, nccl_ranks):
    """A trainer's ranks all killed while the receiver's nccl receives wait for them: the receiver
    aborts every lane's communicator together (an abort's free waits for every kernel on the
    device: one lane after the other, the first would wait forever for the second's receive), keeps
    version 1, and a new group's version 3 commits bit-exact."""
    from conftest import Peer, spec_of, state_bytes

    world = 2
    shared, gpu_of, (receiver_gpu,) = group_gpus(nccl_ranks, world, 1)
    receiver = fresh_peer.run(group_table, spec_of(held_state(1)), receiver_gpu, world, shared, idle_timeout=3.0)
    endpoints = receiver.recv()
    trainer = Peer()
    try:
        job = trainer.run(group_dies_mid_refit, endpoints, gpu_of, world, shared)
        assert job.recv() == "committed"
        assert receiver.request("status")["committed_version"] == 1
        assert sorted([job.recv(), job.recv()]) == [("held", 0), ("held", 1)]
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.process.join(30)
        assert trainer.process.exitcode == -signal.SIGKILL
    finally:
        trainer.close()
    # The receiver hears nothing more of version 2 and aborts it after idle_timeout. A receiver stuck
    # in the abort answers no command: each request below would time out.
    deadline = time.monotonic() + 60
    while "aborted" not in receiver.request("events", timeout=30):
        assert time.monotonic() < deadline, "version 2 was never aborted"
    status = receiver.request("status", timeout=30)
    assert status["committed_version"] == 1
    assert status["dirty"]  # each rank's first BATCH of version 2 was taken (answered) before the kill

    streamers = [
        refit.Streamer(None, transport="nccl", receivers=[endpoints[r]], device=gpu_of[r], direct=False,
                       buffer_bytes=64 << 10, timeout=30.0, group_rank=r, group_size=world)
        for r in range(world)
    ]
    state = held_state(3)

    def send(r):
        torch.cuda.set_device(gpu_of[r])
        per_rank = {k: v.to(f"cuda:{gpu_of[r]}") for k, v in state.items()}
        streamers[r].refit(3, mixed_shards(per_rank, r, world))

    assert each_rank(world, send) == [None] * world
    assert receiver.request("state") == state_bytes(state)
    assert receiver.request("status")["committed_version"] == 3
    for st in streamers:
        st.close()
    receiver.stop()
