"""What does losing a worker cost: continuing from the survivors, or restarting from a checkpoint?

One `sdp train` configuration (llama-debug, B-SDP, 3 workers, C = 2/3) run three times through the
real launcher: clean; with rank KILL_RANK SIGKILLed at step KILL_STEP (the test-only
``SDP_TEST_KILL_AT_STEP``, after that step's collectives) under ``--on-worker-loss continue``; and
the same kill under ``--max-restarts 1 --checkpoint-every EVERY`` (torch elastic restarts every
rank from the newest checkpoint). Each row prints the wall time of the whole command, its excess
over the clean run, and the steps computed again: the restart replays the steps since its
checkpoint and the step that failed; continuing reruns the failed step only, and its recovery
time (agreement, new world, new sync) is read from summary.json. The survivors then train on 2 of
the 3 workers' data, the restarted run on all 3.

    python benchmarks/bench_worker_loss.py [--steps 30] [--kill-step 16] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_RANK = 1


def sdp_train(out: Path, steps: int, *flags: str, env: dict[str, str] | None = None) -> float:
    args = ["--model", "llama-debug", "--mode", "bsdp", "--active", "0.67", "--workers", "3", "--steps", str(steps),
            "--batch-size", "4", "--seq-len", "64", "--max-data-bytes", "200000", "--eval-batches", "1",
            "--memory-steps", "0", "--no-save", "--out", str(out), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sdp_train.cli", "train", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"sdp train {' '.join(flags)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=16)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval of the restarted run")
    a = parser.parse_args()
    kill = {"SDP_TEST_KILL_AT_STEP": f"{a.kill_step}:{KILL_RANK}"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        clean = sdp_train(tmp / "clean", a.steps)
        cont = sdp_train(tmp / "continue", a.steps, "--on-worker-loss", "continue", env=kill)
        restart = sdp_train(tmp / "restart", a.steps, "--max-restarts", "1", "--checkpoint-every", str(a.every),
                            env=kill)
        (change,) = json.loads((tmp / "continue" / "summary.json").read_text())["membership_changes"]
        resumed = json.loads((tmp / "restart" / "summary.json").read_text())["resumed_from_step"]
    print(f"llama-debug, B-SDP, 3 workers, {a.steps} steps, rank {KILL_RANK} SIGKILLed after step {a.kill_step}'s "
          f"collectives")
    print(f"{'run':<44} {'wall s':>7} {'excess s':>9} {'steps again':>12}")
    print(f"{'clean':<44} {clean:>7.1f} {0:>9.1f} {0:>12}")
    print(f"{'--on-worker-loss continue':<44} {cont:>7.1f} {cont - clean:>9.1f} {1:>12}"
          f"   (recovery {change['recovery_s']:.2f} s, at step {change['step']})")
    print(f"{f'--max-restarts 1 --checkpoint-every {a.every}':<44} {restart:>7.1f} {restart - clean:>9.1f} "
          f"{a.kill_step + 1 - resumed:>12}   (resumed from step {resumed})")


if __name__ == "__main__":
    main()
