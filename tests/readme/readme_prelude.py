# Placeholders for what a real worker has and the README's Python fragments only name: its model,
# its training step, the RPC that hands an endpoint to the other side, its engine's loader and its
# generation loop. readme_blocks.py --prelude puts this text before every
# `<!-- README-test: fragment -->` Python block; tests/python/test_readme.py runs the result and
# then calls readme_check().
#
# Unlike the C++ prelude these are real: the other side of the refit runs in a thread of the same
# process (a receiver serving a model of the same architecture for a trainer block, a streamer
# refitting `steps` versions for an engine block), so a block that runs has really refitted, and
# readme_check() compares the weights bit for bit.
import threading as _threading

import refit as _refit
import torch as _torch

_CUDA = _torch.cuda.is_available()
_DEVICE = "cuda" if _CUDA else "cpu"
_TRANSPORT = "cuda_ipc" if _CUDA else "host_shm"


def _make_model(seed):
    g = _torch.Generator().manual_seed(seed)
    m = _torch.nn.Sequential(_torch.nn.Linear(16, 48), _torch.nn.GELU(), _torch.nn.Linear(48, 8))
    with _torch.no_grad():
        for p in m.parameters():
            p.copy_(_torch.randn(p.shape, generator=g))
    return m.to(device=_DEVICE, dtype=_torch.bfloat16)


steps = 3                        # training steps the trainer block runs
model = _make_model(1)           # this side's model
_other = _make_model(2)          # the other side's: different weights until refitted
stop = _threading.Event()        # set by the streamer thread after its last refit
hooks = []                       # what pause_generation/resume_generation saw
_threads = []
_errors = []
_served = {}                     # endpoint_from_generation_worker(): the receiver thread's state


def train_step(m):
    with _torch.no_grad():
        for p in m.parameters():
            p.add_(_torch.randn_like(p) * 0.01)


def pause_generation():
    hooks.append("pause")


def resume_generation(version):
    hooks.append(("resume", version))


class _Engine:
    """An engine whose loader takes (name, tensor) pairs, like vLLM's and SGLang's."""

    def __init__(self, m):
        self._params = dict(m.named_parameters())

    def load_weights(self, weights):
        with _torch.no_grad():
            for name, tensor in weights:
                self._params[name].copy_(tensor)


engine = _Engine(model)


def _thread(fn):
    def run():
        try:
            fn()
        except BaseException as e:  # reported by readme_check()
            _errors.append(e)
            stop.set()

    t = _threading.Thread(target=run, daemon=True)
    t.start()
    _threads.append(t)


def endpoint_from_generation_worker():
    """A generation worker serving `_other` in a thread; its endpoint."""
    rx = _refit.Receiver()
    rx.add_parameters(_other.named_parameters())
    _served["rx"] = rx
    done = _threading.Event()
    _served["done"] = done
    _thread(lambda: rx.serve(done))
    return rx.endpoint


def send_to_trainer(endpoint):
    """A trainer refitting `_other`'s weights to `endpoint` `steps` times, in a thread; sets `stop`
    once the last version is committed (and the streamer closed)."""

    def run():
        try:
            with _refit.Streamer(endpoint, transport=_TRANSPORT, timeout=60.0) as st:
                for step in range(1, steps + 1):
                    train_step(_other)
                    _served.setdefault("stats", []).append(st.refit(step, _other.state_dict()))
        finally:
            stop.set()

    _thread(run)


def _same_bits(a, b):
    return _torch.equal(a.detach().cpu().view(_torch.int16), b.detach().cpu().view(_torch.int16))


def readme_check():
    """After a block ran: the other side finished without error and both models hold the same
    bits, at version `steps`."""
    if "done" in _served:
        _served["done"].set()
    for t in _threads:
        t.join(120)
        assert not t.is_alive(), "the other side's thread did not finish within 120 s"
    if _errors:
        raise _errors[0]
    assert _threads, "the block never called endpoint_from_generation_worker() or send_to_trainer()"
    if "rx" in _served:
        assert _served["rx"].committed_version == steps, _served["rx"].committed_version
        _served["rx"].close()
    else:
        assert [s.version for s in _served["stats"]] == list(range(1, steps + 1))
    mine, theirs = dict(model.named_parameters()), dict(_other.named_parameters())
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert _same_bits(mine[name], theirs[name]), f"{name} differs after the refits"
    with open(__file__, encoding="utf-8") as f:
        hooked = "rx.on_" + "begin(" in f.read()  # the block registered hooks (split: not this line)
    if hooked:
        want = [x for v in range(1, steps + 1) for x in ("pause", ("resume", v))]
        assert hooks == want, f"hooks: {hooks}"
    print("readme_check: ok,", len(mine), "tensors equal at version", steps, "hooks:", hooks)
