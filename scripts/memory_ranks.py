"""Per-rank peak memory of one training configuration, its ranks sharing one device.

    python scripts/memory_ranks.py CONFIG --out DIR [--model llama-134m] [--workers 2] [--device cuda]

CONFIG is one of ``ddp``, ``bsdp``, ``fsdp``, ``fsdp+ac``, ``bsdp+ac``, ``bsdp+fsdp``,
``bsdp+fsdp+ac`` (B-SDP at ``--active``). Each rank is a process on the same device (``cuda:0``, or
the CPU), joined over gloo: several ranks cannot share one GPU under NCCL, and memory needs no
NCCL. Every rank runs `sdp_train.trainer.train.train_prepared`, the loop `sdp train` runs, so the
figures come from the same `MemoryMeter` for every configuration; rank 0 writes DIR/summary.json
(``peak_memory_bytes`` per rank). `scripts/gpu_check.sh` compares them with `sdp plan`.

Not here: launching over several devices (`sdp train`), predicting memory (`sdp plan`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ("ddp", "bsdp", "fsdp", "fsdp+ac", "bsdp+ac", "bsdp+fsdp", "bsdp+fsdp+ac")


def train_config(name: str, args: argparse.Namespace):
    """The `TrainConfig` of CONFIG `name`: its first part is the mode, ``fsdp`` after it composes, ``ac`` checkpoints."""
    from sdp_train.trainer.config import TrainConfig

    if name not in CONFIGS:
        raise SystemExit(f"memory_ranks.py: config {name!r} is not one of {', '.join(CONFIGS)}")
    mode, *extra = name.split("+")
    overrides = json.loads(args.model_overrides) if args.model_overrides else {}
    return TrainConfig(
        model=args.model, model_overrides=overrides, mode=mode, workers=args.workers, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, active=None if mode in ("ddp", "fsdp") else args.active,
        fsdp="fsdp" in extra, activation_checkpointing="ac" in extra, memory_steps=args.steps,
        eval_batches=1, max_data_bytes=args.max_data_bytes, save_model=False, seed=0, out=str(args.out))


def rank_main(rank: int, args: argparse.Namespace, store: str) -> None:
    from sdp_train.parallel.dist import DistInfo
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.train import modules_before_groups, train_prepared

    cfg = train_config(args.config, args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    prep = prepare(cfg)
    for module in modules_before_groups([cfg], device):
        __import__(module)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.workers)
    try:
        train_prepared(prep, DistInfo(rank, args.workers, rank), device)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help=f"one of {', '.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-134m")
    parser.add_argument("--model-overrides", default="", help="JSON, e.g. a tiny model for a dry run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--active", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-data-bytes", type=int, default=2_000_000)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    train_config(args.config, args)  # refuse a bad configuration before starting any rank
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args, f"{tmp}/store"), nprocs=args.workers, start_method="spawn")
    summary = json.loads((args.out / "summary.json").read_text())
    peaks = [p.get("total", 0) / 2**20 for p in summary["peak_memory_bytes"]]
    print(f"{args.config}: peak MiB per rank {', '.join(f'{p:.1f}' for p in peaks)}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
