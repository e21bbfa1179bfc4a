"""How long does `theory.simulate` take for K = 64 workers, d = 1000, 1000 steps? (target: < 10 s)

Times a stepwise SDP run (random static mask, C ~ 0.5, B = 8 blocks of 125) and the DDP baseline
(all-ones mask) in the same run, on the quadratic and the logistic problem, with 2 replicas (the
fewest the simulator accepts), and prints seconds per replica and the SDP / DDP ratio.

    .venv/bin/python benchmarks/bench_simulator.py
"""

from __future__ import annotations

import time

import numpy as np

from masklab.mask import Mask
from theory.problems import make_logistic, make_quadratic
from theory.simulate import simulate

WORKERS, BLOCKS, BLOCK_SIZE, STEPS, SEEDS = 64, 8, 125, 1000, 2


def _time(problem, mask: Mask) -> float:
    start = time.perf_counter()
    simulate(problem, mask, eta=0.5, steps=STEPS, seeds=SEEDS, seed=0)
    return (time.perf_counter() - start) / SEEDS


def main() -> None:
    rng = np.random.default_rng(0)
    m = (rng.random((WORKERS, BLOCKS)) < 0.5).astype(np.uint8)
    m[np.arange(BLOCKS) % WORKERS, np.arange(BLOCKS)] = 1
    m[np.arange(WORKERS), np.arange(WORKERS) % BLOCKS] = 1
    sizes = [BLOCK_SIZE] * BLOCKS
    sdp = Mask(m, block_sizes=sizes)
    ddp = Mask(np.ones((WORKERS, BLOCKS)), block_sizes=sizes)
    problems = {
        "quadratic": make_quadratic(sizes, WORKERS, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0,
                                    seed=0),
        "logistic": make_logistic(sizes, WORKERS, smoothness=1.0, sigma=1.0, suboptimality=1.0, seed=0),
    }
    print(f"K={WORKERS} d={BLOCKS * BLOCK_SIZE} steps={STEPS}, seconds per replica")
    for name, problem in problems.items():
        t_ddp, t_sdp = _time(problem, ddp), _time(problem, sdp)
        print(f"{name:10s} DDP {t_ddp:6.2f} s   SDP {t_sdp:6.2f} s   SDP/DDP {t_sdp / t_ddp:5.2f}")


if __name__ == "__main__":
    main()
