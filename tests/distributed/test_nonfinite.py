"""Non-finite loss or gradients on one rank: every rank sees it in the same step (it travels in the
all-reduce of loss and gradient norm), so ``--nonfinite stop`` ends the run on every rank with one
error line and no summary.json, and ``--nonfinite skip`` drops that step's update everywhere and
finishes. Neither hangs (the subprocess timeout would fail the test).

The fault is the test-only ``SDP_TEST_INJECT_NAN=STEP:RANK``, which multiplies that rank's loss by
NaN (so its gradients are NaN too) in `sdp_train.trainer.run.Run.step`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "llama-debug", "--mode", "bsdp", "--active", "0.5", "--workers", "2", "--steps", "5",
        "--batch-size", "2", "--seq-len", "16", "--max-data-bytes", "100000", "--eval-batches", "1",
        "--memory-steps", "0"]
NAN_AT = "2:1"  # step 2, rank 1


def _sdp_train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "train", *ARGS, *flags, "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
             "SDP_COLLECTIVE_TIMEOUT_S": "60", "SDP_TEST_INJECT_NAN": NAN_AT},
    )


@pytest.mark.slow
def test_nonfinite_stop_ends_every_rank_with_one_clear_error_and_no_summary(tmp_path):
    start = time.monotonic()
    proc = _sdp_train(tmp_path, "--nonfinite", "stop")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "non-finite" in line]
    assert errors == ["sdp train: error: step 2: non-finite training state (mean loss nan, averaged gradient "
                      "norm nan, over 2 rank(s)); nonfinite='stop' ends the run (--nonfinite skip skips such "
                      "steps; a lower --lr may avoid them)"], proc.stderr[-3000:]
    # every rank raises the error after rank 0 has printed it; the agent stops whichever is still running
    failed = [line for line in proc.stderr.splitlines() if line.startswith("sdp: worker failed: ")]
    assert len(failed) == 1 and "(exit code 1)" in failed[0] and "-15" not in failed[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.json").exists()
    assert [json.loads(m)["step"] for m in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert time.monotonic() - start < 60  # well under the 60 s collective timeout: no rank waited on another


@pytest.mark.slow
def test_nonfinite_skip_drops_the_update_on_every_rank_and_finishes(tmp_path):
    proc = _sdp_train(tmp_path, "--nonfinite", "skip", "--checkpoint-every", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["num_skipped_steps"], summary["skipped_steps"]) == (1, [2])
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    metrics = [json.loads(m) for m in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["skipped"], m["loss"] is None) for m in metrics] == \
        [(s, s == 2, s == 2) for s in range(5)]
    for rank in range(2):  # step 2 changed nothing: the state after it is the state before it
        before, after = (torch.load(tmp_path / "checkpoints" / f"step_{s}" / f"rank{rank}.pt", weights_only=True)
                         for s in (2, 3))
        assert all(torch.equal(after["model"][n], t) for n, t in before["model"].items())
        assert before["optimizer"]["state"] and all(
            torch.equal(after["optimizer"]["state"][i][k], v)
            for i, state in before["optimizer"]["state"].items() for k, v in state.items())
    assert summary["num_params_trained"][0] > 0 and len(summary["num_params_trained"]) == 2
