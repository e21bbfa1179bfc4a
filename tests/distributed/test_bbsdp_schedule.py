"""Bb-SDP under a mask schedule, on 3 real gloo ranks through the public API: at every mask change each
block's AdamW state reaches its new holders bit for bit, a worker that stops holding a block frees
its state, and the run equals a single-process reference that trains one model with every block's
holder-averaged gradient under the same schedule. Run as a script, this file is the ranks' program."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from masklab import Mask, Schedule
from tests.distributed.schedule_moves import assert_moves_only_when_a_round_begins

pytestmark = pytest.mark.slow
K, STEPS, LR = 3, 6, 1e-2  # the run ends with round 2: nothing may move for round 3
MASK = Mask(np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), schedule=Schedule("permute", every=2))
SEED = 4  # of the permute draws: rounds 0..3 draw 3 different permutations


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    from sdp_train import SubnetworkDataParallel

    rank = dist.get_rank()
    model = SubnetworkDataParallel(make_net(), mask=MASK, masking="backward", seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model.register_optimizer(opt)
    names = {p: n for n, p in model.module.named_parameters()}
    trace = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        (model(x) - y).square().mean().backward()
        opt.step()  # the hook sends new values; at a change the next forward moves the state
        opt.zero_grad()
        trace.append({"params": {n: t.clone() for n, t in model.module.state_dict().items()},
                      "state": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()
                                if s},
                      "held": model.held_blocks, "moved": model.mask_change_bytes.buffer})
    torch.save(trace, out / f"rank{rank}.pt")
    model.close()
    # an optimizer over the first round's trainable parameters only: the first change (made by step
    # 2's forward) is refused on every rank (one error, no rank left waiting in a collective)
    partial = SubnetworkDataParallel(make_net(), mask=MASK, masking="backward", seed=SEED)
    opt = torch.optim.AdamW([p for p in partial.parameters() if p.requires_grad], lr=LR)
    partial.register_optimizer(opt)
    error = None
    try:
        for step in range(3):
            (partial(batch(step, rank)[0]) - batch(step, rank)[1]).square().mean().backward()
            opt.step()
    except ValueError as exc:
        error = str(exc)
    (out / f"error_rank{rank}.txt").write_text(repr(error))
    partial.close()

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_bbsdp_schedule")


@pytest.fixture(scope="module")
def ranks(out) -> list[list[dict]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


def reference() -> list[dict]:
    """One model and one AdamW; each step every block's gradient is the mean of its holders' (the
    round's mask), the shared parameters' the mean of all K workers'."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    blocks = [f"layers.{j}." for j in range(3)]
    trace = []
    for step in range(STEPS):
        matrix = MASK.round_matrix(step, seed=SEED)
        grads = []
        for k in range(K):
            model.zero_grad()
            x, y = batch(step, k)
            (model(x) - y).square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, p in model.named_parameters():
            j = next((j for j, b in enumerate(blocks) if name.startswith(b)), None)
            holders = range(K) if j is None else np.flatnonzero(matrix[:, j])
            p.grad = sum(grads[k][name] for k in holders) / len(holders)
        opt.step()
        names = {p: n for n, p in model.named_parameters()}
        trace.append({"params": {n: t.clone() for n, t in model.state_dict().items()},
                      "state": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}})
    return trace


def _holders(step: int, name: str) -> list[int]:
    j = int(name.split(".")[1]) if name.startswith("layers.") else None
    matrix = MASK.round_matrix(step, seed=SEED)  # its round's: the next round's change comes with the next step
    return list(range(K)) if j is None else [int(k) for k in np.flatnonzero(matrix[:, j])]


def test_an_optimizer_without_the_moving_parameters_is_refused_on_every_rank(out):
    for r in range(K):
        text = (out / f"error_rank{r}.txt").read_text()
        assert "optimizer does not step them" in text and "build the optimizer over all of model.parameters()" in text


def test_the_schedule_changes_the_holders_of_every_block():
    rounds = [MASK.round_matrix(2 * r, seed=SEED) for r in range(4)]
    assert all(not np.array_equal(a, b) for a, b in zip(rounds, rounds[1:]))


def test_new_holders_get_the_old_holders_adamw_state_bit_for_bit_and_others_free_it(ranks):
    for step in range(STEPS):
        params = [r[step]["params"] for r in ranks]
        for name in params[0]:  # backward masking: every worker holds every value, the holders' own
            assert all(torch.equal(params[0][name], p[name]) for p in params[1:]), (step, name)
        for name in ranks[0][step]["params"]:
            holders = _holders(step, name)
            states = [ranks[k][step]["state"].get(name) for k in range(K)]
            assert all(states[k] is not None for k in holders), (step, name, holders)
            assert all(states[k] is None for k in range(K) if k not in holders), (step, name, holders)
            for k in holders[1:]:
                for key, value in states[holders[0]].items():
                    assert torch.equal(value, states[k][key]), (step, name, key)


def test_state_moves_when_a_step_begins_a_new_round_and_never_after_the_last_step(ranks):
    """Steps 2 and 4 begin new rounds; after the last step (5), which ends round 2, nothing moves."""
    assert_moves_only_when_a_round_begins(ranks, MASK, SEED, [False, False, True, False, True, False])


def test_a_permute_run_equals_the_single_process_reference_of_the_same_schedule(ranks):
    ref = reference()
    for step in range(STEPS):
        for name, value in ref[step]["params"].items():
            torch.testing.assert_close(ranks[0][step]["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} {name}: {m}")
        for name in ref[step]["state"]:
            k = _holders(step, name)[0]
            for key, value in ref[step]["state"][name].items():
                torch.testing.assert_close(ranks[k][step]["state"][name][key], value, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"step {step} {name} {key}: {m}")


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
