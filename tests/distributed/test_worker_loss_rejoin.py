"""A lost worker's replacement rejoins, after a first replacement was lost while it joined: ``sdp train --mode
bsdp --on-worker-loss continue --max-rejoins 2`` on 3 gloo ranks, rank 0 SIGKILLed after step 2's collectives
(as in tests/distributed/test_worker_loss.py), no checkpoint to go back to.

The survivors, workers 1 and 2, rerun step 3 under their rows of the mask; the launcher then starts a
replacement for worker 0, which waits in the store, and the survivors admit it at step 4's boundary
(``SDP_TEST_JOIN_AT_STEP=4,5``: the members wait there for it, so that the step is known; a replacement's
start takes seconds, and without the fault they train on meanwhile). That replacement SIGKILLs itself once
the new world has formed, before its parts come (``SDP_TEST_KILL_JOINER=4``): the members, which were only
sending, agree among themselves, form their world again and run step 4 with their rows; the launcher
starts a second replacement once they have left worker 0 out again, and they admit it at step 5. The new
world has workers 1, 2, 0 in rank order, under the designed mask's rows in that order; worker 0 receives
its blocks, the shared parameters and their AdamW state from their lowest-ranked holders and reads its
data from step 5 on. Checked: exit 0; the lost joiner in one line, no traceback, two replacements; the
loss at step 3 and the rejoin at step 5 in summary.json and on their metrics lines, every step's line once;
every holder of every tensor bit-identical at the end (each rank's file of the final checkpoint); and the
final model, and every step's loss, equal to the single-process reference whose members are workers 0, 1
and 2 up to step 2, workers 1 and 2 at steps 3 and 4 and all three again from step 5 on, each with its
designed row, the rejoined worker 0 on its batch of that step (float32 rounding): the reference that
admitted the second replacement, never the first. Last, worker 1 SIGKILLs itself once its part of the run is
done (``SDP_TEST_KILL_OUTSIDE=finished:6:1``): the launch still exits 0, with a note saying so.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_worker_loss import JOIN_STEP, KILL_RANK, check_rejoined, run_mode

SECOND_JOIN = JOIN_STEP + 1  # where the second replacement joins, after the first was lost at JOIN_STEP


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, ("--max-rejoins", "2"),
                    {"SDP_TEST_JOIN_AT_STEP": f"{JOIN_STEP},{SECOND_JOIN}", "SDP_TEST_KILL_JOINER": str(JOIN_STEP),
                     "SDP_TEST_KILL_OUTSIDE": "finished:6:1"})


@pytest.mark.slow
def test_a_replacement_lost_while_it_joins_leaves_the_members_going_on_and_the_next_one_rejoins(run):
    mode, proc, out = run
    lost = [line for line in proc.stdout.splitlines() if "lost while joining" in line]
    assert len(lost) == 1 and lost[0].startswith(f"sdp train: step {JOIN_STEP + 1}/6: worker(s) [{KILL_RANK}] lost "
                                                 f"while joining (") and "workers 1, 2 go on from this step" in lost[0]
    assert "(1 more allowed)" in proc.stderr and "(0 more allowed)" in proc.stderr  # two replacements
    assert "Traceback" not in proc.stderr
    assert ("sdp: note: rank 1 (exit code -9) ended after it had finished its part of the run, which is complete"
            in proc.stderr.splitlines())
    check_rejoined(mode, proc, out, restored=False, join_step=SECOND_JOIN)
