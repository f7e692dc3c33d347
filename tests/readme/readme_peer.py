"""The other side of the README's Python blocks (tests/python/test_readme.py), in a process of its
own: CUDA IPC cannot map memory into the process that exported it.

    readme_peer.py serve OUT               a generation worker: prints its endpoint, serves until
                                           BYE, saves its weights and committed version to OUT
    readme_peer.py stream ENDPOINT N OUT   a trainer: N steps, a refit after each, saves its
                                           weights and the versions committed to OUT

Both hold make_model(2): other weights than the README block's make_model(1) until refitted.
"""

import sys
import time

import refit
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRANSPORT = "cuda_ipc" if CUDA else "host_shm"


def make_model(seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m.to(device=DEVICE, dtype=torch.bfloat16)


def train_step(m):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)


def weights(m):
    if CUDA:
        torch.cuda.synchronize()
    return {name: p.detach().cpu() for name, p in m.named_parameters()}


def serve(out):
    model = make_model(2)
    with refit.Receiver() as rx:
        rx.add_parameters(model.named_parameters())
        print(rx.endpoint, flush=True)
        deadline = time.monotonic() + 120
        while rx.serve_one(timeout=0.1) != refit.Event.bye:
            if time.monotonic() > deadline:
                raise TimeoutError("readme_peer serve: no BYE within 120 s")
        torch.save({"weights": weights(model), "version": rx.committed_version}, out)


def stream(endpoint, steps, out):
    model = make_model(2)
    versions = []
    with refit.Streamer(endpoint, transport=TRANSPORT, timeout=60.0) as st:
        for step in range(1, steps + 1):
            train_step(model)
            versions.append(st.refit(step, model.state_dict()).version)
    torch.save({"weights": weights(model), "versions": versions}, out)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        stream(sys.argv[2], int(sys.argv[3]), sys.argv[4])
