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

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.test_worker_loss import KILL_RANK, KILL_STEP, STEPS, prepared, reference, run_mode

JOIN_STEP = KILL_STEP + 2  # the survivors rerun step KILL_STEP + 1 without worker 0, which rejoins at the next


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, ("--max-rejoins", "1"), {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP)})


def members_rows(prep, step: int) -> tuple[list[int], np.ndarray]:
    """The members of `step` and a (3, B) matrix with their designed rows (the others zero)."""
    members = [k for k in range(3) if k != KILL_RANK] if KILL_STEP < step < JOIN_STEP else [0, 1, 2]
    matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
    matrix[members] = prep.mask.matrix[members]
    return members, matrix


@pytest.mark.slow
def test_a_replacement_rejoins_under_the_designed_mask_and_the_run_ends_as_the_reference(run):
    from masklab.io import mask_from_dict
    from safetensors.torch import load_file

    _, proc, out = run
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    prep = prepared("bsdp")
    workers = [1, 2, KILL_RANK]
    lost, joined = summary["membership_changes"]
    assert (lost["step"], lost["lost"], lost["joined"], lost["workers"]) == (KILL_STEP + 1, [KILL_RANK], [], [1, 2])
    assert (joined["step"], joined["lost"], joined["joined"], joined["workers"]) == (JOIN_STEP, [], [KILL_RANK], workers)
    mask = mask_from_dict(joined["mask"])
    assert mask.matrix.tolist() == prep.mask.matrix[workers].tolist()  # the designed rows, joiner last
    assert joined["moved_bytes"] > 0 and summary["world_size"] == 3
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP + 1, JOIN_STEP]
    assert metrics[JOIN_STEP]["membership"]["joined"] == [KILL_RANK]
    assert f"worker {KILL_RANK} rejoined" in proc.stdout and "train on under the designed mask" in proc.stdout
    assert f"sdp: rank {KILL_RANK} lost (exit code -9): starting a replacement" in proc.stderr

    # every holder identical: each rank's copy of every tensor it holds, from the checkpoint after the last step
    final = out / "checkpoints" / f"step_{STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(3)]
    for name in set().union(*ranks):
        holders = [r for r in range(3) if name in ranks[r]]
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        assert holders == [r for r in range(3) if block is None or mask.matrix[r, block]], name
        assert all(torch.equal(ranks[holders[0]][name], ranks[r][name]) for r in holders[1:]), name

    expected, losses = reference("bsdp", ("--max-rejoins", "1"), members_of=members_rows)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
