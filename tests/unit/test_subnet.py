"""Worker subnetworks: held tensors, equivalence with the masked full model, load/scatter, Bb-SDP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.errors import ConfigError
from sdp_train.models import block_map, build_model, get_model_config
from sdp_train.models.subnet import (
    apply_backward_mask,
    backward_mask,
    build_worker_model,
    held_tensors,
    load_from_full,
    scatter_to_full,
)
from sdp_train.parallel.blockmap import PassThrough, outer_units

LLAMA = get_model_config(
    "llama-debug", dim=16, n_layers=3, n_heads=2, hidden_dim=32, neuron_groups=4, vocab_size=32, max_seq_len=16
)
RESNET = get_model_config("resnet18-cifar", width_multiplier=1 / 16, in_channels=1, neuron_groups=2)
FAST = settings(max_examples=12, deadline=None)


def rows(n: int) -> st.SearchStrategy[np.ndarray]:
    """Non-empty 0/1 mask rows of length n."""
    return st.lists(st.booleans(), min_size=n, max_size=n).filter(any).map(np.array)


def resnet_neuron_rows() -> st.SearchStrategy[np.ndarray]:
    """ResNet neuron-level rows holding at least one group of every maskable block."""
    n_blocks = block_map(RESNET).num_blocks("block")
    per_block = st.lists(st.booleans(), min_size=RESNET.neuron_groups, max_size=RESNET.neuron_groups).filter(any)
    return st.lists(per_block, min_size=n_blocks, max_size=n_blocks).map(lambda r: np.array(r).ravel())


def tokens() -> torch.Tensor:
    return torch.randint(0, LLAMA.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))


def images() -> torch.Tensor:
    return torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def expected_names(config, held: np.ndarray, level: str) -> set[str]:
    bmap = block_map(config)
    owned = {name for j in np.flatnonzero(held) for name, _ in bmap.owned(level, int(j))}
    return owned | set(bmap.shared(level))


@FAST
@given(held=rows(3))
def test_block_worker_holds_exactly_held_blocks_and_shared_tensors(held):
    worker = build_worker_model(LLAMA, held, "block", seed=0)
    assert set(worker.state_dict()) == expected_names(LLAMA, held, "block")
    assert all(spec.is_whole for spec in worker.full_index().values())


@FAST
@given(held=rows(3))
def test_block_worker_forward_equals_full_model_with_other_blocks_skipped(held):
    full = build_model(LLAMA, seed=1)
    for i in np.flatnonzero(~held):
        del full.layers[str(i)]
    worker = build_worker_model(LLAMA, held, "block", seed=1)
    torch.testing.assert_close(worker(tokens()), full(tokens()), rtol=0, atol=0)


@FAST
@given(held=rows(8))
def test_resnet_block_worker_equals_full_model_with_other_residual_branches_zeroed(held):
    """A block not held adds nothing to its shortcut: identity blocks are skipped, downsampling
    blocks keep relu(downsample(x)), both as the full model with bn2 (the branch's end) zeroed."""
    full = build_model(RESNET, seed=1).double()
    names = block_map(RESNET).block_names("block")
    with torch.no_grad():
        for j in np.flatnonzero(~held):
            full.get_submodule(names[j]).bn2.weight.zero_()
            full.get_submodule(names[j]).bn2.bias.zero_()
    worker = build_worker_model(RESNET, held, "block", seed=1).double()
    assert set(worker.state_dict()) == expected_names(RESNET, held, "block")
    torch.testing.assert_close(worker(images()), full(images()), rtol=0, atol=0)


def test_a_skipped_downsampling_block_computes_relu_of_its_shortcut_and_trains_it():
    held = np.ones(8, dtype=bool)
    held[2] = False  # layer2.0, the second stage's entry
    worker = build_worker_model(RESNET, held, "block", seed=3).double()
    full = build_model(RESNET, seed=3).double()
    skipped, shortcut = worker.layer2["0"], full.layer2["0"].downsample
    assert isinstance(skipped, PassThrough) and sum(p.numel() for p in skipped.parameters()) == sum(
        p.numel() for p in shortcut.parameters())
    x = torch.rand(4, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = skipped(x)
    torch.testing.assert_close(out, torch.relu(shortcut(x)), rtol=0, atol=0)
    assert out.shape == (4, 8, 4, 4)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in skipped.parameters())


def zero_dropped_neurons(full: torch.nn.Module, config, held: np.ndarray) -> None:
    """Zero, in the full model, every tensor part owned by a non-held neuron group."""
    bmap = block_map(config)
    state = full.state_dict()
    with torch.no_grad():
        for j in np.flatnonzero(~held):
            for name, spec in bmap.owned("neuron", int(j)):
                spec.put(state[name], torch.zeros_like(spec.take(state[name])))


@FAST
@given(held=rows(12))
def test_neuron_worker_equals_full_model_with_other_neurons_zeroed(held):
    full = build_model(LLAMA, seed=2).double()
    zero_dropped_neurons(full, LLAMA, held)
    worker = build_worker_model(LLAMA, held, "neuron", seed=2).double()
    torch.testing.assert_close(worker(tokens()), full(tokens()), rtol=0, atol=1e-12)
    assert set(worker.state_dict()) <= set(full.state_dict())


@FAST
@given(held=resnet_neuron_rows())
def test_resnet_neuron_worker_equals_full_model_with_other_channels_zeroed(held):
    full = build_model(RESNET, seed=2).double()
    zero_dropped_neurons(full, RESNET, held)
    worker = build_worker_model(RESNET, held, "neuron", seed=2).double()
    torch.testing.assert_close(worker(images()), full(images()), rtol=0, atol=1e-12)


def test_neuron_layer_with_no_held_group_has_no_mlp():
    held = np.array([1, 1, 0, 0] + [0, 0, 0, 0] + [0, 1, 0, 1], dtype=bool)
    worker = build_worker_model(LLAMA, held, "neuron", seed=0)
    assert worker.layers["1"].mlp is None and "layers.1.mlp_norm.weight" not in worker.state_dict()
    assert worker.layers["0"].mlp.w_gate.weight.shape == (16, LLAMA.dim)
    spec = worker.full_index()["layers.2.mlp.w_down.weight"]
    assert (spec.dim, spec.index, spec.full_size) == (1, tuple(range(8, 16)) + tuple(range(24, 32)), 32)
    assert held_tensors(LLAMA, held, "neuron") == worker.full_index()


@FAST
@pytest.mark.parametrize(("level", "n_blocks"), [("block", 3), ("neuron", 12)])
@given(data=st.data())
def test_scatter_then_load_round_trips_and_leaves_other_entries(level, n_blocks, data):
    row = data.draw(rows(n_blocks))
    full_state = {k: v.clone() for k, v in build_model(LLAMA, seed=0).state_dict().items()}
    original = {k: v.clone() for k, v in full_state.items()}
    worker = build_worker_model(LLAMA, row, level, seed=0)
    with torch.no_grad():
        for p in worker.parameters():
            p.add_(1.0)
    scatter_to_full(worker, full_state)
    reloaded = build_worker_model(LLAMA, row, level, init_state=full_state)
    for name, value in worker.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value)
    changed = sum(int((full_state[n] != original[n]).sum()) for n in full_state)
    assert changed == sum(p.numel() for p in worker.parameters())


def test_seeded_worker_equals_slice_of_seeded_full_model():
    held = np.array([0, 1] * 8, dtype=bool)
    full = build_model(RESNET, seed=5)
    seeded = build_worker_model(RESNET, held, "neuron", seed=5)
    sliced = build_worker_model(RESNET, held, "neuron", seed=0)
    load_from_full(sliced, full.state_dict())
    for name, value in seeded.state_dict().items():
        assert torch.equal(sliced.state_dict()[name], value), name


@pytest.mark.parametrize(
    ("held", "level", "message"),
    [
        (np.ones(4, dtype=bool), "block", "'llama-debug' has 3 blocks at level 'block'; the mask row has length 4"),
        (np.ones(3, dtype=bool), "neuron", "has 12 blocks at level 'neuron'; the mask row has length 3"),
        (np.zeros(3, dtype=bool), "block", "holds no block"),
        (np.array([0, 2, 1]), "block", "boolean or 0/1"),
        (np.ones((1, 3), dtype=bool), "block", "must be 1-D"),
        (np.ones(3, dtype=bool), "layer", "level must be one of"),
    ],
)
def test_invalid_mask_row_is_rejected_with_expected_and_got(held, level, message):
    with pytest.raises(ConfigError, match=message):
        build_worker_model(LLAMA, held, level, seed=0)


def test_resnet_neuron_row_dropping_a_whole_block_is_rejected():
    held = np.ones(16, dtype=bool)
    held[6:8] = False
    with pytest.raises(ConfigError, match="layer2.1"):
        build_worker_model(RESNET, held, "neuron", seed=0)


def test_exactly_one_of_seed_and_init_state():
    with pytest.raises(ConfigError, match="exactly one"):
        build_worker_model(LLAMA, np.ones(3, dtype=bool), "block")


def test_load_from_full_rejects_a_state_of_another_shape():
    worker = build_worker_model(LLAMA, np.ones(3, dtype=bool), "block", seed=0)
    other = build_model(get_model_config("llama-debug", dim=32, n_layers=3, n_heads=2, hidden_dim=32,
                                         neuron_groups=4, vocab_size=32), seed=0)
    with pytest.raises(ConfigError, match="tok_embeddings.weight.*expected"):
        load_from_full(worker, other.state_dict())


def test_backward_mask_freezes_exactly_the_non_held_blocks():
    held = np.array([1, 0, 1], dtype=bool)
    held_names, frozen_names = backward_mask(LLAMA, held)
    assert {n.split(".")[1] for n in frozen_names} == {"1"} and frozen_names
    model = build_model(LLAMA, seed=0)
    apply_backward_mask(model, LLAMA, held)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(frozen_names)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(held_names)
    with pytest.raises(ConfigError, match="level 'block' only"):
        backward_mask(LLAMA, np.ones(12, dtype=bool), "neuron")


def test_a_dropped_downsampling_block_keeps_its_live_shortcut_and_gaining_it_takes_the_shortcut_back():
    """The library's cut (`drop_blocks`, a schedule's `gain_block`) of a full ResNet: the shortcut is
    never moved to the meta device, keeps its full-model names and values, and is the gained block's."""
    from sdp_train.parallel.masking import describe, drop_blocks
    from sdp_train.parallel.schedule import gain_block

    model = build_model(RESNET, seed=4)
    shortcut = model.layer3["0"].downsample
    before = {n: t.clone() for n, t in model.state_dict().items() if n.startswith("layer3.0.downsample.")}
    layout = describe(model, block_map(RESNET).block_names("block"), "block")
    assert layout.shared_inside == ("layer2.0.downsample", "layer3.0.downsample", "layer4.0.downsample")
    assert not any(".downsample." in n for n in layout.block_tensors("layer3.0"))
    assert set(layout.held(np.array([1, 1, 1, 1, 0, 1, 1, 1]))) == set(model.state_dict()) - set(
        layout.block_tensors("layer3.0"))
    drop_blocks(model, layout.blocks, np.array([1, 1, 1, 1, 0, 1, 1, 1]))
    skipped = model.layer3["0"]
    assert isinstance(skipped, PassThrough) and skipped.downsample is shortcut
    assert {n: t for n, t in model.state_dict().items() if n.startswith("layer3.0.")}.keys() == before.keys()
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())
    block = gain_block(model, "layer3.0", torch.device("cpu"))
    assert block.downsample is shortcut and model.layer3["0"] is block and not block.conv1.weight.is_meta


def test_fsdp_outer_units_are_the_declared_groups_unless_a_tensor_is_tied_across_them():
    model = build_model(LLAMA, seed=0)
    assert outer_units(model) == [("tok_embeddings",), ("norm", "output")]
    model.output.weight = model.tok_embeddings.weight  # a tied head: one tensor, one unit (the root)
    assert outer_units(model) == []
    assert outer_units(build_model(RESNET, seed=0)) == []  # nothing declared: everything in the root
