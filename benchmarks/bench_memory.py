"""Measured peak memory per rank of DDP, FSDP, SDP and their compositions, as ratios to a baseline.

Each configuration is a real `sdp train` run (torchrun-launched ranks, gloo on CPU / nccl on GPU)
on the same model, data, seeds and batch; the baseline (DDP unless ``--baseline``) is measured in
the same invocation. Figures are the largest rank's ``peak_memory_bytes`` from summary.json: on
CPU the tracker's breakdown, "state" being the parameters + gradients + optimizer state held
between steps; beside them the collective bytes per step (buffer and ring-model wire bytes).

    python benchmarks/bench_memory.py [--workers 4] [--model llama-debug] [--active 0.5]
        [--data bin:DIR] [--configs FSDP+AC B-SDP+FSDP+AC] [--baseline FSDP+AC]
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
    sdp = CONFIGS[name][1] not in ("ddp", "fsdp")  # the baselines refuse --active
    cmd = [sys.executable, "-m", "sdp_train.cli", "train", "--model", args.model, "--workers", str(args.workers),
           "--steps", "2", "--memory-steps", "2", "--batch-size", str(args.batch_size), "--seq-len",
           str(args.seq_len), "--eval-batches", "1", "--seed", "0", *(["--active", str(args.active)] if sdp else []),
           "--data", args.data, "--no-save", "--out", str(out / name), *CONFIGS[name]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / name / "summary.json").read_text())
    largest = max(summary["peak_memory_bytes"], key=lambda p: p["total"])
    return {**{c: largest[c] for c in COLUMNS}, "state": sum(largest["persistent"].values()),
            "buffer/step": summary["comm_bytes_per_step"], "wire/step": summary["wire_bytes_per_step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="llama-debug")
    p.add_argument("--active", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--data", default="auto", help="sdp train --data (e.g. bin:DIR of uint16 token shards)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="CONFIG",
                   help=f"configurations to run, of {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--baseline", default="DDP", help="the configuration the ratios divide by (one of --configs)")
    args = p.parse_args()
    if args.baseline not in args.configs:
        p.error(f"--baseline {args.baseline!r} is not one of --configs {args.configs}")
    print(f"machine: {platform.machine()}, python {platform.python_version()}; model {args.model}, "
          f"{args.workers} ranks, batch {args.batch_size} x {args.seq_len}, C = {args.active}, data {args.data}; "
          "MiB on the largest rank, peak over steps 0-1; MB of collectives per step")
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_config(name, args, Path(tmp)) for name in args.configs}
    base = results[args.baseline]
    ratio_columns = [(c, f"{label} x {args.baseline}") for c, label in
                     (("total", "total"), ("state", "state"), ("activations", "act"))]
    width = max(len(h) for _, h in ratio_columns) + 2
    header = "".join(f"{c:>12}" for c in (*COLUMNS, "state")) + "".join(f"{h:>{width}}" for _, h in ratio_columns)
    print(f"{'config':<14}{header}{'buffer/step':>12}{'wire/step':>11}")
    for name, r in results.items():
        cells = "".join(f"{r[c] / 2**20:>12.2f}" for c in (*COLUMNS, "state"))
        cells += "".join(f"{r[c] / base[c]:>{width}.3f}" for c, _ in ratio_columns)
        print(f"{name:<14}{cells}{r['buffer/step'] / 1e6:>12.2f}{r['wire/step'] / 1e6:>11.2f}")


if __name__ == "__main__":
    main()
