"""Measured peak memory per rank of DDP, FSDP, SDP and their compositions, as ratios to DDP.

Each configuration is a real `sdp train` run (torchrun-launched ranks, gloo on CPU / nccl on GPU)
on the same model, data, seeds and batch; DDP is measured in the same invocation. Figures are the
largest rank's ``peak_memory_bytes`` from summary.json: on CPU the tracker's deterministic
breakdown, "state" being the parameters + gradients + optimizer state held between steps.

    python benchmarks/bench_memory.py [--workers 4] [--model llama-debug] [--active 0.5]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {  # name -> extra `sdp train` flags
    "DDP": ["--mode", "ddp"],
    "FSDP": ["--mode", "fsdp"],
    "FSDP+AC": ["--mode", "fsdp", "--ac"],
    "B-SDP": ["--mode", "bsdp"],
    "N-SDP": ["--mode", "nsdp"],
    "Bb-SDP": ["--mode", "bbsdp"],
    "B-SDP+AC": ["--mode", "bsdp", "--ac"],
    "B-SDP+FSDP": ["--mode", "bsdp", "--fsdp"],
    "B-SDP+FSDP+AC": ["--mode", "bsdp", "--fsdp", "--ac"],
}
COLUMNS = ("total", "parameters", "gradients", "optimizer", "activations", "other")


def run_config(name: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sdp_train.cli", "train", "--model", args.model, "--workers", str(args.workers),
           "--steps", "2", "--memory-steps", "2", "--batch-size", str(args.batch_size), "--seq-len",
           str(args.seq_len), "--eval-batches", "1", "--seed", "0", "--active", str(args.active),
           "--out", str(out / name), *CONFIGS[name]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    peaks = json.loads((out / name / "summary.json").read_text())["peak_memory_bytes"]
    largest = max(peaks, key=lambda p: p["total"])
    return {**{c: largest[c] for c in COLUMNS}, "state": sum(largest["persistent"].values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="llama-debug")
    p.add_argument("--active", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}; model {args.model}, "
          f"{args.workers} ranks, batch {args.batch_size} x {args.seq_len}, C = {args.active}; "
          "MiB on the largest rank, peak over steps 0-1")
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_config(name, args, Path(tmp)) for name in CONFIGS}
    ddp = results["DDP"]
    header = "".join(f"{c:>12}" for c in (*COLUMNS, "state"))
    print(f"{'config':<14}{header}{'total x DDP':>12}{'state x DDP':>12}{'act x DDP':>10}")
    for name, r in results.items():
        cells = "".join(f"{r[c] / 2**20:>12.2f}" for c in (*COLUMNS, "state"))
        print(f"{name:<14}{cells}{r['total'] / ddp['total']:>12.2f}{r['state'] / ddp['state']:>12.2f}"
              f"{r['activations'] / ddp['activations']:>10.2f}")


if __name__ == "__main__":
    main()
