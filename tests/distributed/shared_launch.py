"""Shared torchrun launches for the distributed test modules that each used to start their own.

A launch runs the rank work of several modules one after another in the same ranks and process
group, each into ``OUTDIR/<entry>``, which saves a torchrun agent and K rank start-ups (torch,
dynamo: about 4.5 CPU-s a rank) per module. An entry of `LAUNCHES` is a module with
``rank_work(out)``, run on every rank (what it must import before the group exists in
``PRELOAD``), or one with a spec function (``launch_spec(out)``, or the one named after a colon:
``module:function``) returning the `tests.distributed.rank_script` case and spec it used to
launch on its own; the spec function runs once, in the pytest process that starts the launch,
and writes the files the spec names. `shared_out` is the modules' fixture: the first pytest
process (an xdist worker or the only one) to need a launch's results starts it, the others wait
on a file lock and reuse them, or see its failure. Each rank writes its CPU seconds per entry to
``OUTDIR/cpu_rank{r}.json`` (where a launch's time goes; BENCHMARKS.md, "Suite CPU time").

    python -m torch.distributed.run --standalone --nproc-per-node K shared_launch.py LAUNCH OUTDIR
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    ranks: int
    entries: tuple[str, ...]
    cpu: bool = False  # ranks on CPU even where CUDA devices are visible (the memory tracker's figures)


LAUNCHES: dict[str, Launch] = {
    "library3": Launch(3, ("test_bsdp_schedule", "test_bbsdp_schedule", "test_nsdp_schedule", "test_local_steps",
                           "test_overlap_averaging", "test_resnet_skipped_blocks", "test_nsdp_full_layer",
                           "test_joiner_state")),
    # test_hf_trainer last: Trainer and Accelerate keep process-wide state (accelerate's PartialState)
    "library2": Launch(2, ("test_api_training", "test_tied_parameters", "test_hf_trainer")),
    # test_compile_blocks last: what dynamo compiled stays compiled in the process
    "train2": Launch(2, ("test_checkpoint_resume", "test_fsdp_composition", "test_memory_savings",
                         "test_sequence_schedule", "test_eval_memory", "test_sdp_training:train_spec",
                         "test_compile_blocks")),
    "memory4": Launch(4, ("test_sdp_training:steps_spec", "test_plan_vs_measured", "test_holder_fsdp_order"), cpu=True),
}
SPEC = "launch_spec.json"  # what a spec entry's ranks run, in its output directory


def _launch_of(entry: str) -> str:
    return next(name for name, launch in LAUNCHES.items() if entry in launch.entries)


def _spec_function(entry: str) -> Callable[[Path], tuple[str, dict]] | None:
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(f"tests.distributed.{module}"), function or "launch_spec", None)


def shared_out(tmp_path_factory, entry: str) -> Path:
    """``OUTDIR/<entry>`` of the launch this pytest session shares (started on first use)."""
    import pytest

    from tests.distributed.conftest import torchrun

    name = _launch_of(entry)
    launch = LAUNCHES[name]
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared_launch_{name}"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the launch (by whoever came first) has ended
        failed = root / "failed.txt"
        if not (root / "done").exists() and not failed.exists():
            try:
                for other in launch.entries:
                    (root / other).mkdir(exist_ok=True)
                    if (spec_of := _spec_function(other)) is not None:
                        case, spec = spec_of(root / other)
                        (root / other / SPEC).write_text(json.dumps({"case": case, "spec": spec}))
                env = {"CUDA_VISIBLE_DEVICES": ""} if launch.cpu else {}
                torchrun(launch.ranks, [str(Path(__file__).resolve()), name, str(root)], timeout=600, env=env)
            except BaseException as exc:  # pytest.fail's Failed is a BaseException
                failed.write_text(str(exc)[-12000:])
                raise
            (root / "done").touch()
    if failed.exists():
        pytest.fail(f"the shared launch {name} ({launch.ranks} ranks) failed:\n{failed.read_text()}")
    return root / entry


def run_alone(rank_work: Callable[[Path], None], out: str | Path) -> None:
    """One module's ``rank_work`` on its own, each rank in a gloo group made around it (the
    modules' ``__main__``: ``python -m torch.distributed.run --standalone --nproc-per-node K
    tests/distributed/test_NAME.py OUTDIR``)."""
    import torch
    import torch.distributed as dist

    from sdp_train.trainer.launch import destroy_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank_work(Path(out))
    finally:
        destroy_distributed()  # what FSDP runs leave referenced released first, as `sdp train` does


def main(name: str, out: Path) -> None:
    """Every entry of launch `name`, one after another, in one process group."""
    import torch.distributed as dist

    from tests.distributed import rank_script

    specs = {entry: json.loads((out / entry / SPEC).read_text()) for entry in LAUNCHES[name].entries
             if (out / entry / SPEC).is_file()}
    preload = {m for s in specs.values() for m in rank_script.preload(s["case"], s["spec"])}
    for entry in LAUNCHES[name].entries:  # a rank_work module names its own in PRELOAD
        if entry not in specs:
            preload.update(getattr(importlib.import_module(f"tests.distributed.{entry}"), "PRELOAD", ()))
    for module in sorted(preload):
        importlib.import_module(module)  # before the group exists, as `sdp train` does (modules_before_groups)

    def every_entry(out: Path) -> None:
        cpu = {}  # this rank's CPU seconds per entry: where a launch's time goes
        for entry in LAUNCHES[name].entries:
            start = time.process_time()
            if entry in specs:
                rank_script.run_case(specs[entry]["case"], specs[entry]["spec"], out / entry)
            else:
                importlib.import_module(f"tests.distributed.{entry}").rank_work(out / entry)
            dist.barrier()
            cpu[entry] = round(time.process_time() - start, 2)
        (out / f"cpu_rank{dist.get_rank()}.json").write_text(json.dumps(cpu))

    run_alone(every_entry, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
