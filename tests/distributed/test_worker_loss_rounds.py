"""Losing a worker where training goes in rounds: a mask schedule (``sdp train --mode bsdp --schedule
permute --every 3 --on-worker-loss continue``) and local steps (``--local-steps 3``), each on 3 gloo
ranks with rank 0 SIGKILLed after step 2's collectives, before its optimizer step. Step 2 ends the
first round in both.

Schedule: round 1 swaps the rows of workers 0 and 2, so after their optimizer step the survivors
fail in the mask change (worker 2 builds blocks 0 and 1 and waits for them from worker 0): they agree
on 3 steps applied, worker 2 drops the blocks it built (`MaskChanges.undo_gains`), and the schedule
goes on over the survivors' rows of every round (`Rounds.for_survivors`), so the change to round 1
is made again between workers 1 and 2 when step 3 begins, worker 2 receiving blocks 0 and 1 with
their AdamW state from worker 1. Checked as in tests/distributed/test_worker_loss.py: exit 0, the
change at step 2 in summary.json and its metrics line, the holders of every block bit-identical at
the end, and the final model and every step's loss equal to the single-process reference whose
members take their rows of each round (3 workers up to step 2, workers 1 and 2 from step 3 on).

Local steps: each worker trains its own subnetwork 3 steps, then every block becomes its holders'
average; the survivors fail in that average after their optimizer step 2, agree on 3 steps applied,
keep their own copies and the step count, and take the average again among themselves. The final
model and every step's loss equal a reference with a subnetwork and an AdamW per worker, each
clipped by its own norm, averaged over the living holders every 3 steps. A module of its own, so
that pytest-xdist runs these launches beside the others.
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
H = 3
LOCAL_STEPS = ("--local-steps", str(H))


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, SCHEDULE)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, LOCAL_STEPS)


@pytest.mark.slow
def test_survivors_lost_in_a_mask_change_make_it_again_and_finish_as_the_reference(scheduled):
    _, proc, out = scheduled
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


@pytest.mark.slow
def test_survivors_lost_in_a_local_steps_average_take_it_again_and_finish_as_the_reference(local):
    _, proc, out = local
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (change,) = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"]) == (KILL_STEP, [KILL_RANK], [1, 2])
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert "having applied this step, from the next step" in proc.stdout

    from safetensors.torch import load_file

    expected, losses = local_steps_reference(prepared("bsdp", LOCAL_STEPS))
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():  # AdamW's steps of about lr turn the sums' rounding into ~1e-5
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=5e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


def local_steps_reference(prep) -> tuple[dict[str, torch.Tensor], list[float]]:
    """B-SDP with local steps on one process: each worker's subnetwork (built from the run's seed) and
    AdamW, each step clipped by its own norm; after every H-th step each tensor becomes its mean over
    the holders alive then (the lost worker computed its step-2 loss and took no step 2)."""
    from sdp_train.data import build_batches
    from sdp_train.models.subnet import build_worker_model
    from sdp_train.trainer.run import loss_fn, lr_at

    cfg = prep.config
    rows = prep.mask.matrix.astype(bool)
    models = [build_worker_model(prep.model_config, rows[k], "block", seed=cfg.seed) for k in range(3)]
    opts = [torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() >= 2],
                                "weight_decay": cfg.weight_decay},
                               {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8) for m in models]
    batches = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=3) for k in range(3)]
    losses = []
    for step in range(STEPS):
        members = [0, 1, 2] if step <= KILL_STEP else [1, 2]
        alive = [k for k in members if step < KILL_STEP or k != KILL_RANK]
        values = []
        for k in members:
            x, y = next(batches[k])
            loss = loss_fn(models[k](x), y)
            values.append(loss.item())
            if k in alive:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(models[k].parameters(), cfg.grad_clip)
                for group in opts[k].param_groups:
                    group["lr"] = lr_at(step, cfg)
                opts[k].step()
                opts[k].zero_grad()
        losses.append(sum(values) / len(values))
        if (step + 1) % H == 0:
            with torch.no_grad():
                states = {k: dict(models[k].named_parameters()) for k in alive}
                for name in {n for state in states.values() for n in state}:
                    holders = [states[k][name] for k in alive if name in states[k]]
                    mean = sum(holders) / len(holders)
                    for tensor in holders:
                        tensor.copy_(mean)
    final = {}
    for k in (2, 1):  # each tensor from its lowest-ranked surviving holder
        final.update(models[k].state_dict())
    return final, losses
