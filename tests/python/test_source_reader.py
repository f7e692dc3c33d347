"""A dict, list or tuple of many tensors (a state_dict) is read by the streamer's reader thread
while the streamer moves the tensors before: every tensor still arrives bit-exact, in any
container; a bad pair deep inside one fails the refit with the same error as anywhere else, the
source's own exception raised again as it is, nothing committed; whatever may run the caller's
Python (a tensor subclass, a Mapping of the caller's) is read on the calling thread; and a child
forked after the reader was made closes its copy of the streamer without waiting for it."""

import collections
import collections.abc
import multiprocessing
import re
import threading

import pytest
import torch

import refit
from conftest import spec_of, state_bytes, streamer

#: More than the binding's python_tensors::reader_from (64), so the reader thread reads them.
MANY = 300


def many_state(version: int):
    """MANY tensors of varied shapes and dtypes, different bytes each version."""
    g = torch.Generator().manual_seed(version)
    state = {}
    for i in range(MANY):
        shape = (1 + i % 7, 3 + i % 5)
        t = torch.randn(shape, generator=g)
        state[f"layer.{i}.w"] = t.to(torch.bfloat16) if i % 3 == 0 else t
    return state


@pytest.fixture
def served(table_peer):
    """A receiver of many_state()'s table that committed version 1 from a dict."""
    state = many_state(1)
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        st.refit(1, state)
        assert job.request("state") == state_bytes(state)
        yield job, st
        # Nothing of a refused refit reached the receiver: version 2 is still free, and the
        # reader of the next refit starts afresh.
        after = many_state(2)
        st.refit(2, after)
        assert job.request("state") == state_bytes(after)
    job.stop()


@pytest.mark.parametrize("container", ["dict", "ordereddict", "list", "tuple", "items"])
def test_every_tensor_of_a_large_container_arrives_bit_exact_version_after_version(table_peer, container):
    job, endpoint = table_peer(spec_of(many_state(1)))
    as_container = {
        "dict": lambda s: s,
        "ordereddict": collections.OrderedDict,  # what state_dict() returns
        "list": lambda s: list(s.items()),
        "tuple": lambda s: tuple(s.items()),
        "items": lambda s: s.items(),  # a view: iterated as pairs, on the calling thread
    }[container]
    with streamer(endpoint) as st:
        for version in (1, 2, 3):
            state = many_state(version)
            stats = st.refit(version, as_container(state))
            assert stats.tensors == MANY
            assert job.request("state") == state_bytes(state)
    job.stop()


BAD_PAIRS = {
    # where, what it becomes, the error
    "non-contiguous": (200, ("layer.200.w", torch.zeros(4, 8)[:, ::2]), ValueError,
                       "tensor 'layer.200.w' is not contiguous: refit reads dense row-major tensors "
                       "(pass tensor.contiguous())"),
    "dtype": (250, ("layer.250.w", torch.zeros(4, dtype=torch.complex64)), TypeError,
              "tensor 'layer.250.w' has dtype torch.complex64, which refit does not carry"),
    "not-a-pair": (100, ("layer.100.w",), TypeError,
                   "refit(): tensors must be a mapping of name to tensor or (name, tensor) pairs; got a tuple"),
}


@pytest.mark.parametrize(
    "bad,container",
    [(bad, c) for bad in BAD_PAIRS for c in ("dict", "list") if not (bad == "not-a-pair" and c == "dict")])
def test_a_bad_pair_deep_in_a_large_container_is_refused_with_its_error(served, bad, container):
    job, st = served
    at, pair, kind, message = BAD_PAIRS[bad]
    pairs = list(many_state(5).items())
    pairs[at] = pair
    with pytest.raises(kind, match=re.escape(message)):
        st.refit(2, dict(pairs) if container == "dict" else pairs)


class SourceBroke(RuntimeError):
    """What a tensor of the test raises when the binding reads it."""


class Exploding(torch.Tensor):
    """A tensor subclass whose dtype cannot be read."""

    @property
    def dtype(self):
        raise SourceBroke("dtype of tensor 180 is gone")


def test_an_exception_a_tensor_raises_deep_in_a_state_dict_is_raised_again_as_it_is(served):
    job, st = served
    state = many_state(5)
    state["layer.180.w"] = state["layer.180.w"].as_subclass(Exploding)
    with pytest.raises(SourceBroke, match="dtype of tensor 180 is gone"):
        st.refit(2, state)


def test_a_failed_refit_of_a_large_state_dict_leaves_the_streamer_usable_for_the_next(served):
    job, st = served
    state = many_state(5)
    state["layer.299.w"] = torch.zeros(4, 8)[:, ::2]  # the very last pair
    with pytest.raises(ValueError, match=re.escape("tensor 'layer.299.w' is not contiguous")):
        st.refit(2, state)
    state["layer.299.w"] = torch.zeros(4, 8)[:, ::2].contiguous()
    with pytest.raises(refit.RefitError, match="layer.299.w") as refused:  # a shape the receiver does not hold
        st.refit(2, state)
    assert refused.value.code == refit.Errc.apply


class Watched(torch.Tensor):
    """A tensor subclass that notes the thread its dtype is read on."""

    threads = []

    @property
    def dtype(self):
        Watched.threads.append(threading.get_ident())
        return super().dtype


def test_what_is_not_a_plain_tensor_deep_in_a_state_dict_is_read_on_the_calling_thread_and_arrives(table_peer):
    state = many_state(1)
    job, endpoint = table_peer(spec_of(state))
    sent = dict(state)
    sent["layer.150.w"] = state["layer.150.w"].as_subclass(Watched)
    sent["layer.151.w"] = state["layer.151.w"].numpy()  # through DLPack
    sent["layer.152.w"] = state["layer.152.w"].as_subclass(Watched)
    Watched.threads.clear()
    with streamer(endpoint) as st:
        st.refit(1, sent)
    # Its Python (here the subclass's dtype) ran where refit() was called, as it would without
    # the reader: torch's function modes and current device are per thread.
    assert Watched.threads == [threading.get_ident()] * 2
    assert job.request("state") == state_bytes(state)
    job.stop()


def test_shards_in_a_large_state_dict_arrive_bit_exact_and_a_subclass_inside_one_is_read_on_the_calling_thread(
        table_peer):
    state = many_state(1)
    job, endpoint = table_peer(spec_of(state))
    sent = {name: refit.Shard(t, t.shape, 0, 0) for name, t in state.items()}  # each the whole tensor
    sent["layer.200.w"] = refit.Shard(state["layer.200.w"].as_subclass(Watched), state["layer.200.w"].shape, 0, 0)
    Watched.threads.clear()
    with streamer(endpoint) as st:
        stats = st.refit(1, sent)
    assert stats.tensors == MANY
    assert Watched.threads == [threading.get_ident()]
    assert job.request("state") == state_bytes(state)
    job.stop()


class LazyState(collections.abc.Mapping):
    """A mapping of the caller's that makes each tensor when it is asked for (as one that gathers
    shards would), noting the thread; items() of the second kind is a generator, without len()."""

    def __init__(self, state, generator_items=False):
        self.state, self.threads, self.generator_items = state, [], generator_items

    def __getitem__(self, name):
        self.threads.append(threading.get_ident())
        return self.state[name].clone()

    def __iter__(self):
        return iter(self.state)

    def __len__(self):
        return len(self.state)

    def items(self):
        if self.generator_items:
            return ((name, self[name]) for name in self.state)
        return super().items()


@pytest.mark.parametrize("generator_items", [False, True], ids=["items-view", "items-generator"])
def test_a_large_mapping_of_the_callers_is_read_on_the_calling_thread_and_arrives(table_peer, generator_items):
    state = many_state(1)
    job, endpoint = table_peer(spec_of(state))
    lazy = LazyState(state, generator_items)
    with streamer(endpoint) as st:
        st.refit(1, lazy)
    assert lazy.threads == [threading.get_ident()] * MANY
    assert job.request("state") == state_bytes(state)
    job.stop()


def test_a_child_forked_after_a_large_refit_closes_its_copy_of_the_streamer_and_the_parent_goes_on(table_peer):
    state = many_state(1)
    job, endpoint = table_peer(spec_of(state))
    with streamer(endpoint) as st:
        st.refit(1, state)  # the streamer's reader thread runs from here on
        # The child has a copy of the reader's state but not its thread: closing must not wait for it.
        child = multiprocessing.get_context("fork").Process(target=st.close)
        child.start()
        child.join(60)
        if child.is_alive():
            child.kill()
            pytest.fail("a forked child hung closing its copy of the streamer")
        assert child.exitcode == 0
        after = many_state(2)
        st.refit(2, after)
        assert job.request("state") == state_bytes(after)
    job.stop()
