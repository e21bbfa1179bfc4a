"""Losing a second worker during the recovery from the first (``--on-worker-loss continue``): the
survivors agree again, without waiting out the collective timeout for the world that cannot form, and
refuse, in one line, a loss that leaves a block without holder; and a second worker lost while the
survivors move blocks to restore coverage (``--restore-coverage``, 4 ranks) is survived: the move is all or
nothing, the workers still alive agree again from their rows before it and move again. Its own module, so
that pytest-xdist runs it beside the other worker-loss launches of tests/distributed/test_worker_loss.py and
_applied.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import json

import numpy as np
import torch

from tests.distributed.test_worker_loss import ARGS, KILL_STEP, ROOT, STEPS, reference


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


FOUR = ("--workers", "4", "--active", "0.75")  # coverage 3: two losses leave every block a holder
MOVE_KILLED = 2  # the worker killed while the blocks move


@pytest.mark.slow
def test_a_worker_lost_while_blocks_move_to_restore_coverage_is_survived_and_the_run_ends_as_the_reference(
        tmp_path):
    """B-SDP on 4 ranks at coverage 3 with ``--restore-coverage``: rank 0 dies after step 2's collectives;
    workers 1-3 agree and move to the mask designed for 3 (every block on each), and worker 2 dies in that
    move (``SDP_TEST_KILL_IN_MOVE``: the blocks' values sent, their AdamW state not). Workers 1 and 3 fail in
    the move, drop what they began to receive, agree again from their rows before it, move to the mask
    designed for 2 (every block on both) and rerun step 3: exit 0, within the collective timeout (120 s,
    nothing waited out), one change at step 3 with workers 0 and 2 lost, every step's line once, both holders
    of every tensor bit-identical at the end, and the final model and every step's loss those of the
    single-process reference with workers 0-3 under their designed rows up to step 2, then workers 1 and 3
    holding every block."""
    from masklab.io import mask_from_dict
    from safetensors.torch import load_file

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:0", "SDP_TEST_KILL_IN_MOVE": str(MOVE_KILLED),
           "SDP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sdp_train.cli", "train", *ARGS, *FOUR, "--mode", "bsdp",
                           "--restore-coverage", "--checkpoint-every", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=3 * TIMEOUT_S, cwd=ROOT, env=env)
    took = time.monotonic() - began
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert took < TIMEOUT_S, f"the run took {took:.0f} s: a survivor waited out the collective timeout"
    survivors = [1, 3]
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (change,) = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"]) == (KILL_STEP + 1, [0, MOVE_KILLED], survivors)
    assert change["coverage_restored"] and change["moved_bytes"] > 0
    assert mask_from_dict(change["mask"]).matrix.all()
    assert summary["world_size"] == 2 and [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP + 1]
    assert f"lost rank 0 (exit code -9), rank {MOVE_KILLED} (exit code -9)" in proc.stderr
    assert "Traceback" not in proc.stderr and "lost workers 0, 2; workers 1, 3 continue without rollback" in proc.stdout

    final = out / "checkpoints" / f"step_{STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(2)]
    assert set(ranks[0]) == set(ranks[1])  # every block on both
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name

    def members_of(prep, step):
        if step <= KILL_STEP:
            return [0, 1, 2, 3], prep.mask.matrix.astype(bool)
        matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
        matrix[survivors] = True
        return survivors, matrix

    expected, losses = reference("bsdp", FOUR, members_of=members_of)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
