"""A lost worker's replacement rejoins: ``sdp train --mode bsdp --on-worker-loss continue --max-rejoins 1``
on 3 gloo ranks, rank 0 SIGKILLed after step 2's collectives (as in tests/distributed/test_worker_loss.py),
no checkpoint to go back to.

The survivors, workers 1 and 2, rerun step 3 under their rows of the mask; the launcher then starts a
replacement for worker 0, which waits in the store, and the survivors admit it at step 4's boundary
(``SDP_TEST_JOIN_AT_STEP=4``: the members wait there for it, so that the step is known; a replacement's
start takes seconds, and without the fault they train on meanwhile). The new world has workers 1, 2, 0
in rank order, under the designed mask's rows in that order; worker 0 receives its blocks, the shared
parameters and their AdamW state from their lowest-ranked holders and reads its data from step 4 on.
Checked: exit 0; the loss at step 3 and the rejoin at step 4 in summary.json and on their metrics lines,
every step's line once; every holder of every tensor bit-identical at the end (each rank's file of the
final checkpoint); and the final model, and every step's loss, equal to the single-process reference
whose members are workers 0, 1 and 2 up to step 2, workers 1 and 2 at step 3 and all three again from
step 4 on, each with its designed row, the rejoined worker 0 on its batch of that step (float32 rounding).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_worker_loss import JOIN_STEP, check_rejoined, run_mode


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, ("--max-rejoins", "1"), {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP)})


@pytest.mark.slow
def test_a_replacement_rejoins_under_the_designed_mask_and_the_run_ends_as_the_reference(run):
    check_rejoined(*run, restored=False)
