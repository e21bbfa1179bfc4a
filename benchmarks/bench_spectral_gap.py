"""How fast is masklab's spectral gap, against networkx.algebraic_connectivity on the same graph?

Also times the full certificate (`masklab.analyze`) of the issue's scale target: a K = 1024,
B = 4096, C = 0.25 random balanced mask. Prints seconds and the ratio networkx / masklab,
measured in the same run, and checks that both give the same gap.

    python benchmarks/bench_spectral_gap.py [--repeats 3] [--skip-networkx-above K]
"""

from __future__ import annotations

import argparse
import platform
import time

import networkx as nx

from masklab import analysis, analyze
from masklab.constructions import random_balanced

CASES = [  # (K, B, coverage)
    (64, 256, 16),
    (256, 1024, 64),
    (1024, 4096, 256),
]


def _best_of(fn, repeats: int) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-networkx-above", type=int, default=1024, metavar="K")
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}")
    print(f"{'K':>6} {'B':>6} {'C':>6} {'masklab s':>10} {'networkx s':>11} {'nx/masklab':>10} {'|gap diff|':>11} {'analyze s':>10}")
    for k, b, c in CASES:
        mask = random_balanced(k, b, coverage=c, seed=0)
        t_ours, gap = _best_of(lambda: analysis.spectral_gap(mask), args.repeats)
        t_full, _ = _best_of(lambda: analyze(mask), 1)
        if k <= args.skip_networkx_above:
            graph = analysis.to_networkx(mask)  # graph construction is not part of either timing
            t_nx, gap_nx = _best_of(
                lambda: nx.algebraic_connectivity(graph, weight="weight", tol=1e-10, method="tracemin_lu"),
                1,
            )
            ratio, diff = f"{t_nx / t_ours:10.1f}", f"{abs(gap_nx - gap):11.2e}"
            t_nx_s = f"{t_nx:11.3f}"
        else:
            ratio, diff, t_nx_s = f"{'-':>10}", f"{'-':>11}", f"{'skipped':>11}"
        print(f"{k:>6} {b:>6} {mask.active_fraction:>6.3f} {t_ours:>10.3f} {t_nx_s} {ratio} {diff} {t_full:>10.3f}")


if __name__ == "__main__":
    main()
