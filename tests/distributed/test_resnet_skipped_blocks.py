"""B-SDP on a ResNet whose downsampling blocks some workers do not hold, on 3 real gloo ranks.

A worker without a downsampling block computes relu(downsample(x)): the shortcut is shared, held
and averaged by every worker, the block's other tensors only by its holders. Two runs, as ``sdp
train`` builds them: a static mask (each worker built from the family's constructor, the block a
`PassThrough` holding the shortcut) and a ``permute`` schedule (the full model cut by the library,
so downsampling blocks move between workers while their shortcut stays). Both must equal a
single-process reference in which each worker's gradient is its subnetwork's and every tensor
takes the mean over its holders, every holder of a tensor must hold the same value (the shortcut's
and its BatchNorm statistics on all ranks), and the export has the full model's names. Run as a
script, this file is the ranks' program."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from masklab import Mask, Schedule
from sdp_train.models import block_map, build_model, get_model_config

pytestmark = pytest.mark.slow
K, STEPS, SEED = 3, 4, 5  # SEED: weights, and the permute draws (round 1 differs from round 0)
RESNET = get_model_config("resnet18-cifar", width_multiplier=1 / 16, in_channels=1)
ROWS = np.array([[1, 1, 1, 0, 0, 1, 1, 1],  # blocks layer1.0 ... layer4.1; layer2.0, 3.0, 4.0 downsample
                 [0, 1, 1, 1, 1, 0, 0, 1],
                 [1, 0, 0, 1, 1, 1, 0, 0]], dtype=np.uint8)
MASKS = {"static": Mask(ROWS), "permute": Mask(ROWS, schedule=Schedule("permute", every=2))}
BLOCKS = block_map(RESNET).block_names("block")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def optimizer(params) -> torch.optim.SGD:
    """SGD with momentum: state that moves with a block, and, unlike AdamW, which divides each
    gradient entry by its own magnitude, no amplification of gloo's summation order."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _wrapped(kind: str):
    """The worker's model as `sdp_train.trainer.modes.build_sync` builds it for a static mask or a schedule."""
    import torch.distributed as dist

    from sdp_train import SubnetworkDataParallel
    from sdp_train.models import model_class
    from sdp_train.models.subnet import build_worker_model, held_tensors
    from sdp_train.trainer.modes import family_layout

    mask = MASKS[kind]
    if kind == "static":
        rows = mask.matrix.astype(bool)
        model = build_worker_model(RESNET, rows[dist.get_rank()], "block", seed=SEED)
        return SubnetworkDataParallel.from_subnetwork(
            model, layout=family_layout(RESNET, "block"), mask=mask, local_index=model.full_index(),
            held_by_rank=[held_tensors(RESNET, rows[r], "block") for r in range(K)], values_agree=True)
    with torch.device("meta"):
        full = model_class(RESNET)(RESNET)
    return SubnetworkDataParallel(full, mask=mask, blocks=list(BLOCKS), seed=SEED, device="cpu",
                                  init=lambda m: m.init_weights(SEED))


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for kind in MASKS:
        model = _wrapped(kind)
        opt = optimizer(model.module.parameters())
        model.register_optimizer(opt)
        trace = []
        for step in range(STEPS):
            x, y = batch(step, rank)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            names = {id(p): n for n, p in model.module.named_parameters()}
            trace.append({"state": {n: t.clone() for n, t in model.module.state_dict().items()},
                          "optimized": sorted(names[id(p)] for g in opt.param_groups for p in g["params"])})
        export = model.full_state_dict()
        torch.save({"trace": trace, "export": export}, out / f"{kind}{rank}.pt")
        model.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    from tests.distributed.shared_launch import shared_out

    out = shared_out(tmp_path_factory, "test_resnet_skipped_blocks")
    return {kind: [torch.load(out / f"{kind}{r}.pt", weights_only=False) for r in range(K)] for kind in MASKS}


def _owner(name: str) -> int | None:
    """The mask column of the block that owns `name`; None for a shared tensor (a shortcut's too)."""
    for j, block in enumerate(block_map(RESNET).blocks["block"]):
        if name in dict(block.tensors):
            return j
    return None


def _holders(kind: str, step: int, name: str) -> list[int]:
    j = _owner(name)
    matrix = MASKS[kind].round_matrix(step, seed=SEED)
    return list(range(K)) if j is None else [int(k) for k in np.flatnonzero(matrix[:, j])]


def reference(kind: str) -> list[dict[str, torch.Tensor]]:
    """One full model and one optimizer; worker k's gradient is its round's subnetwork's on its batch
    (built from the full model's current values), every tensor takes the mean over its holders."""
    from sdp_train.models.subnet import build_worker_model, load_from_full

    model = build_model(RESNET, seed=SEED)
    opt = optimizer(model.parameters())
    trace = []
    for step in range(STEPS):
        matrix = MASKS[kind].round_matrix(step, seed=SEED).astype(bool)
        grads = []
        for k in range(K):
            worker = build_worker_model(RESNET, matrix[k], "block", seed=0)
            load_from_full(worker, model.state_dict())
            x, y = batch(step, k)
            F.cross_entropy(worker(x), y).backward()
            grads.append({n: p.grad for n, p in worker.named_parameters()})
        for name, p in model.named_parameters():
            holders = _holders(kind, step, name)
            p.grad = sum(grads[k][name] for k in holders) / len(holders)
        opt.step()
        trace.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return trace


def test_the_mask_drops_downsampling_blocks_on_some_workers_and_the_schedule_moves_them():
    downsampling = [j for j, b in enumerate(BLOCKS) if b.endswith(".0") and b != "layer1.0"]
    rounds = [MASKS["permute"].round_matrix(step, seed=SEED) for step in (0, 2)]
    assert all(0 < ROWS[:, j].sum() < K for j in downsampling)
    assert any(not np.array_equal(rounds[0][:, j], rounds[1][:, j]) for j in downsampling)


@pytest.mark.parametrize("kind", list(MASKS))
def test_every_holder_of_a_tensor_has_the_same_value_and_the_shortcut_is_everyone_s(runs, kind):
    shortcut = [n for n in block_map(RESNET).shapes if ".downsample." in n]
    for step in range(STEPS):
        states = [runs[kind][k]["trace"][step]["state"] for k in range(K)]
        for name in block_map(RESNET).shapes:
            holders = _holders(kind, step, name)
            assert [k for k in range(K) if name in states[k]] == holders, (kind, step, name)
            for k in holders[1:]:
                assert torch.equal(states[k][name], states[holders[0]][name]), (kind, step, name, k)
        assert all(set(shortcut) <= set(s) for s in states)


@pytest.mark.parametrize("kind", list(MASKS))
def test_the_optimizer_steps_each_held_parameter_once(runs, kind):
    for k in range(K):
        for snap in runs[kind][k]["trace"]:
            params = [n for n in snap["state"] if n in block_map(RESNET).parameter_names]
            assert snap["optimized"] == sorted(params)


@pytest.mark.parametrize("kind", list(MASKS))
def test_a_run_equals_the_single_process_reference_and_exports_the_full_model(runs, kind):
    ref = reference(kind)
    for step in range(STEPS):
        for name, value in ref[step].items():
            k = _holders(kind, step, name)[0]
            torch.testing.assert_close(runs[kind][k]["trace"][step]["state"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kind} step {step} {name}: {m}")
    export = runs[kind][0]["export"]
    assert list(export) == list(build_model(RESNET, seed=0).state_dict())
    for name, value in ref[-1].items():
        torch.testing.assert_close(export[name], value, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
