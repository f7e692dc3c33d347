"""Device-staged receivers on the GPU (skipped without CUDA): a transformers Llama engine that
generates without pause while new versions arrive over cuda_ipc and over nccl, and applies each
between two of its steps. Every step is tagged with the version it ran on, and its logits must equal
those of a reference model of that version, bit for bit: no step ever ran on a mix of versions.

The engine runs in the shared peer process (spawned: it never inherits a CUDA context); the
trainer, the reference and the streamer run here.
"""

import hashlib
import threading
import time

import pytest
import torch

import refit
from conftest import SERVE_LIMIT, _STOP, cuda_devices, need_gpus, rank_gpu, serve_loop, state_bytes
from test_gpu import fixed_ids, gpu_streamer, llama, logits, use_device


def digest(t) -> str:
    """The raw bytes of a tensor, hashed (bf16 included)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


#: Model sizes: "small" (3 M parameters: a transfer takes a millisecond) and "large" (~0.9 B: over
#: NCCL's network transport a transfer takes a fraction of a second, long enough that the engine runs
#: steps while it travels, and the step rate then is measured against the idle one).
SIZES = {"small": {"hidden": 256, "layers": 2}, "large": {"hidden": 2048, "layers": 16}}


def generating_engine(chan, device: int, nccl: bool, shared: bool, size: str = "small"):
    """Job: the same Llama as the reference of version 0 (seed 1) as an engine that runs one forward
    step after another while a thread serves its device-staged receiver; between two steps it
    applies the version that waits (on torch's current stream) and tells the test ("applied", v).
    Returns every step's (version, logits digest) and the step rates with and without a transfer
    in progress, once the test sends ("done",)."""
    use_device(device, nccl, shared)
    torch.manual_seed(1)
    model = llama(device, **SIZES[size])
    model.eval()
    params = dict(model.named_parameters())
    rx = refit.Receiver(device=device, stage="device")
    rx.add_parameters(model.named_parameters())
    rx.add_parameters((k, v) for k, v in model.state_dict().items() if k not in params)
    transfer = threading.Event()
    rx.on_begin(lambda v: transfer.set())
    rx.on_prepared(lambda v: transfer.clear())
    stop = threading.Event()
    serving = threading.Thread(target=rx.serve, args=(stop,), kwargs={"poll": 0.01})
    serving.start()
    steps, busy, idle = [], [0, 0.0], [0, 0.0]
    ids = fixed_ids(device)
    try:
        chan.send(rx.endpoint)
        deadline = time.monotonic() + SERVE_LIMIT
        while time.monotonic() < deadline:
            during = transfer.is_set()
            t0 = time.monotonic()
            with torch.no_grad():
                out = model(input_ids=ids).logits
            version = rx.committed_version or 0  # only this thread applies: the weights this step read
            steps.append((version, digest(out)))  # waits for the step
            tally = busy if during and transfer.is_set() else idle
            tally[0] += 1
            tally[1] += time.monotonic() - t0
            applied = rx.apply()  # between two steps
            if applied is not None:
                chan.send(("applied", applied))
            msg = chan.poll()
            if msg == ("done",) or msg == _STOP:
                break
        else:
            raise TimeoutError("the test never said done")
    finally:
        stop.set()
        serving.join()
        rx.close()
    return {"steps": steps, "busy": busy, "idle": idle, "stage": rx.stage}


@pytest.mark.parametrize("transport,size", [("cuda_ipc", "small"), ("nccl", "small"), ("nccl", "large")])
def test_an_engine_generating_without_pause_runs_every_step_on_one_whole_version(peer, nccl_ranks, transport, size):
    nccl = transport == "nccl"
    if nccl:
        shared = nccl_ranks(2)
    else:
        need_gpus(1)
        shared = False
    pytest.importorskip("transformers")
    torch.cuda.set_device(0)
    torch.manual_seed(1)
    expected = {0: digest(logits(llama(0, **SIZES[size]), 0))}  # the engine's own initial weights
    torch.manual_seed(0)
    model = llama(0, **SIZES[size])
    job = peer.run(generating_engine, rank_gpu(1) if nccl else 0, nccl, shared, size)
    endpoint = job.recv()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 1000, (4, 33), generator=torch.Generator().manual_seed(5)).to("cuda:0")
    # Small buffers: a version takes many batches, so the engine runs steps while it travels.
    with gpu_streamer(endpoint, transport, buffer_bytes=(1 << 20) if size == "small" else (64 << 20), atomic=nccl) as st:
        for version in range(1, 4):
            model.train()
            loss = model(input_ids=data[:, :-1], labels=data[:, 1:]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            expected[version] = digest(logits(model, 0))
            stats = st.refit(version, model.state_dict())
            assert stats.commit_seconds > 0 if nccl else stats.commit_seconds == 0
            # The next BEGIN would be refused while this version waits: the trainer waits for the engine.
            assert job.recv() == ("applied", version)
    job.send(("done",))
    out = job.result()
    assert out["stage"] == "device"
    seen = {}
    for k, (version, got) in enumerate(out["steps"]):
        assert got == expected[version], f"step {k} ran on version {version}, but its logits are not that version's"
        seen[version] = seen.get(version, 0) + 1
    assert sorted(seen) == [0, 1, 2, 3], f"steps per version: {seen}"
    (busy_steps, busy_s), (idle_steps, idle_s) = out["busy"], out["idle"]
    print(
        f"{transport} {size}: {len(out['steps'])} steps, {busy_steps} during transfers "
        f"({busy_steps / busy_s if busy_s else 0:.0f}/s) against {idle_steps / idle_s if idle_s else 0:.0f}/s idle"
    )


def staged_tp_rank(chan, device: int, tp_rank: int, nccl: bool, shared: bool):
    """Job: TP rank ``tp_rank`` of 2 on ``device``, device-staged: half of "col"'s rows, half of
    "row"'s columns (a strided slice of the source) and all of "norm". Commands: ``state`` (its
    weights as they are), ``prepared`` (the version waiting in the stage), ``apply`` (on torch's
    current stream; returns the version applied)."""
    use_device(device, nccl, shared)
    held = {
        "col": torch.zeros(6, 16, dtype=torch.bfloat16, device=f"cuda:{device}"),
        "row": torch.zeros(10, 4, dtype=torch.float32, device=f"cuda:{device}"),
        "norm": torch.zeros(9, dtype=torch.float32, device=f"cuda:{device}"),
    }
    with refit.Receiver(device=device, stage="device") as rx:
        rx.add_parameter("col", held["col"], source_slice=(0, 6 * tp_rank, 6))
        rx.add_parameter("row", held["row"], source_slice=(1, 4 * tp_rank, 4))
        rx.add_parameter("norm", held["norm"])
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(held), "prepared": lambda: rx.prepared_version,
                                     "apply": rx.apply})


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_one_trainer_writes_two_device_staged_tp_ranks_and_each_applies_the_whole_version(ranks, nccl_ranks, transport):
    """Engine-wide versions to two TP ranks (on GPUs of their own where there are enough), each
    staged on its GPU: a cuda_ipc trainer writes each rank's stage directly, nccl sends each rank
    only its parts, received into its stage in place; each rank's weights stay as they were until it
    applies, and then hold its slices of the version, bit for bit."""
    nccl = transport == "nccl"
    if nccl:
        shared = nccl_ranks(3)
        devices = [rank_gpu(1), rank_gpu(2)]
    else:
        need_gpus(1)
        shared = False
        devices = [0, 1 % min(2, cuda_devices())]
    jobs = [p.run(staged_tp_rank, devices[j], j, nccl, shared) for j, p in enumerate(ranks(2))]
    endpoints = [job.recv() for job in jobs]
    torch.cuda.set_device(0)
    zeros = {"col": torch.zeros(6, 16, dtype=torch.bfloat16), "row": torch.zeros(10, 4), "norm": torch.zeros(9)}
    before = [state_bytes(zeros)] * 2
    with refit.Streamer(None, transport=transport, receivers=endpoints, device=0, atomic=True, timeout=30.0) as st:
        for version in (1, 2):
            g = torch.Generator().manual_seed(version)
            whole = {"col": torch.randn(12, 16, generator=g).to(torch.bfloat16), "row": torch.randn(10, 8, generator=g),
                     "norm": torch.randn(9, generator=g)}
            stats = st.refit(version, {k: v.to("cuda:0") for k, v in whole.items()})
            assert stats.direct and stats.commit_seconds > 0
            # nccl: each rank's 6 rows of "col" (192 bytes), 4 columns of "row" (160) and "norm" (36).
            assert stats.parts_bytes == (2 * (192 + 160 + 36) if nccl else 0)
            for j, job in enumerate(jobs):
                assert job.request("prepared") == version
                assert job.request("state") == before[j], f"TP rank {j}: weights changed before apply()"
                assert job.request("apply") == version
                expect = {"col": whole["col"][6 * j:6 * j + 6], "row": whole["row"][:, 4 * j:4 * j + 4].contiguous(),
                          "norm": whole["norm"]}
                before[j] = state_bytes(expect)
                assert job.request("state") == before[j], f"TP rank {j}, version {version}"
    for job in jobs:
        job.stop()
