"""Tied tensors in a model's layout: found, held and counted once, refused where a mask cannot keep them.

A tensor reachable under several state-dict names (a language model's embedding and output layer)
is one tensor: `ModelLayout.aliases` maps each later name to its first, no alias is taken for a
buffer to average, the full model carries it under every name as one tensor, and a full state dict
that names it once (as Hugging Face saves a tied model) loads. A tie across blocks, or between a
block and the shared tensors, or through N-SDP's sliced MLP tensors, is refused naming both names.
The multi-rank behaviour is tests/distributed/test_tied_parameters.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from sdp_train import SubnetworkDataParallel
from sdp_train.errors import ConfigError
from sdp_train.parallel.masking import describe, tied_names


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.extra = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) + self.extra(x)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_tied_output_layer_is_an_alias_and_no_buffer():
    layout = describe(TiedLM(), ["layers.0", "layers.1", "layers.2"], "block")
    assert layout.aliases == {"head.weight": "embed.weight"}
    assert "head.weight" in layout.tensors and "head.weight" not in layout.parameter_names
    assert layout.buffer_names == []


def test_gpt2_ties_its_output_layer_to_the_token_embedding():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8,
                                                                 n_layer=2, n_head=2))
    layout = describe(model, ["transformer.h.0", "transformer.h.1"], "neuron", neuron_groups=2)
    assert layout.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in layout.buffer_names


@pytest.mark.parametrize(("tie", "message"), [
    (lambda m: setattr(m.layers[1].extra, "weight", m.layers[0].extra.weight),
     "'layers.0.extra.weight' and 'layers.1.extra.weight' are one tied tensor in block 'layers.0' and block 'layers.1'"),
    (lambda m: setattr(m.layers[2], "extra", m.layers[0].extra),
     "in block 'layers.0' and block 'layers.2'"),
    (lambda m: setattr(m, "post", m.layers[0].extra),  # one module inside a block and outside
     "'layers.0.extra.weight' and 'post.weight' are one tied tensor in block 'layers.0' and the shared tensors"),
])
def test_a_tie_across_blocks_or_out_of_a_block_is_refused_naming_both_tensors(tie, message):
    model = TiedLM()
    tie(model)
    with pytest.raises(ConfigError, match="tie must stay inside one block") as info:
        describe(model, ["layers.0", "layers.1", "layers.2"], "block")
    assert message in str(info.value)


def test_a_tie_inside_one_block_trains_at_block_level_but_not_through_sliced_neurons():
    square = TiedLM()
    square.layers[1].mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    square.layers[1].extra.weight = square.layers[1].mlp[0].weight
    blocks = ["layers.0", "layers.1", "layers.2"]
    layout = describe(square, blocks, "block")
    assert layout.aliases["layers.1.extra.weight"] == "layers.1.mlp.0.weight"
    with pytest.raises(ConfigError, match="N-SDP slices it by hidden neuron"):
        describe(square, blocks, "neuron", neuron_groups=2)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_every_alias_names_the_first_name_of_the_same_tensor(owners):
    """Property: tied_names maps each later name of a tensor to its first, and nothing else."""
    tensors = [torch.zeros(1) for _ in range(5)]
    state = {f"t{i}": tensors[k] for i, k in enumerate(owners)}
    aliases = tied_names(state)
    first = {}
    for name, k in zip(state, owners):
        first.setdefault(k, name)
    assert aliases == {n: first[k] for n, k in zip(state, owners) if first[k] != n}
    assert all(state[a] is state[f] and f not in aliases for a, f in aliases.items())


def test_the_full_state_has_the_tie_and_a_state_naming_it_once_loads():
    torch.manual_seed(0)
    sdp = SubnetworkDataParallel(TiedLM(), active=1.0)
    full = sdp.full_state_dict()
    assert full["head.weight"] is full["embed.weight"]
    reference = TiedLM()
    reference.load_state_dict(full, strict=True)
    for kept in ("embed.weight", "head.weight"):  # Hugging Face's save_pretrained keeps one name
        state = {n: torch.randn_like(t) if n in ("embed.weight", "head.weight") else t for n, t in full.items()}
        state.pop("head.weight" if kept == "embed.weight" else "embed.weight")
        sdp.load_full_state_dict(state)
        assert torch.equal(sdp.module.head.weight, state[kept]) and sdp.module.head.weight is sdp.module.embed.weight
    with pytest.raises(ConfigError, match=r"lacks 1 tensor\(s\) of the model: \['embed.weight'\]"):
        sdp.load_full_state_dict({n: t for n, t in full.items() if n not in ("embed.weight", "head.weight")})


TIED_FILE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    def forward(self, x):
        return x + self.mlp(self.norm(x))

class TiedLM(nn.Module):
    def __init__(self, across):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 256, bias=False)
        self.head.weight = self.embed.weight
        if across:
            self.blocks[1].norm = self.blocks[0].norm
    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

def tied():
    return TiedLM(False)

def across():
    return TiedLM(True)
"""


def test_sdp_train_prepares_a_tied_model_and_refuses_a_tie_across_blocks_in_one_line(tmp_path, capsys):
    from sdp_train.cli import main
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.prepare import prepare

    (tmp_path / "tied.py").write_text(TIED_FILE)
    for mode in ("bsdp", "nsdp", "bbsdp", "overlap"):
        assert prepare(TrainConfig(model=f"{tmp_path}/tied.py:tied", mode=mode, workers=2)).mask is not None
    out = tmp_path / "run"
    assert main(["train", "--model", f"{tmp_path}/tied.py:across", "--workers", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp train: error: tensors 'blocks.0.norm.weight' and "
                                               "'blocks.1.norm.weight' are one tied tensor"), err
    assert not out.exists()
