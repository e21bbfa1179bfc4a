"""OverlapAveraging on real gloo ranks against a single-process simulation of the same algorithm.

One torchrun launch (3 ranks) trains a small residual model, through the public API only, with a
static mask, a ``cyclic`` and a ``permute`` schedule, and a complete mask next to torch DDP. The
reference keeps K copies of the model in one process, each with its own AdamW and its own batches;
in each step a copy trains only the blocks its worker holds in that step's mask
(``Mask.round_matrix``), and after every H-th step each tensor becomes the average of its holders'
copies while non-holders keep theirs. The tests check every copy after every step, the consensus
distance, the exported model, the bytes (1/H), and that without a schedule a non-holder's copy of
a block never moves (weight decay included: the optimizer must skip it).

Run by hand: ``python -m torch.distributed.run --standalone --nproc-per-node 3 THIS_FILE OUTDIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from masklab import Mask, Schedule

K, STEPS = 3, 6
MATRIX = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 0]])  # holder sets {0,2}, {0,1}, {1,2}, {0,1}
RUNS = {  # name: (mask, local steps H)
    "static": (Mask(MATRIX), 2),
    "static_h1": (Mask(MATRIX), 1),
    "cyclic": (Mask(MATRIX).replace(schedule=Schedule("cyclic", every=2)), 2),
    "permute": (Mask(MATRIX).replace(schedule=Schedule("permute", every=4)), 2),
    "complete": (Mask(np.ones((K, 4), dtype=int)), 1),
}


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyNet(nn.Module):
    def __init__(self, width: int = 12, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def batch(run: str, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step + 97 * list(RUNS).index(run))
    return torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)


def optimizer_for(params, sgd: bool = False) -> torch.optim.Optimizer:
    if sgd:
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# -- the ranks ----------------------------------------------------------------------------------
def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdp_train import OverlapAveraging

    rank = dist.get_rank()
    for run, (mask, h) in RUNS.items():
        model = OverlapAveraging(make_model(), mask=mask, local_steps=h, blocks="layers.*")
        opt = optimizer_for(model.parameters(), sgd=run == "complete")
        model.register_optimizer(opt)
        copies, distances, held = [], [], []
        for step in range(STEPS):
            held.append(model.held_blocks)
            x, y = batch(run, rank, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            copies.append({n: t.detach().clone() for n, t in model.module.state_dict().items()})
            distances.append(model.consensus_distance())
        full = model.full_state_dict(rank0_only=True)
        torch.save({"copies": copies, "distances": distances, "held": held, "bytes": model.comm_bytes,
                    "full": full}, out / f"{run}_rank{rank}.pt")
    ddp = DistributedDataParallel(make_model())
    opt = optimizer_for(ddp.parameters(), sgd=True)
    for step in range(STEPS):
        x, y = batch("complete", rank, step)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.save(ddp.module.state_dict(), out / f"ddp_rank{rank}.pt")


# -- the reference ------------------------------------------------------------------------------
def holders(matrix: np.ndarray, name: str) -> list[int]:
    for j in range(matrix.shape[1]):
        if name.startswith(f"layers.{j}."):
            return [int(k) for k in np.flatnonzero(matrix[:, j])]
    return list(range(K))


def reference(run: str) -> dict:
    mask, h = RUNS[run]
    models = [make_model() for _ in range(K)]
    opts = [optimizer_for(m.parameters(), sgd=run == "complete") for m in models]
    copies, distances = [], []
    for step in range(STEPS):
        matrix = mask.round_matrix(step)
        for k, (m, opt) in enumerate(zip(models, opts)):
            for name, p in m.named_parameters():
                p.requires_grad_(k in holders(matrix, name))
            x, y = batch(run, k, step)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % h == 0:
            with torch.no_grad():
                states = [m.state_dict() for m in models]
                for name in states[0]:
                    hs = holders(matrix, name)
                    mean = sum(states[k][name] * (1.0 / len(hs)) for k in hs)
                    for k in hs:
                        states[k][name].copy_(mean)
        states = [{n: t.detach().clone() for n, t in m.state_dict().items()} for m in models]
        copies.append(states)
        distances.append(consensus(states))
    last = mask.round_matrix(STEPS - 1)
    full = {n: sum(copies[-1][k][n].double() for k in holders(last, n)) / len(holders(last, n))
            for n in copies[-1][0]}
    return {"copies": copies, "distances": distances, "full": full}


def consensus(states: list[dict]) -> dict[str, float]:
    parts: dict[str, float] = {}
    for name in states[0]:
        part = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "other"
        stack = torch.stack([s[name].double() for s in states])
        parts[part] = parts.get(part, 0.0) + float((stack - stack.mean(0)).pow(2).sum()) / K
    parts["total"] = sum(parts.values())
    return parts


# -- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_overlap_averaging")


def _load(out: Path, run: str) -> list[dict]:
    return [torch.load(out / f"{run}_rank{k}.pt") for k in range(K)]


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("run", list(RUNS))
def test_every_copy_after_every_step_matches_the_simulation(ranks_out, run):
    ranks, ref = _load(ranks_out, run), reference(run)
    for step in range(STEPS):
        for k in range(K):
            for name, value in ranks[k]["copies"][step].items():
                torch.testing.assert_close(value, ref["copies"][step][k][name], rtol=0, atol=2e-6,
                                           msg=lambda m: f"{run} step {step} worker {k} {name}: {m}")


@pytest.mark.parametrize("run", list(RUNS))
def test_holders_agree_after_each_round_and_the_consensus_distance_is_measured(ranks_out, run):
    mask, h = RUNS[run]
    ranks, ref = _load(ranks_out, run), reference(run)
    for step in range(STEPS):
        got = ranks[0]["distances"][step]
        assert all(r["distances"][step] == got for r in ranks)  # every rank gets the same numbers
        assert got.keys() == ref["distances"][step].keys()
        for part, value in got.items():
            assert value == pytest.approx(ref["distances"][step][part], rel=1e-6, abs=1e-12), (run, step, part)
        if (step + 1) % h == 0:
            matrix = mask.round_matrix(step)
            for name in ranks[0]["copies"][step]:
                hs = holders(matrix, name)
                for k in hs[1:]:
                    assert torch.equal(ranks[k]["copies"][step][name], ranks[hs[0]]["copies"][step][name]), (
                        run, step, name)
    if mask.schedule.is_static and not (mask.matrix == 1).all():
        assert ranks[0]["distances"][-1]["total"] > 0  # non-holders keep their own copies
    if run == "complete":
        assert max(d["total"] for d in ranks[0]["distances"]) < 1e-12


def test_a_static_non_holder_never_moves_its_copy_weight_decay_included(ranks_out):
    ranks, start = _load(ranks_out, "static"), make_model().state_dict()
    for k in range(K):
        assert ranks[k]["held"][0] == tuple(f"layers.{j}" for j in np.flatnonzero(MATRIX[k]))
        for j in np.flatnonzero(MATRIX[k] == 0):
            for name, value in ranks[k]["copies"][-1].items():
                if name.startswith(f"layers.{j}."):
                    assert torch.equal(value, start[name]), (k, name)


def test_schedules_change_what_a_worker_trains_each_round(ranks_out):
    for run in ("cyclic", "permute"):
        mask, _ = RUNS[run]
        for k, r in enumerate(_load(ranks_out, run)):
            want = [tuple(f"layers.{j}" for j in np.flatnonzero(mask.round_matrix(s)[k])) for s in range(STEPS)]
            assert r["held"] == want, run
    assert len({r for r in _load(ranks_out, "cyclic")[0]["held"]}) > 1


def test_bytes_per_step_fall_like_one_over_h(ranks_out):
    h1 = [r["bytes"] for r in _load(ranks_out, "static_h1")]
    h2 = [r["bytes"] for r in _load(ranks_out, "static")]
    assert all(b > 0 for b in h1) and h1 == [2 * b for b in h2]


def test_exported_model_is_the_holder_average_and_a_complete_mask_equals_ddp(ranks_out):
    for run in RUNS:
        full, ref = _load(ranks_out, run)[0]["full"], reference(run)["full"]
        assert full.keys() == ref.keys()
        for name, value in full.items():
            torch.testing.assert_close(value.double(), ref[name], rtol=0, atol=2e-6)
        assert all(_load(ranks_out, run)[k]["full"] == {} for k in range(1, K))
    ddp = torch.load(ranks_out / "ddp_rank0.pt")
    for k, r in enumerate(_load(ranks_out, "complete")):
        for name, value in r["copies"][-1].items():
            torch.testing.assert_close(value, ddp[name], rtol=0, atol=1e-6, msg=lambda m: f"worker {k} {name}: {m}")


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
