"""Draw the proved bound against the simulated average squared gradient norm, over steps.

DDP and two SDP masks (K = 8 workers, 4 blocks of 8 coordinates each held by 4 workers: once
redrawn by a random permutation every step, once static) on an isotropic heterogeneous quadratic
with L = 1, sigma = zeta = 1, f(x0) - f* = 1, eta = 0.5; 64 replicas. Solid: measured
(1/T) sum_{t<T} E||grad f(x_t)||^2; dashed: the bound of docs/theory.md at horizon T.

    .venv/bin/python scripts/plot_bound_vs_measured.py [--out docs/img/bound_vs_measured.png]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from masklab.mask import Mask, Schedule  # noqa: E402
from theory.bounds import sdp_bound  # noqa: E402
from theory.problems import make_quadratic  # noqa: E402
from theory.simulate import simulate  # noqa: E402

WORKERS, BLOCKS, SIZE, COVERAGE, ETA, STEPS, SEEDS = 8, 4, 8, 4, 0.5, 200, 64


def _masks() -> dict[str, Mask]:
    m = np.zeros((WORKERS, BLOCKS), dtype=np.uint8)
    for j in range(BLOCKS):
        m[[(2 * j + t) % WORKERS for t in range(COVERAGE)], j] = 1
    sizes = [SIZE] * BLOCKS
    return {
        "DDP": Mask(np.ones((WORKERS, BLOCKS)), block_sizes=sizes),
        "SDP C=0.5, permuted every step": Mask(m, block_sizes=sizes, schedule=Schedule("permute", 1)),
        "SDP C=0.5, static": Mask(m, block_sizes=sizes),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/bound_vs_measured.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = make_quadratic([SIZE] * BLOCKS, WORKERS, smoothness=1.0, sigma=1.0, zeta=1.0,
                             suboptimality=1.0, condition=1.0, seed=args.seed)
    horizons = np.arange(1, STEPS + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, mask), colour in zip(_masks().items(), ("black", "tab:blue", "tab:red")):
        result = simulate(problem, mask, eta=ETA, steps=STEPS, seeds=SEEDS, seed=args.seed)
        bound = [sdp_bound(mask, problem.constants, eta=ETA, steps=int(t)).total for t in horizons]
        ax.plot(horizons, result.running_average, color=colour, label=f"{name}: measured")
        ax.plot(horizons, bound, color=colour, linestyle="--", label=f"{name}: bound")
    ax.set_xlabel("steps T")
    ax.set_ylabel(r"$\frac{1}{T}\sum_{t<T} E\|\nabla f(x_t)\|^2$")
    ax.set_yscale("log")
    ax.set_title("Bound vs simulation: quadratic, K=8, L=1, sigma=zeta=1, eta=0.5", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
