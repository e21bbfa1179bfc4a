"""Step time, tokens/s and bytes sent per step of DDP, B-SDP, N-SDP and Bb-SDP, as ratios to DDP.

Each mode is a real `sdp train` run (torchrun-launched ranks, gloo on CPU / nccl on GPU) on the
same model, data, seeds and steps; DDP is measured in the same invocation. Figures are medians
over the steps after the first.

    python benchmarks/bench_train.py [--workers 4] [--steps 30] [--model llama-debug] [--active 0.5]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("ddp", "bsdp", "nsdp", "bbsdp")


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sdp_train.cli", "train", "--model", args.model, "--mode", mode,
           "--workers", str(args.workers), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--seed", "0", "--out", str(out / mode)]
    if mode != "ddp":
        cmd += ["--active", str(args.active)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / mode / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default="llama-debug")
    p.add_argument("--active", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}; model {args.model}, "
          f"{args.workers} ranks, {args.steps} steps, batch {args.batch_size} x {args.seq_len}, C = {args.active}")
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run_mode(mode, args, Path(tmp)) for mode in MODES}
    ddp = results["ddp"]
    print(f"{'mode':<6} {'step s':>8} {'x DDP':>6} {'tok/s':>8} {'x DDP':>6} {'MB/step':>8} {'x DDP':>6} "
          f"{'params/rank':>11} {'x DDP':>6} {'val loss':>8}")
    for mode, s in results.items():
        mb = s["comm_bytes_per_step"] / 1e6
        print(f"{mode:<6} {s['step_time_s']:>8.4f} {s['step_time_s'] / ddp['step_time_s']:>6.2f} "
              f"{s['tokens_per_s']:>8.0f} {s['tokens_per_s'] / ddp['tokens_per_s']:>6.2f} "
              f"{mb:>8.3f} {s['comm_bytes_per_step'] / ddp['comm_bytes_per_step']:>6.2f} "
              f"{s['num_params_local']:>11} {s['num_params_local'] / ddp['num_params_local']:>6.2f} "
              f"{s['final_val_loss']:>8.4f}")


if __name__ == "__main__":
    main()
