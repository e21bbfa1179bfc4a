"""The sync engine's plan and the full-model assembly as pure functions (no process group).

A worker that holds every neuron group of a layer describes that layer's MLP tensors as whole
(`SliceSpec()`, empty index) while another worker holds only some rows: both the engine's
packing positions and the assembly's "lowest-ranked holder" positions must map full positions
through the whole tensor as the identity.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdp_train.models import block_map, get_model_config
from sdp_train.models.blocks import SliceSpec
from sdp_train.subnet import build_worker_model, held_tensors
from sdp_train.sync import SyncEngine, plan_buckets
from sdp_train.train import owned_positions, owned_slices

LLAMA = get_model_config("llama-debug")
GROUPS = LLAMA.neuron_groups


def full_layer_mask() -> np.ndarray:
    """Worker 0 holds every neuron group of layer 2; workers 1 and 2 hold only some of them."""
    mask = np.zeros((3, LLAMA.n_layers, GROUPS), dtype=np.uint8)
    mask[0, :, :] = 0
    mask[0, 2, :] = 1
    mask[0, 0, :2] = 1
    mask[1, :, : GROUPS // 2] = 1
    mask[2, :, GROUPS // 2:] = 1
    mask[2, 2, 0] = 1
    return mask.reshape(3, -1)


def held_by_rank(mask: np.ndarray) -> list[dict[str, SliceSpec]]:
    return [held_tensors(LLAMA, mask[k], "neuron") for k in range(mask.shape[0])]


def parameter_names() -> list[str]:
    bmap = block_map(LLAMA)
    return [n for n in bmap.shapes if n in bmap.parameter_names]


def test_the_mask_really_mixes_whole_and_sliced_holders_of_one_tensor():
    held = held_by_rank(full_layer_mask())
    name = "layers.2.mlp.w_gate.weight"
    assert held[0][name].is_whole and not held[1][name].is_whole and not held[2][name].is_whole


def test_slice_spec_local_positions_of_a_whole_tensor_are_the_full_positions():
    assert SliceSpec().local_positions((5, 0, 3)) == (5, 0, 3)
    sliced = SliceSpec(dim=0, index=(2, 4, 7), full_size=8)
    assert sliced.local_positions((7, 2)) == (2, 0)
    with pytest.raises(ValueError, match="full position 3 is not held"):
        sliced.local_positions((3,))


@pytest.mark.parametrize("rank", range(3))
def test_packed_bucket_is_each_held_slice_scaled_by_inverse_coverage(rank):
    mask = full_layer_mask()
    held = held_by_rank(mask)
    plans = plan_buckets(held, parameter_names())
    model = build_worker_model(LLAMA, mask[rank], "neuron", seed=0)
    engine = SyncEngine(model, plans, model.full_index(), {p.holders: None for p in plans}, rank, backend="reference")
    gen = torch.Generator().manual_seed(rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    index = model.full_index()
    engine.finish()
    assert engine.buckets
    for bucket in engine.buckets:
        parts = []
        for atom in bucket.plan.atoms:
            g = grads[atom.name]
            if atom.dim is not None:
                local = torch.tensor(index[atom.name].local_positions(atom.index))
                g = g.index_select(atom.dim, local)
            parts.append(g.reshape(-1) * (1.0 / len(bucket.plan.holders)))
        torch.testing.assert_close(bucket.buffer, torch.cat(parts), rtol=0, atol=0)
    engine.remove_hooks()


def _assembled(mask: np.ndarray) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Sum over ranks of each rank's owned slices (what the all-reduce/reduce computes)."""
    held = held_by_rank(mask)
    shapes = block_map(LLAMA).shapes
    workers, total = [], {n: torch.zeros(s) for n, s in shapes.items()}
    for r in range(mask.shape[0]):
        model = build_worker_model(LLAMA, mask[r], "neuron", seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(r + 1.0)  # each rank's values differ: the assembly must take the lowest holder's
        state = model.state_dict()
        workers.append(state)
        index = model.full_index()
        for name, value in state.items():
            owned = owned_slices(name, index[name], held, r)
            if owned is None:
                continue
            dim, full_pos, local_pos = owned
            if dim is None:
                total[name] += value
            else:
                total[name].index_add_(dim, torch.tensor(full_pos), value.index_select(dim, torch.tensor(local_pos)))
    return total, workers


def test_assembled_full_model_takes_every_entry_from_its_lowest_ranked_holder():
    mask = full_layer_mask()
    held = held_by_rank(mask)
    total, workers = _assembled(mask)
    for name, shape in block_map(LLAMA).shapes.items():
        holders = [r for r in range(len(held)) if name in held[r]]
        expected = torch.full(shape, float("nan"))
        for r in reversed(holders):  # the lowest rank writes last
            spec = held[r][name]
            spec.put(expected, workers[r][name])
        torch.testing.assert_close(total[name], expected, rtol=0, atol=0, msg=name)


def test_owned_positions_partition_every_held_tensor_among_its_holders():
    held = held_by_rank(full_layer_mask())
    shapes = block_map(LLAMA).shapes
    for name in shapes:
        owners = [(r, owned_positions(name, held, r)) for r in range(len(held))]
        owned = [(r, o) for r, o in owners if o is not None]
        assert owned, name
        if owned[0][1][0] is None:
            assert len(owned) == 1  # a whole tensor: one owner, its lowest holder
            continue
        dim = owned[0][1][0]
        positions = [i for _, (_, idx) in owned for i in idx]
        assert sorted(positions) == list(range(shapes[name][dim])), name  # each position exactly once
        for r, (_, idx) in owned:
            spec = held[r][name]
            assert spec.is_whole or set(idx) <= set(spec.index), (name, r)
            lower = [q for q in range(r) if name in held[q]]
            for q in lower:  # a lower-ranked holder of a position would own it instead
                assert held[q][name].dim is not None and not set(idx) & set(held[q][name].index), (name, r, q)
