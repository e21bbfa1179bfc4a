"""swin-debug: shapes, the shifted-window mask, patch merging, and its B-SDP / N-SDP subnetworks
against the full model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdp_train.errors import ConfigError
from sdp_train.models import block_map, build_model, get_model_config, num_params
from sdp_train.models.subnet import build_worker_model
from sdp_train.models.swin import BlockShape, PatchMerging, SwinBlock, block_shapes, shift_mask

DIGITS = get_model_config("swin-debug", in_channels=1)
CIFAR = get_model_config("swin-debug", in_channels=3, image_size=32)


def images(config, n: int = 4) -> torch.Tensor:
    side = config.image_size
    return torch.randn(n, config.in_channels, side, side, generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)


@pytest.mark.parametrize("config", [DIGITS, CIFAR, get_model_config("swin-debug", depths=(1, 2, 1), heads=(1, 2, 2),
                                                                     image_size=16)])
def test_num_params_equals_the_allocated_parameters_and_the_forward_gives_class_logits(config):
    model = build_model(config, seed=0).double()
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    assert model(images(config)).shape == (4, config.num_classes)


def test_swin_tiny_parameter_count():
    # patch embedding 416 + blocks 2 x 12,722 and 2 x 50,020 (each with a 9 x heads table) + merging 8,448
    # + norm and head 778
    assert num_params(get_model_config("swin-debug")) == 135_126


def test_stages_window_and_shift_follow_swin():
    # digits: 4 x 4 tokens in 2 x 2 windows (odd block shifted by 1), then 2 x 2 tokens: one window, no shift
    assert [(b.stage, b.dim, b.side, b.window, b.shift) for b in block_shapes(DIGITS)] == [
        (0, 32, 4, 2, 0), (0, 32, 4, 2, 1), (1, 64, 2, 2, 0), (1, 64, 2, 2, 0)]
    assert [(b.side, b.shift) for b in block_shapes(CIFAR)] == [(16, 0), (16, 1), (8, 0), (8, 1)]


def test_block_map_covers_every_tensor_of_the_full_model_and_shares_stem_merging_and_head():
    bmap = block_map(DIGITS)
    state = build_model(DIGITS, seed=0).state_dict()
    assert dict(bmap.shapes) == {n: tuple(t.shape) for n, t in state.items()}
    assert bmap.block_names("block") == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert set(bmap.shared("block")) == {"patch_embed.weight", "patch_embed.bias", "merges.0.norm.weight",
                                         "merges.0.norm.bias", "merges.0.reduce.weight", "norm.weight", "norm.bias",
                                         "head.weight", "head.bias"}
    assert bmap.num_blocks("neuron") == 4 * DIGITS.neuron_groups
    covered: dict[tuple[str, int], list[int]] = {}
    for j in range(bmap.num_blocks("neuron")):
        for name, spec in bmap.owned("neuron", j):
            covered.setdefault((name, spec.dim), []).extend(spec.index)
    assert {name for name, _ in covered} == {f"layers.{i}.mlp.{t}" for i in range(4)
                                            for t in ("fc1.weight", "fc1.bias", "fc2.weight")}
    for (name, dim), index in covered.items():
        assert sorted(index) == list(range(bmap.shapes[name][dim]))


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_worker_tensors_equal_the_held_slices_of_the_seeded_full_model(level):
    full = build_model(DIGITS, seed=3).state_dict()
    n = block_map(DIGITS).num_blocks(level)
    row = np.resize([1, 0, 0, 1, 1], n)
    worker = build_worker_model(DIGITS, row, level, seed=3)
    index = worker.full_index()
    sliced = [name for name, spec in index.items() if not spec.is_whole]
    assert bool(sliced) == (level == "neuron")
    for name, local in worker.state_dict().items():
        torch.testing.assert_close(local, index[name].take(full[name]), rtol=0, atol=0)


@pytest.mark.parametrize("config", [DIGITS, CIFAR])
def test_a_dropped_block_is_the_identity(config):
    """A worker without blocks 1 and 2 computes what the full model computes when those blocks'
    residual branches add nothing (their proj and fc2 zeroed)."""
    full = build_model(config, seed=1).double()
    with torch.no_grad():
        for i in ("1", "2"):
            for linear in (full.layers[i].attention.proj, full.layers[i].mlp.fc2):
                linear.weight.zero_()
                linear.bias.zero_()
    worker = build_worker_model(config, np.array([1, 0, 0, 1]), "block", seed=1).double()
    assert list(worker.layers) == ["0", "3"]
    torch.testing.assert_close(worker(images(config)), full(images(config)))


def test_neuron_worker_equals_the_full_model_with_the_dropped_neurons_silenced():
    row = np.zeros(block_map(DIGITS).num_blocks("neuron"), dtype=bool)
    row[[0, 3, 5, 6, 9, 15]] = True  # block 0: groups 0, 3; block 1: 1, 2; block 2: 1; block 3: 3
    full = build_model(DIGITS, seed=1).double()
    with torch.no_grad():  # fc1 row and bias 0 -> gelu(0) = 0: the neuron adds nothing
        for j in np.flatnonzero(~row):
            block, g = divmod(int(j), DIGITS.neuron_groups)
            fc1 = full.layers[str(block)].mlp.fc1
            width = fc1.out_features // DIGITS.neuron_groups
            fc1.weight[g * width:(g + 1) * width] = 0
            fc1.bias[g * width:(g + 1) * width] = 0
    worker = build_worker_model(DIGITS, row, "neuron", seed=1).double()
    assert worker.layers["2"].mlp.fc1.weight.shape == (64, 64)
    torch.testing.assert_close(worker(images(DIGITS)), full(images(DIGITS)))


@pytest.mark.parametrize(("side", "window", "shift"), [(8, 4, 2), (8, 4, 0), (4, 2, 1), (6, 3, 1)])
def test_a_token_only_attends_within_its_shifted_window(side, window, shift):
    """Changing one token changes exactly the outputs of the tokens in its window: along each axis
    the windows are cut at positions shift + k * window (no window wraps around the map's edge)."""
    torch.manual_seed(0)
    block = SwinBlock(BlockShape(0, 8, 2, side, window, shift, 16), mlp_hidden=16).double()
    with torch.no_grad():
        block.attention.relative_position_table.normal_()
    x = torch.randn(1, side, side, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    before = block(x)

    def segment(p: int) -> int:
        return (p - shift) // window

    for ty, tx in [(0, 0), (side - 1, side - 1), (shift, side - 1), (side // 2, 1)]:
        changed = x.clone()
        changed[0, ty, tx] += torch.arange(8)  # not a constant, which LayerNorm would remove
        differs = (block(changed) != before).any(dim=-1)[0]
        expected = torch.tensor([[segment(y) == segment(ty) and segment(x_) == segment(tx) for x_ in range(side)]
                                 for y in range(side)])
        assert torch.equal(differs, expected), (ty, tx)


def test_shift_mask_blocks_exactly_the_pairs_from_opposite_edges():
    mask = shift_mask(4, 2, 1, torch.device("cpu"))  # 4 windows of 4 tokens, after rolling by -1
    assert mask.shape == (4, 4, 4)
    assert torch.all(mask[0] == 0)  # the top-left window holds original tokens (1..2, 1..2): one region
    # the bottom-right window holds original rows/columns 3 and 0: four regions of one token each
    assert torch.equal(mask[3] == 0, torch.eye(4, dtype=torch.bool))
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}


def test_patch_merging_halves_the_map_and_doubles_the_width_from_2x2_neighbourhoods():
    merge = PatchMerging(8).double()
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    out = merge(x)
    assert out.shape == (2, 2, 3, 16)
    changed = x.clone()
    changed[:, 3, 2] += torch.arange(8)  # in the neighbourhood of output token (1, 1)
    differs = (merge(changed) != out).any(dim=-1)
    assert differs.nonzero().tolist() == [[0, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"image_size": 9}, "patch_size=2 must divide image_size=9"),
    ({"image_size": 12}, "window=2 must divide stage 1's 3 x 3"),  # 6 x 6 tokens, then 3 x 3
    ({"image_size": 20, "window": 4}, "window=4 must divide stage 0's 10 x 10 token map"),
    ({"heads": (3, 4)}, "heads[0]=3 must divide the stage's width 32"),
    ({"heads": (2,)}, "heads needs one entry per stage"),
    ({"depths": (2, 0)}, "depths must be a non-empty list of positive ints"),
    ({"neuron_groups": 3}, "neuron_groups=3 must divide the MLP width mlp_ratio * dim = 128"),
    ({"window": 0}, "window must be a positive int"),
])
def test_invalid_swin_config_is_refused_naming_the_value(overrides, message):
    with pytest.raises(ConfigError) as err:
        get_model_config("swin-debug", **overrides)
    assert message in str(err.value)


def test_image_of_another_size_is_refused():
    with pytest.raises(ConfigError, match=r"image size \(32, 32\) is not the image_size=8"):
        build_model(DIGITS, seed=0)(torch.zeros(1, 1, 32, 32))
