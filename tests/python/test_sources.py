"""How Streamer.refit() reads its tensors: exact torch.Tensor and nn.Parameter through the fast
path (no isinstance, no DLPack), tensor subclasses through their attributes (their
__torch_function__ honoured), anything else through DLPack; every one bit-exact, and the same
errors whichever way a tensor was read."""

import re

import numpy as np
import pytest
import torch

import refit
from conftest import spec_of, state_bytes, streamer

#: torch's name -> refit's, for every dtype refit carries that this torch has.
DTYPES = [
    name
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if hasattr(torch, name)
]

SHAPES = {"matrix": (5, 7), "scalar": (), "empty": (0, 3), "vector": (129,)}


def random_tensor(dtype_name: str, shape, seed: int) -> torch.Tensor:
    """Random bytes of any dtype (every bit pattern for the integer and float types; 0/1 for bool),
    made without arithmetic in that dtype (torch has little for uint16 or float8)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def every_dtype_state(seed: int):
    return {
        f"{dtype}.{kind}": random_tensor(dtype, shape, seed * 1000 + i)
        for i, (dtype, (kind, shape)) in enumerate((d, s) for d in DTYPES for s in SHAPES.items())
    }


def test_plain_tensors_of_every_dtype_and_shape_arrive_bit_exact(table_peer):
    state = every_dtype_state(1)
    assert all(type(t) is torch.Tensor for t in state.values())
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        for version in (1, 2):
            state = every_dtype_state(version)
            stats = st.refit(version, state)
            assert stats.tensors == len(state)
            assert job.request("state") == state_bytes(state), f"version {version}"
    job.stop()


def test_parameters_of_a_module_arrive_bit_exact(table_peer):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4, bias=False))
    params = dict(model.named_parameters())
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in params.values())
    job, endpoint = table_peer(spec_of(params))
    with streamer(endpoint) as st:
        st.refit(1, model.named_parameters())  # a generator of (name, Parameter)
        assert job.request("state") == state_bytes(params)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3)
        st.refit(2, params)
        assert job.request("state") == state_bytes(params)
    job.stop()


class Tagged(torch.Tensor):
    """A tensor subclass with no behaviour of its own."""


class Logged(torch.Tensor):
    """A tensor subclass that records every torch function it sees (attribute reads included)."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclasses_and_numpy_arrays_arrive_bit_exact_beside_plain_tensors(table_peer):
    g = torch.Generator().manual_seed(7)
    numpy_array = np.arange(-20, 20, dtype=np.int16).reshape(4, 10)
    state = {
        "plain": torch.randn(6, 5, generator=g),
        "tagged": torch.randn(3, 9, generator=g).to(torch.bfloat16).as_subclass(Tagged),
        "logged": torch.randint(-100, 100, (11,), generator=g, dtype=torch.int64).as_subclass(Logged),
        "numpy": numpy_array,
        "numpy.scalar": np.array(2.5, dtype=np.float64),
        "parameter": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
    }
    expected = {
        name: torch.from_numpy(t) if isinstance(t, np.ndarray) else t.detach().as_subclass(torch.Tensor)
        for name, t in state.items()
    }
    job, endpoint = table_peer(spec_of(expected))
    Logged.seen.clear()
    with streamer(endpoint) as st:
        st.refit(1, state)
    assert job.request("state") == state_bytes(expected)
    assert Logged.seen, "a subclass is read through its attributes, which its __torch_function__ sees"
    job.stop()


class MyShard(refit.Shard):
    __slots__ = ()


class DuckShard:
    """Not a refit.Shard, but says it is one."""

    __refit_shard__ = True

    def __init__(self, tensor, global_shape, dim, start):
        self.tensor, self.global_shape, self.dim, self.start = tensor, tuple(global_shape), dim, start


@pytest.mark.parametrize("shard", [refit.Shard, MyShard, DuckShard], ids=["shard", "subclass", "duck"])
def test_a_shard_is_told_from_a_tensor_by_its_type_or_its_marker(table_peer, shard):
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    job, endpoint = table_peer(spec_of({"w": full}))
    with streamer(endpoint) as st:
        st.refit(1, {"w": shard(full, full.shape, 0, 0)})  # read as a tensor, it would be a TypeError
    assert job.request("state") == state_bytes({"w": full})
    job.stop()


NOT_CONTIGUOUS = "tensor 'w' is not contiguous: refit reads dense row-major tensors (pass tensor.contiguous())"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(16, 8).t(),
        lambda: torch.nn.Parameter(torch.zeros(16, 8).t()),
        lambda: torch.zeros(8, 32)[:, ::2].as_subclass(Tagged),
    ],
    ids=["tensor", "parameter", "subclass"],
)
def test_a_non_contiguous_tensor_is_refused_with_one_message_whichever_path_reads_it(served, make):
    job, st = served
    with pytest.raises(ValueError, match=re.escape(NOT_CONTIGUOUS)):
        st.refit(2, {"w": make()})


@pytest.mark.parametrize(
    "make",
    [lambda: torch.zeros(4, dtype=torch.complex64), lambda: torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))],
    ids=["tensor", "parameter"],
)
def test_an_unsupported_dtype_is_refused_naming_the_tensor_and_dtype(served, make):
    job, st = served
    with pytest.raises(TypeError, match=re.escape("tensor 'w' has dtype torch.complex64, which refit does not carry")):
        st.refit(2, {"w": make()})


@pytest.fixture
def served(table_peer):
    """A receiver of one f32[2] tensor that committed version 1."""
    state = {"x": torch.ones(2)}
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        st.refit(1, state)
        yield job, st
        # Nothing of a refused refit reached the receiver: version 2 is still free.
        st.refit(2, {"x": torch.full((2,), 5.0)})
        assert job.request("state") == state_bytes({"x": torch.full((2,), 5.0)})
    job.stop()
