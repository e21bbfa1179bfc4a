"""Steady-state steps of `sdp train`'s loop make no host synchronisation, on a GPU or on the CPU.

    python scripts/sync_debug_steps.py [--device cuda] [--modes ddp,fsdp,bsdp,nsdp,bbsdp]

For each mode, one rank (a one-rank process group) runs `Run.step` six times on a tiny llama; steps
3 to 5 run under ``torch.cuda.set_sync_debug_mode("error")`` on CUDA (every synchronising CUDA call
raises), under `tests.host_sync.HostSyncDetector` on the CPU (every read of a tensor on the host
raises). The batches are on the device before a guarded step starts, and each step's values are
read after it, outside the guard, where `sdp train` reads them one step late. Prints one line per
mode; exits 1 if any mode synchronised.

Not here: the library's own steps (tests/unit/test_step_host_sync.py), timing (bench_step_host.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TINY = {"model": "llama-debug", "model_overrides": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},
        "workers": 1, "steps": 8, "batch_size": 2, "seq_len": 16, "max_data_bytes": 20_000, "warmup_steps": 1,
        "memory_steps": 0, "eval_batches": 1, "active": 1.0}


def guard(device: torch.device):
    """What fails on a host synchronisation on `device`."""
    if device.type == "cuda":
        @contextlib.contextmanager
        def sync_debug_error():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sync_debug_error()
    from tests.host_sync import HostSyncDetector

    return HostSyncDetector(uploads=False)


def check_mode(mode: str, device: torch.device, out: Path) -> None:
    from sdp_train.data import build_batches
    from sdp_train.parallel.dist import DistInfo
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.run import Run

    prep = prepare(TrainConfig(**{**TINY, "mode": mode, "active": None if mode in ("ddp", "fsdp") else 1.0,
                                  "out": str(out / mode)}))
    run = Run(prep, DistInfo(0, 1, 0), device)
    batches = build_batches(prep.data, split="train", seed=0, rank=0, world_size=1)
    try:
        for step in range(6):
            inputs, targets = (t.to(device) for t in next(batches))
            if device.type == "cuda":
                torch.cuda.synchronize()
            with guard(device) if step >= 3 else contextlib.nullcontext():
                stats = run.step(step, inputs, targets)
            run.finish(step, stats)
    finally:
        run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--modes", default="ddp,fsdp,bsdp,nsdp,bbsdp")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if "fsdp" in args.modes:
        importlib.import_module("torch.distributed.tensor")  # before the group, as `sdp train` does
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            for mode in args.modes.split(","):
                try:
                    check_mode(mode, device, Path(tmp))
                    print(f"{mode}: steps 3-5 made no host synchronisation ({device.type})", flush=True)
                except Exception as exc:  # report every mode, then fail
                    failed.append(mode)
                    print(f"{mode}: FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    traceback.print_exc()
        finally:
            dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
