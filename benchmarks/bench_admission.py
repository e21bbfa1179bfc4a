"""Host cost of a rejoin admission check (`sdp_train.trainer.membership.joiners_at`): one
`TCPStore.check` per missing worker and one `compare_set`, what every member pays per step while a
worker is missing (docs/design.md §7, "Rejoin"). On one host, over loopback:

    .venv/bin/python benchmarks/bench_admission.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

from sdp_train.trainer.agreement import joiners_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        joiners_at(store, step, [0])
        times.append(time.perf_counter() - start)
    print(f"joiners_at, one missing worker, {args.steps} steps: median {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
