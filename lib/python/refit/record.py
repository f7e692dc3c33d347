"""Recorded engine layouts: run an engine's loader once on metadata, keep where each source lands.

An engine's ``load_weights`` (vLLM, SGLang) knows how the trainer's tensors map onto its fused,
sharded parameters: q/k/v into ``qkv_proj`` rows, a tensor-parallel rank's columns, an expert's
rows of a stacked ``w13``. :func:`record` runs it once on *recording tensors* (meta tensors with
the sources' dtypes and shapes, no data) under a ``TorchFunctionMode`` that watches every torch
call, and turns each ``copy_`` into a parameter into a route: the destination view (parameter,
storage offset, shape, strides) and the ``source_slice`` it takes. :meth:`RouteTable.register`
then registers those views with a :class:`refit.Receiver`, so that refits write the engine's
weights in place, with no Python per tensor::

    table = refit.record(model.named_parameters(), model.load_weights, trainer_meta_state_dict)
    table.register(rx, model.named_parameters())

Fail closed: a source whose bytes the loader transforms (arithmetic, a dtype change, reading
values with ``.item()``), copies into something that is not a parameter, writes twice, or takes in
a shape that no single ``narrow`` of it gives, is *unrecorded*, with a reason
(:attr:`RouteTable.unrecorded`); :func:`record` does not raise for it. Such sources can still be
refitted through the real loader (``register(..., allow_fallback=True)``), at the cost of a
second copy of those tensors only.

Nothing here moves or reallocates a parameter: recording never executes a write into one, and
registration hands the receiver views that alias the parameters' own storage.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Route", "RouteTable", "record"]

FORMAT = "refit.route_table/1"

Shape = Tuple[int, ...]
SourceSlice = Tuple[int, int, int]


class Route(NamedTuple):
    """One destination of a source: ``param.as_strided(shape, stride, param.storage_offset() +
    offset)`` receives ``source.narrow(*source_slice)`` (the whole source for None)."""

    param: str
    offset: int
    shape: Shape
    stride: Shape
    source_slice: Optional[SourceSlice]


class _Unrecordable(Exception):
    """Raised inside the loader when it cannot go on for a source (it read a value)."""

    def __init__(self, names: Sequence[str], reason: str) -> None:
        super().__init__(reason)
        self.names = list(names)
        self.reason = reason


class _NotExpressible(Exception):
    pass


# ------------------------------------------------------------------------------ layouts


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _contiguous_strides(shape: Sequence[int]) -> List[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return strides[::-1]


def _canonical(shape: Sequence[int], stride: Sequence[int]) -> List[Tuple[int, int]]:
    """Dims of size > 1 sorted by stride (outer first), merged where contiguous: two layouts
    covering the same elements in the same order have the same canonical form."""
    dims = sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda d: -d[1])
    out: List[Tuple[int, int]] = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return out


def _view_strides(oldshape: Sequence[int], oldstride: Sequence[int], newshape: Sequence[int]) -> Optional[List[int]]:
    """Strides of ``view(newshape)`` of a tensor with ``oldshape``/``oldstride``, or None when it
    needs a copy (ATen's computeStride)."""
    if not oldshape:
        return _contiguous_strides(newshape) if _prod(newshape) == 1 else None
    newstride = [0] * len(newshape)
    view_d = len(newshape) - 1
    chunk_base = oldstride[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(oldshape) - 1, -1, -1):
        tensor_numel *= oldshape[tensor_d]
        if tensor_d == 0 or (oldshape[tensor_d - 1] != 1 and oldstride[tensor_d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or newshape[view_d] == 1):
                newstride[view_d] = view_numel * chunk_base
                view_numel *= newshape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base = oldstride[tensor_d - 1]
                tensor_numel = view_numel = 1
    return newstride if view_d == -1 else None


def _route(source: str, source_shape: Shape, src: Tuple[int, Shape, Shape], param: str, dst: Tuple[int, Shape, Shape]) -> Optional[Route]:
    """The route of ``dst.copy_(src)``: src and dst as (offset, shape, stride) of equal shapes
    (size-1 dims aside), src in the source's contiguous element space, dst in the parameter's
    storage (offset relative to the parameter's). None for an empty copy."""
    s_off, s_shape, s_stride = src
    d_off, d_shape, d_stride = dst
    s_dims = [(n, st) for n, st in zip(s_shape, s_stride) if n != 1]
    d_dims = [(n, st) for n, st in zip(d_shape, d_stride) if n != 1]
    if [n for n, _ in s_dims] != [n for n, _ in d_dims]:
        raise _NotExpressible(f"copy_ broadcasts {list(s_shape)} into {list(d_shape)}")
    numel = _prod(s_shape)
    if numel == 0:
        return None
    if any(st == 0 for _, st in s_dims):
        raise _NotExpressible("the copy reads source elements more than once (a broadcast or expand)")
    # (size, source stride, destination stride), outer source dims first
    dims = sorted(((n, ss, ds) for (n, ss), (_, ds) in zip(s_dims, d_dims)), key=lambda d: -d[1])
    region = _canonical([d[0] for d in dims], [d[1] for d in dims])
    cs = _contiguous_strides(source_shape)
    total = _prod(source_shape)

    found: Optional[Tuple[Optional[SourceSlice], List[int]]] = None
    if s_off == 0 and numel == total and _canonical(source_shape, cs) == region:
        found = (None, list(source_shape))
    for d in range(len(source_shape)):
        if found is not None:
            break
        if source_shape[d] <= 1 or s_off % cs[d]:
            continue
        start, rest = s_off // cs[d], total // source_shape[d]
        if start >= source_shape[d] or numel % rest:
            continue
        length = numel // rest
        if length == 0 or start + length > source_shape[d]:
            continue
        nshape = list(source_shape)
        nshape[d] = length
        if _canonical(nshape, cs) == region:
            found = ((d, start, length), nshape)
    if found is None:
        raise _NotExpressible(
            "it reads a region of the source that is not one narrow of it"
            + (" (a transposed or permuted read)" if _is_permuted(s_dims) else ""))
    source_slice, nshape = found
    stride = _view_strides([d[0] for d in dims], [d[2] for d in dims], nshape)
    if stride is None:
        raise _NotExpressible("the destination cannot take the source's shape as one strided view")
    if nshape and nshape[-1] == 1:
        stride[-1] = 1
    if nshape and nshape[-1] > 1 and stride[-1] != 1:
        raise _NotExpressible("the destination's last dimension is not dense for the source's (a transposed copy)")
    return Route(param, d_off, tuple(nshape), tuple(stride), source_slice)


def _is_permuted(dims: Sequence[Tuple[int, int]]) -> bool:
    strides = [s for _, s in dims]
    return strides != sorted(strides, reverse=True)


def _overlap(a: Route, b: Route) -> bool:
    """Whether two routes into one parameter share an element (exact for views up to 2**22
    elements, else by their address ranges)."""

    def span(r: Route) -> Tuple[int, int]:
        if _prod(r.shape) == 0:
            return (0, -1)
        return r.offset, r.offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride))

    (alo, ahi), (blo, bhi) = span(a), span(b)
    lo, hi = max(alo, blo), min(ahi, bhi)
    if lo > hi:
        return False
    if _prod(a.shape) > (1 << 22) or _prod(b.shape) > (1 << 22):
        return True  # conservative: the receiver would refuse a real overlap anyway

    def addresses(r: Route) -> torch.Tensor:
        base = torch.arange(r.offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride)) + 1)
        return base.as_strided(r.shape, r.stride, r.offset).reshape(-1)

    mask = torch.zeros(hi - lo + 1, dtype=torch.bool)
    x = addresses(a)
    mask[x[(x >= lo) & (x <= hi)] - lo] = True
    y = addresses(b)
    return bool(mask[y[(y >= lo) & (y <= hi)] - lo].any())


def _static_target(offset: int, shape: Shape, stride: Shape, param: str) -> Route:
    return Route(param, offset, tuple(shape), tuple(stride), None)


# ------------------------------------------------------------------------------ the table


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


class RouteTable:
    """Where each source lands in the engine: the result of :func:`record`.

    Attributes:
        entries: source name -> list of :class:`Route` (empty: the loader wrote nothing from it,
            e.g. another rank's expert; don't send it to this receiver).
        unrecorded: source name -> why its load could not be recorded.
        sources: source name -> (dtype, shape), as recorded.
        params: parameter name -> (dtype, shape, stride) at recording; :meth:`register` checks the
            live parameters against them.
        notes: what the loader did that no route needs (constant writes such as zeroed padding
            rows); not part of the digest.
    """

    def __init__(self, entries: Mapping[str, Sequence[Route]], unrecorded: Mapping[str, str],
                 sources: Mapping[str, Tuple[torch.dtype, Shape]], params: Mapping[str, Tuple[torch.dtype, Shape, Shape]],
                 notes: Sequence[str] = ()) -> None:
        self.entries: Dict[str, List[Route]] = {k: [Route(*r) for r in v] for k, v in entries.items()}
        self.unrecorded: Dict[str, str] = dict(unrecorded)
        self.sources: Dict[str, Tuple[torch.dtype, Shape]] = {k: (d, tuple(s)) for k, (d, s) in sources.items()}
        self.params: Dict[str, Tuple[torch.dtype, Shape, Shape]] = {k: (d, tuple(s), tuple(st)) for k, (d, s, st) in params.items()}
        self.notes: List[str] = list(notes)

    # -- what a streamer sends to this receiver

    def needed(self) -> List[str]:
        """Sources this receiver registers (routes, or a fallback scratch tensor), in source
        order: what its streamer must send (a name it does not register fails the refit)."""
        return [n for n in self.sources if self.entries.get(n) or n in self.unrecorded]

    def skipped(self) -> List[str]:
        """Sources the loader consumed without writing anything (another rank's experts, a
        skipped ``rotary_emb.inv_freq``)."""
        return [n for n in self.sources if n not in self.unrecorded and not self.entries.get(n)]

    # -- save / load / compare

    def _content(self) -> Dict[str, Any]:
        return {
            "format": FORMAT,
            "sources": {n: {"dtype": _dtype_name(d), "shape": list(s)} for n, (d, s) in self.sources.items()},
            "params": {n: {"dtype": _dtype_name(d), "shape": list(s), "stride": list(st)} for n, (d, s, st) in self.params.items()},
            "entries": {n: [{"param": r.param, "offset": r.offset, "shape": list(r.shape), "stride": list(r.stride),
                             "source_slice": None if r.source_slice is None else list(r.source_slice)}
                            for r in sorted(routes, key=lambda r: (r.param, r.offset))]
                        for n, routes in self.entries.items()},
            "unrecorded": dict(self.unrecorded),
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        """The table as JSON text (:meth:`from_json` reads it back)."""
        content = self._content()
        content["notes"] = list(self.notes)
        return json.dumps(content, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "RouteTable":
        """A table saved by :meth:`to_json`. Raises ValueError for another format."""
        obj = json.loads(text)
        if obj.get("format") != FORMAT:
            raise ValueError(f"not a refit route table (format {obj.get('format')!r}, expected {FORMAT!r})")
        return cls(
            entries={n: [Route(e["param"], e["offset"], tuple(e["shape"]), tuple(e["stride"]),
                               None if e["source_slice"] is None else tuple(e["source_slice"])) for e in routes]
                     for n, routes in obj["entries"].items()},
            unrecorded=obj["unrecorded"],
            sources={n: (_dtype(s["dtype"]), tuple(s["shape"])) for n, s in obj["sources"].items()},
            params={n: (_dtype(p["dtype"]), tuple(p["shape"]), tuple(p["stride"])) for n, p in obj["params"].items()},
            notes=obj.get("notes", ()),
        )

    def digest(self) -> str:
        """A stable sha256 (hex) of the table's content: sources, parameters, routes and which
        sources are unrecorded (not the reasons' text, nor notes). Equal tables, equal digests,
        whatever order they were built in."""
        content = self._content()
        content["unrecorded"] = sorted(content["unrecorded"])
        text = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteTable):
            return NotImplemented
        return self._content() == other._content()

    def __repr__(self) -> str:
        routes = sum(len(v) for v in self.entries.values())
        return (f"refit.RouteTable({len(self.sources)} sources, {routes} routes, "
                f"{len(self.unrecorded)} unrecorded, digest {self.digest()[:12]})")

    # -- registration

    def register(self, receiver: Any, params: Any, *, allow_fallback: bool = False,
                 loader: Optional[Callable[[Iterable[Tuple[str, torch.Tensor]]], Any]] = None) -> Callable[..., None]:
        """Registers every route with ``receiver.add_parameter`` as a view of the live parameter
        (``params``: ``named_parameters()``, a dict or pairs; they must have the dtypes, shapes
        and strides recorded). Views alias the parameters' storage: nothing is moved.

        Unrecorded sources: ValueError listing them and why, unless ``allow_fallback``; then each
        gets a scratch tensor of its dtype and shape (on the parameters' device) as its
        destination, and the returned callable runs ``loader`` over ``[(name, scratch)]`` for
        those names. Call it from ``rx.on_commit`` (before resuming generation): those tensors
        cost a second copy, the others none. Without unrecorded sources the callable does nothing.

        Example::

            table = refit.record(model.named_parameters(), model.load_weights, meta_state)
            fallback = table.register(rx, model.named_parameters(), allow_fallback=True,
                                      loader=model.load_weights)
            rx.on_commit(fallback)              # fallback(version)
        """
        live = dict(params.items() if hasattr(params, "items") else params)
        if self.unrecorded and not allow_fallback:
            lines = "\n".join(f"  {n}: {why}" for n, why in self.unrecorded.items())
            raise ValueError(f"{len(self.unrecorded)} source(s) could not be recorded and a receiver cannot mix routes "
                             f"and a callback; pass allow_fallback=True (and loader=) to load them through the loader "
                             f"after each commit:\n{lines}")
        if self.unrecorded and loader is None:
            raise ValueError("allow_fallback=True needs loader= (the engine's load_weights) for "
                             + ", ".join(sorted(self.unrecorded)))
        self._check_params(live)
        for name in self.sources:
            for r in self.entries.get(name, ()):
                receiver.add_parameter(name, _alias(live[r.param], r), source_slice=r.source_slice)
        scratch: Dict[str, torch.Tensor] = {}
        if self.unrecorded:
            device = next(iter(live.values())).device if live else torch.device("cpu")
            for name in self.unrecorded:
                dtype, shape = self.sources[name]
                scratch[name] = torch.zeros(shape, dtype=dtype, device=device)
                receiver.add_parameter(name, scratch[name])
        return _Fallback(scratch, loader)

    def _check_params(self, live: Mapping[str, torch.Tensor]) -> None:
        used = {r.param for routes in self.entries.values() for r in routes}
        for name in sorted(used):
            if name not in live:
                raise ValueError(f"parameter '{name}' of the route table is not among the parameters given")
            p, (dtype, shape, stride) = live[name], self.params[name]
            if (p.dtype, tuple(p.shape), tuple(p.stride())) != (dtype, shape, stride):
                raise ValueError(f"parameter '{name}' is {_dtype_name(p.dtype)}{list(p.shape)} stride {list(p.stride())}; "
                                 f"the table was recorded for {_dtype_name(dtype)}{list(shape)} stride {list(stride)}")


def _alias(param: torch.Tensor, r: Route) -> torch.Tensor:
    base = param.detach()
    view = base.as_strided(r.shape, r.stride, base.storage_offset() + r.offset)
    expected = base.data_ptr() + r.offset * base.element_size()
    if view.data_ptr() != expected or _storage_key(view) != _storage_key(base):
        raise AssertionError(f"view of '{r.param}' at offset {r.offset} does not alias the parameter")
    return view


class _Fallback:
    """``fallback(version=None)``: loads the unrecorded sources from their scratch tensors."""

    def __init__(self, scratch: Dict[str, torch.Tensor], loader: Optional[Callable[..., Any]]) -> None:
        self.scratch = scratch
        self.names = list(scratch)
        self._loader = loader

    def __call__(self, version: Any = None) -> None:
        if not self.scratch:
            return
        assert self._loader is not None
        with torch.no_grad():
            self._loader(list(self.scratch.items()))

    def __bool__(self) -> bool:
        return bool(self.scratch)

    def __repr__(self) -> str:
        return f"refit.record fallback for {self.names}"


# ------------------------------------------------------------------------------ recording


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except AttributeError:  # torch < 2.0
        return t.storage()._cdata


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    return name


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


# Calls that read only metadata: executed on the recording tensor as they are.
_METADATA = {
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "dtype", "device", "is_contiguous", "stride",
    "element_size", "itemsize", "nbytes", "storage_offset", "layout", "requires_grad", "is_cuda", "is_meta", "is_cpu",
    "is_floating_point", "is_complex", "is_signed", "is_sparse", "is_quantized", "names", "__len__", "__repr__",
    "__str__", "__format__", "__hash__", "grad", "grad_fn", "is_leaf", "get_device", "_is_view", "__dir__",
    "output_nr", "_version", "__reduce_ex__", "is_shared", "is_pinned", "_base",
}
# Views: the result must share the source's storage (else it is a copy and taints).
_VIEWS = {
    "narrow", "__getitem__", "select", "view", "reshape", "reshape_as", "view_as", "flatten", "unflatten", "squeeze",
    "unsqueeze", "t", "T", "mT", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "chunk",
    "split", "split_with_sizes", "tensor_split", "unbind", "expand", "expand_as", "as_strided", "data", "detach",
    "alias", "__iter__",
}
# Copies that keep every value and the dtype: the recording tensor stands for its result.
_SAME_VALUES = {"contiguous", "clone", "cpu", "cuda", "pin_memory", "requires_grad_", "share_memory_", "__deepcopy__"}
_DTYPE_METHODS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int": torch.int32, "long": torch.int64, "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
    "bool": torch.bool,
}
_VALUE_READS = {
    "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy", "__array__", "equal",
    "allclose", "isclose", "data_ptr", "__contains__",
}
_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
}
_CONSTANT_WRITES = {"fill_", "zero_"}


def _write_target(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The tensor a call writes into, if any."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    if name in _INPLACE_DUNDERS or name == "__setitem__":
        return args[0]
    if name.endswith("_") and not name.startswith("_") and name not in ("requires_grad_", "share_memory_"):
        return args[0]
    return None


class _Recorder:
    """The state of one recording: sources (meta tensors), parameters, what was seen."""

    def __init__(self, params: Sequence[Tuple[str, torch.Tensor]], sources: Mapping[str, Tuple[torch.dtype, Shape]]) -> None:
        self.sources = dict(sources)
        self.base: Dict[str, torch.Tensor] = {n: torch.empty(s, dtype=d, device="meta") for n, (d, s) in sources.items()}
        self.src_of: Dict[int, str] = {_storage_key(t): n for n, t in self.base.items()}
        self.taint: Dict[int, Tuple[List[str], str]] = {}
        self.keep: List[torch.Tensor] = []  # tainted results stay alive: their storage keys stay unique
        self.params: Dict[int, List[Tuple[str, torch.Tensor]]] = {}
        for name, p in params:
            self.params.setdefault(_storage_key(p), []).append((name, p))
        self.routes: Dict[str, List[Route]] = {n: [] for n in sources}
        self.unrecorded: Dict[str, str] = {}
        self.static: List[Tuple[Route, str]] = []  # constant writes: (target, what)
        self.dirty: Dict[str, List[str]] = {}  # param -> non-constant writes that are no copy of a source
        self.busy = False

    # -- classification

    def source_of(self, t: torch.Tensor) -> Optional[str]:
        return self.src_of.get(_storage_key(t))

    def tainted(self, t: torch.Tensor) -> Optional[Tuple[List[str], str]]:
        return self.taint.get(_storage_key(t))

    def involved(self, tensors: Sequence[torch.Tensor]) -> List[str]:
        names: List[str] = []
        for t in tensors:
            n = self.source_of(t)
            found = [n] if n is not None else (self.tainted(t) or ([], ""))[0]
            names.extend(x for x in found if x not in names)
        return names

    def param_of(self, t: torch.Tensor) -> Optional[Tuple[str, torch.Tensor]]:
        owners = self.params.get(_storage_key(t))
        if not owners:
            return None
        lo = t.storage_offset()
        hi = lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else lo
        for name, p in owners:
            plo = p.storage_offset()
            phi = plo + sum((n - 1) * s for n, s in zip(p.shape, p.stride())) if p.numel() else plo
            if plo <= lo and hi <= phi:
                return name, p
        return owners[0]

    def unrecord(self, names: Sequence[str], reason: str) -> None:
        for n in names:
            self.unrecorded.setdefault(n, reason)

    def add_taint(self, outputs: Any, names: List[str], reason: str) -> None:
        for t in _tensors(outputs):
            if self.source_of(t) is None:
                self.taint.setdefault(_storage_key(t), (names, reason))
                self.keep.append(t)

    # -- the torch function handler

    def handle(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        name = _op_name(func)
        target = _write_target(name, args, kwargs)
        if target is not None:
            return self.write(name, func, target, args, kwargs)
        tensors = list(_tensors((args, kwargs)))
        names = self.involved(tensors)
        if not names:
            return func(*args, **kwargs)
        if name in _METADATA:
            return func(*args, **kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        taint = self.tainted(first) if first is not None else None
        if name in _VALUE_READS:
            raise _Unrecordable(names, f"the loader reads its values ({name})")
        if first is not None and taint is None and len(names) == 1:
            same = self.same_values(name, first, args, kwargs)
            if same is not None:
                return same
            if name in _VIEWS:
                out = self.run(name, func, args, kwargs, names)
                if any(t.dtype != first.dtype for t in _tensors(out)):
                    raise _Unrecordable(names, f"the loader reinterprets its bytes as another dtype ({name})")
                if all(self.source_of(t) == names[0] for t in _tensors(out)):
                    return out
                self.add_taint(out, names, f"{name} makes a copy (not a view) of it")
                return out
        out = self.run(name, func, args, kwargs, names)
        if not list(_tensors(out)):
            raise _Unrecordable(names, f"the loader reads its values ({name})")
        reason = taint[1] if taint is not None else f"the loader computes with it ({name})"
        self.add_taint(out, names, reason)
        return out

    def run(self, name: str, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], names: List[str]) -> Any:
        try:
            return func(*args, **kwargs)
        except _Unrecordable:
            raise
        except Exception as e:  # noqa: BLE001 - a meta tensor cannot do it: the source is unrecordable
            raise _Unrecordable(names, f"{name} failed on its recording tensor: {type(e).__name__}: {e}") from None

    def same_values(self, name: str, first: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[Any]:
        """The recording tensor itself for calls that copy it without changing a value (None
        when the call is not one); a dtype change taints."""
        dtype: Optional[torch.dtype] = None
        if name in _SAME_VALUES:
            dtype = first.dtype
        elif name in _DTYPE_METHODS and len(args) == 1 and not kwargs.keys() - {"memory_format"}:
            dtype = _DTYPE_METHODS[name]
        elif name in ("to", "type"):
            dtype = kwargs.get("dtype", first.dtype)
            for a in args[1:]:
                if isinstance(a, torch.dtype):
                    dtype = a
                elif isinstance(a, torch.Tensor):
                    dtype = a.dtype
                elif name == "type" and isinstance(a, str):
                    return None
            if name == "type" and len(args) == 1 and not kwargs:
                return None  # .type() answers a string
        else:
            return None
        if dtype != first.dtype:
            out = torch.empty(first.shape, dtype=dtype, device="meta")
            self.add_taint(out, [self.source_of(first)], f"the loader converts it from {_dtype_name(first.dtype)} to {_dtype_name(dtype)} ({name})")
            return out
        if name == "requires_grad_":
            return first
        return first.detach()

    def write(self, name: str, func: Any, target: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """A call that writes into ``target``: never executed on a parameter or a source."""
        values = [t for t in _tensors((list(args[1:]), kwargs)) if t is not target]
        if name == "__setitem__":
            target = self.run(name, torch.Tensor.__getitem__, (args[0], args[1]), {}, self.involved(values) or ["?"]) \
                if self.param_of(args[0]) is not None or self.involved(values) else target
            values = [args[2]] if isinstance(args[2], torch.Tensor) else []
        names = self.involved(values)
        owner = self.param_of(target)
        if owner is None and name == "__setitem__" and self.param_of(args[0]) is not None:
            pname = self.param_of(args[0])[0]  # advanced indexing: not a view of the parameter
            if names:
                self.unrecord(names, f"the loader writes it into '{pname}' through an index that is not a view")
            else:
                self.dirty.setdefault(pname, []).append("__setitem__ (advanced indexing)")
            return None
        if owner is None:
            hit = self.involved([target])
            if hit:
                self.unrecord(hit, f"the loader modifies it in place ({name})")
            elif names:  # the temporary may be kept by the engine (a scale, a cache): refits would miss it
                why = f"the loader copies it into a tensor that is not a parameter ({name})"
                self.unrecord(names, why)
                self.add_taint(target, names, why)
            else:
                return func(*args, **kwargs)
            return None if name == "__setitem__" else target
        pname, p = owner
        if name in ("copy_", "__setitem__") and len(values) == 1 and names and self.source_of(values[0]) is not None:
            self.copy(pname, p, target, values[0])
        elif names:
            taint = self.tainted(values[0]) if len(values) == 1 else None
            self.unrecord(names, taint[1] if taint else f"the loader writes it into '{pname}' with {name}, not a copy")
        elif name in _CONSTANT_WRITES or name in ("copy_", "__setitem__"):
            if target.numel() == 0:
                return None if name == "__setitem__" else target
            self.static.append((_static_target(target.storage_offset() - p.storage_offset(), tuple(target.shape),
                                               tuple(target.stride()), pname), name))
        else:
            self.dirty.setdefault(pname, []).append(name)
        return None if name == "__setitem__" else target

    def copy(self, pname: str, p: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        source = self.source_of(src)
        assert source is not None
        if dst.dtype != src.dtype:
            self.unrecord([source], f"copy_ into '{pname}' converts {_dtype_name(src.dtype)} to {_dtype_name(dst.dtype)}")
            return
        try:
            route = _route(source, self.sources[source][1], (src.storage_offset(), tuple(src.shape), tuple(src.stride())), pname,
                           (dst.storage_offset() - p.storage_offset(), tuple(dst.shape), tuple(dst.stride())))
        except _NotExpressible as e:
            self.unrecord([source], f"copy_ into '{pname}': {e}")
            return
        if route is not None:
            self.routes[source].append(route)

    # -- after the loader ran

    def finish(self, params: Sequence[Tuple[str, torch.Tensor]]) -> RouteTable:
        notes: List[str] = []
        by_param: Dict[str, List[Tuple[str, Route]]] = {}
        for source, routes in self.routes.items():
            for r in routes:
                by_param.setdefault(r.param, []).append((source, r))
        for pname, whats in self.dirty.items():
            writers = sorted({s for s, _ in by_param.get(pname, ())})
            why = f"the loader also changes '{pname}' with {', '.join(sorted(set(whats)))}"
            self.unrecord(writers, why)
            if not writers:
                notes.append(why + " (no source is copied into it)")
        for target, what in self.static:
            hit = [s for s, r in by_param.get(target.param, ()) if _overlap(r, target)]
            if hit:
                self.unrecord(hit, f"the loader also writes a constant ({what}) into bytes of '{target.param}' it lands in")
            else:
                notes.append(f"'{target.param}': the loader writes a constant ({what}) at offset {target.offset} "
                             f"shape {list(target.shape)}; refits leave those elements as they are")
        for pname, routes in by_param.items():
            routes.sort(key=lambda sr: sr[1].offset)
            for i, (sa, ra) in enumerate(routes):
                for sb, rb in routes[i + 1:]:
                    if _overlap(ra, rb):
                        why = f"'{sa}' and '{sb}' are written into the same bytes of '{pname}'"
                        self.unrecord([sa, sb], why)
        entries = {n: ([] if n in self.unrecorded else rs) for n, rs in self.routes.items()}
        return RouteTable(entries, self.unrecorded, self.sources,
                          {n: (p.dtype, tuple(p.shape), tuple(p.stride())) for n, p in params}, notes)


class _Mode(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.busy:
            return func(*args, **kwargs)
        return self.recorder.handle(func, args, kwargs)


_setitem_lock = threading.Lock()
_modes_see_setitem: Optional[bool] = None


def _probe_setitem() -> bool:
    """Whether torch function modes see ``Tensor.__setitem__`` (torch >= 2; 1.13 does not)."""
    global _modes_see_setitem
    if _modes_see_setitem is None:
        seen = []

        class Probe(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if _op_name(func) == "__setitem__":
                    seen.append(True)
                    return None
                return func(*args, **(kwargs or {}))

        t, v = torch.zeros(2), torch.ones(1)
        with Probe():
            t[0:1] = v  # torch 1.13 sees a scalar value, not a tensor one: probe with a tensor
        _modes_see_setitem = bool(seen)
    return _modes_see_setitem


class _PatchedSetitem:
    """Routes ``Tensor.__setitem__`` to the recorder while recording, where modes do not see it."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.orig = torch.Tensor.__setitem__

    def __enter__(self) -> None:
        recorder, orig = self.recorder, self.orig

        def setitem(t, index, value):
            if recorder.busy:
                return orig(t, index, value)
            recorder.busy = True
            try:
                return recorder.handle(orig, (t, index, value), {})
            finally:
                recorder.busy = False

        setitem.__name__ = "__setitem__"
        _setitem_lock.acquire()
        torch.Tensor.__setitem__ = setitem

    def __exit__(self, *exc) -> None:
        torch.Tensor.__setitem__ = self.orig
        _setitem_lock.release()


def _source_meta(sources: Any) -> Dict[str, Tuple[torch.dtype, Shape]]:
    items = sources.items() if hasattr(sources, "items") else sources
    out: Dict[str, Tuple[torch.dtype, Shape]] = {}
    for name, spec in items:
        if isinstance(spec, torch.Tensor):
            out[name] = (spec.dtype, tuple(spec.shape))
            continue
        dtype, shape = spec
        out[name] = (_dtype(dtype) if isinstance(dtype, str) else dtype, tuple(shape))
    return out


Params = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


def record(params: Params, loader: Callable[[Iterable[Tuple[str, torch.Tensor]]], Any], sources: Any) -> RouteTable:
    """Records where ``loader`` puts each source in ``params``: a :class:`RouteTable`.

    Args:
        params: the engine's parameters (``model.named_parameters()``, a dict or pairs; persistent
            buffers too if they are refitted). Any device, the meta device included; never written.
        loader: the engine's loader, called with an iterable of ``(name, tensor)`` pairs, like
            vLLM's ``model.load_weights``.
        sources: the trainer's tensors: name -> tensor (a meta-device ``state_dict()`` will do)
            or name -> ``(dtype, shape)``.

    The loader runs once on meta tensors, under a ``TorchFunctionMode``: views of a source
    (``narrow``, slicing, ``view``/``reshape`` without a copy, ``chunk``/``split``, ``t`` when
    transposed back) are followed; a ``copy_`` (or ``param[...] = w``) of one into a parameter or a
    view of one becomes a :class:`Route`. Anything else done with a source's values marks that
    source unrecorded with the reason, and ``record`` goes on. A loader that raises marks the
    source it was given last and is called again with the sources it has not seen (a loader that
    takes pairs one by one, as vLLM's do, finishes each before asking for the next).

    Example::

        meta = {k: v.to("meta") for k, v in trainer_model.state_dict().items()}
        table = refit.record(engine.named_parameters(), engine.load_weights, meta)
        assert not table.unrecorded, table.unrecorded
        table.register(rx, engine.named_parameters())
        open("routes.json", "w").write(table.to_json())
    """
    plist = list(params.items() if hasattr(params, "items") else params)
    meta = _source_meta(sources)
    rec = _Recorder(plist, meta)
    pending = list(meta)
    last: List[Optional[str]] = [None]

    def feed(names: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
        for n in names:
            last[0] = n
            yield n, rec.base[n]

    patch = None if _probe_setitem() else _PatchedSetitem(rec)
    with torch.no_grad():
        while pending:
            last[0] = None
            seen_before = len(pending)
            try:
                if patch is not None:
                    patch.__enter__()
                try:
                    with _Mode(rec):
                        loader(feed(pending))
                finally:
                    if patch is not None:
                        patch.__exit__(None, None, None)
                pending = []
            except _Unrecordable as e:
                rec.unrecord(e.names, e.reason)
                pending = pending[pending.index(last[0]) + 1:] if last[0] in pending else []
            except Exception as e:  # noqa: BLE001 - the loader's own failure: its current source is unrecorded
                why = f"the loader raised {type(e).__name__}: {e}"
                if last[0] is None:
                    rec.unrecord(pending, why + " (before taking a source)")
                    pending = []
                else:
                    rec.unrecord([last[0]], why)
                    pending = pending[pending.index(last[0]) + 1:]
            assert len(pending) < seen_before
    return rec.finish(plist)
