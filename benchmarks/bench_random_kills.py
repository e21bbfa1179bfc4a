"""SIGKILL a random rank of ``sdp train --on-worker-loss continue`` at a random moment, `--runs` times, and
report how each run ended and how long each recovery took (`recovery_s`, summary.json): the faults no test
places by hand (docs/design.md §7). A recovery that takes about the collective timeout is a survivor that
waited it out. On one host:

    .venv/bin/python benchmarks/bench_random_kills.py --mode overlap --runs 10 [--seed 0] [-- --max-rejoins 1]

Each run trains llama-debug on 3 ranks for `--steps` steps with ``SDP_COLLECTIVE_TIMEOUT_S=--timeout``, and
kills a rank a uniform random time in [0, `--window`) s after the first metrics line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(args: argparse.Namespace, rng: random.Random, out: Path) -> dict:
    """One launch, one kill; what it ended with."""
    cmd = [sys.executable, "-m", "sdp_train.cli", "train", "--model", "llama-debug", "--active", "0.67", "--workers",
           "3", "--steps", str(args.steps), "--batch-size", "2", "--seq-len", "16", "--max-data-bytes", "100000",
           "--eval-batches", "1", "--memory-steps", "0", "--warmup-steps", "2", "--seed", str(rng.randrange(5)),
           "--on-worker-loss", "continue", "--mode", args.mode, *args.extra, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_COLLECTIVE_TIMEOUT_S": str(args.timeout)}
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, killed, at_step = out / "metrics.jsonl", None, None
    while proc.poll() is None and time.monotonic() - began < 300:
        if metrics.exists() and metrics.read_text().strip():
            time.sleep(rng.uniform(0, args.window))
            ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if ranks:
                killed = int(rng.choice(ranks))
                try:
                    os.kill(killed, signal.SIGKILL)
                    at_step = len(metrics.read_text().splitlines())  # metrics lines written at the kill
                except ProcessLookupError:  # the rank ended between pgrep and the kill: the run is ending
                    killed = None
            break
        time.sleep(0.01)
    try:
        _, stderr = proc.communicate(timeout=6 * args.timeout + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        return {"ended": "hung", "killed": killed is not None}
    summary = out / "summary.json"
    changes = json.loads(summary.read_text())["membership_changes"] if summary.exists() else []
    errors = [line for line in stderr.splitlines() if line.startswith("sdp train: error:")]
    notes = [line for line in stderr.splitlines() if line.startswith("sdp: note:")]
    return {"ended": f"exit {proc.returncode}", "killed": killed is not None, "lines_at_kill": at_step,
            "traceback": "Traceback" in stderr, "recovery_s": [round(c["recovery_s"], 2) for c in changes if c["lost"]],
            "error": errors[:1], "note": notes[:1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="overlap", choices=("bsdp", "nsdp", "bbsdp", "overlap"))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=float, default=3.0, help="seconds after the first metrics line")
    parser.add_argument("--timeout", type=float, default=30.0, help="SDP_COLLECTIVE_TIMEOUT_S of the runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*", help="more sdp train flags, after --")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    recoveries = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            result = one_run(args, rng, Path(tmp) / f"run{n}")
            recoveries += result.get("recovery_s", [])
            print(f"run {n}: {json.dumps(result)}", flush=True)
    if recoveries:
        stalled = sum(r > args.timeout / 2 for r in recoveries)
        print(f"{args.mode} {' '.join(args.extra)}: {len(recoveries)} recoveries, median "
              f"{statistics.median(recoveries):.2f} s, max {max(recoveries):.2f} s, {stalled} over half the "
              f"{args.timeout:g} s collective timeout")


if __name__ == "__main__":
    main()
