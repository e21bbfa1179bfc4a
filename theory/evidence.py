"""Bound-versus-measured tables for docs/theory.md, computed by simulation.

``python -m theory.evidence tightening`` prints Theorem 2' against the trace bound it replaces
(permute every step); ``python -m theory.evidence consensus`` prints Theorem 4's guaranteed
per-round contraction against the rate measured by simulated overlap averaging. Each table is deterministic for a seed. This module proves
nothing and is not used by the bounds; it only reproduces the tables the docs quote.
"""

from __future__ import annotations

import argparse

import numpy as np

from masklab.mask import Mask, Schedule
from theory.bounds import sdp_bound, update_statistics
from theory.consensus import consensus_period, per_round_factor
from theory.problems import make_quadratic
from theory.simulate import simulate, simulate_consensus

STEPS, SEEDS, SIZE = 200, 32, 4


def tightening_grid(*, seed: int = 0) -> list[dict[str, float]]:
    """Theorem 2' vs the trace bound on isotropic quadratics, sigma = 0, zeta = 2, D = 0.1, L = 1.

    K in {4, 8}, coverage c in {1, 2, K/2}, B = max(2, K/c) blocks of 4 coordinates (block j held
    by workers jc .. jc+c-1 mod K, then permuted every step), eta in {0.5, 1}, T = 200, 32 replicas.
    """
    rows = []
    for k in (4, 8):
        for c in sorted({1, 2, k // 2}):
            b = max(2, k // c)
            m = np.zeros((k, b), dtype=np.uint8)
            for j in range(b):
                m[[(j * c + t) % k for t in range(c)], j] = 1
            mask = Mask(m, block_sizes=[SIZE] * b, schedule=Schedule("permute", 1))
            problem = make_quadratic([SIZE] * b, k, smoothness=1.0, sigma=0.0, zeta=2.0, suboptimality=0.1,
                                     condition=1.0, seed=seed)
            _, _, kappa = update_statistics(mask)
            trace_extra = np.sum((k / mask.coverage - 1.0 - kappa) * problem.constants.zeta_sq)
            for eta in (0.5, 1.0):
                result = simulate(problem, mask, eta=eta, steps=STEPS, seeds=SEEDS, seed=seed)
                tight = sdp_bound(mask, problem.constants, eta=eta, steps=STEPS).total
                rows.append({"K": k, "c": c, "B": b, "eta": eta, "measured": result.measured,
                             "stderr": result.stderr, "bound": tight, "trace_bound": tight + eta * trace_extra})
    return rows


def _print_tightening(rows: list[dict[str, float]]) -> None:
    print("| K | c | eta | measured +- s.e. | Theorem 2' | ratio | trace bound | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K']} | {r['c']} | {r['eta']} | {r['measured']:.4g} +- {r['stderr']:.2g} | {r['bound']:.4g} | "
              f"{r['bound'] / r['measured']:.2f} | {r['trace_bound']:.4g} | {r['trace_bound'] / r['measured']:.2f} |")


def consensus_grid(*, seed: int = 0) -> list[dict[str, object]]:
    """Theorem 4 vs simulation: K = 6, six blocks of 2 coordinates, block j held by workers j..j+c-1.

    Pure averaging (eta = 0) from independent N(0, 1) copies, 512 replicas; the measured rate is
    (Xi(2P') / Xi(P'))^(1/P') per round with P' = 4 periods (at least 12 rounds).
    """
    rows = []
    for c in (2, 3):
        matrix = [[1 if (k - j) % 6 < c else 0 for j in range(6)] for k in range(6)]
        for kind, every in (("static", 1), ("permute", 1), ("permute", 3), ("cyclic", 1), ("cyclic", 2)):
            mask = Mask(matrix, block_sizes=[2] * 6, schedule=Schedule(kind, every))
            problem = make_quadratic([2] * 6, 6, smoothness=1.0, sigma=0.0, zeta=0.0, suboptimality=1.0, seed=seed)
            span = max(4 * consensus_period(mask), 12)
            res = simulate_consensus(problem, mask, rounds=2 * span, seeds=512, seed=seed)
            xi = res.deviation.mean(axis=0)
            measured = (xi[2 * span] / xi[span]) ** (1.0 / span) if xi[span] > 0 else 0.0
            rows.append({"c": c, "schedule": f"{kind} every {every}", "period": consensus_period(mask),
                         "guaranteed": float(per_round_factor(mask).max()), "measured": float(measured)})
    return rows


def _print_consensus(rows: list[dict[str, object]]) -> None:
    print("| c | schedule | period P | guaranteed factor per round | measured per round |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['c']} | {r['schedule']} | {r['period']} | {r['guaranteed']:.3f} | {r['measured']:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("tightening", "consensus"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.table == "tightening":
        _print_tightening(tightening_grid(seed=args.seed))
    else:
        _print_consensus(consensus_grid(seed=args.seed))


if __name__ == "__main__":
    main()
