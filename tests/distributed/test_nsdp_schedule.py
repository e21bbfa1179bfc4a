"""N-SDP (forward masking, neuron level) under a mask schedule, on 3 real gloo ranks through the public API.

At every mask change each MLP tensor is re-cut to the neuron groups its worker holds now: a group a
worker gains arrives with its AdamW state from the group's lowest-ranked old holder, so every two
workers that hold a group hold the same values and state bit for bit; the run equals a
single-process reference in which each worker trains its round's MLP slices (the other neurons
zeroed) and every neuron takes the mean of its holders' gradients; and a run stopped in the middle
of a round resumes from its saved state to the same values bit for bit. Run as a script, this file
is the ranks' program."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, Schedule
from tests.distributed.mlp_net import HIDDEN, batch, make_net
from tests.distributed.schedule_moves import assert_moves_only_when_a_round_begins

pytestmark = pytest.mark.slow
K, STEPS, LR, STOP, GROUPS = 3, 6, 1e-2, 3, 3  # the run ends with round 2; STOP ends round 1
BASE = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]])  # per block: every worker keeps 2 of its 3 neuron groups
MASK = Mask(np.hstack([BASE, np.roll(BASE, 1, axis=0), BASE]), schedule=Schedule("permute", every=2))
SEED = 4


def _wrapped():
    from sdp_train import MLPSpec, SubnetworkDataParallel

    model = SubnetworkDataParallel(make_net(), mask=MASK, level="neuron", neuron_groups=GROUPS,
                                   mlp=MLPSpec(("up",), "down"), seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model.register_optimizer(opt)
    return model, opt


def _train(model, opt, rank: int, steps: range) -> list[dict]:
    trace = []
    for step in steps:
        x, y = batch(step, rank)
        (model(x) - y).square().mean().backward()
        opt.step()  # the hook counts the step; at a change the next forward re-cuts the MLPs
        opt.zero_grad()
        names = {id(p): n for n, p in model.module.named_parameters()}
        trace.append({"params": {n: t.clone() for n, t in model.module.state_dict().items()},
                      "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
                      "index": {n: model.local_index[n] for n in names.values()},
                      "optimized": sorted(names[id(p)] for g in opt.param_groups for p in g["params"]),
                      "moved": model.mask_change_bytes.buffer})
    return trace


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = _wrapped()
    torch.save(_train(model, opt, rank, range(STEPS)), out / f"rank{rank}.pt")
    model.close()
    model, opt = _wrapped()
    _train(model, opt, rank, range(STOP + 1))
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "schedule": model.schedule_state()}
    model.close()
    model, opt = _wrapped()
    model.load_schedule_state(saved["schedule"])  # first: it re-cuts the MLPs to the saved round's shapes
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    torch.save(_train(model, opt, rank, range(STOP + 1, STEPS)), out / f"resumed{rank}.pt")
    model.close()

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_nsdp_schedule")


@pytest.fixture(scope="module")
def ranks(out) -> list[list[dict]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


def _keep(matrix: np.ndarray, k: int) -> list[torch.Tensor]:
    """Worker k's hidden-neuron mask of each block under `matrix`."""
    rows = matrix[k].reshape(3, GROUPS)
    return [torch.tensor(np.repeat(rows[j], HIDDEN // GROUPS), dtype=torch.float32) for j in range(3)]


def reference() -> list[dict]:
    """One full model and one AdamW; each step worker k's gradient is that of its round's slices
    (the neurons it does not hold zeroed), each neuron's rows/columns take the mean over the
    neuron's holders, every other tensor the mean over all K workers."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    trace = []
    for step in range(STEPS):
        matrix = MASK.round_matrix(step, seed=SEED).astype(bool)
        grads = []
        for k in range(K):
            model.zero_grad()
            x, y = batch(step, k)
            (model(x, keep=_keep(matrix, k)) - y).square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, p in model.named_parameters():
            p.grad = sum(g[name] for g in grads) / K
            if name.startswith("layers.") and (".up." in name or name.endswith("down.weight")):
                j, dim = int(name.split(".")[1]), 1 if name.endswith("down.weight") else 0
                holders = torch.tensor(np.repeat(matrix[:, j * GROUPS:(j + 1) * GROUPS].sum(0), HIDDEN // GROUPS),
                                       dtype=torch.float32)
                shape = [1] * p.dim()
                shape[dim] = HIDDEN
                p.grad = sum(g[name] for g in grads) / holders.view(shape)  # non-holders' gradients are 0
        opt.step()
        names = {p: n for n, p in model.named_parameters()}
        trace.append({"params": {n: t.clone() for n, t in model.state_dict().items()},
                      "state": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}})
    return trace


def test_every_change_re_cuts_the_mlps():
    rounds = [MASK.round_matrix(2 * r, seed=SEED) for r in range(4)]
    assert all(not np.array_equal(a, b) for a, b in zip(rounds, rounds[1:]))


def test_the_slices_and_their_adamw_state_equal_the_single_process_reference(ranks):
    """Against the reference, every rank's slice of every tensor (so holders agree with each other)."""
    ref = reference()
    for step in range(STEPS):
        for rank, trace in enumerate(ranks):
            snap = trace[step]
            assert snap["optimized"] == sorted(snap["params"])  # the optimizer steps exactly the module's tensors
            for name, local in snap["params"].items():
                full = ref[step]["params"][name]
                torch.testing.assert_close(local, snap["index"][name].take(full), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} rank {rank} {name}: {m}")
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(snap["state"][name][key],
                                               snap["index"][name].take(ref[step]["state"][name][key]),
                                               rtol=1e-5, atol=1e-7, msg=lambda m: f"step {step} {name} {key}: {m}")


def test_groups_move_when_a_step_begins_a_new_round_and_never_after_the_last_step(ranks):
    """Steps 2 and 4 begin new rounds; after the last step (5), which ends round 2, nothing moves."""
    assert_moves_only_when_a_round_begins(ranks, MASK, SEED, [False, False, True, False, True, False])


def test_holders_of_a_group_agree_bit_for_bit(ranks):
    for step in range(STEPS):
        for name in ranks[0][step]["params"]:
            seen: dict[int, tuple] = {}  # full position -> (rank, values at it)
            for rank, trace in enumerate(ranks):
                spec, local = trace[step]["index"][name], trace[step]["params"][name]
                positions = range(local.shape[0]) if spec.is_whole else spec.index
                dim = 0 if spec.is_whole else spec.dim
                for i, p in enumerate(positions):
                    values = [local.select(dim, i)] + [trace[step]["state"][name][k].select(dim, i)
                                                       for k in ("exp_avg", "exp_avg_sq")]
                    if p in seen:
                        assert all(torch.equal(a, b) for a, b in zip(seen[p][1], values)), (step, name, p)
                    seen[p] = (rank, values)


def test_a_run_resumed_in_the_middle_of_the_schedule_goes_on_bit_for_bit(out, ranks):
    for r in range(K):
        resumed = torch.load(out / f"resumed{r}.pt", weights_only=False)
        for snap, whole in zip(resumed, ranks[r][STOP + 1:], strict=True):
            for name, value in whole["params"].items():
                assert torch.equal(snap["params"][name], value), (r, name)
            for name, state in whole["state"].items():
                for key, value in state.items():
                    assert torch.equal(snap["state"][name][key], value), (r, name, key)


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
