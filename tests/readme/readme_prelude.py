# Placeholders for what a real worker has and the README's Python fragments only name: its model,
# its training step, the RPC that hands an endpoint to the other side, its engine's loader and its
# generation loop. readme_blocks.py --prelude puts this text before every
# `<!-- README-test: fragment -->` Python block; tests/python/test_readme.py runs the result and
# then calls readme_check().
#
# Unlike the C++ prelude these are real: the other side of the refit runs in a process of its own
# (tests/readme/readme_peer.py: a receiver for a trainer block, a streamer refitting `steps`
# versions for an engine block), so a block that runs has really refitted, and readme_check()
# compares both sides' weights bit for bit.
import os as _os
import subprocess as _subprocess
import sys as _sys
import tempfile as _tempfile
import threading as _threading

import torch as _torch

_HERE = _os.environ["REFIT_README_DIR"]   # tests/readme, set by test_readme.py
_sys.path.insert(0, _HERE)
import readme_peer as _peer  # noqa: E402

steps = 3                                # training steps the trainer block runs
model = _peer.make_model(1)              # this side's model
stop = _threading.Event()                # set once the peer trainer finished
hooks = []                               # what pause_generation/resume_generation saw
_procs = []
_tmp = _tempfile.mkdtemp(prefix="refit-readme-")
_out = _os.path.join(_tmp, "peer.pt")


def train_step(m):
    _peer.train_step(m)


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


def endpoint_from_generation_worker():
    """A generation worker in another process; its endpoint."""
    p = _subprocess.Popen([_sys.executable, _os.path.join(_HERE, "readme_peer.py"), "serve", _out],
                          stdout=_subprocess.PIPE, text=True)
    _procs.append(p)
    return p.stdout.readline().strip()


def send_to_trainer(endpoint):
    """A trainer in another process refits `steps` versions to `endpoint`; `stop` is set when it
    is done."""
    p = _subprocess.Popen([_sys.executable, _os.path.join(_HERE, "readme_peer.py"), "stream", endpoint,
                           str(steps), _out])
    _procs.append(p)
    _threading.Thread(target=lambda: (p.wait(), stop.set()), daemon=True).start()


def readme_check():
    """After a block ran: the peer finished without error, and both sides hold the same bits at
    version `steps`."""
    assert _procs, "the block never called endpoint_from_generation_worker() or send_to_trainer()"
    for p in _procs:
        assert p.wait(120) == 0, f"the peer process failed ({p.returncode})"
    peer = _torch.load(_out)
    assert peer.get("version", steps) == steps, peer.get("version")
    assert peer.get("versions", list(range(1, steps + 1))) == list(range(1, steps + 1)), peer.get("versions")
    mine = _peer.weights(model)
    assert mine.keys() == peer["weights"].keys()
    for name, t in mine.items():
        assert _torch.equal(t.view(_torch.int16), peer["weights"][name].view(_torch.int16)), f"{name} differs"
    with open(__file__, encoding="utf-8") as f:
        hooked = "rx.on_" + "begin(" in f.read()  # the block registered hooks (split: not this line)
    if hooked:
        want = [x for v in range(1, steps + 1) for x in ("pause", ("resume", v))]
        assert hooks == want, f"hooks: {hooks}"
    print("readme_check: ok,", len(mine), "tensors equal at version", steps, "hooks:", hooks)
