"""Block discovery checks what it picks: only lists whose modules return their input's shape are
residual blocks a worker can drop.

On tiny Hugging Face models (no download), on CPU and on the meta device, discovery picks each
family's decoder or encoder layers, and for Swin the blocks inside the stages (the stages end in a
width-changing patch merging, and dropping one failed inside the model). A model with no residual
list is refused naming each list and what it does to the shape; the outermost residual list wins
over lists inside its modules; an example input makes discovery check a user's own model, and
``sdp train`` finds the blocks once, with a batch like the data's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sdp_train import find_blocks
from sdp_train.errors import ConfigError
from sdp_train.parallel.masking import drop_blocks

transformers = pytest.importorskip("transformers")
T = transformers

HF = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)), "model.layers.*"),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)), "model.layers.*"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=32,
                                                    bos_token_id=0, eos_token_id=0)), "transformer.h.*"),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32)),
             "bert.encoder.layer.*"),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=1, num_labels=3)), "vit.layers.*"),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=16, patch_size=2, num_channels=1, embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=2,
        num_labels=3)), "swin.encoder.layers.*.blocks.*"),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("kind", sorted(HF))
def test_discovery_picks_the_residual_blocks_of_hugging_face_models(kind, device):
    build, pattern = HF[kind]
    torch.manual_seed(0)
    with torch.device(device):
        model = build()
    assert find_blocks(model) == find_blocks(model, pattern)


def test_dropping_the_blocks_found_in_hugging_face_swin_keeps_the_model_running():
    torch.manual_seed(0)
    model = HF["swin"][0]().eval()
    blocks = find_blocks(model)
    assert blocks == [f"swin.encoder.layers.{s}.blocks.{b}" for s in range(2) for b in range(2)]
    drop_blocks(model, blocks, np.array([1, 0, 0, 1]))
    with torch.no_grad():
        assert model(pixel_values=torch.randn(2, 1, 16, 16)).logits.shape == (2, 3)


class Widen(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int = 4) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Pyramid(nn.Module):
    """A large list of width-doubling stages, and a smaller list of residual blocks after them (not named
    as a known layout, so that size alone would pick the stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Widen(16 * 2**i) for i in range(3))
        self.trunk = nn.ModuleList(Residual(128) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in (*self.stages, *self.trunk):
            x = module(x)
        return x


def test_with_an_example_a_larger_list_that_changes_the_shape_loses_to_a_residual_one():
    model = Pyramid()
    assert sum(p.numel() for p in model.stages.parameters()) > sum(p.numel() for p in model.trunk.parameters())
    assert find_blocks(model) == ["stages.0", "stages.1", "stages.2"]  # unchecked: the largest list
    assert find_blocks(model, example=torch.randn(2, 16)) == ["trunk.0", "trunk.1"]


def test_a_model_without_a_residual_list_is_refused_naming_each_list_and_why():
    model = Pyramid()
    model.trunk = nn.ModuleList([Widen(128), Widen(256)])
    with pytest.raises(ConfigError) as info:
        find_blocks(model, example=torch.randn(2, 16))
    message = str(info.value)
    assert "found no residual block list in Pyramid" in message
    assert "stages.* changes the shape: stages.0 maps (2, 16) to (2, 32)" in message
    assert "trunk.* changes the shape: trunk.0 maps (2, 128) to (2, 256)" in message


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_residual_stages_win_over_the_blocks_inside_them():
    model = nn.Sequential()
    model.stages = nn.ModuleList(Stage() for _ in range(2))
    model.forward = lambda x: model.stages[1](model.stages[0](x))
    assert find_blocks(model, example=torch.randn(1, 8)) == ["stages.0", "stages.1"]


def test_two_equally_large_residual_lists_are_refused_naming_both():
    model = nn.Module()
    model.a, model.b = nn.ModuleList(Residual(8) for _ in range(2)), nn.ModuleList(Residual(8) for _ in range(2))
    model.forward = lambda x: model.b[1](model.b[0](model.a[1](model.a[0](x))))
    with pytest.raises(ConfigError, match=r"several equally large block lists \['a', 'b'\]"):
        find_blocks(model, example=torch.randn(1, 8))


PYRAMID_FILE = '''
import torch
from torch import nn

class Widen(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)
    def forward(self, x):
        return self.proj(x)

class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4), nn.GELU(), nn.Linear(4, width))
    def forward(self, x):
        return x + self.mlp(x)

class Pyramid(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(Widen(64 * 2**i) for i in range(3))
        self.trunk = nn.ModuleList(Residual(512) for _ in range(2))
        self.head = nn.Linear(512, 10)
    def forward(self, images):
        x = images.flatten(1)
        for module in (*self.stages, *self.trunk):
            x = module(x)
        return self.head(x)

def build():
    return Pyramid()
'''


def test_sdp_train_finds_a_user_models_residual_blocks_on_a_batch_like_the_data(tmp_path):
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.prepare import prepare

    (tmp_path / "pyramid.py").write_text(PYRAMID_FILE)
    prep = prepare(TrainConfig(model=f"{tmp_path}/pyramid.py:build", workers=2))
    assert prep.blocks == ("trunk.0", "trunk.1") and prep.mask.block_names == prep.blocks
