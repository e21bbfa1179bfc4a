"""``sdp train --mlp`` names a user model's MLP for N-SDP, and ``sdp train --help`` says what every flag does.

A model whose MLP projections have names no known layout uses (``ff.a``, ``ff.b`` -> ``ff.out``) is
refused at N-SDP without ``--mlp``, with the flag named in the error; with it the run prepares a
neuron mask and trains (one in-process worker, so no launch). ``--help`` gives every flag a text
besides its default, lists the built-in models and the modes, and shows ``FILE.py:FACTORY``.
"""

from __future__ import annotations

import argparse
import json

import pytest

from sdp_train.cli import main
from sdp_train.cli.train import register
from sdp_train.errors import ConfigError
from sdp_train.models import model_names
from sdp_train.parallel.discovery import MLPSpec
from sdp_train.trainer.config import MODES, TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.user_model import parse_mlp

FFN_FILE = """
import torch
from torch import nn

class FeedForward(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
    def forward(self, x):
        return self.out(torch.nn.functional.silu(self.a(x)) * self.b(x))

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = FeedForward(width)
    def forward(self, x):
        return x + self.ff(self.norm(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(3))
        self.head = nn.Linear(16, 10)
    def forward(self, images):
        h = self.embed(images.flatten(1))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

def build():
    return Net()
"""


@pytest.fixture
def ffn(tmp_path):
    (tmp_path / "ffn.py").write_text(FFN_FILE)
    return f"{tmp_path}/ffn.py:build"


def test_mlp_names_the_projections_of_a_user_models_mlp(ffn, capsys, tmp_path):
    assert parse_mlp("ff.a, ff.b:ff.out") == MLPSpec(("ff.a", "ff.b"), "ff.out")
    assert main(["train", "--model", ffn, "--mode", "nsdp", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "found no MLP in block 'layers.0'" in err[0] and "--mlp IN[,IN...]:OUT" in err[0]
    prep = prepare(TrainConfig(model=ffn, mode="nsdp", mlp="ff.a,ff.b:ff.out", workers=2))
    assert prep.mask.matrix.shape == (2, 3 * 4)  # 3 blocks x 4 neuron groups
    out = tmp_path / "run"
    assert main(["train", "--model", ffn, "--mode", "nsdp", "--mlp", "ff.a,ff.b:ff.out", "--workers", "1",
                 "--active", "1.0", "--steps", "2", "--batch-size", "4", "--eval-batches", "1",
                 "--memory-steps", "0", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["config"]["mlp"] == "ff.a,ff.b:ff.out"


@pytest.mark.parametrize(("values", "message"), [
    ({"mlp": "ff.a,ff.b"}, "expected the projections into the hidden layer, then the one out of it"),
    ({"mlp": ":ff.out"}, "IN[,IN...]:OUT"),
    ({"mlp": "ff.a:ff.out", "mode": "bsdp"}, "names the MLP that N-SDP cuts in your own model"),
    ({"mlp": "ff.a:ff.out", "model": "llama-debug"}, "got model 'llama-debug'"),
])
def test_a_bad_mlp_is_refused_naming_the_value(ffn, values, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(**{"model": ffn, "mode": "nsdp", **values})


def test_help_says_what_every_flag_does_and_lists_models_modes_and_file_factory():
    parser = argparse.ArgumentParser(prog="sdp")
    register(parser.add_subparsers())
    train = parser._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        if action.dest != "help":
            assert action.help and not action.help.startswith("(default"), action.option_strings
    text = train.format_help()
    assert all(name in text for name in model_names()) and all(f"  {mode} " in text for mode in MODES)
    assert "--model NAME|FILE.py:FACTORY" in text and "--mlp IN[,IN...]:OUT" in text
