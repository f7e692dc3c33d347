"""refit — stream model weights from RL trainers to inference engines, at C++ speed.

The trainer (policy worker) streams a ``state_dict()`` after every step; the engine (generation
worker) registers its parameters once and serves. Bytes move in refit's C++ core through
shared memory, CUDA IPC or NCCL, with the GIL released; a version is committed only when every
tensor arrived exactly once.

Engine::

    import refit
    with refit.Receiver() as rx:                      # binds a private ipc:// endpoint
        rx.add_parameters(model.named_parameters())   # written in place, no extra copy
        send_to_trainer(rx.endpoint)
        rx.serve(stop_event)                          # or rx.serve_one(timeout=0.01) in a loop

Trainer::

    import refit
    with refit.Streamer(endpoint) as st:              # transport="auto": cuda_ipc or host_shm
        for step in range(steps):
            train_step()
            st.refit(step, model.state_dict())        # returns once the engine committed

Errors are :class:`RefitError` (``.code`` is an :class:`Errc`); deadlines are
:class:`RefitTimeout`, also a ``TimeoutError``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Union

from ._errors import Errc, Event, RefitError, RefitTimeout
from . import _refit
from ._refit import DroppedReceiver, ReceiverStats, RefitStats, View
try:  # refit.record needs torch; without it the rest of refit works
    from .record import Route, RouteTable, record
except ImportError:  # pragma: no cover - exercised where torch is absent
    pass

_refit._set_error_types(RefitError, RefitTimeout)


def _torchs_nccl() -> Optional[str]:
    """The libnccl.so.2 of the ``nvidia-nccl`` wheel torch brings, found without importing torch."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(d, "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    return None


# One NCCL per process, whatever the import order: refit loads NCCL at its first nccl session, the
# one the process has loaded already (torch's, once torch is imported), else torch's wheel's (so that
# a torch imported later shares it), else the system's. REFIT_NCCL_LIBRARY or use_nccl_library()
# name another. nccl_library() says which was taken.
_torch_nccl = _torchs_nccl()
if _torch_nccl is not None:
    _refit._prefer_nccl_library(_torch_nccl)


def nccl_library() -> dict:
    """Which NCCL refit's nccl transport uses, loading it now if it is not yet.

    Returns a dict: ``available`` (bool), ``path`` (the file loaded), ``version`` (``22809`` for
    2.28.9), ``chosen_by`` (``"loaded in this process"``, ``"REFIT_NCCL_LIBRARY"``, ...) and
    ``error`` (why none is available). Peers whose versions differ refuse each other at HELLO, with
    both versions in the message.

    Example::

        >>> import torch, refit
        >>> refit.nccl_library()["path"]   # torch's own: .../nvidia/nccl/lib/libnccl.so.2
    """
    return _refit.nccl_library()


def use_nccl_library(path: str) -> None:
    """Names the NCCL to load (before the first nccl session; the same as REFIT_NCCL_LIBRARY).

    Raises RefitError (``Errc.invalid_argument``) when another NCCL is in use already or ``path``
    cannot be loaded.
    """
    _refit.use_nccl_library(path)


__version__ = _refit.__version__
__all__ = [
    "DroppedReceiver",
    "Errc",
    "Event",
    "Receiver",
    "ReceiverStats",
    "RefitError",
    "RefitStats",
    "RefitTimeout",
    "Route",
    "Shard",
    "RouteTable",
    "Streamer",
    "View",
    "nccl_library",
    "record",
    "use_nccl_library",
]

try:  # torch is optional: without it, views are numpy arrays and sources any DLPack producer
    import torch as _torch
except ImportError:  # pragma: no cover - exercised where torch is absent
    _torch = None

Tensors = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


class Shard:
    """A trainer rank's part of a tensor, for a group of streamers (sharded trainers).

    ``tensor`` holds ``[start, start + tensor.shape[dim])`` along ``dim`` of the whole tensor,
    whose shape is ``global_shape`` (equal to ``tensor.shape`` in every other dimension). The part
    must be one contiguous range of the whole: ``dim=0`` (FSDP's ``Shard(0)``: a range of rows), or
    a dimension after leading dimensions of size 1. Give it in place of the tensor::

        rows = (param.shape[0] + world - 1) // world          # torch.chunk, as FSDP shards
        st.refit(step, {name: refit.Shard(local, full_shape, 0, rank * rows)})

    With FSDP2, ``param`` is a DTensor: ``refit.Shard(param.to_local(), param.shape, 0, start)``
    with ``start`` its first row (``rank * ceil(rows / world)``, clipped to the rows). Every rank
    of the group sends its shards to the same receivers (``Streamer(group_rank=, group_size=)``);
    each receiver commits when the ranks' shards cover every tensor exactly once.
    """

    __refit_shard__ = True
    __slots__ = ("tensor", "global_shape", "dim", "start")

    def __init__(self, tensor: Any, global_shape: Any, dim: int = 0, start: int = 0) -> None:
        self.tensor = tensor
        self.global_shape = tuple(int(d) for d in global_shape)
        dim = int(dim)
        if dim < 0:
            dim += len(self.global_shape)
        self.dim = dim
        self.start = int(start)

    def __repr__(self) -> str:
        shape = tuple(getattr(self.tensor, "shape", ()))
        return f"refit.Shard({shape} of {self.global_shape}, dim={self.dim}, start={self.start})"


_refit._set_shard_type(Shard)  # refit() tells a Shard from a tensor by its type, not by hasattr()


def _check_endpoint(endpoint: Any, what: str) -> None:
    """A streamer's endpoint must be one a receiver prints: ZeroMQ itself would accept
    "localhost:5555" here and fail only at the first refit, with "Invalid argument (errno 22)"."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{what} must be a str (the engine's Receiver.endpoint), not {type(endpoint).__name__}")
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise ValueError(
            f"{what} {endpoint!r} is not an endpoint refit can connect to: it starts with ipc:// or tcp://; "
            "pass the engine's Receiver.endpoint as it is (e.g. 'ipc:///run/user/1000/refit-.../receiver.sock', "
            "or 'tcp://host:5555' for a receiver bound to tcp://*:5555)"
        )


def _device_index(device: Any) -> int:
    """The CUDA ordinal of ``device`` (int, "cuda:1", torch.device); the current CUDA device
    (or 0) for None."""
    if device is None:
        if _torch is not None and _torch.cuda.is_available():
            return _torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    if _torch is not None and isinstance(device, (str, _torch.device)):
        try:
            d = _torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device {device!r}: {e}") from None
        if d.type == "cpu":
            return 0
        if d.type != "cuda":
            raise ValueError(f"device {device!r}: refit reads CPU and CUDA memory")
        return d.index if d.index is not None else (_torch.cuda.current_device() if _torch.cuda.is_available() else 0)
    if isinstance(device, str):
        if device == "cpu":
            return 0
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
        if device == "cuda":
            return 0
    raise TypeError(f"device must be an int, 'cuda:N', 'cpu' or a torch.device; got {device!r}")


def _layout_digest(layout: Any) -> str:
    """The digest both sides compare at HELLO: a route table's ``digest()``, a digest string, or
    "" for None (no check)."""
    if layout is None:
        return ""
    if isinstance(layout, str):
        return layout
    if hasattr(layout, "digest"):
        return str(layout.digest())
    raise TypeError(f"layout must be a route table (with digest()), a digest str or None; got {type(layout).__name__}")


def _stream_context(stream: int, device: int):
    """Runs Python callbacks on the stream the receiver's views are ready on, so that torch work
    they enqueue is ordered after the bytes arrived and before the buffer is reused."""
    if not stream or _torch is None or not _torch.cuda.is_available():
        return contextlib.nullcontext()
    return _torch.cuda.stream(_torch.cuda.ExternalStream(stream, device=device))


class Receiver(_refit.Receiver):
    """The engine's side: binds a socket, applies refits into its weights.

    Args:
        endpoint: where to bind. None: a fresh private ``ipc://`` socket (mode 0700);
            ``"tcp://*:0"`` binds to 127.0.0.1 on a free port (read it back from
            :attr:`endpoint`).
        device: CUDA device applies run on (int, ``"cuda:1"``, torch.device; default: the
            current one).
        idle_timeout: seconds a refit in progress may see no message before it is aborted (its
            streamer is presumed dead).
        token: session token (default ``REFIT_TOKEN``); a streamer with another one is refused.
        curve: CURVE keys for tcp across hosts: a dict (or object) with ``public_key``,
            ``secret_key`` and optionally ``allowed_clients``.
        engine: how GPU copies are made (``"automatic"``, ``"kernel"``, ``"memcpy_batch"``,
            ``"memcpy_each"``).
        layout: the route table the parameters were registered from (``refit.record``), or its
            digest: a streamer whose ``layout`` differs is refused at HELLO (``Errc.invalid_argument``)
            before any byte moves. None: no check.
        streamers: how many streamers send each version together (sharded trainers: one per
            trainer rank, each sending its :class:`Shard` of every tensor). The receiver binds one
            endpoint per streamer (:attr:`endpoints`; rank k connects to ``endpoints[k]``); with
            more than one, ``endpoint`` must be None, ``"tcp://*:0"``, or contain ``"{rank}"``.
            A version commits when every rank's END arrived and their shards cover every tensor
            exactly once; rows covered twice or by nobody, or a rank that fails or falls silent,
            fail it on every rank.
        delta_threads: threads that check and apply a delta's patches into host weights
            (host_shm deltas); 0: min(hardware threads, 8).
        control_lane: offer a streamer on this host a shared-memory lane for its requests
            (``Streamer(control_lane=True)``): a private 2 MiB segment, three FIFOs and a Unix
            socket, removed once the streamer opened them. The socket passes descriptors of
            memory in torch's expandable segments, so that weights held there are written
            directly and a trainer's tensors there are read in place. False: ZeroMQ only (such
            weights are then staged into, such tensors packed).
        allow_insecure_tcp: bind a tcp endpoint other hosts can reach (not loopback) without
            ``curve``. Refused by default (``RefitError`` with ``Errc.invalid_argument``): the
            token and every message would cross the network in the clear. The environment
            variable ``REFIT_ALLOW_INSECURE=1`` allows it too.
        stage: None (default): every batch is written into the weights as it arrives, and END
            commits. ``"host"``: every batch lands in a stage the receiver owns (host memory, a
            copy of the registered parameters' bytes), the weights stay untouched while the
            engine keeps reading them, END reports ``Event.prepared`` (:meth:`on_prepared`), and
            the engine calls :meth:`apply` between two of its steps: one local copy, then the
            version is committed. Host parameters over host_shm, or parameters on one GPU over
            cuda_ipc and nccl (the stage then in page-locked host memory); whole versions, subsets
            and deltas (a delta's patches wait in the stage; :meth:`apply` writes them).
            ``"device"``: the same with the stage
            on the engine's GPU, for parameters on one GPU over cuda_ipc and nccl; :meth:`apply`
            is then one launch of refit's copy kernel on torch's current stream (no host wait).
            A cuda_ipc trainer writes a device stage directly (its default), as it would the
            weights, and nccl receives into it in place, so one trainer serves the device-staged
            receivers of several TP ranks (over nccl each receives only its parts).
        stage_bytes: the most memory the stage may take; 0 (default): what a version needs (the
            registered parameters' bytes). A version that needs more is refused before anything
            is written (``Errc.invalid_argument``, saying both byte counts).

    Example::

        with refit.Receiver() as rx:
            rx.add_parameters(model.named_parameters())
            print(rx.endpoint)             # hand it to the trainer
            while not done:
                if rx.serve_one(timeout=0.01) == refit.Event.committed:
                    print("now at version", rx.committed_version)

    An async RL engine keeps generating while the next version arrives (``stage="host"``)::

        rx = refit.Receiver(stage="host")
        rx.add_parameters(model.named_parameters())
        threading.Thread(target=rx.serve, args=(stop,), daemon=True).start()
        while generating:
            rx.apply()                 # between two steps: the version that waits, if any
            step(model)                # every request sees one whole version

    Thread rules: ``serve_one``/``serve`` and the registration calls from one thread at a time;
    :meth:`apply` and the properties from any thread.
    """

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        device: Any = None,
        idle_timeout: float = 60.0,
        token: Optional[str] = None,
        curve: Any = None,
        engine: str = "automatic",
        layout: Any = None,
        streamers: int = 1,
        delta_threads: int = 0,
        control_lane: bool = True,
        allow_insecure_tcp: bool = False,
        stage: Optional[str] = None,
        stage_bytes: int = 0,
    ) -> None:
        super().__init__(
            endpoint,
            device=_device_index(device),
            idle_timeout=idle_timeout,
            token=token,
            curve=curve,
            engine=engine,
            layout=_layout_digest(layout),
            streamers=streamers,
            delta_threads=delta_threads,
            control_lane=control_lane,
            allow_insecure_tcp=allow_insecure_tcp,
            stage="none" if stage is None else stage,
            stage_bytes=stage_bytes,
        )
        self._begin_fn = None
        self._partials = None  # on_tensor's chunks being reassembled, dropped at every BEGIN
        self._device = _device_index(device)

    def add_parameter(
        self,
        name: str,
        tensor: Any,
        source_slice: Optional[Tuple[int, int, int]] = None,
        *,
        scale: Any = None,
        quant: Optional[str] = None,
        dtype: Optional[str] = None,
        scale_2: Any = None,
        scale_layout: str = "row_major",
    ) -> None:
        """Registers ``tensor`` as where the source tensor ``name`` lands, written in place.

        ``tensor`` may be a view into one of the engine's own tensors (strided included), and
        ``source_slice=(dim, start, length)`` takes only ``source.narrow(dim, start, length)``:
        the engine's layout becomes the destination, with no callback and no extra copy::

            q, kv = 4096, 1024                            # fused q/k/v, GQA sizes
            rx.add_parameter("q_proj.weight", qkv.narrow(0, 0, q))
            rx.add_parameter("k_proj.weight", qkv.narrow(0, q, kv))
            rx.add_parameter("v_proj.weight", qkv.narrow(0, q + kv, kv))
            # tensor parallel, rank r of 2: a row-parallel shard takes columns of the source
            rx.add_parameter("o_proj.weight", o_local, source_slice=(1, r * 2048, 2048))
            # tied embeddings: one source, two destinations
            rx.add_parameter("embed_tokens.weight", embed)
            rx.add_parameter("embed_tokens.weight", lm_head)

        The view's shape must equal the source's (with ``length`` along ``dim``); a name may be
        registered several times, once per destination, but no two destinations may share a
        byte. A version commits when every registered destination was written exactly once.
        The tensor must stay alive and in place (the receiver keeps a reference). Raises
        TypeError/ValueError for a bad tensor, RefitError(invalid_argument) naming the tensors
        for a view outside its storage, overlapping destinations, a bad slice or a name
        registered with another dtype; a source that does not fit the view (its shape around
        the slice) fails that refit with ``Errc.apply`` before anything of it is written.

        Conversion: the tensor's dtype may differ from the source's. A float32, bfloat16 or
        float16 destination of a source of another of those three is cast (round to nearest
        even); an f8_e4m3 destination with ``quant="block128"`` (one scale per 128 x 128 block of
        the last two dimensions) or ``quant="tensor"`` (one scale) is quantised as DeepGEMM's
        ``per_block_cast_to_fp8`` does, its ``scale_inv`` (float32, same device, shape
        ``[ceil(rows/128), ceil(cols/128)]`` — of the destination's part for a shard — or ``[1]``)
        written to ``scale``. The streamer converts, once, before the bytes leave it::

            w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty(32, 32, dtype=torch.float32, device="cuda")
            rx.add_parameter("o_proj.weight", w, scale=s, quant="block128")

        ``quant="channel"`` keeps one float32 scale per row (output channel) of the last two
        dimensions, shape ``[rows, 1]`` (compressed-tensors' "channel" ``weight_scale``), by the
        same rule. ``quant="mxfp8"`` is OCP MXFP8: one E8M0 scale per 32 elements of a row (the
        last block of a row may be shorter), shape ``[rows, ceil(cols/32)]``, of dtype
        ``torch.float8_e8m0fnu`` (torch 2.7+) or its bytes as uint8; X = 2^(floor(log2(amax)) - 8),
        elements x / X rounded to nearest even and saturated to ±448::

            w = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty(4096, 128, dtype=torch.float8_e8m0fnu, device="cuda")
            rx.add_parameter("o_proj.weight", w, scale=s, quant="mxfp8")

        ``quant="nvfp4"`` is NVIDIA's NVFP4 as TensorRT-Model-Optimizer computes it: e2m1 elements
        two a byte (element 2k in the low nibble; the destination is ``torch.float4_e2m1fn_x2`` or
        uint8 of shape ``[rows, cols/2]``, ``cols`` even), one e4m3 scale per 16 elements of a row
        (``scale``: ``[rows, ceil(cols/16)]``, float8_e4m3fn or uint8) and one float32 per-tensor
        scale (``scale_2``, one element): scale_2 = amax / (6 * 448), block scale
        e4m3((amax_block / 6) / scale_2), elements e2m1(x / (block scale * scale_2)), round to
        nearest even, saturating; a checkpoint's ``weight``, ``weight_scale``, ``weight_scale_2``::

            w = torch.empty(4096, 2048, dtype=torch.uint8, device="cuda")
            s = torch.empty(4096, 256, dtype=torch.float8_e4m3fn, device="cuda")
            s2 = torch.empty(1, dtype=torch.float32, device="cuda")
            rx.add_parameter("o_proj.weight", w, quant="nvfp4", scale=s, scale_2=s2,
                             scale_layout="swizzled")

        ``scale_layout="swizzled"`` (mxfp8 and nvfp4) writes the block scales in the 128 x 4 tiles
        cuBLAS/CUTLASS block-scaled GEMMs read (vLLM's ``swizzle_blockscale``): the grid padded
        to a multiple of 128 rows and 4 columns (``[4096, 256]`` above too; ``[ceil(rows/128)*128,
        ceil(cols/16/4)*4]``), padding written as zero; such a destination takes its source whole.

        Torch without float8 dtypes (before 2.1): pass a uint8 tensor and ``dtype="f8_e4m3"``,
        which reads its bytes as e4m3. A block128 shard (``source_slice`` along one of the last
        two dimensions) must start on a multiple of 128 and end on one or at the source's end;
        an mxfp8 shard along the last dimension likewise on multiples of 32. Raises ValueError
        for a bad ``quant``/``dtype`` name or a scale of the wrong size or device, TypeError for a
        scale of the wrong dtype (float32; float8_e8m0fnu or uint8 for mxfp8),
        RefitError(invalid_argument) for a quant without an f8_e4m3 destination or a scale, a
        scale without quant, or a shard starting inside a block."""
        super().add_parameter(
            name,
            tensor,
            source_slice,
            scale=scale,
            quant=quant,
            dtype=dtype,
            scale_2=scale_2,
            scale_layout=scale_layout,
        )

    def add_parameters(self, params: Tensors) -> None:
        """Registers every ``(name, tensor)`` of a ``state_dict()``, ``named_parameters()`` or
        any iterable of pairs. Tensors are written in place: they must stay alive (the receiver
        keeps a reference) and contiguous. Raises TypeError/ValueError naming a bad tensor,
        RefitError(invalid_argument) for a name registered twice."""
        items = params.items() if hasattr(params, "items") else params
        for name, tensor in items:
            self.add_parameter(name, tensor)

    def on_batch(self, fn: Callable[[List[View]], None]) -> Callable[[List[View]], None]:
        """Applies through ``fn(views)``, called once per batch with its entries (each a
        :class:`View`: ``.name``, ``.offset``, ``.tensor``, ``.whole``, ``.last``) instead of a
        parameter table. Views alias the receiver's buffer, or over cuda_ipc the trainer's own
        tensor (``Streamer(share_tensors=True)``): read them, never write into them, and only
        during the call; on CUDA the call runs on the stream they are ready on (torch's current
        stream). An
        exception aborts the refit; the streamer sees ``Errc.apply`` with its type and message.
        Returns ``fn`` (usable as a decorator)."""
        self._set_batch(fn, "on_batch")
        return fn

    def _set_batch(self, fn: Callable[[List[View]], None], what: str) -> None:
        device = self.device

        def call(views, stream):
            with _stream_context(stream, device):
                fn(views)

        self._on_batch(call, what)

    def on_tensor(self, fn: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
        """Applies through ``fn(name, tensor)``, once per whole tensor — the shape of an
        engine's ``load_weights``. Tensors split into chunks on the way are reassembled first
        (in a tensor of their own); others alias the receiver's buffer, or over cuda_ipc the
        trainer's own tensor: read them (``param.copy_(tensor)``), never write into them, and only
        during the call. Returns ``fn``.

        A receiver applies through its parameter table or a callback: after ``add_parameter`` /
        ``add_parameters`` this raises ``RefitError`` (``Errc.invalid_argument``) until
        :meth:`clear_parameters`. So does :meth:`on_batch`."""
        # name -> [buffer, bytes covered]. Chunks of a tensor arrive in order from one streamer, in
        # any order from a group (each rank's shard); a tensor is whole when its chunks cover it.
        partial = {}

        def assemble(v: View):
            entry = partial.get(v.name)
            if entry is None:
                like = v.tensor
                if _torch is not None:
                    buf = _torch.empty(v.total, dtype=_torch.uint8, device=like.device)
                else:
                    import numpy

                    buf = numpy.empty(v.total, dtype=numpy.uint8)
                entry = partial[v.name] = [buf, 0]
            buf = entry[0]
            if _torch is not None:
                buf[v.offset : v.offset + v.nbytes].copy_(v.tensor)
            else:
                buf[v.offset : v.offset + v.nbytes] = v.tensor
            entry[1] += v.nbytes
            if entry[1] < v.total:
                return None
            del partial[v.name]
            if _torch is not None:
                return buf.view(v.dtype).reshape(v.shape)
            return buf

        def on_views(views):
            for v in views:
                if v.whole:
                    fn(v.name, v.tensor)
                    continue
                t = assemble(v)
                if t is not None:
                    fn(v.name, t)

        self._set_batch(on_views, "on_tensor")
        self._partials = partial
        self._on_begin(self._begin)  # a refit that failed half-way leaves nothing behind
        return fn

    def serve_one(self, timeout: float = 0.1) -> Event:
        """Waits up to ``timeout`` seconds for one message and handles it; returns what happened
        (an :class:`Event`). The GIL is released while waiting and applying. A refit superseded
        by a new HELLO or BEGIN is reported as ``Event.aborted``; the message that superseded it
        is handled by the next call."""
        return Event(super().serve_one(timeout))

    def on_begin(self, fn: Optional[Callable[[int], None]]):
        """``fn(version)`` when a refit starts, before its first batch (pause generation,
        open a staging area). Raising refuses the refit (``Errc.apply`` at the streamer).
        None removes it. Returns ``fn``."""
        self._begin_fn = fn
        self._on_begin(self._begin if self._partials is not None else fn)
        return fn

    def _begin(self, version: int) -> None:
        self._partials.clear()
        if self._begin_fn is not None:
            self._begin_fn(version)

    def on_commit(self, fn: Optional[Callable[[int], None]]):
        """``fn(version)`` once ``version`` is committed (:attr:`committed_version` says so).
        Exceptions are logged, not raised. None removes it. Returns ``fn``."""
        self._on_commit(fn)
        return fn

    def on_abort(self, fn: Optional[Callable[[int, str], None]]):
        """``fn(version, reason)`` when a refit in progress ends without committing, for any
        reason. Exceptions are logged, not raised. None removes it. Returns ``fn``."""
        self._on_abort(fn)
        return fn

    def on_prepared(self, fn: Optional[Callable[[int], None]]):
        """A staged receiver (``stage="host"``): ``fn(version)`` on the serving thread when
        ``version`` is whole in the stage (:attr:`prepared_version` says so), before
        ``serve_one`` returns ``Event.prepared``. Tell the engine's loop to :meth:`apply` it, or
        call :meth:`apply` here to apply at once. Exceptions are logged, not raised. None removes
        it. Returns ``fn``."""
        self._on_prepared(fn)
        return fn

    def apply(self, stream: Any = None) -> Optional[int]:
        """A staged receiver: copies the prepared version from the stage into the weights and
        commits it (:attr:`committed_version` moves, ``on_commit`` runs on this thread before
        this returns). Returns the version applied, or None when none waits. Call it from the
        engine's loop between two steps, from any thread; the GIL is released during the copy.
        A device stage enqueues its copy on ``stream`` (a ``torch.cuda.Stream``; default:
        torch's current stream of the receiver's GPU) behind the engine's work there and
        returns without waiting: the engine's next step on that stream sees the new version
        whole.
        While a version waits, the next one's BEGIN is refused (its streamer sees
        ``Errc.apply``): apply promptly. Raises RefitError(``Errc.apply``) when the parameters
        changed since the version was prepared (it is dropped, nothing is written).

        Example::

            rx = refit.Receiver(stage="host")
            ...
            if rx.apply() is not None:      # between two generation steps
                print("now at version", rx.committed_version)
        """
        return self._apply_prepared(self._stage_stream(stream))

    def apply_prepared(self, stream: Any = None) -> Optional[int]:
        """The same as :meth:`apply` (the C++ name)."""
        return self._apply_prepared(self._stage_stream(stream))

    def _stage_stream(self, stream: Any) -> int:
        """The cudaStream_t a device stage's apply runs on (0: the receiver's own, waited for)."""
        if self.stage != "device":
            return 0
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(self._device)
        return int(getattr(stream, "cuda_stream", stream))

    @property
    def prepared_version(self) -> Optional[int]:
        """A staged receiver: the version waiting in the stage for :meth:`apply`; None when
        none waits."""
        return super().prepared_version

    @property
    def last_error(self) -> Optional[str]:
        """Why the last refit failed (or a message was refused) since the last commit; None once a
        later version committed, or when nothing failed."""
        return super().last_error

    def serve(self, stop: Any = None, *, poll: float = 0.1) -> None:
        """Serves until ``stop`` says so: a callable returning True, a ``threading.Event`` that
        is set, or None (until Ctrl-C). ``stop`` is checked between messages, at least every
        ``poll`` seconds; Ctrl-C interrupts within one poll. The GIL is released while waiting."""
        if stop is None:
            check = None
        elif hasattr(stop, "is_set"):
            check = stop.is_set
        elif callable(stop):
            check = stop
        else:
            raise TypeError(f"stop must be a callable, a threading.Event or None; got {type(stop).__name__}")
        self._serve(check, poll)

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        try:
            return f"refit.Receiver({self.endpoint!r}, committed_version={self.committed_version})"
        except RefitError:
            return "refit.Receiver(closed)"


class Streamer(_refit.Streamer):
    """The trainer's side: streams named tensors to one receiver, or to several: nccl broadcasts,
    cuda_ipc writes each receiver of this host directly (TP ranks).

    Args:
        endpoint: the receiver's :attr:`Receiver.endpoint` (``ipc://...`` or ``tcp://host:port``).
        transport: ``"auto"`` (default): at the first refit, ``"cuda_ipc"`` when its tensors are
            on a GPU of this host, ``"host_shm"`` when they are in host memory; the choice is
            logged once (logger ``refit``, INFO) and is :attr:`transport` afterwards. Or say it:
            ``"cuda_ipc"`` (GPUs of one host), ``"nccl"`` (other GPUs or hosts, one to many: never
            chosen by ``"auto"``) or ``"host_shm"`` (CPU tensors, no GPU needed).
        receivers: every receiver's endpoint (``endpoint`` is then ignored): nccl broadcasts to
            them, or, in place to receivers that registered views (TP ranks' shards with
            ``source_slice``, fused or stacked tensors), sends each only the bytes its views take,
            straight into them (``RefitStats.parts_bytes``); cuda_ipc writes each one's parameter
            table directly, or its device stage (TP ranks of one host).
        buffer_bytes, buffers: the ping-pong staging buffers (capacity of each, how many).
        direct: write straight into the receiver's weights where it can (cuda_ipc direct, nccl in
            place); False always stages.
        timeout: seconds to wait for any reply before :class:`RefitTimeout`.
        token, curve: as for :class:`Receiver` (curve: ``public_key``, ``secret_key``,
            ``server_key``).
        device: CUDA device of the buffers (default: the current one).
        layout: the route table (or its digest) the trainer's names were recorded against; a
            receiver registered from another one refuses the session. None: no check.
        delta: send only what changed since the last version every receiver committed: the
            streamer keeps its own copy of that version (the base), sends the changed elements as
            patches that receivers apply in place, and a checksum of the whole version that they
            check. The first version, and any version a receiver holds no base for, is sent whole
            by the same call (``RefitStats.whole_after_refusal``). host_shm (CPU tensors), or
            cuda_ipc or nccl with ``direct=False`` (the diff and the patching on the GPUs; over nccl
            only the patches cross the link).
        delta_memory: where the base lives: ``"host"`` (page-locked with CUDA) or ``"device"``.
        delta_max_bytes: bound on the base's memory; a larger version is always sent whole.
        delta_threads: threads of the host diff (host_shm deltas); 0: min(hardware threads, 8).
            The patches are the same bytes whatever the number.
        delta_batch_bytes: bytes of tensors one delta batch covers before it is sent (each batch
            costs a round trip, and on the GPU a wait of the diff and of the receivers' check);
            0: max(32 MiB, ``buffer_bytes``) over host_shm, max(32 MiB, four times ``buffer_bytes``) over
            cuda_ipc and nccl. A batch also goes when its patches fill a buffer. The
            patches and the result do not depend on it.
        group_rank, group_size: this streamer is rank ``group_rank`` of ``group_size`` streamers
            (one per trainer rank) that send each version together, each its :class:`Shard` of
            every tensor, to receivers made with ``streamers=group_size``; rank k connects to each
            receiver's ``endpoints[k]``. Every rank refits the same versions; ``refit()`` returns
            when the version has ended on every receiver (so ``timeout`` must cover the slowest
            rank). Any transport: over nccl each rank has a communicator of its own with the
            receivers, and sends only its rows (in place, to each receiver only the rows its views
            take); no ``delta``.
        share_tensors: cuda_ipc sessions through the buffers (a receiver with a callback, or one
            whose weights cannot be written directly): the receiver reads every tensor in this
            device's memory where it is (its allocation mapped through CUDA IPC) instead of the
            streamer packing it into a buffer: one copy instead of two, and no per-batch hand-off
            between the two processes' GPU work (``RefitStats.shared_bytes``). Tensors in torch's
            expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) are shared
            too, chunk by chunk, their descriptors passed through the control lane (so it needs
            ``control_lane``). The receiver keeps an allocation mapped until a refit that does not
            read it ends, or :meth:`close`: memory the trainer frees meanwhile
            (``torch.cuda.empty_cache()``) returns to the driver only then. False: every tensor
            goes through the buffers.
        control_lane: when the receiver runs on this host (any transport), send BEGIN, the
            batches, END and BYE through a shared-memory lane it offers instead of ZeroMQ: a round
            trip costs microseconds instead of ~0.1 ms, most of a small refit's fixed cost
            (``RefitStats.control_lane``). Falls back to ZeroMQ by itself. False: ZeroMQ only.
        nccl_twin: nccl only, opt-in: each session also has a second communicator, and the
            broadcasts of odd buffers go on it, so that a batch's broadcast starts while the one
            before it drains (a buffer-sized broadcast loses ~10 % of the link to its start and
            end). Over NVLink it took llama3-8b's 2 × 256 MiB buffered refits from 0.96 to 0.99 of
            the raw broadcast, and 2 × 64 MiB ones from 0.89–0.90 to 0.95–0.97 in six runs of
            seven. It costs every rank NCCL's own buffers once more (~0.5 GiB a rank on H200s).
            False (default): one communicator.
        atomic: engine-wide versions: a version reaches every receiver of this streamer (the
            TP/EP ranks of one engine) or none. Each receiver answers END once the version is
            whole and checked (*prepared*), without committing; once all have, each hears COMMIT
            and only then commits (in place) or reports ``Event.prepared`` (a staged receiver,
            whose engine then calls ``apply()``). When any receiver fails or stays silent first,
            the others are told and discard the version (``committed_version`` unchanged
            everywhere). One more round trip per refit (``RefitStats.commit_seconds``). A
            sharded trainer (``group_size > 1``): every rank sets it; a receiver commits only
            once every rank said COMMIT.
        on_receiver_failure: ``"fail"`` (default): a receiver that fails fails the version for
            all. ``"drop"`` (host_shm): a receiver that dies, stays silent past ``timeout``,
            refuses a batch or fails its checks leaves the version and this streamer; the others
            commit it, ``refit()`` returns, ``RefitStats.dropped`` names each one dropped
            (endpoint, code, reason) and a warning is logged at once. ``add_receiver()`` takes a
            restarted engine back. ``st.receivers`` lists the endpoints served.
        min_receivers: with ``"drop"``, ``refit()`` raises when fewer receivers than this are left.
        rejoin: with ``"drop"``, a dropped receiver is tried again at the next version, then after
            2, 4, ... up to 64 versions while it keeps failing, and served again once it answers
            (a restarted engine on the same endpoint catches up then). Each try of an endpoint
            nobody serves costs that version one ``timeout`` and lists it in ``dropped`` again.
        receiver_groups: engines as groups of receivers, e.g. ``[[tp0, tp1], [tp0b, tp1b]]``: each
            list the endpoints of one engine's ranks (each also in ``receivers``; without
            ``receivers``, the groups' endpoints in order are the receivers). With ``"drop"``, a rank
            that fails drops its whole engine: its other ranks are told to abort the version
            (``committed_version`` unchanged, a staged rank's weights untouched) while the other
            engines commit, and ``RefitStats.dropped`` names every rank of it. With ``atomic``,
            a version so reaches every rank of an engine or none, engine by engine.

    Example::

        with refit.Streamer(endpoint, transport="host_shm", delta=True) as st:
            for step in range(steps):
                stats = st.refit(step, model.state_dict())   # step 0 whole, then deltas
                print(stats.delta, stats.changed / max(stats.elements, 1), stats.bytes)

        with refit.Streamer(endpoint) as st:              # transport="auto"
            stats = st.refit(step, model.state_dict())
            print(st.transport, stats.bytes / stats.seconds / 1e9, "GB/s")

    Thread rules: one thread at a time.
    """

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        transport: str = "auto",
        receivers: Optional[List[str]] = None,
        buffer_bytes: int = 256 << 20,
        buffers: int = 2,
        direct: bool = True,
        timeout: float = 30.0,
        token: Optional[str] = None,
        device: Any = None,
        curve: Any = None,
        alignment: int = 256,
        keep_whole: bool = True,
        engine: str = "automatic",
        layout: Any = None,
        delta: bool = False,
        delta_memory: str = "host",
        delta_max_bytes: int = 64 << 30,
        delta_threads: int = 0,
        delta_batch_bytes: int = 0,
        group_rank: int = 0,
        group_size: int = 1,
        share_tensors: bool = True,
        control_lane: bool = True,
        nccl_twin: bool = False,
        atomic: bool = False,
        on_receiver_failure: str = "fail",
        min_receivers: int = 1,
        rejoin: bool = False,
        receiver_groups: Optional[List[List[str]]] = None,
    ) -> None:
        if receivers is None and receiver_groups:
            receivers = [ep for group in receiver_groups for ep in group]
        if endpoint is None:
            if not receivers:
                raise ValueError("Streamer needs the receiver's endpoint (or receivers=[...])")
            endpoint = receivers[0]
        _check_endpoint(endpoint, "endpoint")
        for i, ep in enumerate(receivers or ()):
            _check_endpoint(ep, f"receivers[{i}]")
        super().__init__(
            endpoint,
            transport=transport,
            receivers=receivers,
            buffer_bytes=buffer_bytes,
            buffers=buffers,
            direct=direct,
            timeout=timeout,
            token=token,
            device=_device_index(device),
            curve=curve,
            alignment=alignment,
            keep_whole=keep_whole,
            engine=engine,
            layout=_layout_digest(layout),
            delta=delta,
            delta_memory=delta_memory,
            delta_max_bytes=delta_max_bytes,
            delta_threads=delta_threads,
            delta_batch_bytes=delta_batch_bytes,
            group_rank=group_rank,
            group_size=group_size,
            share_tensors=share_tensors,
            control_lane=control_lane,
            nccl_twin=nccl_twin,
            atomic=atomic,
            on_receiver_failure=on_receiver_failure,
            min_receivers=min_receivers,
            rejoin=rejoin,
            receiver_groups=receiver_groups,
        )

    def add_receiver(self, endpoint: str) -> None:
        """Serves the receiver at ``endpoint`` from the next version on: that version opens its
        session and sends it the version whole (a delta streamer: whole to every receiver when it
        holds no base). Between refits only; raises RefitError (``Errc.invalid_argument``) during
        one (from a generator), for an endpoint served already, or over nccl.

        Example::

            st.add_receiver(restarted_engine_endpoint)
            st.refit(step, model.state_dict())   # it holds this version when refit returns
        """
        _check_endpoint(endpoint, "endpoint")
        super().add_receiver(endpoint)

    def remove_receiver(self, endpoint: str) -> None:
        """Stops serving the receiver at ``endpoint``: it is told goodbye and keeps its last
        committed version; the next version goes to the others. Between refits only; raises
        RefitError (``Errc.invalid_argument``) for an endpoint not served or the last receiver."""
        super().remove_receiver(endpoint)

    def refit(self, version: int, tensors: Tensors, *, stream: Any = None, subset: bool = False) -> RefitStats:
        """Streams ``tensors`` as ``version`` and returns once the receiver committed it.

        ``tensors``: a mapping (``state_dict()``), a list of ``(name, tensor)`` pairs, or a
        generator of pairs — the generator's next tensor is gathered while earlier batches are
        applied. Tensors are read in place (no copy) and must stay unchanged until this returns;
        the streamer keeps a reference to each. CUDA tensors are read after the work enqueued so
        far on torch's current stream of their device (or on ``stream``), never with a device
        synchronisation. The GIL is released while bytes move; a dict, list or tuple of 64 pairs
        or more is read meanwhile by a thread of this streamer's own (kept until ``close()``),
        which takes the GIL while it reads and lets go of it every 64 pairs, up to the first pair
        that is not a plain torch tensor or a ``Shard`` of one (that one and the rest are read on
        the calling thread, as are generators and mappings of other types).

        Raises TypeError/ValueError naming a bad tensor (unsupported dtype, not contiguous),
        RefitError with the receiver's code (``Errc.apply`` for a shape or dtype mismatch), or
        RefitTimeout. An exception raised by a generator is raised again as it is. After any
        error the receiver has not committed ``version``.

        ``subset=True``: ``tensors`` are only some of the receiver's (LoRA adapters, the tensors
        that changed); the receiver commits them and keeps its others. A receiver that never
        committed a whole version (or whose weights are dirty) refuses with
        ``Errc.needs_whole`` before anything is written.
        """
        return super().refit(version, tensors, stream=stream, subset=subset)

    def announce(self, hold: float = 1.0) -> int:
        """Says that a refit follows within ``hold`` seconds (at most 10), so that the receivers are
        awake for it: call it when the next version is known to come soon (before the optimizer
        step), then ``refit()`` as usual. A receiver between versions sleeps, and waking it costs a
        refit 45–130 µs (a third of a small model's refit on an H200); told, each receiver on this
        host waits spinning (a CPU core busy) until the refit begins or ``hold`` has passed.
        Receivers on other hosts are not told. Returns how many receivers were told: 0 before the
        first refit, which begins the session. Raises RefitError (``Errc.invalid_argument``) for a
        ``hold`` outside 0..10 or a closed streamer.
        """
        return super().announce(hold)

    def __enter__(self) -> "Streamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
