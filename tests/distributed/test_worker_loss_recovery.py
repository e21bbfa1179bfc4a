"""Losing a second worker during the recovery from the first (``--on-worker-loss continue``): the
survivors agree again, without waiting out the collective timeout for the world that cannot form, and
refuse, in one line, a loss that leaves a block without holder. Its own module, so that pytest-xdist
runs it beside the other worker-loss launches of tests/distributed/test_worker_loss.py and _applied.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.distributed.test_worker_loss import ARGS, KILL_STEP, ROOT


TIMEOUT_S = 120  # the collective timeout: a run this long waited it out (the old rendezvous did)


@pytest.mark.slow
def test_a_survivor_lost_during_the_recovery_leaves_a_block_without_holder_and_the_run_stops_in_one_line(tmp_path):
    """Rank 0 dies after step 2's collectives, worker 1 in the recovery (``SDP_TEST_KILL_IN_RECOVERY``:
    after the survivors decided on workers 1 and 2, before their world forms). Worker 2's new world
    then cannot form: it learns so from worker 1's exit mark (`membership.gather`), not from a rendezvous
    that waits out the collective timeout (120 s here: a run that took that long waited it), agrees
    again, alone, and the loss of workers 0 and 1 leaves a block without holder: one error line, exit 1,
    no summary, no traceback."""
    from masklab import load_mask

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:0", "SDP_TEST_KILL_IN_RECOVERY": "1",
           "SDP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sdp_train.cli", "train", *ARGS, "--mode", "bsdp", "--out", str(out)],
                          capture_output=True, text=True, timeout=3 * TIMEOUT_S, cwd=ROOT, env=env)
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-8000:]
    assert took < TIMEOUT_S, f"the run took {took:.0f} s: a survivor waited out the collective timeout"
    mask = load_mask(out / "mask.json")
    block = next(j for j in range(mask.blocks) if set(mask.holder_set(j)) <= {0, 1})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sdp train: error:")]
    assert errors == [f"sdp train: error: step {KILL_STEP + 1}: lost workers [0, 1] held every copy of block {block} "
                      f"({mask.block_names[block]}): continuing is impossible; restart from a checkpoint (--resume)"]
    assert "rank 2 (exit code 1)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "summary.json").exists()
