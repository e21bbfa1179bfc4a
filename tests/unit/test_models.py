"""Model registry, parameter counts, forward shapes, causality and block maps."""

from __future__ import annotations

import pytest
import torch

from sdp_train.errors import ConfigError
from sdp_train.models import block_map, build_model, get_model_config, model_names, num_params
from sdp_train.parallel.blockmap import SliceSpec


def tiny_llama(**overrides):
    fields = {"dim": 32, "n_layers": 3, "n_heads": 2, "hidden_dim": 64, "neuron_groups": 4, "max_seq_len": 32}
    return get_model_config("llama-debug", **{**fields, **overrides})


def tiny_resnet(**overrides):
    return get_model_config("resnet18-cifar", **{"width_multiplier": 1 / 16, "in_channels": 1, **overrides})


@pytest.mark.parametrize(
    ("name", "target", "rel"),
    [
        ("llama-debug", 1e6, 0.1),
        ("llama-134m", 134e6, 0.01),
        ("llama-500m", 500e6, 0.05),
        ("llama-1b", 1e9, 0.06),
        ("resnet18-cifar", 11_173_962, 0.0),
    ],
)
def test_named_config_param_count_is_close_to_its_name(name, target, rel):
    config = get_model_config(name)
    shapes = block_map(config)  # meta device: counts what the module really allocates
    allocated = sum(torch.Size(s).numel() for n, s in shapes.shapes.items() if n in shapes.parameter_names)
    assert num_params(config) == allocated
    assert abs(num_params(config) - target) <= rel * target


@pytest.mark.parametrize(
    "config", [tiny_llama(), get_model_config("llama-debug"), tiny_resnet(), tiny_resnet(num_classes=3),
               get_model_config("swin-debug"), get_model_config("swin-debug", image_size=32, depths=(2, 2, 2),
                                                               heads=(2, 2, 4))]
)
def test_num_params_equals_instantiated_count(config):
    model = build_model(config, seed=0)
    assert num_params(config) == sum(p.numel() for p in model.parameters())


def test_model_names_lists_every_named_config():
    assert set(model_names()) == {"llama-debug", "llama-134m", "llama-500m", "llama-1b", "resnet18-cifar",
                                 "wideresnet18-cifar", "swin-debug", "swin-tiny", "vit-tiny"}


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(ConfigError, match="llama-134m.*resnet18-cifar"):
        get_model_config("gpt-2")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_heads": 5}, "dim / n_heads"),
        ({"neuron_groups": 7}, "neuron_groups must divide hidden_dim"),
        ({"dim": 0}, "dim must be a positive int"),
        ({"colour": "red"}, "unknown config fields"),
    ],
)
def test_invalid_llama_config_is_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        get_model_config("llama-debug", **overrides)


def test_invalid_resnet_config_is_rejected():
    with pytest.raises(ConfigError, match="must divide every stage width"):
        get_model_config("resnet18-cifar", width_multiplier=1 / 16, neuron_groups=3)
    with pytest.raises(ConfigError, match="width_multiplier"):
        get_model_config("resnet18-cifar", width_multiplier=0.0)


def test_llama_forward_shape():
    config = tiny_llama(vocab_size=50)
    logits = build_model(config, seed=0)(torch.randint(0, 50, (2, 16)))
    assert logits.shape == (2, 16, 50)


def test_llama_rejects_sequences_longer_than_max_seq_len():
    with pytest.raises(ConfigError, match="max_seq_len"):
        build_model(tiny_llama(max_seq_len=8), seed=0)(torch.zeros(1, 9, dtype=torch.int64))


@pytest.mark.parametrize(("channels", "side"), [(1, 8), (3, 32)])
def test_resnet_forward_shape(channels, side):
    model = build_model(tiny_resnet(in_channels=channels, num_classes=7), seed=0)
    assert model(torch.randn(4, channels, side, side)).shape == (4, 7)


def test_future_tokens_do_not_affect_past_logits():
    model = build_model(tiny_llama(), seed=0)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_same_seed_gives_identical_model_and_other_seed_differs():
    config = tiny_llama()
    a, b, c = (build_model(config, seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_llama_block_map_names_and_shared_tensors():
    bmap = block_map(tiny_llama())
    assert bmap.block_names("block") == ("layers.0", "layers.1", "layers.2")
    assert bmap.block_names("neuron")[:2] == ("layers.0.mlp.g0", "layers.0.mlp.g1")
    assert bmap.num_blocks("neuron") == 12
    assert set(bmap.shared("block")) == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert "layers.1.mlp_norm.weight" in bmap.shared("neuron")
    assert "layers.1.mlp.w_gate.weight" not in bmap.shared("neuron")


@pytest.mark.parametrize("config", [tiny_llama(), tiny_resnet(), get_model_config("swin-debug")])
def test_neuron_groups_partition_the_sliced_dimension_of_each_tensor(config):
    bmap = block_map(config)
    covered: dict[tuple[str, int], list[int]] = {}
    for j in range(bmap.num_blocks("neuron")):
        for name, spec in bmap.owned("neuron", j):
            assert spec.full_size == bmap.shapes[name][spec.dim]
            covered.setdefault((name, spec.dim), []).extend(spec.index)
    for (name, dim), index in covered.items():
        assert sorted(index) == list(range(bmap.shapes[name][dim]))


def test_every_resnet_block_is_maskable_and_its_downsampling_shortcut_is_shared():
    bmap = block_map(tiny_resnet())
    assert bmap.block_names("block") == tuple(f"layer{s}.{j}" for s in (1, 2, 3, 4) for j in (0, 1))
    shared = set(bmap.shared("block"))
    downsample = {n for n in bmap.shapes if ".downsample." in n}
    assert len(downsample) == 3 * 6  # three stage entries: 1x1 conv weight, BatchNorm's 5 tensors
    assert shared == {n for n in bmap.shapes if not n.startswith("layer")} | downsample
    assert {n for n, _ in bmap.owned("block", 2)} == {n for n in bmap.shapes if n.startswith("layer2.0.")} - downsample
    assert bmap.block_names("neuron")[:2] == ("layer1.0.g0", "layer1.0.g1") and bmap.num_blocks("neuron") == 8 * 4


def test_unknown_level_is_rejected():
    with pytest.raises(ConfigError, match="level must be one of"):
        block_map(tiny_llama()).num_blocks("layer")


def test_slice_spec_rejects_unsorted_or_out_of_range_index():
    with pytest.raises(ConfigError, match="strictly increasing"):
        SliceSpec(dim=0, index=(2, 1), full_size=4)
    with pytest.raises(ConfigError, match="must lie in"):
        SliceSpec(dim=0, index=(1, 4), full_size=4)
