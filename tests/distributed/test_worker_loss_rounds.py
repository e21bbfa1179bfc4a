"""Losing a worker under a mask schedule: ``sdp train --mode bsdp --schedule permute --every 3
--on-worker-loss continue`` on 3 gloo ranks, rank 0 SIGKILLed after step 2's collectives.

Step 2 ends round 0 and round 1 swaps the rows of workers 0 and 2, so after their optimizer step the
survivors fail in the mask change (worker 2 builds blocks 0 and 1 and waits for them from worker 0):
they agree on 3 steps applied, worker 2 drops the blocks it built (`MaskChanges.undo_gains`), and the
schedule goes on over the survivors' rows of every round (`Rounds.for_survivors`), so the change to
round 1 is made again between workers 1 and 2 when step 3 begins, worker 2 receiving blocks 0 and 1
with their AdamW state from worker 1. Checked as in tests/distributed/test_worker_loss.py: exit 0,
the change at step 2 in summary.json and its metrics line, the holders of every block bit-identical
at the end, and the final model and every step's loss equal to the single-process reference whose
members take their rows of each round (3 workers up to step 2, workers 1 and 2 from step 3 on). One
launch of its own, so that pytest-xdist runs it beside the others.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed.test_worker_loss import (
    KILL_RANK,
    KILL_STEP,
    STEPS,
    common_part,
    held_parts,
    members_rows,
    prepared,
    reference,
    run_mode,
)

SCHEDULE = ("--schedule", "permute", "--every", "3")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, SCHEDULE)


@pytest.mark.slow
def test_survivors_lost_in_a_mask_change_make_it_again_and_finish_as_the_reference(run):
    _, proc, out = run
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    prep = prepared("bsdp", SCHEDULE)
    round1 = prep.mask.round_matrix(KILL_STEP + 1, seed=prep.config.seed)
    assert not (round1 == prep.mask.round_matrix(KILL_STEP, seed=prep.config.seed)).all()  # step 3 changes mask

    (change,) = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"]) == (KILL_STEP, [KILL_RANK], [1, 2])
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP]
    assert "having applied this step, from the next step" in proc.stdout
    assert summary["mask_change_bytes"] > 0

    final = out / "checkpoints" / f"step_{STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(2)]
    _, rows = members_rows("bsdp", prep, STEPS - 1)
    specs = held_parts("bsdp", rows[[1, 2]])
    assert set(ranks[0]) == set(specs[0]) and set(ranks[1]) == set(specs[1])  # each holds its round-1 row
    for name in set(ranks[0]) & set(ranks[1]):
        a, b = common_part(specs, ranks, name)
        assert torch.equal(a, b), name

    from safetensors.torch import load_file

    expected, losses = reference("bsdp", SCHEDULE)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
