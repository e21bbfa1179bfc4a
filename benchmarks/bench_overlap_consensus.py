"""Does the mask's spectral gap gamma(M) predict how fast overlap averaging's copies agree?

Two masks of equal coverage (K = 7 workers, 7 blocks, every block held by c = 3 workers) but
different gamma: the Fano plane (projective plane of order 2, gamma 0.333) and a random balanced
mask (``random_balanced(7, 7, coverage=3, seed=3)``, gamma 0.096). Both train through
`sdp_train.OverlapAveraging` on 7 gloo ranks.

1. Mixing: the copies start apart (each worker adds N(0, 1) noise to its copy of every tensor),
   then rounds of holder averages run with no training. Measured: the consensus distance of the
   blocks after r rounds over its start, averaged over trials. Theory (`theory.consensus`,
   Theorem 4): E Xi_j(r) <= (1 - g_j)^floor(r / P) Xi_j(0), g_j the per-block gap of the schedule's
   expected mixing operator (for ``permute``, (c_j - 1)/(K - 1) exactly, and the expectation then
   equals the bound), P the period.
2. Training: 60 AdamW steps with H = 2 local steps, on data that differ by worker (each worker's
   targets come from its own teacher), permute every 2 steps, for both masks and a static Fano
   mask. Measured: the consensus distance at the end and the exported model's loss on every
   worker's data.

    python -m torch.distributed.run --standalone --nproc-per-node 7 benchmarks/bench_overlap_consensus.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from masklab import Schedule  # noqa: E402
from masklab.analysis import spectral_gap  # noqa: E402
from masklab.constructions import projective_plane, random_balanced  # noqa: E402
from sdp_train import OverlapAveraging  # noqa: E402
from theory.consensus import consensus_deviation_bound, consensus_period, consensus_rates  # noqa: E402

K, WIDTH, ROUNDS, TRIALS, STEPS, H = 7, 16, 6, 6, 60, 2


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(Residual() for _ in range(7))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).squeeze(-1)


def masks():
    fano, rand = projective_plane(2), random_balanced(7, 7, coverage=3, seed=3)
    return {"fano": fano, "random": rand}


def blocks_only(distance: dict[str, float]) -> float:
    return sum(v for k, v in distance.items() if k.startswith("layers."))


def mixing(name, mask, kind, rank) -> dict:
    torch.manual_seed(0)
    model = OverlapAveraging(Net(), mask=mask.replace(schedule=Schedule(kind, every=1)), blocks="layers.*", seed=1)
    ratios = np.zeros((TRIALS, ROUNDS + 1))
    for trial in range(TRIALS):
        g = torch.Generator().manual_seed(1000 * trial + rank)
        with torch.no_grad():
            for p in model.module.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        start = blocks_only(model.consensus_distance())
        ratios[trial, 0] = 1.0
        for r in range(1, ROUNDS + 1):
            model.average(model.round_matrix(trial * ROUNDS + r - 1))
            ratios[trial, r] = blocks_only(model.consensus_distance()) / start
    scheduled = model.mask
    theory = consensus_deviation_bound(scheduled, np.ones(7), rounds=ROUNDS) / 7
    return {"mask": name, "schedule": kind, "gamma": spectral_gap(mask),
            "gaps": consensus_rates(scheduled).round(4).tolist(), "period": consensus_period(scheduled),
            "measured": ratios.mean(0).tolist(), "spread": ratios.std(0).tolist(), "theory": theory.tolist()}


def data(worker: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    teacher = torch.Generator().manual_seed(10_000 + worker)
    w = torch.randn(8, generator=teacher)
    return x, torch.tanh(x @ w)


def training(name, mask, kind, rank) -> dict:
    torch.manual_seed(0)
    schedule = Schedule(kind, every=H) if kind != "static" else Schedule()
    model = OverlapAveraging(Net(), mask=mask.replace(schedule=schedule), blocks="layers.*", local_steps=H, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.register_optimizer(opt)
    history = []
    for step in range(STEPS):
        x, y = data(rank, 32, seed=100_000 * rank + step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % (4 * H) == 0:
            history.append(blocks_only(model.consensus_distance()))
    full = Net()
    full.load_state_dict(model.full_state_dict())
    with torch.no_grad():
        losses = [F.mse_loss(full(x), y).item() for x, y in (data(k, 256, seed=7 + k) for k in range(K))]
    return {"mask": name, "schedule": kind, "gamma": spectral_gap(mask), "consensus_history": history,
            "final_consensus": history[-1], "val_loss_all_workers": float(np.mean(losses)),
            "bytes_per_step": model.comm_bytes / STEPS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != K:
        raise SystemExit(f"run with --nproc-per-node {K}")
    torch.set_num_threads(1)
    try:
        results = {"mixing": [mixing(n, m, kind, rank) for n, m in masks().items() for kind in ("permute", "cyclic")],
                   "training": [training(n, m, kind, rank) for n, m in masks().items() for kind in ("permute",)]
                   + [training("fano", masks()["fano"], "static", rank)]}
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(f"Mixing (no training): blocks' consensus distance after r rounds / at start, mean of {TRIALS} trials")
    print("| mask | gamma | schedule | per-block gap g_j | period | r=1 measured / theory | "
          f"r={ROUNDS} measured / theory |")
    print("|---|---:|---|---|---:|---:|---:|")
    for row in results["mixing"]:
        print(f"| {row['mask']} | {row['gamma']:.3f} | {row['schedule']} | {min(row['gaps']):.3f}-{max(row['gaps']):.3f} "
              f"| {row['period']} | {row['measured'][1]:.3f} / {row['theory'][1]:.3f} "
              f"| {row['measured'][-1]:.4f} / {row['theory'][-1]:.4f} |")
    print(f"\nTraining: {STEPS} AdamW steps, H = {H}, per-worker teachers")
    print("| mask | gamma | schedule | consensus distance (blocks) at the end | loss of the export on all workers' data | bytes/step |")
    print("|---|---:|---|---:|---:|---:|")
    for row in results["training"]:
        print(f"| {row['mask']} | {row['gamma']:.3f} | {row['schedule']} | {row['final_consensus']:.4g} "
              f"| {row['val_loss_all_workers']:.4f} | {row['bytes_per_step']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
