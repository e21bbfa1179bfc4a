"""Losing a worker without rollback: ``sdp train --mode bsdp|nsdp|bbsdp|overlap --on-worker-loss
continue --restore-coverage`` on 3 gloo ranks, rank 0 SIGKILLed mid-run, no checkpoint to go back to
(tests/distributed/test_worker_loss_rejoin.py has B-SDP's survivors with their rows as they are, the path
every mode takes without the flag).

The fault is the test-only ``SDP_TEST_KILL_AT_STEP=STEP:RANK`` (`sdp_train.trainer.faults`): the rank
kills itself after step STEP's collectives, before its optimizer step, so the survivors apply step
STEP with its gradient and their step STEP + 1 fails; they agree on the survivors, re-form the world
and rerun step STEP + 1 under the mask without row 0 (with ``--restore-coverage``: under the mask
designed for 2 workers with the start's coverage 2, every block on both, after the blocks and
neuron groups each survivor lacked came, with their AdamW state, from the other; Bb-SDP's, which
every worker runs, with their values and AdamW state). Bb-SDP's survivors fail in step STEP itself,
sending the new values after the optimizer step: they agree that they applied it, send every block
again from its lowest-ranked surviving holder and go on with step STEP + 1. Overlap averaging's fail
in step STEP's average: they take it again among themselves, then each takes the blocks it newly holds
(values, AdamW state) from the other and goes on with step STEP + 1. This module launches N-SDP;
test_worker_loss_applied.py Bb-SDP and overlap averaging; test_worker_loss_recovery.py B-SDP (4 ranks,
a second worker lost in the move). One launch per mode checks: exit 0; the membership change
recorded at the failing step in summary.json and its metrics line, every step's line once; the
holders of every tensor (N-SDP: every row or column; Bb-SDP: every tensor; overlap averaging: every
block both hold) identical at the end (each survivor's rank file of the final checkpoint, written
after the last step); and the final model, and every step's loss, equal to a single-process
reference that averages each entry over its holders among the members of the step, with 3 workers
up to step STEP and workers 1 and 2 from step STEP + 1 on, with their rows of the mask in force
(float32 rounding).

Bb-SDP's launch (tests/distributed/test_worker_loss_applied.py) goes on (``--eval-every 2``,
``SDP_TEST_KILL_OUTSIDE=evaluating:4:1``): worker 1, rank 0 of the survivors' world, SIGKILLs itself at the start
of the evaluation after step 4's update, outside a training step.
Worker 2, which holds every block under the survivors' restored mask, fails in that evaluation's collectives,
recovers alone (the change has ``during: evaluating`` and the next step, 4), evaluates again as the new rank 0
(the metrics file is now its to write) and trains steps 4 and 5 alone under its row, all ones: the reference's
members are then worker 2 only (`OUTSIDE`).

N-SDP's launch goes on (``--max-rejoins 1``, ``SDP_TEST_JOIN_AT_STEP=JOIN_STEP``): worker 0's replacement
rejoins at JOIN_STEP, receives its neuron groups under the survivors' restored rows, and every worker then
goes back to its designed row (`check_rejoined`, shared with tests/distributed/test_worker_loss_rejoin.py:
the reference's members are workers 0-2 under the designed rows again from JOIN_STEP on). So does overlap
averaging's (tests/distributed/test_worker_loss_applied.py): the replacement receives its copy of every
tensor (the blocks it does not hold too) and the AdamW state of what it holds from their lowest-ranked
holders under the survivors' restored rows, as `_overlap_reference` rebuilds worker 0 at JOIN_STEP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_STEP, KILL_RANK = 6, 2, 0
ARGS = ["--model", "llama-debug", "--active", "0.67", "--workers", "3", "--steps", str(STEPS),
        "--batch-size", "2", "--seq-len", "16", "--max-data-bytes", "100000", "--eval-batches", "1",
        "--memory-steps", "0", "--warmup-steps", "2", "--seed", "3", "--on-worker-loss", "continue", "--log-every", "1"]
LEVEL = {"bsdp": "block", "nsdp": "neuron", "bbsdp": "block", "overlap": "block"}
# The step whose collective fails on the survivors: B-/N-SDP send nothing after the optimizer step, so
# the survivors apply step KILL_STEP and fail in step KILL_STEP + 1, which they rerun; Bb-SDP fails in
# KILL_STEP's broadcast of the new values, after every survivor applied it, and goes on with the next.
# Overlap averaging (every step here, local_steps 1) averages in the optimizer step's hook: the same as Bb-SDP.
CHANGE_STEP = {"bsdp": KILL_STEP + 1, "nsdp": KILL_STEP + 1, "bbsdp": KILL_STEP, "overlap": KILL_STEP}
RESTORES = ("bsdp", "nsdp", "bbsdp", "overlap")  # launched with --restore-coverage
JOIN_STEP = KILL_STEP + 2  # where worker 0's replacement rejoins (`SDP_TEST_JOIN_AT_STEP`), after the rerun step
REJOIN = ("--max-rejoins", "1")
RESTORE_AND_REJOIN = ("--restore-coverage", *REJOIN)
# launched with a replacement for worker 0 that rejoins (`check_rejoined`) after --restore-coverage
REJOINS = {"nsdp": RESTORE_AND_REJOIN, "overlap": RESTORE_AND_REJOIN}
# a second loss, outside a step: worker 1 killed at the start of the evaluation after this many steps
OUTSIDE, OUTSIDE_WORKER = {"bbsdp": 4}, 1


# bbsdp, overlap: test_worker_loss_applied.py; B-SDP's --restore-coverage launch is the 4-rank one of
# test_worker_loss_recovery.py (a second worker lost in the move: the same checks, and more)
@pytest.fixture(scope="module", params=["nsdp"])
def run(request, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return launch(request.param, tmp_path_factory)


def launch(mode: str, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    """`run_mode`, for `REJOINS` with a replacement for worker 0 that rejoins at JOIN_STEP."""
    if mode in REJOINS:
        return run_mode(mode, tmp_path_factory, REJOINS[mode], {"SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP)})
    if mode in OUTSIDE:
        return run_mode(mode, tmp_path_factory, ("--restore-coverage", "--eval-every", "2"),
                        {"SDP_TEST_KILL_OUTSIDE": f"evaluating:{OUTSIDE[mode]}:{OUTSIDE_WORKER}"})
    return run_mode(mode, tmp_path_factory)


def run_mode(mode: str, tmp_path_factory, extra: tuple[str, ...] = (), faults: dict[str, str] | None = None
             ) -> tuple[str, subprocess.CompletedProcess, Path]:
    """``sdp train --mode MODE --on-worker-loss continue`` (and `extra` flags) on 3 ranks, rank 0
    SIGKILLed at KILL_STEP (and the other test-only `faults`, `sdp_train.trainer.faults`)."""
    out = tmp_path_factory.mktemp(f"worker_loss_{mode}") / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:{KILL_RANK}", "SDP_COLLECTIVE_TIMEOUT_S": "60", **(faults or {})}
    restore = ["--restore-coverage"] if mode in RESTORES and not extra else []
    proc = subprocess.run([sys.executable, "-m", "sdp_train.cli", "train", *ARGS, "--mode", mode, *restore, *extra,
                           "--checkpoint-every", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-8000:]
    return mode, proc, out


def members_rows(mode: str, prep, step: int) -> tuple[list[int], np.ndarray]:
    """The members of `step` (worker numbers) and a (3, B) matrix with their rows of the mask in force
    (the others zero): `survivors_rows` once KILL_RANK is lost; under a schedule, the round's rows; from
    `OUTSIDE`'s step on, worker 2 alone with its row of them."""
    members = [0, 1, 2] if step <= KILL_STEP else [k for k in range(3) if k != KILL_RANK]
    if mode in OUTSIDE and step >= OUTSIDE[mode]:
        members = [k for k in members if k != OUTSIDE_WORKER]
    matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
    if not prep.mask.schedule.is_static:
        matrix[members] = prep.mask.round_matrix(step, seed=prep.config.seed)[members]
    else:
        survivors = [k for k in range(3) if k != KILL_RANK]
        rows = survivors_rows(mode, prep)[[survivors.index(k) for k in members]] if step > KILL_STEP else None
        matrix[members] = prep.mask.matrix[members] if step <= KILL_STEP else rows
    return members, matrix


def rejoin_rows(mode: str, prep, step: int, *, restored: bool, join_step: int = JOIN_STEP
                ) -> tuple[list[int], np.ndarray]:
    """`members_rows` of a run whose replacement for KILL_RANK rejoins at `join_step`: every worker's designed
    row before the loss and from `join_step` on (the joiner's too, whatever the rank order), between them
    the survivors' rows (`restored`: the mask designed for them, `survivors_rows`)."""
    if not KILL_STEP < step < join_step:
        return [0, 1, 2], prep.mask.matrix.astype(bool)
    members = [k for k in range(3) if k != KILL_RANK]
    matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
    matrix[members] = survivors_rows(mode, prep) if restored else prep.mask.matrix[members]
    return members, matrix


def survivors_rows(mode: str, prep) -> np.ndarray:
    """The survivors' mask after losing KILL_RANK: the start mask's rows without it, or (`RESTORES`) the
    mask designed for them with the start's coverage (`masklab.survivors.restored_mask`)."""
    from masklab.failures import survivors_mask
    from masklab.survivors import restored_mask

    if mode not in RESTORES or not prep.mask.schedule.is_static:
        return survivors_mask(prep.mask, [KILL_RANK]).matrix
    groups = prep.model_config.neuron_groups if LEVEL[mode] == "neuron" else None
    return restored_mask(prep.mask, [KILL_RANK], coverage=int(prep.mask.coverage.min()), groups=groups,
                         seed=prep.config.seed).matrix


def reference(mode: str, extra: tuple[str, ...] = (), members_of=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The run on one process: one full model and one AdamW (the run's groups and hyperparameters),
    each step every member's gradient from its subnetwork on its own batch (its row of the mask in
    force: `survivors_rows` once KILL_RANK is lost; `members_of(prep, step)` when given, as
    `members_rows`), each entry's the mean over its holders among the members (`sdp_train.testing`'s
    simulated update: blocks, neuron slices and shared parameters alike), clipped as a whole. A block
    a survivor newly holds has one AdamW state here, which the run moves from its old holder. Every
    worker's batch stream moves with the steps, a member's or not: a worker that rejoins reads the
    batch of the step it joins at. `extra` flags may change the run's (``--workers``: that many workers)."""
    from sdp_train.cli import build_parser
    from sdp_train.cli.train import config_from_args
    from sdp_train.data import build_batches
    from sdp_train.testing import _simulated_update, from_sdp_train
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.run import loss_fn, lr_at

    cfg = config_from_args(build_parser().parse_args(["train", *ARGS, "--mode", mode, *extra, "--out", "unused"]))
    prep = prepare(cfg)
    if mode == "overlap":
        return _overlap_reference(cfg, prep, rejoin=cfg.max_rejoins > 0, restored=cfg.restore_coverage)
    model, _, subnetwork = from_sdp_train(prep.model_config, LEVEL[mode], seed=cfg.seed)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    batches = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=cfg.workers)
               for k in range(cfg.workers)]
    losses = []
    for step in range(cfg.steps):
        members, matrix = (members_of or (lambda prep, step: members_rows(mode, prep, step)))(prep, step)
        drawn = [next(b) for b in batches]
        values = []

        def loss(sub, batch):
            values.append(loss_fn(sub(batch[0]), batch[1]))
            return values[-1]

        if mode == "bbsdp":  # backward masking: the full model's gradient, each block's averaged over its holders
            grads = _backward_masked_update(model, matrix, members, [drawn[k] for k in members], loss)
        else:
            grads = _simulated_update(model, [subnetwork(model, matrix[k]) for k in members],
                                      [drawn[k] for k in members], loss)
        for name, p in params.items():
            p.grad = grads[name]
        torch.nn.utils.clip_grad_norm_(params.values(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        losses.append(sum(v.item() for v in values) / len(members))
    return model.state_dict(), losses


@torch.no_grad()
def average_holders(copies: Sequence[torch.nn.Module], members: Sequence[int], rows: np.ndarray, block) -> None:
    """Overlap averaging's average in a reference: each parameter of `copies`, the mean over the `members`
    whose row of `rows` holds its block (`block(name)`; None: a shared parameter, every member's)."""
    states = [dict(m.named_parameters()) for m in copies]
    for name in states[0]:
        holders = [k for k in members if block(name) is None or rows[k, block(name)]]
        mean = sum(states[k][name] for k in holders) / len(holders)
        for k in holders:
            states[k][name].copy_(mean)


def copy_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch, cfg, step: int, *, steps: bool) -> float:
    """One worker's own copy in an overlap-averaging reference: its loss on `batch` and, with `steps`,
    its clipped AdamW step at `step`'s learning rate (the parameters it trains are those that require
    a gradient)."""
    from sdp_train.trainer.run import loss_fn, lr_at

    x, y = batch
    loss = loss_fn(model(x), y)
    if steps:
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        opt.zero_grad()
    return loss.item()


def _overlap_reference(cfg, prep, *, rejoin: bool = False, restored: bool = False
                       ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Overlap averaging on one process: a copy and an AdamW per worker (over every parameter; those of the
    blocks its row in force does not hold take no gradient, so AdamW skips them), each clipped by its own
    norm; after every step each tensor is replaced by its mean over its holders among the survivors of that
    step (the lost worker took no step 2). With `restored`, right after that average at KILL_STEP each
    survivor takes every block the mask designed for the survivors newly gives it (`survivors_rows`),
    values and AdamW state, from its lowest-ranked holder among them under their old rows, and trains and
    averages under those rows. With `rejoin`, worker 0 is back from JOIN_STEP on, in the new world's rank
    order 1, 2, 0: its copy of every tensor (the blocks it does not hold too) and the AdamW state of what it
    holds are those of the tensor's lowest-ranked holder among workers 1 and 2 under their rows in force,
    it reads its batch of JOIN_STEP, and the survivors go back to their designed rows (the AdamW state of
    what they drop goes)."""
    import copy

    from sdp_train.data import build_batches
    from sdp_train.testing import from_sdp_train

    base, _, _ = from_sdp_train(prep.model_config, "block", seed=cfg.seed)
    matrix = prep.mask.matrix.astype(bool)
    rows = matrix.copy()  # the rows in force

    def block(name: str) -> int | None:
        return int(name.split(".")[1]) if name.startswith("layers.") else None

    def enter(k: int) -> None:  # worker k trains its row in force; AdamW forgets what it dropped
        for n, p in copies[k].named_parameters():
            p.requires_grad_(block(n) is None or bool(rows[k, block(n)]))
            if not p.requires_grad:
                opts[k].state.pop(p, None)

    copies, opts = [], []
    for k in range(3):
        model = copy.deepcopy(base)
        params = dict(model.named_parameters())
        opts.append(torch.optim.AdamW(
            [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
             {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8))
        copies.append(model)
        enter(k)
    batches = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=3) for k in range(3)]
    losses = []
    survivors = [k for k in range(3) if k != KILL_RANK]
    for step in range(STEPS):
        if rejoin and step == JOIN_STEP:
            _welcome(copies, opts, KILL_RANK, survivors, rows, block)
            rows[:] = matrix
            for k in survivors:
                enter(k)
        members = ([0, 1, 2] if step < KILL_STEP or (rejoin and step >= JOIN_STEP)
                   else survivors)
        stepping = [0, 1, 2] if step != KILL_STEP else members  # at KILL_STEP rank 0 computes its loss, then dies
        values = []
        drawn = [next(b) for b in batches]  # a worker's stream moves with the steps: a joiner reads its step's
        for k in (range(3) if step <= KILL_STEP else members):
            values.append(copy_step(copies[k], opts[k], drawn[k], cfg, step, steps=k in stepping))
        losses.append(sum(values) / len(values))
        average_holders(copies, members, rows, block)
        if restored and step == KILL_STEP:  # the survivors' restored rows, at the boundary after this average
            new = np.zeros_like(rows)
            new[survivors] = survivors_rows("overlap", prep)
            _hand_over(copies, opts, survivors, rows, new, block)
            rows = new
            for k in survivors:
                enter(k)
    final = {}
    for name, value in copies[survivors[0]].state_dict().items():
        holders = [k for k in (members if rejoin else survivors) if block(name) is None or rows[k, block(name)]]
        final[name] = copies[holders[0]].state_dict()[name]
    return final, losses


@torch.no_grad()
def _hand_over(copies: list, opts: list, members: list[int], rows: np.ndarray, new: np.ndarray, block) -> None:
    """Each member's copy of every block `new` gives it and `rows` did not, with the AdamW state of its
    parameters, from the lowest-ranked member holding the block under `rows` (`OverlapAveraging.hand_over`)."""
    states = [dict(m.state_dict(keep_vars=True)) for m in copies]
    params = [dict(m.named_parameters()) for m in copies]
    for k in members:
        for name, value in states[k].items():
            j = block(name)
            if j is None or not new[k, j] or rows[k, j]:
                continue
            src = next(r for r in members if rows[r, j])
            value.copy_(states[src][name])
            if name in params[k]:
                state = opts[src].state[params[src][name]]
                opts[k].state[params[k][name]] = {key: v.clone() for key, v in state.items()}


@torch.no_grad()
def _welcome(copies: list, opts: list, joiner: int, members: list[int], matrix: np.ndarray, block) -> None:
    """The joiner's copy of every tensor from the lowest-ranked member holding it (`members` in rank order),
    and each AdamW state of a parameter it holds likewise (`OverlapAveraging.welcome`)."""
    def source(name: str) -> int:
        return next(k for k in members if block(name) is None or matrix[k, block(name)])

    states = [dict(m.state_dict(keep_vars=True)) for m in copies]
    params = [dict(m.named_parameters()) for m in copies]
    for name, value in states[joiner].items():
        value.copy_(states[source(name)][name])
    for name, param in params[joiner].items():
        if param.requires_grad:
            held = params[source(name)][name]
            opts[joiner].state[param] = {key: v.clone() for key, v in opts[source(name)].state[held].items()}


def _backward_masked_update(model, matrix, members: list[int], batches: list, loss) -> dict[str, torch.Tensor]:
    """Each member's gradient of the full model on its batch; a block's tensors (``layers.J.``) take the
    mean over the members holding block J, every other tensor the mean over all members."""
    per = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()
        per.append({n: p.grad.clone() for n, p in model.named_parameters()})
    grads = {}
    for name in per[0]:
        j = int(name.split(".")[1]) if name.startswith("layers.") else None
        holders = [i for i, k in enumerate(members) if j is None or matrix[k, j]]
        grads[name] = sum(per[i][name] for i in holders) / len(holders)
    return grads


def prepared(mode: str, extra: tuple[str, ...] = ()):
    from sdp_train.cli import build_parser
    from sdp_train.cli.train import config_from_args
    from sdp_train.trainer.prepare import prepare

    return prepare(config_from_args(build_parser().parse_args(["train", *ARGS, "--mode", mode, *extra,
                                                               "--out", "unused"])))


def held_parts(mode: str, matrix: np.ndarray) -> list[dict]:
    """What each row of `matrix` holds of every tensor (`SliceSpec`s, full-model positions)."""
    from sdp_train.models.subnet import held_tensors

    prep = prepared(mode)
    return [held_tensors(prep.model_config, row.astype(bool), LEVEL[mode]) for row in matrix]


def common_part(specs: list[dict], ranks: list[dict], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks' values of the part of `name` they both hold (N-SDP: rows/columns found by their
    full-model positions; a whole tensor as it is)."""
    held = (specs[0][name], specs[1][name])
    if all(s.is_whole for s in held):
        return ranks[0][name], ranks[1][name]
    dim, size = next(s.dim for s in held if not s.is_whole), max(s.full_size for s in held)
    full = [list(range(size)) if s.is_whole else list(s.index) for s in held]
    both = sorted(set(full[0]) & set(full[1]))
    return tuple(ranks[r][name].index_select(dim, torch.tensor([full[r].index(i) for i in both])) for r in (0, 1))


@pytest.mark.slow
def test_the_survivors_of_a_sigkill_finish_as_the_reference_that_switches_to_the_survivors_mask(run):
    if run[0] in REJOINS:  # and, once the replacement rejoins, to the designed rows
        check_rejoined(*run, restored=run[0] in RESTORES)
    else:
        check_survivors(*run)


def check_survivors(mode: str, proc: subprocess.CompletedProcess, out: Path) -> None:
    """What every mode's run must show (module doc)."""
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lost = [KILL_RANK]
    survivors = [k for k in range(3) if k != KILL_RANK]

    from masklab.io import mask_from_dict

    change, *outside = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"], change["during"]) == (CHANGE_STEP[mode], lost,
                                                                                     survivors, None)
    rows = survivors_rows(mode, prepared(mode))
    assert mask_from_dict(change["mask"]).matrix.tolist() == rows.tolist()
    assert change["coverage_restored"] == (mode in RESTORES)
    if mode in RESTORES:  # the start's coverage 2 on the 2 survivors: each gained what it lacked
        assert rows.all() and change["moved_bytes"] > 0
        assert "under a mask that restores the designed coverage" in proc.stdout
    assert [m["step"] for m in metrics] == list(range(STEPS))  # every step once: none recomputed before the loss
    assert metrics[CHANGE_STEP[mode]]["membership"]["workers"] == survivors
    assert f"lost worker {KILL_RANK}; workers 1, 2 continue without rollback" in proc.stdout
    assert ("having applied this step, from the next step" in proc.stdout) == (CHANGE_STEP[mode] == KILL_STEP)
    assert f"lost rank {KILL_RANK} (exit code -9)" in proc.stderr
    assert f"step {STEPS}/{STEPS} loss=" in proc.stdout  # rank 0's successor took over the live log
    if mode in OUTSIDE:  # and worker 1, in the evaluation after OUTSIDE[mode] steps: worker 2 goes on alone
        check_outside(mode, proc, out, outside, metrics, summary)
        return
    assert not outside and summary["world_size"] == 2
    assert [m["step"] for m in metrics if "membership" in m] == [CHANGE_STEP[mode]]

    # holders identical: each survivor's copy of every tensor it holds, from the checkpoint after the last step
    final = out / "checkpoints" / f"step_{STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(2)]
    shared = set(ranks[0]) & set(ranks[1])
    assert any(name.startswith("layers.") for name in shared)
    if mode == "bbsdp":  # every survivor runs the whole model: every tensor the same on both
        assert set(ranks[0]) == set(ranks[1]) and all(torch.equal(ranks[0][n], ranks[1][n]) for n in shared)
    else:  # overlap averaging: each keeps a copy of the whole model, of which the holders agree
        specs = held_parts(mode, rows)
        for name in shared:
            if name in specs[0] and name in specs[1]:
                a, b = common_part(specs, ranks, name)
                assert torch.equal(a, b), name

    from safetensors.torch import load_file

    expected, losses = reference(mode)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    # Bb-SDP: every worker's backward runs through the whole model, and AdamW's step, about lr per
    # entry whatever the gradient's size, turns the reordered sums' rounding into up to ~1e-5 (measured)
    atol = 5e-5 if mode in ("bbsdp", "overlap") else 1e-5
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=atol, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


def check_outside(mode: str, proc: subprocess.CompletedProcess, out: Path, outside: list[dict], metrics: list[dict],
                  summary: dict) -> None:
    """What Bb-SDP's run shows after its second loss, worker 1 at the start of the evaluation after OUTSIDE[mode]
    steps (module doc): the change outside a step, worker 2 alone evaluating again, writing the metrics lines
    and the final checkpoint, which records it and which `--resume` refuses; the final model and every step's
    loss as the reference whose members are worker 2 alone from that step on."""
    from safetensors.torch import load_file

    steps = OUTSIDE[mode]
    (second,) = outside
    assert (second["step"], second["lost"], second["workers"], second["during"]) == (steps, [OUTSIDE_WORKER], [2],
                                                                                     "evaluating")
    assert summary["world_size"] == 1
    assert [m["step"] for m in metrics if "membership" in m] == [CHANGE_STEP[mode], steps]
    assert metrics[steps]["membership"]["during"] == "evaluating"
    # the survivor's evaluation is logged, on the line of the step it follows, and in val_history
    assert [m["step"] for m in metrics if "val_loss" in m] == [1, 3]
    assert [v["step"] for v in summary["val_history"]] == [1, 3]
    assert summary["val_history"][1]["val_loss"] == metrics[3]["val_loss"]
    assert (f"sdp train: after step {steps}/{STEPS}, while evaluating: lost worker {OUTSIDE_WORKER}; worker 2 "
            "continues without rollback") in proc.stdout and "evaluating again" in proc.stdout
    assert "rank 1 (exit code -9); rank 2 finished the run" in proc.stderr and "Traceback" not in proc.stderr
    final = out / "checkpoints" / f"step_{STEPS}"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["workers"] == [2] and manifest["identity"]["world_size"] == 1 and not (final / "rank1.pt").exists()

    expected, losses = reference(mode)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():  # Bb-SDP's tolerance, as `check_survivors`
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=5e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)


def check_rejoined(mode: str, proc: subprocess.CompletedProcess, out: Path, *, restored: bool,
                   join_step: int = JOIN_STEP) -> None:
    """What a run whose replacement for KILL_RANK rejoins at `join_step` must show: exit 0 (`run_mode`); the
    loss at CHANGE_STEP (`restored`: under the mask designed for the survivors) and the rejoin at `join_step`
    in summary.json and on their metrics lines, every step's line once; workers 1, 2 and 0 in rank order
    under the designed mask's rows in that order; every holder of every tensor (N-SDP: every row or
    column; Bb-SDP: every tensor) bit-identical at the end (each rank's file of the final checkpoint);
    and the final model, and every step's loss, equal to the reference with the members of `rejoin_rows`."""
    from masklab.io import mask_from_dict
    from safetensors.torch import load_file

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    prep = prepared(mode)
    workers = [1, 2, KILL_RANK]
    lost, joined = summary["membership_changes"]
    assert (lost["step"], lost["lost"], lost["joined"], lost["workers"]) == (CHANGE_STEP[mode], [KILL_RANK], [], [1, 2])
    assert lost["coverage_restored"] == restored
    assert mask_from_dict(lost["mask"]).matrix.tolist() == rejoin_rows(mode, prep, KILL_STEP + 1, restored=restored
                                                                       )[1][[1, 2]].astype(int).tolist()
    assert (joined["step"], joined["lost"], joined["joined"], joined["workers"]) == (join_step, [], [KILL_RANK],
                                                                                    workers)
    mask = mask_from_dict(joined["mask"])
    assert mask.matrix.tolist() == prep.mask.matrix[workers].tolist()  # the designed rows, joiner last
    assert joined["moved_bytes"] > 0 and summary["world_size"] == 3
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [CHANGE_STEP[mode], join_step]
    assert metrics[join_step]["membership"]["joined"] == [KILL_RANK]
    assert f"worker {KILL_RANK} rejoined" in proc.stdout and "train on under the designed mask" in proc.stdout
    assert ("under a mask that restores the designed coverage" in proc.stdout) == restored
    assert f"sdp: rank {KILL_RANK} lost (exit code -9): starting a replacement" in proc.stderr
    assert f"step {STEPS}/{STEPS} loss=" in proc.stdout  # rank 0's successor took over the live log

    # every holder identical: each rank's copy of every tensor it holds, from the checkpoint after the last step
    final = out / "checkpoints" / f"step_{STEPS}"
    ranks = [torch.load(final / f"rank{r}.pt", weights_only=True)["model"] for r in range(3)]
    specs = held_parts(mode, mask.matrix)
    for name in set().union(*ranks):
        holders = [r for r in range(3) if name in ranks[r]]
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        if mode == "overlap":  # every rank keeps a copy of every tensor, of which the holders agree
            assert holders == [0, 1, 2], name
            holders = [r for r in range(3) if block is None or mask.matrix[r, block]]
        elif LEVEL[mode] == "block" and mode != "bbsdp":  # forward masking keeps the held blocks only
            assert holders == [r for r in range(3) if block is None or mask.matrix[r, block]], name
        for r in holders[1:]:
            if mode == "bbsdp":
                assert torch.equal(ranks[holders[0]][name], ranks[r][name]), name
            elif name in specs[holders[0]] and name in specs[r]:
                a, b = common_part([specs[holders[0]], specs[r]], [ranks[holders[0]], ranks[r]], name)
                assert torch.equal(a, b), (name, r)

    expected, losses = reference(mode, RESTORE_AND_REJOIN if restored else REJOIN,
                                 members_of=lambda prep, step: rejoin_rows(mode, prep, step, restored=restored,
                                                                           join_step=join_step))
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    atol = 5e-5 if mode in ("bbsdp", "overlap") else 1e-5  # as `check_survivors`
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=atol, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
