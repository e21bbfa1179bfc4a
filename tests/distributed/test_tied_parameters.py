"""Tied parameters (one tensor under several names) in every mode of the library, on 2 gloo ranks.

One torchrun launch trains three models whose output layer shares the embedding's weight, a Hugging
Face ``GPT2LMHeadModel`` (tied by default), a ``Qwen2ForCausalLM`` with ``tie_word_embeddings=True``
and a custom module, under B-SDP, N-SDP, Bb-SDP, holder FSDP, local steps, a ``permute`` schedule
and `OverlapAveraging` (GPT-2 all of them, the custom model the first three and overlap averaging,
Qwen2 B-SDP), 2 steps each. Each rank records, and the tests check, that the tie survives
training on every rank, that every holder's tensors equal the assembled full model's (the holders
agree), that the tied tensor trained, that the export reloads (``from_pretrained``, or
``load_state_dict(strict=True)``) with the tie intact and every value equal, and that with a
complete mask and equal batches the library's gradient norm is torch's, which counts a tied tensor
once. Before the fix every run crashed at construction (``StopIteration`` or ``KeyError`` in the
sync engine's buffer averaging, which took the tied name for a buffer).

Run by hand: ``python -m torch.distributed.run --standalone --nproc-per-node 2 THIS_FILE OUTDIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from masklab import Mask, Schedule

K, STEPS, VOCAB, WIDTH = 2, 2, 64, 16
BLOCK_MASK = np.array([[1, 1, 0, 1], [0, 1, 1, 1]])
MODELS = ("gpt2", "qwen2", "custom")
RUNS = {  # run -> (wrapper, keyword arguments); GPT-2 takes every run, the custom model the first four
    "bsdp": ("sdp", {"mask": BLOCK_MASK}),
    "nsdp": ("sdp", {"active": 0.5, "level": "neuron", "neuron_groups": 2}),
    "bbsdp": ("sdp", {"mask": BLOCK_MASK, "masking": "backward"}),
    "overlap": ("overlap", {"mask": BLOCK_MASK, "local_steps": 2}),
    "fsdp": ("sdp", {"mask": BLOCK_MASK, "fsdp": True}),
    "local": ("sdp", {"mask": BLOCK_MASK, "local_steps": 2}),
    "permute": ("sdp", {"mask": BLOCK_MASK, "schedule": "permute"}),
    "complete": ("sdp", {"mask": np.ones((K, 4), dtype=int)}),
}
CASES = [(m, r) for m in MODELS for r in RUNS
         if m == "gpt2" or r == "bsdp" or (m == "custom" and r in ("nsdp", "bbsdp", "overlap"))]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TiedLM(nn.Module):
    """A user's language model whose output layer is the embedding (one Parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build(model: str) -> nn.Module:
    import transformers

    if model == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=WIDTH, n_layer=4, n_head=2))
    if model == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True))
    return TiedLM()


TIES = {"gpt2": ("transformer.wte.weight", "lm_head.weight"), "qwen2": ("model.embed_tokens.weight", "lm_head.weight"),
        "custom": ("embed.weight", "head.weight")}


# -- the ranks --------------------------------------------------------------------------------------
def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _run(model_name: str, run: str, out: Path) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from sdp_train import OverlapAveraging, SubnetworkDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    module = build(model_name)
    first, alias = TIES[model_name]
    before = module.get_parameter(first).detach().clone()
    kind, options = RUNS[run]
    options = dict(options)
    if options.pop("schedule", None):
        options["mask"] = Mask(BLOCK_MASK, schedule=Schedule("permute", every=1))
    if isinstance(options.get("mask"), np.ndarray):
        options["mask"] = Mask(options["mask"])
    model = (OverlapAveraging if kind == "overlap" else SubnetworkDataParallel)(module, seed=0, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "overlap" or run in ("bbsdp", "local", "permute"):
        model.register_optimizer(optimizer)
    result = {}
    generator = torch.Generator().manual_seed(rank if run != "complete" else 0)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
        logits = _logits(model(tokens))
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        if run == "complete":  # equal batches and every worker holds everything: the average is the local gradient
            local = torch.nn.utils.get_total_norm([p.grad for p in model.module.parameters()])
            result["norm"] = [float(model.grad_norm()), float(local)]
        optimizer.step()
        optimizer.zero_grad()
    state = model.module.state_dict(keep_vars=True)
    result["tie_kept"] = state[alias] is state[first] if alias in state else None
    full = model.full_state_dict()
    layout = model.layout
    held = layout.held(model.round_matrix(STEPS - 1)[rank]) if kind == "overlap" else model.local_index
    result["holder_gap"] = 0.0 if run == "fsdp" else max(
        float((held[n].take(full[n]) - t.detach()).abs().max()) for n, t in model.module.state_dict().items()
        if n in held)
    result["export_tied"] = full[alias] is full[first]
    result["trained"] = float((full[first] - before).abs().max())
    directory = out / f"{model_name}_{run}"
    model.save_full(directory)
    if rank == 0:
        if model_name == "custom":
            reloaded = TiedLM()
            reloaded.load_state_dict(load_file(directory / "model.safetensors"), strict=True)
        else:
            import transformers

            reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
        again = reloaded.state_dict(keep_vars=True)
        result["reload_tied"] = again[alias] is again[first]
        result["reload_gap"] = max(float((again[n].detach() - full[n]).abs().max()) for n in full)
    if hasattr(model, "close"):
        model.close()
    return result


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    results = {}
    try:
        for model_name, run in CASES:
            results[f"{model_name}_{run}"] = _run(model_name, run, out)
    finally:
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])


# -- the tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.distributed.shared_launch import shared_out

    out = shared_out(tmp_path_factory, "test_tied_parameters")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(K)]


@pytest.mark.parametrize(("model", "run"), CASES)
def test_a_tied_tensor_stays_tied_agrees_among_holders_and_exports_with_its_tie(ranks_out, model, run):
    case = f"{model}_{run}"
    for rank, results in enumerate(ranks_out):
        got = results[case]
        assert got["tie_kept"] in (True, None), (rank, got)
        assert got["holder_gap"] == 0.0, (rank, got)
        assert got["export_tied"] and got["trained"] > 0, (rank, got)
    assert ranks_out[0][case]["reload_tied"] and ranks_out[0][case]["reload_gap"] == 0.0, ranks_out[0][case]


def test_a_tied_tensor_is_counted_once_in_the_gradient_norm(ranks_out):
    sdp_norm, torch_norm = ranks_out[0]["gpt2_complete"]["norm"]
    assert sdp_norm == pytest.approx(torch_norm, rel=1e-5)
