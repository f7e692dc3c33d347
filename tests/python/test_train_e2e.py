"""End to end: a model trained here, refit after every step into the same architecture in a peer;
the peer's outputs on a fixed input equal the trainer's bit for bit."""

import torch
from torch import nn

import refit
from conftest import serve_loop, streamer, tensor_bytes

VOCAB, DIM, HIDDEN, SEQ = 61, 32, 64, 12


class TinyLM(nn.Module):
    """Embedding, Linear, LayerNorm, BatchNorm (buffers: f32 running stats, an i64 0-d counter),
    and a bf16 output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False).to(torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.norm(nn.functional.gelu(self.up(x)))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        x = x + self.down(h)
        return self.head(x.to(torch.bfloat16)).float()


def fixed_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(99))


def outputs(model: nn.Module) -> torch.Tensor:
    """The model's logits on the fixed input, in eval mode, on one thread (the same reduction
    order in both processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model(fixed_input())
        model.train(was_training)
        return out
    finally:
        torch.set_num_threads(threads)


def generation_worker(chan):
    """Job: the inference side. Its own (different) initial weights; registers the model's
    parameters (they require grad) and buffers; answers ``logits``."""
    torch.manual_seed(12345)
    model = TinyLM().eval()
    assert all(p.requires_grad for p in model.parameters())
    with refit.Receiver() as rx:
        rx.add_parameters(model.named_parameters())
        rx.add_parameters(model.named_buffers())
        chan.send(rx.endpoint)
        return serve_loop(rx, chan, {"logits": lambda: tensor_bytes(outputs(model))})


def test_a_model_trained_here_and_refit_after_every_step_gives_the_same_logits_there(peer):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(7))
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}

    job = peer.run(generation_worker)
    endpoint = job.recv()
    assert job.request("logits") != tensor_bytes(outputs(model))  # different weights before the first refit

    history = []
    with streamer(endpoint, buffer_bytes=16 << 10) as st:  # the embedding and head are chunked
        for step in range(1, 5):
            model.train()
            logits = model(data[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            stats = st.refit(step, model.state_dict())
            assert stats.tensors == len(model.state_dict())
            expected = outputs(model)
            got = job.request("logits")
            assert got == tensor_bytes(expected), f"step {step}: the generation side's logits differ"
            history.append(expected)
            assert job.request("status")["committed_version"] == step
    job.stop()
    # Training moved the weights: every refit carried new values.
    for a, b in zip(history, history[1:]):
        assert not torch.equal(a, b)
    assert int(model.bn.num_batches_tracked) == 4
