"""Shared torchrun launches for the library test modules that each used to start their own.

Each module of `LAUNCHES` keeps its ``rank_work(out)``; one launch per rank count runs them one
after another in the same ranks and process group, each into ``OUTDIR/<module>``, which saves a
torchrun agent and K rank start-ups (torch, dynamo, transformers) per module. `shared_out` is the
modules' fixture: the first pytest process (an xdist worker or the only one) to need a launch's
results starts it, the others wait on a file lock and reuse them, or see its failure.

    python -m torch.distributed.run --standalone --nproc-per-node K shared_launch.py OUTDIR
"""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

LAUNCHES: dict[int, tuple[str, ...]] = {  # ranks -> the modules whose rank work runs in that launch
    3: ("test_bsdp_schedule", "test_bbsdp_schedule", "test_nsdp_schedule", "test_local_steps",
        "test_overlap_averaging", "test_resnet_skipped_blocks"),
    # test_hf_trainer last: Trainer and Accelerate keep process-wide state (accelerate's PartialState)
    2: ("test_api_training", "test_tied_parameters", "test_hf_trainer"),
}


def shared_out(tmp_path_factory, module: str) -> Path:
    """``OUTDIR/<module>`` of the launch this pytest session shares (started on first use)."""
    import pytest

    from tests.distributed.conftest import torchrun

    ranks = next(k for k, modules in LAUNCHES.items() if module in modules)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared_launch_{ranks}"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the launch (by whoever came first) has ended
        failed = root / "failed.txt"
        if not (root / "done").exists() and not failed.exists():
            try:
                torchrun(ranks, [str(Path(__file__).resolve()), str(root)], timeout=600)
            except BaseException as exc:  # pytest.fail's Failed is a BaseException
                failed.write_text(str(exc)[-12000:])
                raise
            (root / "done").touch()
    if failed.exists():
        pytest.fail(f"the shared {ranks}-rank launch failed:\n{failed.read_text()}")
    return root / module


def run_alone(rank_work: Callable[[Path], None], out: str | Path) -> None:
    """One module's ``rank_work`` on its own, each rank in a gloo group made around it (the
    modules' ``__main__``: ``python -m torch.distributed.run --standalone --nproc-per-node K
    tests/distributed/test_NAME.py OUTDIR``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank_work(Path(out))
    finally:
        dist.destroy_process_group()


def main(out: Path) -> None:
    """Every module of the launch with this world size, one after another, in one process group."""
    import torch.distributed as dist

    def every_module(out: Path) -> None:
        for name in LAUNCHES[dist.get_world_size()]:
            (out / name).mkdir(exist_ok=True)
            importlib.import_module(f"tests.distributed.{name}").rank_work(out / name)
            dist.barrier()

    run_alone(every_module, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
