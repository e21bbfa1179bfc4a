"""Losing a worker and taking it back where training goes in rounds: a mask schedule (``sdp train --mode
bsdp --schedule permute --every 3 --on-worker-loss continue --restore-coverage --max-rejoins 1``, 12 steps)
and local steps
(``--local-steps 3 --restore-coverage``, 9 steps), each on 3 gloo ranks with rank 0 SIGKILLed after step
2's collectives, before its optimizer step, and its replacement admitted at a step the test fixes
(``SDP_TEST_JOIN_AT_STEP``: the members wait there for it; a replacement's start takes seconds). Step 2
ends the first round in both.

Schedule: round 1 swaps the rows of workers 0 and 2, so after their optimizer step the survivors
fail in the mask change (worker 2 builds blocks 0 and 1 and waits for them from worker 0): they agree
on 3 steps applied, worker 2 drops the blocks it built (`MaskChanges.undo_gains`), and the schedule
goes on over the survivors with every round's mask the one restoring its designed coverage 2 for them
(`Rounds.for_survivors` with ``restore``: with 2 survivors, every block on both), the round of step 3's
at once (`Run.continue_with`): each survivor receives the blocks it lacked under its rows of round 0,
with their AdamW state, from the other. At step 4, inside round 1, worker 0's replacement rejoins: the
new world is workers 1, 2, 0; the joiner receives its row of round 1 (not round 0's) with its AdamW
state from the members under their restored rows, and the members then drop what their designed rows
of round 1 do not hold (`Rounds.for_joiners` with the rows in force, the schedule's change to the
designed rows made at once: `Run.welcome`); every round from then on is the designed round's rows of
the workers in that order, and the changes at steps 6 and 9 move blocks in the new world (at step 9
to the joiner). Checked as in tests/distributed/test_worker_loss.py: exit 0, the loss at step 2 (the
coverage restored, bytes moved) and the rejoin at step 4 in summary.json and on their metrics lines,
every step's line once, every holder of every tensor bit-identical at the end, each rank holding its
designed row of the last round, and the final model and every step's loss equal to the single-process
reference whose members take their rows of each round (workers 0-2 their designed rows up to step 2,
1-2 every block at step 3, 0-2 their designed rows from step 4 on). The survivors' rows as they are
under a schedule (without ``--restore-coverage``) have no launch of their own: the unit tests of
`Rounds.for_survivors` (tests/unit/test_worker_loss_agreement.py) and a run by hand (RELIABILITY.md).

Local steps: each worker trains its own subnetwork 3 steps, then every block becomes its holders'
average; the survivors fail in that average after their optimizer step 2, agree on 3 steps applied,
keep their own copies and the step count, and take the average again among themselves; right after
it, a round's boundary, they move to the mask that restores the designed coverage (both hold every
block, each gaining the ones it lacked with their AdamW state from the other) and train round 1
under it. The replacement may join only at a round's boundary, right after the average (holders'
copies differ inside a round): at step 6 it takes each tensor it holds, with its AdamW state, from
its lowest-ranked holder (worker 1, else 2) and the step count, and the survivors go back to their
designed rows. The final model and every step's loss equal a reference with a subnetwork and an AdamW
per worker, each clipped by its own norm, averaged over the living holders every 3 steps, the
survivors regrouped at step 3 and worker 0 rebuilt at step 6 from the holders' values and AdamW
state.

Overlap averaging under a schedule (``--mode overlap --schedule permute --every 3 --local-steps 3``, 9 steps):
each worker keeps its own copy and AdamW state; step 2's average ends round 0 and changes the mask, and the
survivors fail in it after their optimizer step, take it again among themselves under their rows of round 0
and enter round 1 restricted to their rows. The replacement joins at step 6, right after round 1's average
and at another change of mask: it takes its copy of every tensor from the lowest-ranked member holding it in
round 1 (worker 2 holds a block in round 2 it did not hold in round 1) and the AdamW state of what it holds
in round 2 likewise. The final model and every step's loss equal `overlap_schedule_reference`'s, every
holder of every tensor of the last round bit-identical.

A module of its own, so that pytest-xdist runs these launches beside the others.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.test_worker_loss import (KILL_RANK, KILL_STEP, average_holders, copy_step, prepared,
                                                reference, run_mode)

REJOIN = ("--max-rejoins", "1")
SCHEDULE_STEPS = 12  # rounds of 3 steps: changes at steps 3, 6 and 9
SCHEDULE = ("--schedule", "permute", "--every", "3", "--steps", str(SCHEDULE_STEPS), "--restore-coverage", *REJOIN)
H = 3
LOCAL_RUN_STEPS = 3 * H  # the survivors train round 1 under their restored rows; worker 0 rejoins for round 2
LOCAL_STEPS = ("--local-steps", str(H), "--steps", str(LOCAL_RUN_STEPS), "--restore-coverage", *REJOIN)
# overlap averaging under a schedule that changes the mask with every average: rounds of H steps
OVERLAP = ("--schedule", "permute", "--every", str(H), "--local-steps", str(H), "--steps", str(LOCAL_RUN_STEPS),
           *REJOIN)
# the schedule's: inside round 1, after the survivors trained step 3; local steps' and overlap's: round 2's boundary
JOIN_STEP = {"scheduled": KILL_STEP + 2, "local": 2 * H, "overlap": 2 * H}
WORKERS = [1, 2, KILL_RANK]  # the world after the rejoin, in rank order


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, SCHEDULE, {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP["scheduled"])})


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("bsdp", tmp_path_factory, LOCAL_STEPS, {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP["local"])})


@pytest.fixture(scope="module")
def overlap(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return run_mode("overlap", tmp_path_factory, OVERLAP, {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP["overlap"])})


def members_of(join_step: int, *, restored: bool = False):
    """`reference`'s members of each step, with their designed rows of the round of that step: workers 0-2
    up to KILL_STEP, the survivors until `join_step`, all three again from then on. `restored`: the
    survivors' rows restore the designed coverage 2 of every round, which for 2 survivors is every block
    on both."""

    def members(prep, step: int) -> tuple[list[int], np.ndarray]:
        survivors = KILL_STEP < step < join_step
        members = [k for k in range(3) if k != KILL_RANK] if survivors else [0, 1, 2]
        matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
        designed = prep.mask.round_matrix(step, seed=prep.config.seed)
        matrix[members] = True if survivors and restored else designed[members]
        return members, matrix

    return members


def check_changes(proc: subprocess.CompletedProcess, out: Path, join_step: int, steps: int, mask: np.ndarray) -> None:
    """The loss at KILL_STEP (every survivor had applied it) and the rejoin at `join_step` under `mask`, the
    designed rows of WORKERS, in summary.json, on their metrics lines and in the output."""
    from masklab.io import mask_from_dict

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lost, joined = summary["membership_changes"]
    assert (lost["step"], lost["lost"], lost["joined"], lost["workers"]) == (KILL_STEP, [KILL_RANK], [], [1, 2])
    assert (joined["step"], joined["lost"], joined["joined"], joined["workers"]) == (join_step, [], [KILL_RANK], WORKERS)
    assert mask_from_dict(joined["mask"]).matrix.tolist() == mask.tolist()
    assert joined["moved_bytes"] > 0 and summary["world_size"] == 3
    assert [m["step"] for m in metrics] == list(range(steps))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP, join_step]
    assert metrics[join_step]["membership"]["joined"] == [KILL_RANK]
    assert "having applied this step, from the next step" in proc.stdout
    assert f"worker {KILL_RANK} rejoined" in proc.stdout


def check_holders(out: Path, steps: int, rows: np.ndarray) -> None:
    """Each rank's file of the final checkpoint holds exactly its row of `rows` (the blocks of the last
    round, and the shared tensors), and every holder of a tensor has the same values, bit for bit."""
    final = out / "checkpoints" / f"step_{steps}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(3)]
    for name in set().union(*ranks):
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        holders = [r for r in range(3) if name in ranks[r]]
        assert holders == [r for r in range(3) if block is None or rows[r, block]], name
        assert all(torch.equal(ranks[holders[0]][name], ranks[r][name]) for r in holders[1:]), name


def check_model(out: Path, expected: dict[str, torch.Tensor], atol: float) -> None:
    from safetensors.torch import load_file

    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.slow
def test_survivors_lost_in_a_mask_change_make_it_again_and_a_rejoin_in_a_later_round_ends_as_the_reference(
        scheduled):
    _, proc, out = scheduled
    prep = prepared("bsdp", SCHEDULE)
    seed, join = prep.config.seed, JOIN_STEP["scheduled"]
    round1 = prep.mask.round_matrix(KILL_STEP + 1, seed=seed)
    assert not (round1 == prep.mask.round_matrix(KILL_STEP, seed=seed)).all()  # step 3 changes mask
    assert not (round1[KILL_RANK] == prep.mask.round_matrix(0, seed=seed)[KILL_RANK]).all()  # joins in round 1's row
    last = prep.mask.round_matrix(SCHEDULE_STEPS - 1, seed=seed)
    assert not (last[KILL_RANK] == round1[KILL_RANK]).all()  # and gains blocks after the rejoin
    check_changes(proc, out, join, SCHEDULE_STEPS, prep.mask.round_matrix(join, seed=seed)[WORKERS])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mask_change_bytes"] > 0 and prep.mask.coverage.min() == 2
    from masklab.io import mask_from_dict

    lost = summary["membership_changes"][0]
    assert lost["coverage_restored"] and lost["moved_bytes"] > 0 and lost["restore_at"] is None
    assert mask_from_dict(lost["mask"]).matrix.tolist() == [[1] * prep.mask.blocks] * 2  # round 1's, restored
    assert not round1[[1, 2]].all()  # the survivors' rows of round 1 do not hold every block: blocks move
    check_holders(out, SCHEDULE_STEPS, last[WORKERS])
    expected, losses = reference("bsdp", SCHEDULE, members_of=members_of(join, restored=True))
    check_model(out, expected, atol=1e-5)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_survivors_lost_in_a_local_steps_average_take_it_again_restore_coverage_and_a_rejoin_ends_as_the_reference(
        local):
    _, proc, out = local
    prep = prepared("bsdp", LOCAL_STEPS)
    restored = restore_rows(prep)
    assert not (restored == prep.mask.matrix[WORKERS[:-1]]).all()  # the survivors gain blocks at step 3
    check_changes(proc, out, JOIN_STEP["local"], LOCAL_RUN_STEPS, prep.mask.matrix[WORKERS])
    lost = json.loads((out / "summary.json").read_text())["membership_changes"][0]
    from masklab.io import mask_from_dict

    assert lost["coverage_restored"] and lost["moved_bytes"] > 0 and lost["restore_at"] is None
    assert mask_from_dict(lost["mask"]).matrix.tolist() == restored.tolist()  # at once: the loss ended a round
    check_holders(out, LOCAL_RUN_STEPS, prep.mask.matrix[WORKERS])  # the run ends on an average: holders agree
    expected, losses = local_steps_reference(prep)
    check_model(out, expected, atol=5e-5)  # AdamW's steps of about lr turn the sums' rounding into ~1e-5
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_overlap_survivors_lost_in_the_average_that_changes_round_take_it_again_and_a_rejoin_ends_as_the_reference(
        overlap):
    _, proc, out = overlap
    prep = prepared("overlap", OVERLAP)
    seed, join = prep.config.seed, JOIN_STEP["overlap"]
    rounds = [prep.mask.round_matrix(step, seed=seed) for step in range(0, LOCAL_RUN_STEPS, H)]
    assert not (rounds[1] == rounds[0]).all()  # the average the loss interrupts ends round 0: a change
    # worker 2 trains in round 2 a block it did not hold in round 1: the joiner's copy of it comes from worker 1
    assert any(rounds[2][2, j] and not rounds[1][2, j] and rounds[2][KILL_RANK, j] for j in range(prep.mask.blocks))
    check_changes(proc, out, join, LOCAL_RUN_STEPS, rounds[2][WORKERS])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the survivors learn of the loss at once, not after the collective timeout (60 s here): the first average's
    # holder groups exist before it (made lazily there, their rendezvous waited for the lost rank: 60.4 s)
    assert metrics[KILL_STEP]["step_time_s"] < 30
    final = out / "checkpoints" / f"step_{LOCAL_RUN_STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(3)]
    last = rounds[-1][WORKERS]
    for name in ranks[0]:  # every rank keeps a copy of every tensor; the last round's holders agree bit for bit
        assert all(name in rank for rank in ranks), name
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        holders = [r for r in range(3) if block is None or last[r, block]]
        assert all(torch.equal(ranks[holders[0]][name], ranks[r][name]) for r in holders[1:]), name
    expected, losses = overlap_schedule_reference(prep)
    check_model(out, expected, atol=5e-5)  # as overlap averaging's static launch
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


def overlap_schedule_reference(prep, *, kill_step: int = KILL_STEP, join_step: int = JOIN_STEP["overlap"],
                               steps: int = LOCAL_RUN_STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Overlap averaging under a schedule on one process: a copy and an AdamW per worker (over every parameter,
    as the run's under a schedule), each step's blocks of the worker's row of that step's round trainable
    (the others take no gradient, so AdamW skips them and keeps their state), each clipped by its own norm;
    after every H-th step (H the config's) each parameter becomes its mean over the holders of that round
    among the living workers (the lost worker computed its `kill_step` loss and took no step). At
    `join_step` worker 0 gets a new AdamW and its copy of every tensor from the lowest-ranked of workers 1, 2
    holding it in the round just trained (whose holders have just averaged it), and the AdamW state of each
    parameter it holds in the round of `join_step` from the same worker; it reads its batch of `join_step`."""
    import copy

    from sdp_train.data import build_batches
    from sdp_train.testing import from_sdp_train

    cfg = prep.config
    base, _, _ = from_sdp_train(prep.model_config, "block", seed=cfg.seed)

    def block(name: str) -> int | None:
        return int(name.split(".")[1]) if name.startswith("layers.") else None

    def adamw(model):
        params = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def round_of(step: int) -> np.ndarray:
        return prep.mask.round_matrix(step, seed=cfg.seed).astype(bool)

    copies = [copy.deepcopy(base) for _ in range(3)]
    opts = [adamw(m) for m in copies]
    batches = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=3) for k in range(3)]
    survivors = WORKERS[:-1]
    losses = []
    for step in range(steps):
        rows = round_of(step)
        if step == join_step:
            trained = round_of(step - 1)
            copies[KILL_RANK] = copy.deepcopy(base)
            opts[KILL_RANK] = adamw(copies[KILL_RANK])
            with torch.no_grad():
                states = [dict(m.state_dict(keep_vars=True)) for m in copies]
                params = [dict(m.named_parameters()) for m in copies]
                for name, value in states[KILL_RANK].items():
                    src = next(k for k in survivors if block(name) is None or trained[k, block(name)])
                    value.copy_(states[src][name])
                    if name in params[KILL_RANK] and (block(name) is None or rows[KILL_RANK, block(name)]):
                        held = opts[src].state[params[src][name]]
                        opts[KILL_RANK].state[params[KILL_RANK][name]] = {key: v.clone() for key, v in held.items()}
        members = survivors if kill_step < step < join_step else [0, 1, 2]
        alive = [k for k in members if step != kill_step or k != KILL_RANK]
        drawn = [next(b) for b in batches]  # every worker's stream moves with the steps, a member's or not
        values = []
        for k in members:
            for name, p in copies[k].named_parameters():
                p.requires_grad_(block(name) is None or bool(rows[k, block(name)]))
                p.grad = None
            values.append(copy_step(copies[k], opts[k], drawn[k], cfg, step, steps=k in alive))
        losses.append(sum(values) / len(values))
        if (step + 1) % cfg.local_steps == 0:
            average_holders(copies, alive, rows, block)
    last = round_of(steps - 1)
    final = {}
    for name in copies[0].state_dict():  # each tensor from its lowest-ranked holder in the new world's order
        src = next(k for k in WORKERS if block(name) is None or last[k, block(name)])
        final[name] = copies[src].state_dict()[name]
    return final, losses


def restore_rows(prep) -> np.ndarray:
    """The survivors' restored rows after losing KILL_RANK, as every survivor designs them."""
    from masklab.survivors import restored_mask
    from sdp_train.trainer.train import coverage_to_restore

    return restored_mask(prep.mask, [KILL_RANK], **coverage_to_restore(prep)).matrix.astype(bool)


def local_steps_reference(prep, *, kill_step: int = KILL_STEP, join_step: int = JOIN_STEP["local"],
                          steps: int = LOCAL_RUN_STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """B-SDP with local steps on one process: each worker's subnetwork (built from the run's seed) and
    AdamW, each step clipped by its own norm; after every H-th step each tensor becomes its mean over
    the holders alive then (the lost worker computed its `kill_step` loss and took no step there; the
    survivors rerun a step they had not applied). With ``--restore-coverage`` (the config's), at the
    first round's boundary from the loss on (`restore_step`) each survivor takes its restored row,
    every tensor it newly holds and its AdamW state from the lowest-ranked survivor holding it. At
    `join_step` worker 0 is built again and takes every tensor it holds, and its AdamW state, from its
    lowest-ranked holder in the new world (worker 1, else worker 2), and the survivors go back to their
    designed rows (dropping what they gained)."""
    from sdp_train.data import build_batches
    from sdp_train.trainer.membership import restore_step
    from sdp_train.trainer.run import loss_fn, lr_at

    cfg = prep.config
    rows = prep.mask.matrix.astype(bool)
    survivors = WORKERS[:-1]
    models, opts = map(list, zip(*(_worker(prep, rows[k]) for k in range(3))))
    batches = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=3) for k in range(3)]
    # the survivors apply `kill_step` (the lost worker dies after its statistics' all-reduce) and fail in the
    # average that ends it, or in the next step's all-reduce, which they rerun
    restore_at = restore_step(kill_step + 1, H) if cfg.restore_coverage else None
    losses = []
    for step in range(steps):
        if step == restore_at:
            _regroup(prep, models, opts, dict(zip(survivors, restore_rows(prep))), survivors)
        if step == join_step:
            models[KILL_RANK] = None
            _regroup(prep, models, opts, {k: rows[k] for k in WORKERS}, survivors)
        members = survivors if kill_step < step < join_step else [0, 1, 2]
        alive = [k for k in members if step != kill_step or k != KILL_RANK]
        drawn = [next(b) for b in batches]  # every worker's stream moves with the steps, a member's or not
        values = []
        for k in members:
            x, y = drawn[k]
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
    for k in reversed(WORKERS):  # each tensor from its lowest-ranked holder
        final.update(models[k].state_dict())
    return final, losses


def _worker(prep, row: np.ndarray):
    """A worker's subnetwork of `row`, built from the run's seed, and its AdamW, as the run's."""
    from sdp_train.models.subnet import build_worker_model

    cfg = prep.config
    model = build_worker_model(prep.model_config, row, "block", seed=cfg.seed)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2],
                              "weight_decay": cfg.weight_decay},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


@torch.no_grad()
def _regroup(prep, models: list, opts: list, new_rows: dict, members: list[int]) -> None:
    """Each worker of `new_rows` rebuilt with its new row: every tensor it held before keeps its values and
    AdamW state, every other from the first of `members` that held it (a worker whose model is None held
    nothing: a joiner)."""
    states = [None if m is None else m.state_dict() for m in models]  # before any worker is rebuilt
    params = [None if m is None else dict(m.named_parameters()) for m in models]
    adamw = list(opts)
    for k, row in new_rows.items():
        model, opt = _worker(prep, np.asarray(row, dtype=bool))
        mine = dict(model.named_parameters())
        for name, tensor in model.state_dict().items():
            src = k if states[k] is not None and name in states[k] else next(j for j in members if name in states[j])
            tensor.copy_(states[src][name])
            if name in mine:
                held = adamw[src].state[params[src][name]]
                assert held, name  # every parameter held has taken a step
                opt.state[mine[name]] = {key: value.clone() for key, value in held.items()}
        models[k], opts[k] = model, opt
