"""The chunked language-model loss (`sdp_train.models.lm_loss`) against torch's plain cross-entropy over
the full logits: the same loss and gradients to float32 rounding, for any chunk count (chunks that do
not divide the tokens, more chunks than tokens), ignored targets, a tied embedding and the built-in
LLaMA through ``forward(tokens, targets, loss_chunks=N)``; and the bytes `sdp plan` counts for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.models import build_model, get_model_config
from sdp_train.models.lm_loss import IGNORE_INDEX, chunked_cross_entropy
from sdp_train.planning.activations import activation_model
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.run import loss_fn

TOLERANCE = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {}}  # float32: assert_close's defaults


def _plain(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


@settings(deadline=None, max_examples=40)
@given(batch=st.integers(1, 3), seq=st.integers(1, 9), dim=st.integers(1, 6), vocab=st.integers(2, 13),
       chunks=st.integers(1, 30), ignored=st.floats(0.0, 0.7), scale=st.floats(0.1, 4.0),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31 - 1))
def test_chunked_loss_and_gradients_equal_the_plain_loss_over_the_full_logits(
        batch, seq, dim, vocab, chunks, ignored, scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    drop = torch.rand(batch, seq, generator=g) < ignored
    drop.view(-1)[0] = False  # at least one target: with none both losses are NaN
    targets[drop] = IGNORE_INDEX
    loss = chunked_cross_entropy(hidden, weight, targets, chunks)
    grads = torch.autograd.grad(loss * scale, (hidden, weight))  # a loss gradient other than 1
    expected = _plain(hidden, weight, targets)
    expected_grads = torch.autograd.grad(expected * scale, (hidden, weight))
    torch.testing.assert_close(loss, expected, **TOLERANCE[dtype])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    with torch.no_grad():  # validation: no gradients computed, the same loss
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunks), loss)


class TiedLM(nn.Module):
    """GPT-2's layout: the output layer is the embedding (one Parameter under two names)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets=None, loss_chunks=1):
        h = self.embed(tokens)
        h = h + self.mlp(h)
        return self.head(h) if targets is None else chunked_cross_entropy(h, self.head.weight, targets, loss_chunks)


@settings(deadline=None, max_examples=10)
@given(chunks=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_a_tied_embedding_gets_the_sum_of_its_two_gradients(chunks, seed):
    torch.manual_seed(seed)
    model = TiedLM(vocab=11, dim=6)
    tokens, targets = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    model(tokens, targets, loss_chunks=chunks).backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss_fn(model(tokens), targets).backward()
    assert chunked.keys() == {"embed.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked[name], p.grad, msg=name)


@pytest.mark.parametrize("chunks", [1, 3, 8, 200])
def test_llama_chunked_forward_trains_as_the_plain_loss_of_its_logits(chunks):
    model = build_model(get_model_config("llama-debug", n_layers=2), seed=0)
    tokens, targets = torch.randint(0, 256, (3, 17)), torch.randint(0, 256, (3, 17))
    loss = model(tokens, targets, loss_chunks=chunks)
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = loss_fn(model(tokens), targets)
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked[name], p.grad, msg=name)


def test_the_head_keeps_the_bytes_the_plan_counts():
    """Autograd's saved tensors and the two gradients the loss computes in forward: the llama
    family's ``head`` with ``loss_chunks`` (the formula's other terms are checked in test_plan.py)."""
    config = get_model_config("llama-debug", n_layers=1)
    model, batch, seq_len = build_model(config, seed=0), 4, 32
    tokens, targets = torch.randint(0, 256, (batch, seq_len)), torch.randint(0, 256, (batch, seq_len))
    skip = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets, loss_chunks=5)
    # the targets: not saved by the chunked loss, but alive through the step (the plan's constant batch)
    kept = sum(seen.values()) + sum(g.untyped_storage().nbytes() for g in loss.grad_fn.grads) + targets.nbytes
    acts = activation_model(model, frozenset(), batch_size=batch, seq_len=seq_len, image_size=8, elem=4,
                            loss_chunks=5)
    assert acts.forward_bytes(ac=False) == pytest.approx(kept, abs=8)
    plain = activation_model(model, frozenset(), batch_size=batch, seq_len=seq_len, image_size=8, elem=4)
    n, d, v = batch * seq_len, config.dim, config.vocab_size
    assert plain.head - acts.head == 4 * (n * v - v * d)  # no log-softmax; the weight's gradient instead
    assert acts.loss_backward == 4 * (n * d + -(-n // 5) * v)  # the norm's output and one chunk's logits


def test_backward_twice_is_refused():
    hidden = torch.randn(4, 3, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(5, 3), torch.randint(0, 5, (4,)), 2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


@pytest.mark.parametrize(("hidden", "weight", "targets", "chunks", "message"), [
    ((4, 3), (5, 3), (4,), 0, "chunks=0 must be an integer >= 1"),
    ((4, 3), (5, 2), (4,), 1, r"hidden \(4, 3\) and weight \(5, 2\) do not multiply"),
    ((4, 3), (5, 3), (2, 2), 1, r"targets \(2, 2\) must have the leading shape"),
])
def test_bad_inputs_are_refused_naming_the_values(hidden, weight, targets, chunks, message):
    with pytest.raises(ConfigError, match=message):
        chunked_cross_entropy(torch.randn(hidden), torch.randn(weight), torch.zeros(targets, dtype=torch.long), chunks)


def test_a_negative_chunk_count_is_refused_by_config_and_cli(capsys):
    with pytest.raises(ConfigError, match="loss_chunks=-1 must be an integer >= 0"):
        TrainConfig(loss_chunks=-1)
    assert main(["train", "--model", "llama-debug", "--loss-chunks", "-1"]) == 2
    assert "loss_chunks=-1" in capsys.readouterr().err


def test_under_bfloat16_autocast_it_matches_torchs_autocast_loss():
    """``sdp train --dtype bfloat16``: the head's matmuls in bfloat16 as autocast runs torch's linear, the
    softmax in float32 as autocast runs its cross-entropy; equal to bfloat16 rounding."""
    model = build_model(get_model_config("llama-debug", n_layers=2), seed=0)
    tokens, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, targets, loss_chunks=3)
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_fn(model(tokens), targets)
    plain.backward()
    assert loss.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(loss, plain, rtol=1e-3, atol=0.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked[name], p.grad, rtol=0.0, atol=1e-2 * float(p.grad.abs().max()), msg=name)
