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
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from sdp_train.models import block_map, get_model_config
from sdp_train.models.subnet import build_worker_model, held_tensors
from sdp_train.parallel import sync
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.export import assemble, owned_positions
from sdp_train.parallel.sync import SyncEngine, layer_of, plan_buckets
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.modes import family_layout
from sdp_train.trainer.prepare import design_for_model
from sdp_train.trainer.run import loss_fn

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
    sq_norm = engine.finish()
    assert engine.buckets
    # without a group nothing is sent, so nothing is packed and the gradients stay as they were
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    owned = 0.0
    for bucket in engine.buckets:
        kernels.pack(bucket.grads(), bucket.layout, bucket.buffer, scale=bucket.layout.inverse_coverage,
                     backend="reference")  # what the engine sends where the bucket has a group
        if bucket.plan.holders[0] == rank:
            owned += float((bucket.buffer * len(bucket.plan.holders)).double().pow(2).sum())
        parts = []
        for atom in bucket.plan.atoms:
            g = grads[atom.name]
            if atom.dim is not None:
                local = torch.tensor(index[atom.name].local_positions(atom.index))
                g = g.index_select(atom.dim, local)
            parts.append(g.reshape(-1) * (1.0 / len(bucket.plan.holders)))
        torch.testing.assert_close(bucket.buffer, torch.cat(parts), rtol=0, atol=0)
    assert float(sq_norm) == pytest.approx(owned, rel=1e-5)  # read in place: the held slices' squares
    engine.remove_hooks()


def _assembled(mask: np.ndarray) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Sum over ranks of each rank's owned slices as `assemble` places them (what its reduce computes)."""
    held = held_by_rank(mask)
    shapes = block_map(LLAMA).shapes
    tensors = family_layout(LLAMA, "neuron").tensors
    workers, total = [], {n: torch.zeros(s) for n, s in shapes.items()}
    for r in range(mask.shape[0]):
        model = build_worker_model(LLAMA, mask[r], "neuron", seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(r + 1.0)  # each rank's values differ: the assembly must take the lowest holder's
        state = model.state_dict()
        workers.append(state)
        pieces = assemble(state, model.full_index(), tensors, held, r, rank0_only=False, device=torch.device("cpu"))
        for name, piece in pieces.items():  # one process: this rank's owned slices, zeros elsewhere
            total[name] += piece
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


def random_masks(workers: int, blocks: int):
    """Masks with every column covered and every row non-empty."""
    return (st.lists(st.lists(st.booleans(), min_size=workers, max_size=workers).filter(any),
                     min_size=blocks, max_size=blocks)
            .map(lambda cols: np.array(cols, dtype=np.uint8).T)
            .filter(lambda m: m.any(axis=1).all()))


@settings(max_examples=15, deadline=None)
@given(mask=random_masks(3, LLAMA.n_layers * GROUPS), span=st.integers(1, 3), cap_mb=st.sampled_from([0.05, 0.3, 25.0]))
def test_buckets_partition_every_held_slice_within_one_holder_set_layer_span_and_cap(mask, span, cap_mb):
    held = held_by_rank(mask)
    names = parameter_names()
    shapes = block_map(LLAMA).shapes
    plans = plan_buckets(held, names, layers_per_bucket=span, shapes=shapes, bucket_cap_mb=cap_mb)
    layer = layer_of(names)
    covered: dict[tuple[str, int], tuple[int, ...]] = {}
    for plan in plans:
        layers = [layer[a.name] for a in plan.atoms]
        assert max(layers) - min(layers) < span
        numel = sum(int(np.prod(shapes[a.name])) // (1 if a.dim is None else shapes[a.name][a.dim])
                    * (1 if a.dim is None else len(a.index)) for a in plan.atoms)
        assert len(plan.atoms) == 1 or numel * 4 <= cap_mb * 2**20
        for atom in plan.atoms:
            positions = range(shapes[atom.name][0]) if atom.dim is None else atom.index
            for i in positions:
                key = (atom.name, i)
                assert key not in covered, key  # each slice in exactly one bucket
                covered[key] = plan.holders
    for name in names:  # ... which is averaged among exactly the ranks holding it
        holders = [r for r in range(len(held)) if name in held[r]]
        sliced = [held[r][name].dim for r in holders if not held[r][name].is_whole]
        for i in range(shapes[name][sliced[0] if sliced else 0]):
            expected = tuple(r for r in holders if held[r][name].is_whole or i in held[r][name].index)
            if expected:
                assert covered[(name, i)] == expected, (name, i)
    keys = [p.order_key for p in plans]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # one strict global launch order


def test_layer_of_numbers_layers_and_attaches_outside_parameters_to_the_previous_one():
    names = ["tok.weight", "layers.0.a.weight", "layers.0.b.weight", "layers.1.a.weight", "norm.weight",
             "out.weight"]
    assert layer_of(names) == {"tok.weight": -1, "layers.0.a.weight": 0, "layers.0.b.weight": 0,
                               "layers.1.a.weight": 1, "norm.weight": 1, "out.weight": 1}
    assert layer_of(["conv1.weight", "layer1.0.conv1.weight", "layer2.0.conv1.weight", "fc.bias"])["fc.bias"] == 1


@pytest.mark.parametrize(("mode", "level"), [("nsdp", "neuron"), ("bsdp", "block")])
def test_first_collective_starts_before_the_last_gradient_is_ready(monkeypatch, mode, level):
    """The events of one backward on rank 0 of a designed mask: some holder-group all_reduce is
    launched while backward still produces gradients (it overlaps backward)."""
    cfg = TrainConfig(model="llama-debug", mode=mode, workers=2, active=0.5)
    mask = design_for_model(cfg, LLAMA).matrix
    held = [held_tensors(LLAMA, mask[k], level) for k in range(2)]
    plans = plan_buckets(held, parameter_names(), shapes=block_map(LLAMA).shapes)
    events: list[str] = []

    class Done:
        def wait(self) -> None:
            pass

    def fake_all_reduce(buffer, group=None, async_op=False):
        events.append("launch")
        return Done()

    monkeypatch.setattr(sync.dist, "all_reduce", fake_all_reduce)
    model = build_worker_model(LLAMA, mask[0], level, seed=0)
    for name, p in model.named_parameters():  # registered before the engine's hooks: runs before them
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(f"grad {name}"))
    groups = {p.holders: (object() if len(p.holders) > 1 else None) for p in plans}
    engine = SyncEngine(model, plans, model.full_index(), groups, 0, backend="reference")
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    engine.finish()
    engine.remove_hooks()
    assert "launch" in events
    last_grad = max(i for i, e in enumerate(events) if e.startswith("grad"))
    assert events.index("launch") < last_grad, events
