"""Which NCCL refit loads (include/refit/nccl.hpp): one per process, torch's when torch brings one,
the one REFIT_NCCL_LIBRARY names otherwise, and peers of other NCCL versions refused at HELLO with
both versions, before any communicator exists.

The CPU cases run in fresh interpreters (a process loads its NCCL once); the GPU cases pair this
process (torch imported first, as every test here) with a peer told to load another NCCL.
"""

import ctypes.util
import glob
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import refit
from conftest import (
    claim_nccl_host,
    mixed_state,
    rank_gpu,
    serve_loop,
    spec_of,
    state_bytes,
    streamer,
    zeros_like_spec,
)


def nccl_in_fresh_python(env_extra=None, before="", call="refit.nccl_library()"):
    """refit.nccl_library() (or `call`) as a new interpreter sees it, after `before`."""
    code = f"import json, refit\n{before}\nprint(json.dumps({call}))"
    env = dict(os.environ, **(env_extra or {}))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def default_nccl():
    info = nccl_in_fresh_python()
    if not info["available"]:
        pytest.skip(f"no NCCL here: {info['error']}")
    return info


def test_without_nccl_built_in_or_found_the_reason_is_said_and_nothing_is_loaded():
    info = nccl_in_fresh_python()
    if info["available"]:
        assert info["version"] >= 21900 and os.path.basename(info["path"]).startswith("libnccl.so")
        assert info["chosen_by"] and info["error"] == ""
    else:
        assert info["path"] == "" and info["version"] == 0
        assert "built without NCCL" in info["error"] or "no NCCL could be loaded" in info["error"]


def test_a_missing_library_named_in_REFIT_NCCL_LIBRARY_is_reported_with_dlopens_reason(tmp_path):
    default_nccl()
    missing = str(tmp_path / "libnccl.so.2")
    info = nccl_in_fresh_python({"REFIT_NCCL_LIBRARY": missing})
    assert not info["available"]
    assert info["error"].startswith(f"cannot load {missing} (REFIT_NCCL_LIBRARY): ")
    assert "No such file or directory" in info["error"]


def test_a_library_that_is_not_nccl_is_refused_by_name():
    default_nccl()
    libz = ctypes.util.find_library("z")
    if libz is None:
        pytest.skip("no libz to stand in for a library that is not NCCL")
    info = nccl_in_fresh_python({"REFIT_NCCL_LIBRARY": libz})
    assert not info["available"]
    assert info["error"] == f"{libz} (REFIT_NCCL_LIBRARY) has no ncclGetVersion: it is not NCCL 2.19 or newer"


def test_an_nccl_the_process_loaded_first_is_the_one_refit_uses():
    path = default_nccl()["path"]
    info = nccl_in_fresh_python(
        {"REFIT_NCCL_LIBRARY": ""}, before=f"import ctypes; ctypes.CDLL({path!r}, mode=ctypes.RTLD_GLOBAL)"
    )
    assert info["available"] and info["path"] == path
    # torch's wheel, when torch brought one, is loaded by torch itself at import: that one again.
    assert info["chosen_by"] == "loaded in this process"


def test_use_nccl_library_names_it_and_another_one_later_is_refused_with_both(tmp_path):
    path = default_nccl()["path"]
    named = nccl_in_fresh_python(
        {"REFIT_NCCL_LIBRARY": ""}, before=f"refit.use_nccl_library({path!r})"
    )
    assert named["available"] and named["path"] == path and named["chosen_by"] == "use_nccl_library"
    other = str(tmp_path / "libnccl.so.2")
    code = (
        f"refit.use_nccl_library({path!r})\n"
        "try:\n"
        f"    refit.use_nccl_library({other!r})\n"
        "    out = None\n"
        "except refit.RefitError as e:\n"
        "    out = [str(e.code), str(e)]"
    )
    code_and_message = nccl_in_fresh_python({"REFIT_NCCL_LIBRARY": ""}, before=code, call="out")
    assert code_and_message is not None, "a second library was accepted"
    assert "invalid_argument" in code_and_message[0]
    assert f"use_nccl_library({other}): NCCL" in code_and_message[1]
    assert "is in use already (use_nccl_library)" in code_and_message[1]


def test_the_nccl_of_torchs_wheel_is_preferred_whatever_the_import_order():
    torch_nccl = refit._torch_nccl
    if torch_nccl is None:
        pytest.skip("torch here brings no NCCL wheel (nvidia.nccl)")
    for before in ("", "import torch"):  # refit first, then torch; or torch first
        info = nccl_in_fresh_python({"REFIT_NCCL_LIBRARY": ""}, before=before)
        assert info["available"]
        assert os.path.realpath(info["path"]) == os.path.realpath(torch_nccl), before


# ------------------------------------------------------------------------------ GPU: two peers


def system_nccl_other_than(version: int):
    """A libnccl.so.2 of another version than `version` on this machine, or None."""
    candidates = glob.glob("/usr/lib/x86_64-linux-gnu/libnccl.so.2*") + glob.glob("/usr/local/cuda*/lib64/libnccl.so.2*")
    for path in sorted(set(os.path.realpath(p) for p in candidates)):
        info = nccl_in_fresh_python({"REFIT_NCCL_LIBRARY": path})
        if info["available"] and info["version"] != version:
            return path, info
    return None


def nccl_table(chan, spec, device: int, shared: bool, library):
    """Job: a parameter table on `device` behind an nccl receiver that loads `library` (None: the
    default choice). Sends its endpoint, then its nccl_library(). Commands: ``state``."""
    if library is not None:
        os.environ["REFIT_NCCL_LIBRARY"] = library
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    claim_nccl_host(shared)
    torch.cuda.set_device(device)
    params = zeros_like_spec(spec, device=f"cuda:{device}")
    with refit.Receiver(device=device) as rx:
        rx.add_parameters(params)
        chan.send(rx.endpoint)
        chan.send(refit.nccl_library())
        return serve_loop(rx, chan, {"state": lambda: state_bytes(params)})


def test_peers_with_the_same_nccl_commit_and_another_version_is_refused_at_hello(fresh_peer, nccl_ranks):
    shared = nccl_ranks(2)
    torch.cuda.set_device(0)
    mine = refit.nccl_library()
    assert mine["available"], mine["error"]
    spec = spec_of(mixed_state(1))

    # The same library (the peer imported torch too, and took torch's): every version commits.
    job = fresh_peer.run(nccl_table, spec, rank_gpu(1), shared, None)
    endpoint = job.recv()
    theirs = job.recv()
    assert (theirs["version"], os.path.realpath(theirs["path"])) == (mine["version"], os.path.realpath(mine["path"]))
    with streamer(None, transport="nccl", receivers=[endpoint], device=0, buffer_bytes=64 << 10) as st:
        state = mixed_state(1, device="cuda:0")
        st.refit(1, state)
        assert job.request("state") == state_bytes(state)
    job.stop()

    other = system_nccl_other_than(mine["version"])
    if other is None:
        pytest.skip(f"no NCCL of another version than {mine['version']} on this machine")
    path, info = other
    job = fresh_peer.run(nccl_table, spec, rank_gpu(1), shared, path)
    endpoint = job.recv()
    assert job.recv()["version"] == info["version"]
    with streamer(None, transport="nccl", receivers=[endpoint], device=0, buffer_bytes=64 << 10, timeout=30.0) as st:
        t0 = time.monotonic()
        with pytest.raises(refit.RefitError) as caught:
            st.refit(1, mixed_state(1, device="cuda:0"))
        took = time.monotonic() - t0
    message = str(caught.value)
    v = lambda n: f"{n // 10000}.{n // 100 % 100}.{n % 100}"  # noqa: E731
    assert caught.value.code == refit.Errc.nccl, message
    assert "this receiver refuses the session of" in message and "before making a communicator" in message
    assert f"this process uses NCCL {v(info['version'])} ({info['path']})" in message
    assert f"the streamer uses NCCL {v(mine['version'])} ({mine['path']})" in message
    assert took < 10.0, f"the refusal took {took:.1f} s (the reply timeout is 30 s)"
    assert job.request("status")["committed_version"] is None
    job.stop()
