"""Run under torchrun by test_teardown.py: `sdp_train.trainer.train.train` for each config, then list native threads.

    python -m torch.distributed.run --standalone --nproc-per-node K teardown_script.py SPEC.json OUTDIR

A finished run must leave no process group behind: every gloo group's worker threads
(``pt_gloo_runloop``) and transport loop (``gloo_tcp_loop``) are joined when `train` returns. A
group that outlives `train` is destroyed during interpreter finalization, where a gloo thread that
touches a Python object aborts the process (``terminate called without an active exception``,
SIGABRT) after the run has already written its summary.

`train` creates the default group itself; this script creates it first (``train`` then uses it),
under a fresh store prefix per config, so that one process can run several configs in a row.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.train import train


def native_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def main(spec_path: str, out: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=120))
    report = []
    for i, values in enumerate(spec["configs"]):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"teardown{i}", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        train(TrainConfig.from_dict({**values, "workers": world_size, "out": f"{out}/run{i}"}, source=spec_path))
        report.append({"config": values, "initialized": dist.is_initialized(), "threads": native_threads()})
    Path(out, f"threads_rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
