"""One torchrun launch of 3 gloo ranks for the 3-rank library modules that each used to start their own.

Each module (`MODULES`) keeps its ``rank_work(out)``; this script runs them one after another in
the same ranks and process group, each into ``OUTDIR/<module>``, which saves a torchrun agent and
3 rank start-ups (torch, dynamo) per module. `shared_out` is the modules' fixture: the first pytest
process (an xdist worker or the only one) to need the results launches it, the others wait on a file
lock and reuse them, or see its failure.

    python -m torch.distributed.run --standalone --nproc-per-node 3 schedule_launch.py OUTDIR
"""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
from pathlib import Path

K = 3
MODULES = ("test_bsdp_schedule", "test_bbsdp_schedule", "test_nsdp_schedule", "test_local_steps",
           "test_overlap_averaging", "test_resnet_skipped_blocks")


def shared_out(tmp_path_factory, module: str) -> Path:
    """``OUTDIR/<module>`` of the launch this pytest session shares (launched on first use)."""
    import pytest

    from tests.distributed.conftest import torchrun

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "schedule_launch"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the launch (by whoever came first) has ended
        failed = root / "failed.txt"
        if not (root / "done").exists() and not failed.exists():
            try:
                torchrun(K, [str(Path(__file__).resolve()), str(root)], timeout=600)
            except BaseException as exc:  # pytest.fail's Failed is a BaseException
                failed.write_text(str(exc)[-12000:])
                raise
            (root / "done").touch()
    if failed.exists():
        pytest.fail(f"the shared schedule launch failed:\n{failed.read_text()}")
    return root / module


def main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for name in MODULES:
            (out / name).mkdir(exist_ok=True)
            importlib.import_module(f"tests.distributed.{name}").rank_work(out / name)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
