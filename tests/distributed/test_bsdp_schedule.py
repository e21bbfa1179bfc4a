"""B-SDP (forward masking) under a mask schedule, on 3 real gloo ranks through the public API.

At every mask change a block's parameters, buffers and AdamW state reach its new holders bit for
bit, a worker that stops holding a block frees it (its parameters leave the module and the
optimizer), the parameters stay in the optimizer group their name belongs to, and the run equals a
single-process reference in which each worker trains its round's subnetwork and every block takes
the mean of its holders' gradients. A change is made when the step that trains the new round begins,
so nothing moves after the last step (the run ends with a round). A second run stops at the end of
a round, before its change, saves each worker's model, optimizer and schedule state, and a fresh
wrapper resumes from them to the same values bit for bit. Run as a script, this file is the ranks'
program."""

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
K, STEPS, LR, STOP = 3, 6, 1e-2, 3  # STOP: the resumed run saves after step 3, at the end of round 1
MASK = Mask(np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), schedule=Schedule("permute", every=2))
SEED = 4  # of the permute draws: rounds 0..3 draw 3 different permutations


class Block(nn.Module):
    """A residual block (dropping it is the identity), with a buffer that must move with it."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, h):
        return h + self.scale * self.f(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x, held=None):
        h = self.embed(x)
        for j, layer in enumerate(self.layers):
            if held is None or held[j]:
                h = layer(h)
        return self.head(h)


def make_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    for j, layer in enumerate(net.layers):
        layer.scale.fill_(0.5 + 0.1 * j)  # distinct per block: a buffer sent from the wrong block shows
    return net


def make_optimizer(params: list[tuple[str, nn.Parameter]]) -> torch.optim.AdamW:
    """Weight decay on weights only: two groups, which a gained block's parameters must keep."""
    decay = [p for n, p in params if n.endswith("weight")]
    rest = [p for n, p in params if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def _snapshot(model, opt) -> dict:
    names = {id(p): n for n, p in model.module.named_parameters()}
    return {"params": {n: t.clone() for n, t in model.module.state_dict().items()},
            "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items() if s},
            "groups": [[names.get(id(p), "?") for p in g["params"]] for g in opt.param_groups],
            "module_params": [n for n, _ in model.module.named_parameters()],
            "held": model.held_blocks, "moved": model.mask_change_bytes.buffer, "change_s": model.mask_change_seconds}


def _train(model, opt, rank: int, steps: range, meter=None) -> list[dict]:
    from contextlib import nullcontext

    trace = []
    for step in steps:
        with meter.measure() if meter is not None else nullcontext():
            x, y = batch(step, rank)
            (model(x) - y).square().mean().backward()
            opt.step()  # the hook counts the step; a change is made by the next step's forward
            opt.zero_grad()
        trace.append(_snapshot(model, opt))
        if meter is not None:  # live parameter bytes at the step's end, by the memory tracker
            trace[-1]["live_param_bytes"] = meter.peak["persistent"]["parameters"]
    return trace


def _wrapped():
    from sdp_train import SubnetworkDataParallel

    model = SubnetworkDataParallel(make_net(), mask=MASK, seed=SEED)
    opt = make_optimizer(list(model.module.named_parameters()))
    model.register_optimizer(opt)
    return model, opt


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    from sdp_train.trainer.memory import MemoryMeter

    model, opt = _wrapped()
    meter = MemoryMeter(model.module, opt, torch.device("cpu"))
    torch.save(_train(model, opt, rank, range(STEPS), meter), out / f"rank{rank}.pt")
    model.close()
    # stop after step STOP, save, resume in a fresh wrapper (built in round 0) and go on
    model, opt = _wrapped()
    _train(model, opt, rank, range(STOP + 1))
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "schedule": model.schedule_state()}
    torch.save(saved, out / f"ckpt{rank}.pt")
    model.close()
    saved = torch.load(out / f"ckpt{rank}.pt", weights_only=True)
    model, opt = _wrapped()
    model.load_schedule_state(saved["schedule"])  # first: it rebuilds the saved round's subnetwork
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    torch.save(_train(model, opt, rank, range(STOP + 1, STEPS)), out / f"resumed{rank}.pt")
    model.close()

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_bsdp_schedule")


@pytest.fixture(scope="module")
def ranks(out) -> list[list[dict]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(K)]


def reference() -> list[dict]:
    """One full model and one AdamW (the same groups); each step worker k's gradient is that of its
    round's subnetwork (the blocks it does not hold skipped) on its batch, every block takes the mean
    over its holders, the shared parameters the mean over all K workers."""
    model = make_net()
    opt = make_optimizer(list(model.named_parameters()))
    trace = []
    for step in range(STEPS):
        matrix = MASK.round_matrix(step, seed=SEED).astype(bool)
        grads = []
        for k in range(K):
            model.zero_grad()
            x, y = batch(step, k)
            (model(x, held=matrix[k]) - y).square().mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for name, p in model.named_parameters():
            j = int(name.split(".")[1]) if name.startswith("layers.") else None
            holders = range(K) if j is None else np.flatnonzero(matrix[:, j])
            p.grad = sum(grads[k][name] for k in holders) / len(holders)
        opt.step()
        names = {p: n for n, p in model.named_parameters()}
        trace.append({"params": {n: t.clone() for n, t in model.state_dict().items()},
                      "state": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}})
    return trace


def _holders(step: int, name: str) -> list[int]:
    """Who holds `name` after step `step`: the holders of its round (the next round's change is made
    when the next step begins)."""
    j = int(name.split(".")[1]) if name.startswith("layers.") else None
    matrix = MASK.round_matrix(step, seed=SEED)
    return list(range(K)) if j is None else [int(k) for k in np.flatnonzero(matrix[:, j])]


def test_the_schedule_changes_the_holders_of_every_block():
    rounds = [MASK.round_matrix(2 * r, seed=SEED) for r in range(4)]
    assert all(not np.array_equal(a, b) for a, b in zip(rounds, rounds[1:]))


def test_new_holders_get_the_block_and_its_adamw_state_bit_for_bit_and_others_free_it(ranks):
    full = make_net().state_dict()
    for step in range(STEPS):
        for name in full:
            holders = _holders(step, name)
            values = [ranks[k][step]["params"].get(name) for k in range(K)]
            states = [ranks[k][step]["state"].get(name) for k in range(K)]
            assert all(values[k] is not None for k in holders), (step, name, holders)
            assert all(values[k] is None for k in range(K) if k not in holders), (step, name, holders)
            for k in holders[1:]:
                assert torch.equal(values[holders[0]], values[k]), (step, name)
            if not name.endswith("scale"):  # a parameter: its AdamW state too
                assert all(states[k] is None for k in range(K) if k not in holders), (step, name)
                for k in holders[1:]:
                    for key, value in states[holders[0]].items():
                        assert torch.equal(value, states[k][key]), (step, name, key)


def test_blocks_move_when_a_step_begins_a_new_round_and_never_after_the_last_step(ranks):
    """Bytes move in steps 2 and 4, whose rounds differ from the step before, and not after the last
    step (5), which ends round 2: round 3 never trains (its move was 1/3 of all bytes moved)."""
    changed = [False, False, True, False, True, False]
    assert_moves_only_when_a_round_begins(ranks, MASK, SEED, changed)
    for trace in ranks:  # the time of the changes grows with them only (a delayed restore's record reads it)
        seconds = [snap["change_s"] for snap in trace]
        assert [b > a for a, b in zip(seconds, seconds[1:])] == changed[1:], seconds


def test_a_dropped_block_is_freed(ranks):
    """The memory tracker sees exactly the held blocks' parameters alive after every step (a dropped
    block whose tensors something still referenced stayed allocated before)."""
    sizes = {n: p.numel() * p.element_size() for n, p in make_net().named_parameters()}
    for trace in ranks:
        for snap in trace:
            assert snap["live_param_bytes"] == sum(sizes[n] for n in snap["module_params"])


def test_the_optimizer_steps_exactly_the_held_parameters_in_their_own_groups(ranks):
    for trace in ranks:
        for snap in trace:
            decay, rest = snap["groups"]
            for group in (decay, rest):  # in the module's order, whatever the history of changes
                assert group == sorted(group, key=snap["module_params"].index)
            assert set(decay + rest) == set(snap["module_params"])
            assert all(n.endswith("weight") for n in decay) and not any(n.endswith("weight") for n in rest)
            held = {int(n.split(".")[1]) for n in snap["module_params"] if n.startswith("layers.")}
            assert tuple(f"layers.{j}" for j in sorted(held)) == snap["held"]


def test_a_permute_run_equals_the_single_process_reference_of_the_same_schedule(ranks):
    ref = reference()
    for step in range(STEPS):
        for name, value in ref[step]["params"].items():
            k = _holders(step, name)[0]
            torch.testing.assert_close(ranks[k][step]["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} {name}: {m}")
        for name in ref[step]["state"]:
            k = _holders(step, name)[0]
            for key, value in ref[step]["state"][name].items():
                torch.testing.assert_close(ranks[k][step]["state"][name][key], value, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"step {step} {name} {key}: {m}")


def test_a_run_resumed_in_the_middle_of_the_schedule_goes_on_bit_for_bit(out, ranks):
    for r in range(K):
        resumed = torch.load(out / f"resumed{r}.pt", weights_only=False)
        for snap, whole in zip(resumed, ranks[r][STOP + 1:], strict=True):
            assert snap["params"].keys() == whole["params"].keys() and snap["groups"] == whole["groups"]
            for name, value in whole["params"].items():
                assert torch.equal(snap["params"][name], value), (r, name)
            for name, state in whole["state"].items():
                for key, value in state.items():
                    assert torch.equal(snap["state"][name][key], value), (r, name, key)


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
