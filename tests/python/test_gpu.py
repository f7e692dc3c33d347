"""GPU refits (skipped without CUDA): cuda_ipc (direct, staged, on_tensor) and nccl (the receiver
on a second GPU, or on the streamer's where it is the only one: see conftest.nccl_ranks), and a
transformers Llama trained here and refit after every step, logits equal there.

The receiver runs in the shared peer process (spawned: it never inherits a CUDA context); each
job sets its device before it makes a CUDA tensor.
"""

import os

import pytest
import torch

import refit
from conftest import (
    Stopped,
    claim_nccl_host,
    mixed_state,
    need_gpus,
    rank_gpu,
    serve_loop,
    spec_of,
    state_bytes,
    streamer,
    tensor_bytes,
    zeros_like_spec,
)


@pytest.fixture
def one_gpu():
    need_gpus(1)
    torch.cuda.set_device(0)


@pytest.fixture
def nccl_pair(nccl_ranks):
    """A streamer here on cuda:0 and a receiver on rank_gpu(1); True when they share the GPU."""
    shared = nccl_ranks(2)
    torch.cuda.set_device(0)
    return shared


def gpu_streamer(endpoint, transport, **options):
    """A streamer on cuda:0; nccl broadcasts to ``receivers=[endpoint]``."""
    if transport == "nccl":
        return streamer(None, transport="nccl", receivers=[endpoint], device=0, **options)
    return streamer(endpoint, transport=transport, device=0, **options)


def use_device(device: int, nccl: bool, shared: bool = False) -> None:
    """In a job: NCCL's environment (with ``shared``, what nccl_ranks() returned, a host of this
    peer's own), then the device, before any CUDA tensor exists."""
    if nccl:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    claim_nccl_host(nccl and shared)
    torch.cuda.set_device(device)


# ------------------------------------------------------------------------- peer jobs


def gpu_table(chan, spec, device: int, nccl: bool, shared: bool = False):
    """Job: a parameter table of CUDA tensors on ``device``. Commands: ``state``."""
    use_device(device, nccl, shared)
    params = zeros_like_spec(spec, device=f"cuda:{device}")
    with refit.Receiver(device=device) as rx:
        rx.add_parameters(params)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: state_bytes(params)})


def gpu_stacked_experts(chan, device: int, shared: bool):
    """Job: an engine's stacked experts ``w13[E, 2I, H]`` and a norm. The trainer's ``gate`` and
    ``up`` ``[E, I, H]`` land in the views ``w13[:, :I]`` and ``w13[:, I:]``, whose rows lie apart
    (expert by expert). Commands: ``state`` (w13 and the norm)."""
    use_device(device, True, shared)
    w13 = torch.zeros(4, 2 * 96, 64, dtype=torch.bfloat16, device=f"cuda:{device}")
    norm = torch.zeros(64, dtype=torch.bfloat16, device=f"cuda:{device}")
    with refit.Receiver(device=device) as rx:
        rx.add_parameter("experts.gate", w13[:, :96])
        rx.add_parameter("experts.up", w13[:, 96:])
        rx.add_parameter("norm", norm)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"state": lambda: (tensor_bytes(w13), tensor_bytes(norm))})


def allocator_settings():
    """torch's run-time switch of the caching allocator's settings, or None where it has none."""
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )


def gpu_table_expandable(chan, spec, device: int):
    """Job: gpu_table with the parameters in torch's expandable segments (VMM memory), as an
    engine run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True holds them. Sends None
    (and ends) where torch cannot switch at run time."""
    settings = allocator_settings()
    if settings is None:
        chan.send(None)
        return []
    use_device(device, False)
    settings("expandable_segments:True")
    torch.cuda.empty_cache()
    try:
        params = zeros_like_spec(spec, device=f"cuda:{device}")
        with refit.Receiver(device=device) as rx:
            rx.add_parameters(params)
            chan.send(rx.endpoint)
            return serve_loop(rx, chan, {"state": lambda: state_bytes(params)})
    finally:
        settings("expandable_segments:False")
        torch.cuda.empty_cache()


def gpu_on_tensor(chan, device: int, nccl: bool, shared: bool = False):
    """Job: an on_tensor sink on ``device`` keeping a copy of each tensor. Commands: ``take``."""
    use_device(device, nccl, shared)
    got = {}
    with refit.Receiver(device=device) as rx:

        @rx.on_tensor
        def load_weights(name, tensor):
            assert tensor.device == torch.device("cuda", device), tensor.device
            got[name] = tensor.clone()  # on the stream the bytes are ready on

        def take():
            torch.cuda.synchronize(device)
            out = state_bytes(got)
            got.clear()
            return out

        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"take": take})


# -------------------------------------------------------------------- state_dict refits


def refit_three_versions(job, st, read):
    for version in (1, 2, 3):
        state = mixed_state(version, device="cuda:0")
        stats = st.refit(version, state)
        assert job.request(read) == state_bytes(state), f"version {version}"
        assert job.request("status")["committed_version"] == version
    return stats


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_cuda_ipc_state_dict_arrives_bit_exact(peer, one_gpu, direct):
    job = peer.run(gpu_table, spec_of(mixed_state(1)), 0, False)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "cuda_ipc", direct=direct, buffer_bytes=64 << 10) as st:
        stats = refit_three_versions(job, st, "state")
    assert stats.direct is direct
    job.stop()


def spread_state(version: int, devices: int):
    """300 tensors (more than the binding reads on the refit's thread) dealt round the GPUs."""
    g = torch.Generator().manual_seed(2000 + version)
    return {
        f"layer.{i}.w": torch.randn(3 + i % 5, 8, generator=g).to(f"cuda:{i % devices}") for i in range(300)
    }


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_large_state_dict_spread_over_two_gpus_arrives_bit_exact(peer, direct):
    # The binding's reader thread takes the tensors on the streamer's GPU; the first one on the
    # other GPU (whose torch stream only the calling thread may know) and the rest after it are
    # read on the calling thread: every tensor still arrives, version after version.
    need_gpus(2)
    torch.cuda.set_device(0)
    job = peer.run(gpu_table, spec_of(spread_state(1, 2)), 0, False)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "cuda_ipc", direct=direct, buffer_bytes=64 << 10) as st:
        for version in (1, 2, 3):
            state = spread_state(version, 2)
            stats = st.refit(version, state)
            assert stats.tensors == 300
            assert job.request("state") == state_bytes(state), f"version {version}"
            assert job.request("status")["committed_version"] == version
    assert stats.direct is direct
    job.stop()


@pytest.mark.parametrize("share", [True, False], ids=["shared", "packed"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_cuda_ipc_through_on_tensor_arrives_bit_exact(peer, one_gpu, direct, share):
    job = peer.run(gpu_on_tensor, 0, False)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "cuda_ipc", direct=direct, buffer_bytes=64 << 10, share_tensors=share) as st:
        stats = refit_three_versions(job, st, "take")
    assert stats.direct is False  # a callback sink is always staged
    # Shared: the receiver read every tensor where it is in this process's memory (torch's
    # allocations, mapped); packed: every byte went through the buffers.
    assert stats.shared_bytes == (stats.bytes if share else 0)
    job.stop()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
def test_cuda_ipc_tensors_in_expandable_segments_arrive_bit_exact(peer, one_gpu, lane):
    """torch's expandable segments are VMM chunks that cudaIpc handles cannot export. Through the
    control lane's descriptor link the receiver maps the chunks and reads every tensor where it
    is, a tensor spanning chunks included; without a lane they go through the buffers. A tensor
    made anew for each version (often in reused or new chunks) arrives bit-exact either way."""
    settings = allocator_settings()
    if settings is None:
        pytest.skip("this torch cannot switch to expandable segments at run time")
    job = peer.run(gpu_on_tensor, 0, False)
    endpoint = job.recv()
    settings("expandable_segments:True")
    torch.cuda.empty_cache()  # so that the large tensor takes a new (expandable) segment
    try:
        with gpu_streamer(endpoint, "cuda_ipc", direct=False, buffer_bytes=1 << 20, control_lane=lane) as st:
            for version in (1, 2, 3):
                state = mixed_state(version, device="cuda:0")
                big = torch.arange(16 << 20, dtype=torch.int32, device="cuda:0") * version  # 64 MiB: 4 chunks
                state["big"] = big
                stats = st.refit(version, state)
                assert job.request("take") == state_bytes(state), f"version {version}"
                if lane:
                    assert stats.shared_bytes == stats.bytes, f"version {version}"
                else:
                    assert stats.shared_bytes <= stats.bytes - big.numel() * big.element_size()
                del big, state
    finally:
        settings("expandable_segments:False")
        torch.cuda.empty_cache()
    job.stop()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
def test_cuda_ipc_writes_an_engines_expandable_segments_weights_directly(peer, one_gpu, lane):
    """An engine whose weights are in torch's expandable segments offers them for direct writes
    through the control lane's descriptor link: the streamer maps the chunks and writes the
    weights where they are. Without a lane the refit stages through the buffers. Bit-exact."""
    job = peer.run(gpu_table_expandable, spec_of(mixed_state(1)), 0)
    endpoint = job.recv()
    if endpoint is None:
        job.stop()
        pytest.skip("this torch cannot switch to expandable segments at run time")
    with gpu_streamer(endpoint, "cuda_ipc", direct=True, control_lane=lane) as st:
        stats = refit_three_versions(job, st, "state")
    assert stats.direct is lane
    job.stop()


@pytest.mark.parametrize("direct", [True, False], ids=["in-place", "buffered"])
def test_nccl_state_dict_arrives_bit_exact_at_another_rank(peer, nccl_pair, direct):
    job = peer.run(gpu_table, spec_of(mixed_state(1)), rank_gpu(1), True, nccl_pair)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "nccl", direct=direct, buffer_bytes=64 << 10) as st:
        refit_three_versions(job, st, "state")
    job.stop()


@pytest.mark.parametrize("direct", [True, False], ids=["in-place", "buffered"])
def test_nccl_stacked_experts_land_in_views_whose_rows_lie_apart(peer, nccl_pair, direct):
    """An engine's w13 takes gate and up through views whose rows lie apart. In place, the streamer
    sends the receiver exactly its parts (every byte once), which it receives into its scatter
    memory and copies into place; buffered, whole tensors are broadcast and applied. 64 KiB
    batches split ``up`` across two of them. Bit-exact over three versions."""
    job = peer.run(gpu_stacked_experts, rank_gpu(1), nccl_pair)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "nccl", direct=direct, buffer_bytes=64 << 10) as st:
        for version in (1, 2, 3):
            g = torch.Generator().manual_seed(version)
            state = {
                name: torch.randn(shape, generator=g).to(torch.bfloat16).to("cuda:0")
                for name, shape in (("experts.gate", (4, 96, 64)), ("experts.up", (4, 96, 64)), ("norm", (64,)))
            }
            stats = st.refit(version, state)
            want = torch.cat([state["experts.gate"], state["experts.up"]], dim=1)
            assert job.request("state") == (tensor_bytes(want), tensor_bytes(state["norm"])), f"version {version}"
            assert stats.direct is direct
            assert stats.parts_bytes == (sum(t.numel() * t.element_size() for t in state.values()) if direct else 0)
    job.stop()


def test_nccl_through_on_tensor_arrives_bit_exact_at_another_rank(peer, nccl_pair):
    job = peer.run(gpu_on_tensor, rank_gpu(1), True, nccl_pair)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "nccl", buffer_bytes=64 << 10) as st:
        refit_three_versions(job, st, "take")
    job.stop()


# ------------------------------------------------------------------- a transformers model


def llama(device: int, hidden: int = 256, layers: int = 2):
    """A small Llama from a config (no download), bf16, on ``device``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    major = int(transformers.__version__.split(".")[0])
    dtype_arg = {"dtype": torch.bfloat16} if major >= 5 else {"torch_dtype": torch.bfloat16}
    model = transformers.AutoModelForCausalLM.from_config(config, **dtype_arg)
    model = model.to(f"cuda:{device}")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    return model


def fixed_ids(device: int):
    return torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(3)).to(f"cuda:{device}")


def logits(model, device: int):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=fixed_ids(device)).logits
    torch.cuda.synchronize(device)
    return out


def llama_worker(chan, device: int, nccl: bool, shared: bool = False):
    """Job: the generation side: the same Llama (other initial weights), its parameters and
    persistent buffers registered. Commands: ``logits``."""
    use_device(device, nccl, shared)
    torch.manual_seed(1)
    model = llama(device)
    params = dict(model.named_parameters())
    with refit.Receiver(device=device) as rx:
        rx.add_parameters(model.named_parameters())
        rx.add_parameters((k, v) for k, v in model.state_dict().items() if k not in params)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"logits": lambda: tensor_bytes(logits(model, device))})


def fuse(model):
    """Puts the model's weights in an engine's layout, as vLLM and SGLang hold them: per layer, q, k
    and v become views into one fused ``qkv`` tensor, gate and up into one ``gate_up`` (the model's
    own forward then reads the fused memory). Returns ``(source name, view)`` for every weight."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for block, parts in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            weights = [getattr(block, p).weight for p in parts]
            fused = torch.cat([w.detach() for w in weights])
            row = 0
            for part, w in zip(parts, weights):
                view = fused.narrow(0, row, w.shape[0])
                getattr(block, part).weight = torch.nn.Parameter(view, requires_grad=False)
                assert getattr(block, part).weight.data_ptr() == view.data_ptr()
                out.append((f"model.layers.{i}.{'self_attn' if parts[0] == 'q_proj' else 'mlp'}.{part}.weight", view))
                row += w.shape[0]
    return out


def fused_llama_worker(chan, device: int):
    """Job: the generation side in a fused layout (see fuse): q/k/v and gate/up land in views of
    the fused tensors, everything else in place. Commands: ``logits``."""
    use_device(device, False)
    torch.manual_seed(1)
    model = llama(device)
    views = fuse(model)
    fused_names = {name for name, _ in views}
    with refit.Receiver(device=device) as rx:
        for name, view in views:
            rx.add_parameter(name, view)
        rx.add_parameters((k, v) for k, v in model.state_dict().items() if k not in fused_names)
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"logits": lambda: tensor_bytes(logits(model, device))})


def train_and_refit(job, model, transport, **options):
    """Three training steps here, a refit after each; the other side's logits equal ours every time."""
    endpoint = job.recv()
    assert job.request("logits") != tensor_bytes(logits(model, 0))  # other weights before the first refit
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 1000, (4, 33), generator=torch.Generator().manual_seed(5)).to("cuda:0")
    seen = []
    with gpu_streamer(endpoint, transport, buffer_bytes=1 << 20, **options) as st:
        for step in range(1, 4):
            model.train()
            loss = model(input_ids=data[:, :-1], labels=data[:, 1:]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats = st.refit(step, model.state_dict())  # ordered after optimizer.step() on the stream
            expected = tensor_bytes(logits(model, 0))
            assert job.request("logits") == expected, f"step {step}: the logits differ"
            seen.append(expected)
    job.stop()
    assert seen[0] != seen[1] != seen[2]  # every step changed the weights
    return stats


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_llama_engine_in_a_fused_layout_gives_the_same_logits_after_every_refit(peer, one_gpu, direct):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = llama(0)
    job = peer.run(fused_llama_worker, 0)
    stats = train_and_refit(job, model, "cuda_ipc", direct=direct)
    assert stats.direct is direct


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_a_llama_trained_here_gives_the_same_logits_there_after_every_refit(peer, nccl_ranks, transport):
    nccl = transport == "nccl"
    if nccl:
        shared = nccl_ranks(2)
    else:
        need_gpus(1)
        shared = False
    pytest.importorskip("transformers")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = llama(0)
    job = peer.run(llama_worker, rank_gpu(1) if nccl else 0, nccl, shared)
    train_and_refit(job, model, transport)


# ------------------------------------------------------------------- storage identity


def graphed_mlp_worker(chan, device: int):
    """Job: an engine that captured a CUDA graph of its forward over its weights (as engines do for
    decoding), then registered them. Commands: ``replay`` (the graph's output for the fixed input,
    replayed now), ``moved`` (names of parameters whose data_ptr changed since registration)."""
    use_device(device, False)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)).to(f"cuda:{device}")
    static_in = torch.randn(8, 64, generator=torch.Generator().manual_seed(9)).to(f"cuda:{device}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        model(static_in)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = model(static_in)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    def replay():
        graph.replay()
        torch.cuda.synchronize(device)
        return static_out.cpu()

    with refit.Receiver(device=device) as rx:
        rx.add_parameters(model.named_parameters())
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {
            "replay": replay,
            "moved": lambda: [n for n, p in model.named_parameters() if p.data_ptr() != ptrs[n]],
        })


def test_a_cuda_graph_captured_before_100_refits_computes_with_the_new_weights(peer, one_gpu):
    """refit writes in place and never moves a parameter: a graph captured over the engine's
    weights before the first refit gives, after each refit, what the trainer's model computes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)).to("cuda:0")
    static_in = torch.randn(8, 64, generator=torch.Generator().manual_seed(9)).to("cuda:0")
    job = peer.run(graphed_mlp_worker, 0)
    endpoint = job.recv()
    previous = job.request("replay")  # its own initial weights
    with gpu_streamer(endpoint, "cuda_ipc") as st:
        for version in range(1, 101):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            stats = st.refit(version, model.state_dict())
            assert stats.direct
            if version in (1, 2, 50, 100):
                with torch.no_grad():
                    expected = model(static_in).cpu()
                got = job.request("replay")
                # The same weights, the same GEMMs (replayed or eager: equal up to the kernel choice).
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), f"version {version}: the graph computed with other weights"
                assert not torch.equal(got, previous), f"version {version}: the graph's output did not change"
                previous = got
    assert job.request("moved") == []
    assert job.request("status")["committed_version"] == 100
    job.stop()


def gpu_table_served_from_a_thread(chan, spec, device: int):
    """Job: as gpu_table, but serve() runs on a thread of its own, as engines run it: that thread
    never made a CUDA call (no current context) when the first HELLO arrives."""
    import threading

    use_device(device, False)
    params = zeros_like_spec(spec, device=f"cuda:{device}")
    stop = threading.Event()
    with refit.Receiver(device=device) as rx:
        rx.add_parameters(params)
        server = threading.Thread(target=rx.serve, args=(stop,), kwargs={"poll": 0.02})
        server.start()
        chan.send(rx.endpoint)
        commands = {"state": lambda: state_bytes(params)}
        try:
            while True:
                name, *args = chan.recv()  # raises Stopped when the test is done
                chan.send(commands[name](*args))
        except Stopped:
            return []
        finally:
            stop.set()
            server.join()


def test_a_receiver_served_from_its_own_thread_takes_direct_cuda_ipc_refits(peer, one_gpu):
    job = peer.run(gpu_table_served_from_a_thread, spec_of(mixed_state(1)), 0)
    endpoint = job.recv()
    with gpu_streamer(endpoint, "cuda_ipc") as st:
        for version in (1, 2):
            state = mixed_state(version, device="cuda:0")
            assert st.refit(version, state).direct
            assert job.request("state") == state_bytes(state)
    job.stop()
