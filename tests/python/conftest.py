"""Shared helpers of refit's pytest suite.

Multi-process tests run the receiver in a *peer*: a process started with the ``spawn`` method
(it imports torch and refit itself, never inherits a CUDA context) that runs *jobs*, functions
``fn(chan, *args)`` defined at the top level of a test module or of this file. A job talks to its
test through ``chan``; the test holds a :class:`Job` with ``send``, ``recv`` and ``result``.

Rules the helpers enforce, so that a bug gives a failure and never a hang:
- every wait has a deadline (``WAIT`` seconds unless told), on both sides;
- synchronisation goes through the pipe (messages), never through sleeping;
- a job that is still running when its test ends is told to stop, and its process is killed if
  it does not; a job that runs past JOB_LIMIT ends its process; a peer whose parent died exits;
- endpoints come from ``Receiver.endpoint`` (a private ``ipc://`` socket by default, or
  ``tcp://127.0.0.1:0`` read back): no fixed ports.

One peer (``peer``) is shared by the tests of a session, so that torch is imported once; tests
that kill or signal their peer take a ``fresh_peer`` of their own.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import pytest

CTX = multiprocessing.get_context("spawn")

#: The longest any single wait of the suite may take, in seconds (a message, a refit, a join).
WAIT = float(os.environ.get("REFIT_TEST_WAIT", "60"))
#: Streamers' reply deadline in tests: a receiver that is not serving fails the refit this soon.
STREAMER_TIMEOUT = 20.0
#: How long a peer's serve loop runs at most before it gives up on its test.
SERVE_LIMIT = 4 * WAIT
#: How long a job may run at all: past it, its process exits (code 70).
JOB_LIMIT = SERVE_LIMIT + WAIT

_STOP = "__stop__"


class PeerFailed(AssertionError):
    """The peer's job raised (the message holds its traceback) or the peer died."""


class Stopped(Exception):
    """Raised in a job by Channel.recv() when its test told it to stop."""


# ------------------------------------------------------------------------- the child's side


class Channel:
    """A job's end of the pipe to its test."""

    def __init__(self, conn, job_id: int) -> None:
        self._conn = conn
        self._id = job_id

    def send(self, obj: Any) -> None:
        self._conn.send(("msg", self._id, obj))

    def poll(self) -> Optional[Any]:
        """A message from the test if one is waiting (``_STOP`` included), else None."""
        while self._conn.poll(0):
            kind, job_id, obj = self._conn.recv()
            if job_id == self._id:
                return _STOP if kind == "stop" else obj
        return None

    def recv(self, timeout: float = WAIT) -> Any:
        """The next message from the test; raises Stopped when the test said stop, TimeoutError
        past the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(f"the test sent nothing for {timeout} s")
            kind, job_id, obj = self._conn.recv()
            if job_id != self._id:
                continue  # a message meant for an earlier job
            if kind == "stop":
                raise Stopped()
            return obj


def _peer_main(conn) -> None:
    """The peer's loop: runs jobs until told to exit, the test process dies or nothing comes."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            if not conn.poll(10.0):
                if parent is not None and not parent.is_alive():
                    return
                continue
            kind, job_id, payload = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "exit":
            return
        if kind != "job":
            continue  # a late message for a job that already ended
        fn, args, kwargs = payload
        chan = Channel(conn, job_id)
        # Whatever a job waits on, the process ends: past JOB_LIMIT the watchdog exits it.
        watchdog = threading.Timer(JOB_LIMIT, os._exit, args=(70,))
        watchdog.daemon = True
        watchdog.start()
        try:
            result = fn(chan, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            try:
                conn.send(("failed", job_id, text))
            except (OSError, ValueError):
                return
            continue
        finally:
            watchdog.cancel()
        conn.send(("done", job_id, result))


# -------------------------------------------------------------------------- the test's side


class Job:
    """A job running in a peer."""

    def __init__(self, peer: "Peer", job_id: int, name: str) -> None:
        self._peer = peer
        self.id = job_id
        self.name = name
        self.finished = False
        self._outcome: Optional[Tuple[str, Any]] = None

    def send(self, obj: Any) -> None:
        self._peer._conn.send(("msg", self.id, obj))

    def _next(self, timeout: float) -> Tuple[str, Any]:
        deadline = time.monotonic() + timeout
        conn = self._peer._conn
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerFailed(f"job {self.name}: nothing arrived from the peer within {timeout} s")
            try:
                ready = conn.poll(min(left, 0.5))
            except (EOFError, OSError):
                ready = True
            if not ready:
                if not self._peer.process.is_alive():
                    raise PeerFailed(f"job {self.name}: the peer died (exit code {self._peer.process.exitcode})")
                continue
            try:
                kind, job_id, obj = conn.recv()
            except (EOFError, OSError):
                self._peer.process.join(WAIT)
                raise PeerFailed(f"job {self.name}: the peer died (exit code {self._peer.process.exitcode})")
            if job_id != self.id:
                continue
            if kind in ("done", "failed"):
                self.finished = True
                self._outcome = (kind, obj)
            return kind, obj

    def recv(self, timeout: float = WAIT) -> Any:
        """The next message the job sent; PeerFailed if it raised, ended or nothing came."""
        if self.finished:
            self._raise_outcome("ended before sending the message the test waits for")
        kind, obj = self._next(timeout)
        if kind == "msg":
            return obj
        self._raise_outcome("ended before sending the message the test waits for")

    def request(self, *command: Any, timeout: float = WAIT) -> Any:
        """Sends a command to a job in :func:`serve_loop` and returns its answer."""
        self.send(command)
        return self.recv(timeout)

    def result(self, timeout: float = WAIT) -> Any:
        """The job's return value; PeerFailed with its traceback if it raised. Messages the job
        sent and the test did not read are an error too."""
        while not self.finished:
            kind, obj = self._next(timeout)
            if kind == "msg":
                raise PeerFailed(f"job {self.name} sent {obj!r}, which the test did not read")
        return self._raise_outcome("")

    def stop(self, timeout: float = WAIT) -> Any:
        """Tells the job to stop (a serve loop returns, a recv raises Stopped) and returns its
        result."""
        if not self.finished:
            self._peer._conn.send(("stop", self.id, None))
        return self.result(timeout)

    def _raise_outcome(self, why: str) -> Any:
        assert self._outcome is not None
        kind, obj = self._outcome
        if kind == "failed":
            raise PeerFailed(f"job {self.name} raised in the peer:\n{obj}")
        if why:
            raise PeerFailed(f"job {self.name} {why} (it returned {obj!r})")
        return obj


class Peer:
    """A spawned process running jobs one at a time."""

    def __init__(self) -> None:
        self._conn, child = CTX.Pipe(duplex=True)
        self.process = CTX.Process(target=_peer_main, args=(child,), daemon=True, name="refit-test-peer")
        self.process.start()
        child.close()
        self._next_id = 0
        self.job: Optional[Job] = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Job:
        """Starts ``fn(chan, *args, **kwargs)`` in the peer. ``fn`` must be a top-level function."""
        assert self.job is None or self.job.finished, f"job {self.job.name} is still running"
        self._next_id += 1
        self.job = Job(self, self._next_id, getattr(fn, "__name__", repr(fn)))
        self._conn.send(("job", self._next_id, (fn, args, kwargs)))
        return self.job

    def settle(self, timeout: float = 10.0) -> bool:
        """Ends the running job, if any (told to stop). False when the peer is no longer usable."""
        job = self.job
        if job is not None and not job.finished and self.alive():
            try:
                job.stop(timeout)
            except PeerFailed:
                pass
        return self.alive() and (job is None or job.finished)

    def close(self, timeout: float = 10.0) -> None:
        if self.alive():
            try:
                self._conn.send(("exit", 0, None))
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()


@pytest.fixture(scope="session")
def _shared_peer():
    holder: Dict[str, Peer] = {}
    yield holder
    if "peer" in holder:
        holder["peer"].close()


@pytest.fixture
def peer(_shared_peer) -> Peer:
    """A peer process shared with other tests (torch imported once). Leave it alive."""
    p = _shared_peer.get("peer")
    if p is None or not p.alive():
        p = _shared_peer["peer"] = Peer()
    yield p
    if not p.settle():
        p.close()
        del _shared_peer["peer"]


@pytest.fixture
def fresh_peer() -> Peer:
    """A peer process of this test alone, closed (killed if need be) at its end."""
    p = Peer()
    yield p
    p.settle()
    p.close()


# ------------------------------------------------------------------------------ tensors


def tensor_bytes(t) -> Tuple[str, Tuple[int, ...], bytes]:
    """A tensor as (dtype, shape, raw bytes): compares bit for bit (NaNs, -0.0, bf16 included)
    and travels through a pipe without torch's shared-memory pickling."""
    import torch

    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype), tuple(t.shape), raw


def state_bytes(tensors) -> Dict[str, Tuple[str, Tuple[int, ...], bytes]]:
    items = tensors.items() if hasattr(tensors, "items") else tensors
    return {name: tensor_bytes(t) for name, t in items}


def spec_of(tensors) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """(name, dtype name, shape) of each tensor: what a peer needs to allocate the same table."""
    items = tensors.items() if hasattr(tensors, "items") else tensors
    return [(name, str(t.dtype).replace("torch.", ""), tuple(t.shape)) for name, t in items]


def zeros_like_spec(spec, device: str = "cpu"):
    import torch

    return {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for name, dtype, shape in spec}


def mixed_state(version: int, device: str = "cpu"):
    """A state_dict of every common dtype, a 0-d and an empty tensor; different bytes per
    version (NaN, -0.0 and every bit pattern of the integer types included)."""
    import torch

    g = torch.Generator().manual_seed(1000 + version)
    f32 = torch.randn(33, 17, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = -0.0
    state = {
        "embed.weight": torch.randn(64, 24, generator=g).to(torch.bfloat16),
        "attn.qkv": torch.randn(24, 72, generator=g).to(torch.float16),
        "mlp.w1": f32,
        "mlp.w2": torch.randn(7, 5, 3, generator=g, dtype=torch.float64),
        "step": torch.tensor(version * 1_000_000_007, dtype=torch.int64),  # 0-d
        "positions": torch.randint(-(2**31), 2**31 - 1, (129,), generator=g, dtype=torch.int32),
        "bytes": torch.randint(0, 256, (300,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(5, 9, generator=g) > 0.5,
        "lora.empty": torch.empty(0, 16, dtype=torch.float32),
        "norm.weight": torch.randn(1, generator=g),
    }
    return {k: v.to(device) for k, v in state.items()}


# --------------------------------------------------------------------- refit in the peer


def streamer(endpoint: str, **options):
    """A host_shm Streamer with test-sized buffers and deadline."""
    import refit

    options.setdefault("transport", "host_shm")
    options.setdefault("buffer_bytes", 1 << 20)
    options.setdefault("timeout", STREAMER_TIMEOUT)
    return refit.Streamer(endpoint, **options)


def receiver_status(rx) -> Dict[str, Any]:
    s = rx.last_stats
    return {
        "committed_version": rx.committed_version,
        "dirty": rx.dirty,
        "last_error": rx.last_error,
        "stats": {k: getattr(s, k) for k in ("version", "tensors", "bytes", "batches", "seconds", "apply_seconds", "drain_seconds")},
    }


def serve_loop(rx, chan: Channel, handlers: Optional[Dict[str, Callable[..., Any]]] = None, events: Optional[list] = None) -> List[str]:
    """Serves ``rx`` until the test says stop; between messages answers commands
    ``(name, *args)`` with ``handlers[name](*args)`` (``status`` and ``events`` built in).
    Returns the names of the events serve_one() reported (idle left out)."""
    import refit

    seen = events if events is not None else []
    table = {"status": lambda: receiver_status(rx), "events": lambda: list(seen)}
    table.update(handlers or {})
    parent = multiprocessing.parent_process()
    deadline = time.monotonic() + SERVE_LIMIT
    while time.monotonic() < deadline:
        event = rx.serve_one(timeout=0.02)
        if event != refit.Event.idle:
            seen.append(event.name)
        msg = chan.poll()
        if msg is None:
            if parent is not None and not parent.is_alive():
                raise RuntimeError("the test process died")
            continue
        if msg == _STOP:
            return seen
        name, *args = msg
        chan.send(table[name](*args))
    raise TimeoutError(f"served {SERVE_LIMIT} s without being told to stop")


def serve_table(chan: Channel, spec, endpoint: Optional[str] = None, token: Optional[str] = None, fill: Optional[float] = None, control_lane: bool = True) -> List[str]:
    """Job: a Receiver with a parameter table allocated from ``spec`` (zeros, or ``fill``);
    sends its endpoint, then serves. Commands: ``state`` (the table as tensor_bytes),
    ``status``, ``events``."""
    import refit

    params = zeros_like_spec(spec)
    if fill is not None:
        for t in params.values():
            t.fill_(fill)
    kwargs = {} if token is None else {"token": token}
    if not control_lane:
        kwargs["control_lane"] = False
    with refit.Receiver(endpoint, **kwargs) as rx:
        rx.add_parameters(params)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(params)})


@pytest.fixture
def table_peer(peer):
    """Starts :func:`serve_table` in the shared peer: ``job, endpoint = table_peer(spec, ...)``."""

    def start(spec, **kwargs):
        job = peer.run(serve_table, spec, **kwargs)
        return job, job.recv()

    return start


# ------------------------------------------------------------------------------ devices


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int = 1) -> None:
    """Skips the calling test unless ``n`` CUDA devices are visible."""
    found = cuda_devices()
    if found < n:
        pytest.skip(f"needs {n} CUDA device(s), found {found}")


@pytest.fixture
def nccl_ranks(monkeypatch):
    """``shared = nccl_ranks(ranks, distinct=False)``: a test of ``ranks`` NCCL ranks (a streamer
    and receivers), one GPU each where there are enough (rank k on ``rank_gpu(k)``). With fewer
    GPUs the ranks share them, and the call returns True: then every peer that joins the
    communicator must claim a host of its own (:func:`claim_nccl_host`) before its first NCCL
    call, since NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
    detected") and takes the host from NCCL_HOSTID; it then connects them through its network
    transport over loopback: slow, but the same protocol, so the nccl tests run on one GPU. The
    test process keeps its real host: every other rank has one of its own.

    Skips the test when there is no GPU, or when ``distinct`` asks for a GPU per rank (a test of
    crossing GPUs)."""

    def need(ranks: int, distinct: bool = False) -> bool:
        found = cuda_devices()
        if distinct and found < ranks:
            pytest.skip(f"needs {ranks} CUDA device(s), one per nccl rank (it crosses GPUs), found {found}")
        if found == 0:
            pytest.skip(f"needs a CUDA device (its {ranks} nccl ranks share the GPUs there are), found 0")
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
        return found < ranks

    return need


def rank_gpu(k: int) -> int:
    """The GPU of NCCL rank ``k`` (0: the streamer) after :func:`nccl_ranks`: k where there are
    enough GPUs, else k modulo the GPUs visible."""
    found = cuda_devices()
    return k % found if found else 0


#: NCCL_HOSTID as this process started with it (a peer: as its test process had it then).
_STARTING_HOSTID = os.environ.get("NCCL_HOSTID")


def claim_nccl_host(shared: bool) -> None:
    """In a peer's job, before its first NCCL call: with ranks sharing a GPU (what
    :func:`nccl_ranks` returned), an NCCL host of this process's own; otherwise the host the
    process started with, so that a job never inherits the claim of an earlier one. NCCL reads
    the host once, at a process's first communicator: a peer that joined NCCL under one host
    keeps it, so a test places its ranks so that whether they share (nccl_ranks(n), n the ranks of
    one communicator) comes out the same for every nccl test on a machine."""
    if shared:
        os.environ["NCCL_HOSTID"] = f"refit-test-{os.getpid()}"
    elif _STARTING_HOSTID is None:
        os.environ.pop("NCCL_HOSTID", None)
    else:
        os.environ["NCCL_HOSTID"] = _STARTING_HOSTID


@pytest.fixture(scope="module")
def _rank_peers():
    peers: List[Peer] = []
    yield peers
    for p in peers:
        p.close()


@pytest.fixture
def ranks(_rank_peers):
    """``ranks(n)``: n peers, one per rank (kept for the module: torch is imported once each), for
    tests with one receiver process per TP or EP rank."""

    def get(n: int) -> List[Peer]:
        while len(_rank_peers) < n:
            _rank_peers.append(Peer())
        for i in range(n):
            if not _rank_peers[i].alive():
                _rank_peers[i] = Peer()
        return _rank_peers[:n]

    yield get
    for i, p in enumerate(_rank_peers):
        if not p.settle():
            p.close()
            _rank_peers[i] = Peer()
