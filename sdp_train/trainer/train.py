"""`train(config)`: the loop every rank runs, and the files rank 0 writes.

``DIR/metrics.jsonl`` gets one line per step (step, loss, lr, grad_norm, step_time_s,
tokens_per_s, comm_bytes: buffer bytes, wire_bytes: bytes sent under ``wire_model``, skipped) as
the run goes (`sdp_train.parallel.wire` states both); a non-finite loss or gradient norm is written
as ``null`` so every line stays strict JSON. ``DIR/summary.json`` is written last, atomically, so
its presence means the run finished. It holds ``peak_memory_bytes``: per rank, the peak over the
first ``memory_steps`` steps, with its breakdown (`sdp_train.trainer.memory`); ``num_params_trained``:
per rank, the parameter elements its optimizer updates (the held blocks and shared parameters
under SDP, the last round's in B-SDP and N-SDP under a schedule, and under overlap averaging with a
static mask; every parameter in Bb-SDP and overlap averaging under a schedule, where each block
trains in some round; the whole model under DDP; the local shards under FSDP); ``skipped_steps`` and
``num_skipped_steps``: the steps whose update ``nonfinite='skip'`` dropped; ``final_train_loss``:
the loss of the last step not skipped; under overlap averaging (mode ``overlap``)
``final_consensus_distance``: how far the workers' copies are apart at the end, per block, ``other``
and ``total`` (`sdp_train.OverlapAveraging.consensus_distance`), which the metrics line of every
evaluation (``eval_every``) and `val_history` also carry as ``consensus_distance``; under a
schedule in B-SDP, N-SDP and Bb-SDP ``mask_change_bytes``: buffer bytes of what this rank's mask
changes moved (rank 0's; not in ``comm_bytes``);
with ``--on-worker-loss continue`` ``membership_changes``: per loss of workers, the step the
survivors reran (a loss outside a step, while they evaluated, checkpointed or saved the final model:
``during`` says which, which they did again, and the step is the next to train), the workers lost and
those left (workers of the original run), the recovery's
seconds, the survivors' mask, whether it restores the designed coverage (``restore_coverage``) and
the buffer bytes rank 0 moved for it (with local steps, a loss inside a round has ``restore_at``, the
step whose start makes the move, recorded then as a change of its own with no worker lost), and per
rejoin (``max_rejoins``) the step, the workers that ``joined`` and all workers in rank order, the
designed mask's rows in that order (under a schedule, of the round in force), the seconds and the
bytes rank 0 sent (that step's metrics line has ``membership``; `sdp_train.trainer.membership`);
``comm_bytes_per_step`` (buffer bytes) and ``wire_bytes_per_step`` (bytes sent under
``wire_model``), medians per rank (with ``local_steps`` > 1, which sends once every
``local_steps`` steps, means over every step); ``model_file``: the
final full model's file name, ``model.safetensors`` (null under ``save_model=False``), written by
rank 0 just before summary.json (`sdp_train.trainer.outputs`). Validation loss is that of the full
assembled model, the very tensors the model file holds. On image data (``digits``, ``cifar``) that
model's top-1 accuracy on the same batches is ``final_val_accuracy`` (null for language models),
and every evaluation's ``val_accuracy`` in `val_history` and the metrics line. While the run goes, rank 0 shows a
progress bar, plain ``--log-every`` lines and TensorBoard scalars (`sdp_train.trainer.log`).

Checkpoints and restarts: with ``checkpoint_every`` the loop writes ``DIR/checkpoints/step_N``
(`sdp_train.trainer.checkpoint`, rotated to ``keep_checkpoints``). A resumed run keeps the metrics lines
of the steps before its checkpoint. When torch's elastic agent restarts the worker group after a
failure (``max_restarts``), the new attempt resumes by itself from the newest valid checkpoint
under ``DIR/checkpoints`` (from the start, or from ``resume``, when there is none), so it ends
with the same parameters and loss trajectory as an uninterrupted run. Under ``nonfinite='stop'``
a non-finite step raises NonFiniteError on every rank and no summary.json is written.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from masklab.io import atomic_write_text, mask_to_dict
from sdp_train.data import IMAGE_DATASETS, build_batches
from sdp_train.errors import ConfigError, NonFiniteError
from sdp_train.models import block_map, model_class
from sdp_train.parallel.blockmap import BlockMap, on_meta
from sdp_train.parallel.dist import (all_gather_objects, default_device, get_dist_info, meet_before_groups, print0,
                                     wait, watch_waits)
from sdp_train.parallel.grads import local
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.wire import WIRE_MODEL
from sdp_train.trainer.agreement import (JOIN_ENV, STEPS_DONE_KEY, MembershipChange, RunEnded, WorkerLossError,
                                         exited_key, finished_key, joining_fails)
from sdp_train.trainer.checkpoint import (
    check_out_shared,
    check_resumable,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.faults import die
from sdp_train.trainer.launch import LAUNCHER_ENV, destroy_distributed, init_distributed, restart_attempt, run_id
from sdp_train.trainer.log import RunLog
from sdp_train.trainer.membership import Point, Survival
from sdp_train.trainer.memory import TRACKER_MODULE, MemoryMeter, format_bytes
from sdp_train.trainer.outputs import MODEL_FILE, save_model
from sdp_train.trainer.prepare import Prepared, prepare
from sdp_train.trainer.run import Run, forward_precision, logits_of, loss_chunks_of, loss_fn, train_loss
from sdp_train.trainer.user_model import NEURON_GROUPS as USER_NEURON_GROUPS
from sdp_train.trainer.user_model import UserModel


def modules_before_groups(configs: Sequence[TrainConfig], device: torch.device) -> tuple[str, ...]:
    """The modules runs of `configs` import that must come before the process group (`init_distributed`):
    DTensor for FSDP, torch's memory tracker for a measured step on CPU. Nothing else: each costs
    every rank a second or more to import."""
    names = []
    if any(c.fsdp or c.mode == "fsdp" for c in configs):
        names.append("torch.distributed.tensor")
    if device.type != "cuda" and any(c.memory_steps > 0 for c in configs):
        names.append(TRACKER_MODULE)
    return tuple(names)


def train(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run `cfg` on this rank; rank 0 returns the summary (other ranks None)."""
    prep = resume_after_restart(prepare(cfg))  # every check before any process group exists
    device = default_device()
    info = get_dist_info()
    if info.world_size != cfg.workers:
        raise ConfigError(f"--workers {cfg.workers} but the launcher started {info.world_size} ranks")
    if cfg.on_worker_loss == "continue" and LAUNCHER_ENV not in os.environ:
        raise ConfigError("on_worker_loss='continue' (--on-worker-loss) needs the ranks started by "
                          "`sdp train --workers N` itself: torchrun's agent stops every rank when one fails")
    torch.manual_seed(cfg.seed)
    joining = os.environ.get(JOIN_ENV) == "1"  # a replacement for a lost worker (--max-rejoins)
    if joining:
        for name in modules_before_groups([cfg], device):
            importlib.import_module(name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    else:
        info = init_distributed(device, preload=modules_before_groups([cfg], device))
    try:
        if joining:
            try:
                survival, info, admitted = Survival.join(prep.mask, info.rank, device,
                                                         restore=coverage_to_restore(prep), seed=cfg.seed)
            except RunEnded as exc:  # started as the run ended: not a failure, the launch exits 0
                print(f"sdp train: note: {exc}", file=sys.stderr, flush=True)
                return None
            watch_waits(survival.loss_begun)
            meet_before_groups(survival.meet_for_group)
            return train_prepared(prep, info, device, survival, admitted=admitted)
        if cfg.checkpoint_every or prep.resume_from is not None:
            check_out_shared(cfg.out, info.world_size)  # a multi-node run's checkpoints need one shared --out
        survival = (Survival.for_run(prep.mask, info, restore=coverage_to_restore(prep), rejoin=cfg.max_rejoins > 0,
                                     seed=cfg.seed) if cfg.on_worker_loss == "continue" else None)
        if survival is not None:  # a survivor blocked on a peer that failed out gives up once recovery begins
            watch_waits(survival.loss_begun)
            meet_before_groups(survival.meet_for_group)  # and one lost before a new group's members all came
        return train_prepared(prep, info, device, survival)
    except WorkerLossError as exc:  # the survivors cannot continue: one of them says why
        if exc.report:
            print(f"sdp train: error: {exc}", file=sys.stderr, flush=True)
        raise
    except NonFiniteError as exc:
        # Raised on every rank in the same step. Rank 0 reports it before any rank leaves: a
        # launcher stops the other ranks at the first exit, which could cut rank 0 off unprinted.
        if info.is_main:
            print(f"sdp train: error: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()
        raise
    finally:
        watch_waits(None)
        meet_before_groups(None)
        destroy_distributed()  # joins every group's threads now, not during interpreter shutdown


def train_prepared(prep: Prepared, info, device: torch.device, survival: Survival | None = None, *,
                   admitted: MembershipChange | None = None) -> dict[str, Any] | None:
    """`train` after its checks, on a process group that exists: rank 0 returns the summary.

    With `survival` (``--on-worker-loss continue``) a step that fails because workers were lost is
    run again on its batch by the survivors, in their new world (`Survival.recover`), and, with
    ``--max-rejoins``, replacements join at a step boundary (`Survival.admit`). `admitted`: this rank
    is such a replacement, admitted by that change at its step: its part, the shared tensors and
    their optimizer state come from their holders, and it reads its worker's data from that step on."""
    cfg = prep.config
    out = Path(cfg.out)
    shard = (info.rank, info.world_size)
    if admitted is not None:  # the lost worker's data shard of the first world; built under the members' rows
        shard = (survival.worker, cfg.workers)
        # under a schedule the state of the round in force is in the welcome mask (members' restored rows too)
        in_force = None if prep.mask.schedule.is_static else admitted.welcome_mask.matrix
        position = Rounds(prep.mask, cfg.seed, counts=True).for_joiners(admitted.workers, steps=admitted.step,
                                                                         in_force=in_force)
        with joining_fails(survival.worker, admitted.step):
            run = Run(dataclasses.replace(prep, mask=admitted.welcome_mask), info, device, joining=position)
        prep = dataclasses.replace(prep, mask=admitted.mask)  # the designed rows in rank order, from `welcome` on
    else:
        run = Run(prep, info, device)
    batches = build_batches(prep.data, split="train", seed=cfg.seed, rank=shard[0], world_size=shard[1])
    if admitted is not None:  # the step, the learning rate's schedule and the data go on from the members'
        if run.faults.kill_joiner == admitted.step:  # tests only: lost while the members send its parts
            die()
        # going to the designed rows from members' restored ones: all or nothing, the joiner answering too
        vote = survival.welcome_vote(run, admitted.step, admitted.workers, admitted.welcome_mask, admitted.mask)
        try:
            with joining_fails(survival.worker, admitted.step):
                run.welcome(range(len(admitted.rows), len(admitted.workers)), admitted.mask, vote)
        finally:  # given up (the members go on without it): the others stop waiting for its answer
            survival.move_given_up()
        run.steps_applied = admitted.step
        batches.load_state_dict({**batches.state_dict(), "step": admitted.step})
        start = admitted.step
    else:
        start = 0 if prep.resume_from is None else load_checkpoint(run, batches, prep.resume_from)
    if start < cfg.steps:  # a checkpoint at the end of a round: the change comes now, before the memory meter
        run.enter_next_round()
    meter = MemoryMeter(run.model, run.optimizer, device, extra=run.comm_buffers)
    metrics_file, history = open_metrics(out, start) if info.is_main else (None, [])
    log = RunLog(cfg, start=start, enabled=info.is_main)
    records: list[dict[str, Any]] = []
    val_history: list[dict[str, float]] = []
    consecutive_skips = 0
    worker = info.rank if survival is None else survival.worker  # its number in the first world (test faults)
    carried: MembershipChange | None = None  # a loss outside a step, for the next step's metrics line

    def changed(change: MembershipChange, *, applied: bool = False) -> None:
        """After a membership change: this rank's new `info`; where rank 0 was lost, the new rank 0 takes over
        metrics.jsonl (the lines so far, from `records`) and the live log (progress, ``--log-every`` lines,
        TensorBoard from the next step); the change printed (`report_change`)."""
        nonlocal info, metrics_file, history, log
        info = run.info
        if info.is_main and metrics_file is None:
            metrics_file, history = open_metrics(out, start)
            metrics_file.writelines(json.dumps(_json_safe(r)) + "\n" for r in records)
            log.close()
            log = RunLog(cfg, start=records[-1]["step"] + 1 if records else start, enabled=True)
        report_change(change, info, cfg.steps, applied=applied)

    def outside_step(during: str, work: Callable[[], Any]) -> Any:
        """`work()` outside a training step (`during`: evaluating, checkpointing, saving the final model). With
        `survival`, a worker lost in it is recovered from as in a step (`Survival.recover`: the survivors
        agree, form their world and go on under their mask), with no step to rerun, and the survivors do
        `work` again in their new world; a loss that leaves a block without holder still stops the run. A
        survivor that the others were ahead of (`Survival.meeting`) skips `work` up to their point: an
        evaluation gives the result it took from them, a checkpoint (complete) nothing."""
        nonlocal carried
        if survival is None:
            return work()
        survival.where = point = Point(run.steps_applied, during)
        while True:
            if survival.skips(point):
                return survival.skip(point)
            try:
                done = work()
                break
            except RuntimeError as exc:  # a collective with a lost peer fails; other errors re-raise
                if isinstance(exc, WorkerLossError):
                    raise
                change = survival.recover(run, run.steps_applied, exc, device, during=during)
            changed(change)
            carried = change
        if during == "evaluating":  # for survivors of a loss still waiting for it (`meeting`)
            survival.evaluation = (point.steps, done)
        return done

    def held(point: str, steps: int) -> tuple[Callable[[], None], Callable[[], None]] | None:
        """Tests only (``SDP_TEST_HOLD_AT``): what runs before and after the wait of `point`'s last collective."""
        if run.faults.hold_at is None or survival is None:
            return None
        return (lambda: run.faults.hold_for(point, steps, worker, lambda w: survival.store.check([exited_key(w)])),
                lambda: run.faults.kill_after(point, steps, worker))

    def evaluated(*, save_to: Path | None = None) -> tuple[float, float | None, dict[str, float] | None]:
        """`evaluate` and, in mode overlap, the consensus distance (collectives)."""
        run.faults.kill_at_point("evaluating", run.steps_applied, worker)  # tests only
        steps = run.steps_applied
        val_loss, val_accuracy = evaluate(run, prep, save_to=save_to, before_result=None if save_to is None else
                                          lambda: run.faults.kill_at_point("saving", steps, worker),
                                          held=held("evaluating", steps))
        return val_loss, val_accuracy, run.consensus_distance()

    def close_step(step: int, record: dict[str, Any], stats) -> None:
        """Read `step`'s values (a host synchronisation), then its evaluation, metrics line and checkpoint."""
        nonlocal consecutive_skips
        values = run.finish(step, stats)  # nonfinite='stop' raises here, on every rank
        record.update(loss=values["loss"], lr=values["lr"], grad_norm=values["grad_norm"], skipped=values["skipped"])
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            val_loss, val_accuracy, consensus = outside_step("evaluating", evaluated)
            val_history.append({"step": step, "val_loss": val_loss})
            record["val_loss"] = val_loss
            if val_accuracy is not None:
                val_history[-1]["val_accuracy"] = record["val_accuracy"] = val_accuracy
            if consensus is not None:  # mode overlap
                val_history[-1]["consensus_distance"] = record["consensus_distance"] = consensus
        records.append(record)
        consecutive_skips = consecutive_skips + 1 if values["skipped"] else 0
        if consecutive_skips >= cfg.max_consecutive_skips:  # the same on every rank: stats are all-reduced
            raise NonFiniteError(f"step {step}: {consecutive_skips} non-finite steps in a row "
                                 f"(max_consecutive_skips={cfg.max_consecutive_skips}); the run has diverged")
        if metrics_file is not None:
            metrics_file.write(json.dumps(_json_safe(record)) + "\n")
            metrics_file.flush()
        # after the metrics line: a checkpoint at step + 1 implies the lines of every step before it
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
            outside_step("checkpointing", lambda: save_checkpoint(
                run, batches, step + 1, out / "checkpoints", keep=cfg.keep_checkpoints,
                workers=None if survival is None else survival.workers,
                after_write=lambda: run.faults.kill_at_point("checkpointing", step + 1, worker),
                held=held("checkpointing", step + 1)))
        log.update(record, meter.peak.get("total"))

    def must_close_now(step: int) -> bool:
        """Whether `step` is closed before the next step starts (it evaluates, checkpoints or is the last)."""
        return (step + 1 == cfg.steps or bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                or bool(cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0))

    try:
        # A step's values are read one step late, after the next step is queued (a GPU never waits on
        # the host), except where the step evaluates, checkpoints or ends the run.
        pending: tuple[int, dict[str, Any], Any] | None = None
        for step in range(start, cfg.steps):
            inputs, targets = (t.to(device) for t in next(batches))
            change = None
            if survival is not None:
                survival.where = Point(step, "boundary")
            if survival is not None and survival.meets_in(step):
                pass  # the survivors ahead of this one at a loss were in this step: they did this boundary's work
            elif survival is not None and (admitted is None or step > start):  # a joiner was admitted at its start
                restored = survival.restore_due(run, step)  # a restore a loss inside a round left due
                if restored is not None:  # (a worker lost while the blocks moved: survived, rank 0 too)
                    changed(restored)
                joined = survival.admit(run, step, device)  # then joiners (a failed admission: a member lost)
                if joined is not None:
                    changed(joined)
                change = joined or restored  # the step's metrics line has the last
            if survival is not None:
                survival.where = Point(step, "step")
            change, carried = change or carried, None
            while True:  # once, unless workers are lost during the step (`survival`)
                bytes_before, wire_before = run.comm_bytes, run.wire_bytes
                measured = meter.measure() if step - start < cfg.memory_steps else nullcontext()
                t0 = time.perf_counter()
                try:
                    with measured:
                        stats = run.step(step, inputs, targets)
                    break
                except RuntimeError as exc:  # a collective with a lost peer fails; other errors re-raise
                    if survival is None:
                        raise
                    change = survival.recover(run, step, exc, device)
                    applied = run.steps_applied == step + 1  # lost while Bb-SDP sent the step's new values
                    changed(change, applied=applied)
                    if applied:  # every survivor applied this step (they agreed on it): go on, do not rerun
                        stats = run.applied_stats
                        break
            step_time = time.perf_counter() - t0
            tokens = targets.numel() * info.world_size
            record = {"step": step, "loss": None, "lr": None, "grad_norm": None,
                      "step_time_s": step_time, "tokens_per_s": tokens / step_time,
                      "comm_bytes": run.comm_bytes - bytes_before, "wire_bytes": run.wire_bytes - wire_before,
                      "skipped": None}
            if change is not None:
                record["membership"] = {"lost": list(change.lost), "joined": list(change.joined),
                                        "workers": list(change.workers), "recovery_s": change.recovery_s,
                                        "coverage_restored": change.restored}
                if change.during is not None:
                    record["membership"]["during"] = change.during
            if pending is not None:
                close_step(*pending)
            pending = (step, record, stats)
            if must_close_now(step):
                close_step(*pending)
                pending = None
        if survival is not None:  # no boundary is left to admit a replacement at (`Survival.join`, the launcher)
            survival.store.set(STEPS_DONE_KEY, "1")

        def finish_run() -> tuple[tuple[float, float | None, dict[str, float] | None], list[dict[str, Any]]]:
            """The final evaluation, the model file and every rank's figures (collectives)."""
            values = evaluated(save_to=out if cfg.save_model else None)
            trained = sum(p.numel() for p in _optimizer_params(run))
            return values, _gather({"peak": meter.peak, "trained": trained}, run.info.world_size, device)

        (val_loss, val_accuracy, final_consensus), per_rank = outside_step("saving the final model", finish_run)
        mask_change_bytes = run.mask_change_bytes
        log.final(val_loss, val_accuracy)
        num_params_local = sum(p.numel() for p in run.model.parameters())
    finally:
        log.close()
        if metrics_file is not None:
            metrics_file.close()
        run.close()  # its hooks and groups go now, before `train` destroys the process groups
    if not info.is_main:
        _finished(survival, run.faults, cfg.steps)
        return None
    history += [_json_safe(r) for r in records]  # the steps of earlier attempts, then this one's
    timed = records[1:] or records or history  # this attempt's first step pays one-off warm-up costs
    # averaging every local_steps steps (overlap averaging, or B-/N-SDP with local steps) sends once per
    # round: its bytes per step are the mean over the whole run; stepwise averaging sends the same every
    # step, so the median of `timed` is that number
    averages_rounds = cfg.mode == "overlap" or cfg.local_steps > 1
    per_step, every = (statistics.fmean, history) if averages_rounds else (statistics.median, timed)
    skipped = [r["step"] for r in history if r.get("skipped")]
    finite = [r["loss"] for r in history if not r.get("skipped")]
    summary = {
        "final_train_loss": finite[-1] if finite else None,
        "final_val_loss": val_loss,
        "final_val_accuracy": val_accuracy,
        "val_history": val_history,
        "comm_bytes_per_step": per_step([r["comm_bytes"] for r in every]),
        "wire_bytes_per_step": per_step(w) if (w := [r["wire_bytes"] for r in every if "wire_bytes" in r])
        else None,
        "wire_model": WIRE_MODEL,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "world_size": info.world_size,
        "num_params_local": num_params_local,
        "num_params_trained": [r["trained"] for r in per_rank],
        "peak_memory_bytes": [r["peak"] for r in per_rank],
        "num_skipped_steps": len(skipped),
        "skipped_steps": skipped,
        "resumed_from_step": start,
        "restart_attempt": restart_attempt(),
        "config": cfg.to_dict(),
        "mask": None if prep.mask is None else mask_to_dict(prep.mask),
        "model_file": MODEL_FILE if cfg.save_model else None,
    }
    if final_consensus is not None:
        summary["final_consensus_distance"] = final_consensus
    if mask_change_bytes is not None:
        summary["mask_change_bytes"] = mask_change_bytes
    if survival is not None:
        summary["membership_changes"] = [c.to_dict() for c in survival.changes]
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    _finished(survival, run.faults, cfg.steps)
    final = summary["final_train_loss"]
    accuracy = "" if val_accuracy is None else f", val accuracy {val_accuracy:.2%}"
    print0(f"done: final train loss {'n/a' if final is None else f'{final:.4f}'}, val loss {val_loss:.4f}{accuracy}, "
           f"{summary['comm_bytes_per_step'] / 1e6:.3f} MB of collective buffers per step per rank "
           f"({(summary['wire_bytes_per_step'] or 0) / 1e6:.3f} MB sent, ring model), peak memory "
           f"{_peak_text(summary['peak_memory_bytes'])}"
           f"{f', {len(skipped)} step(s) skipped (non-finite)' if skipped else ''} -> {out}")
    return summary


def _finished(survival: Survival | None, faults, steps: int) -> None:
    """Tell the launcher (``--on-worker-loss continue``) that this worker's part of the run is done, so that an
    exit after this point (a kill during teardown) does not fail the launch."""
    if survival is not None:
        survival.store.set(finished_key(survival.worker), "1")
        faults.kill_at_point("finished", steps, survival.worker)  # tests only


def coverage_to_restore(prep: Prepared) -> dict[str, Any] | None:
    """With ``restore_coverage``: what `masklab.survivors.restored_mask` designs the survivors' mask with
    (the start mask's least coverage, N-SDP's neuron groups per block, the run's seed, and at block level
    a built-in family's bytes per block, `holder_bytes`, so that the survivors' bytes stay balanced where
    blocks differ in size, as in a ResNet; with ``restore_budgets`` the budgets and the bytes every worker
    holds whatever its blocks); else None."""
    cfg = prep.config
    if not cfg.restore_coverage:
        return None
    groups = sizes = None
    if cfg.level == "neuron":
        groups = USER_NEURON_GROUPS if isinstance(prep.model_config, UserModel) else prep.model_config.neuron_groups
    elif not isinstance(prep.model_config, UserModel):
        bmap = block_map(prep.model_config)
        sizes = [holder_bytes(bmap, [n for n, _ in block.tensors], cfg.mode) for block in bmap.blocks["block"]]
    restore = {"coverage": int(prep.mask.coverage.min()), "groups": groups, "seed": cfg.seed, "sizes": sizes}
    if cfg.restore_budgets is not None:  # block level, a built-in family (TrainConfig checks)
        every_block = holder_bytes(bmap, list(bmap.shapes), "bsdp")  # a worker that holds every tensor whole
        restore |= {"budgets": cfg.restore_budget_bytes, "fixed_bytes": every_block - sum(sizes)}
    return restore


ELEMENT_BYTES = 4  # float32: parameters, gradients and AdamW state stay float32 under bfloat16 autocast too
PARAMETER_BYTES = 4 * ELEMENT_BYTES  # a parameter, its gradient and AdamW's two moments, per element


def holder_bytes(bmap: BlockMap, names: Sequence[str], mode: str) -> int:
    """The bytes of the tensors `names` of `bmap`'s model that a worker keeps only where it holds them in
    `mode`: `PARAMETER_BYTES` per parameter element and `ELEMENT_BYTES` per buffer element; in Bb-SDP
    and overlap averaging, whose workers keep every block, a parameter's gradient and AdamW state only. Activations and
    communication buffers are not counted."""
    if mode in ("bbsdp", "overlap"):
        return sum((PARAMETER_BYTES - ELEMENT_BYTES) * math.prod(bmap.shapes[n]) for n in names
                   if n in bmap.parameter_names)
    return sum((PARAMETER_BYTES if n in bmap.parameter_names else ELEMENT_BYTES) * math.prod(bmap.shapes[n])
               for n in names)


def report_change(change: MembershipChange, info, steps: int, *, applied: bool = False) -> None:
    """Print, on the new rank 0, who was lost, who trains on and the survivors' mask with its certificate
    (`applied`: every survivor had applied the step, which is not rerun; a loss outside a step,
    `change.during`: what the survivors do again)."""
    if not info.is_main:
        return
    from masklab import analyze
    from sdp_train.trainer.outputs import mask_lines

    if change.joined:
        print(f"sdp train: step {change.step + 1}/{steps}: worker{'s' * (len(change.joined) > 1)} "
              f"{', '.join(map(str, change.joined))} rejoined ({change.recovery_s:.2f} s, "
              f"{change.moved_bytes / 1e6:.3f} MB moved by this rank); workers {', '.join(map(str, change.workers))} "
              "train on under the designed mask (its rows in that order):", flush=True)
        print("\n".join(mask_lines(change.mask, analyze(change.mask))), flush=True)
        return
    if not change.lost:  # with local steps, the restore that a loss inside a round left due
        print(f"sdp train: step {change.step + 1}/{steps}: workers {', '.join(map(str, change.workers))} restore the "
              f"designed coverage at the round's boundary ({change.recovery_s:.2f} s, {change.moved_bytes / 1e6:.3f} "
              "MB moved by this rank):", flush=True)
        print("\n".join(mask_lines(change.mask, analyze(change.mask))), flush=True)
        return
    lost = ", ".join(map(str, change.lost))
    later = ("" if change.restore_at is None else
             f", until the round's boundary before step {change.restore_at + 1} restores the designed coverage")
    where = (f"step {change.step + 1}/{steps}" if change.during is None else
             f"after step {change.step}/{steps}, while {change.during}")
    survivors = ", ".join(map(str, change.workers))
    print(f"sdp train: {where}: lost worker{'s' * (len(change.lost) > 1)} {lost}; "
          + (f"workers {survivors} continue" if len(change.workers) > 1 else f"worker {survivors} continues")
          + f" without rollback ({change.recovery_s:.2f} s), "
          + ("having applied this step, from the next step" if applied else "rerunning this step"
             if change.during is None else f"{change.during} again")
          + (f" under a mask that restores the designed coverage ({change.moved_bytes / 1e6:.3f} MB moved by "
             "this rank):" if change.restored else f" under the survivors' mask{later}:"), flush=True)
    print("\n".join(mask_lines(change.mask, analyze(change.mask))), flush=True)


def _peak_text(peaks: list[dict[str, int]]) -> str:
    largest = max((p.get("total", 0) for p in peaks), default=0)
    # nothing measured: memory_steps=0, or a restart from the final checkpoint trained no step
    return f"{format_bytes(largest)} on the largest rank" if largest else "not measured (no step measured)"


def resume_after_restart(prep: Prepared) -> Prepared:
    """On a restarted attempt of the worker group, continue from the newest valid checkpoint of this run."""
    cfg, attempt = prep.config, restart_attempt()
    if attempt == 0 or not cfg.checkpoint_every:
        return prep
    found = latest_valid_checkpoint(Path(cfg.out) / "checkpoints", run_id=run_id())
    if found is None:
        start = "the start" if prep.resume_from is None else str(prep.resume_from)
        print0(f"sdp train: restart {attempt}: no valid checkpoint under {Path(cfg.out) / 'checkpoints'}; "
               f"starting again from {start}")
        return prep
    check_resumable(found, cfg, prep.model_config, prep.mask, finished_ok=True, same_config=True)
    print0(f"sdp train: restart {attempt}: resuming from {found}")
    return dataclasses.replace(prep, resume_from=found)


def metrics_history(out: str | Path, start: int, *, report: bool = True) -> list[dict[str, Any]]:
    """The records of steps ``0 .. start-1`` in ``out/metrics.jsonl``, which a run resumed at `start` keeps.

    Lines after them (steps the checkpoint does not cover, or a line half-written when a run was
    killed) are dropped, with a note on stderr when any was damaged. A damaged or missing line among
    the kept steps is a ConfigError naming the file and line: the resume refuses rather than
    continue with a history that has a hole. A missing file means no history.
    """
    path = Path(out) / "metrics.jsonl"
    if not start or path.is_symlink() or not path.is_file():  # a link is not this run's file (replaced)
        return []
    kept: list[dict[str, Any]] = []
    dropped = 0
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if len(kept) == start:
            dropped += 1
            continue
        try:
            record = json.loads(line)
            step = record["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ConfigError(f"{path}:{lineno}: damaged metrics line ({type(exc).__name__}: {exc}); the resume "
                              f"at step {start} keeps the lines of steps 0..{start - 1}: repair the file, or "
                              f"remove it to resume without that history") from None
        if step != len(kept):
            raise ConfigError(f"{path}:{lineno}: expected the line of step {len(kept)}, found step {step!r}")
        kept.append(record)
    if dropped and report:
        print0(f"sdp train: {path}: kept steps 0..{start - 1} (the checkpoint's), dropped {dropped} later line(s)")
    return kept


def open_metrics(out: Path, start: int):
    """metrics.jsonl for writing, and the records it keeps: none (fresh), or (resuming) the steps before `start`.

    The kept history is read and checked before anything is removed or rewritten.
    """
    kept = metrics_history(out, start)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", MODEL_FILE):  # present only once this run has finished
        (out / stale).unlink(missing_ok=True)
    path = out / "metrics.jsonl"
    if path.is_symlink():  # never write through a link planted in --out: replace it by a real file
        path.unlink()
    f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w", encoding="utf-8")
    f.writelines(json.dumps(record) + "\n" for record in kept)
    f.flush()
    return f, kept


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with non-finite floats as None (``null``): strict JSON, unlike Python's ``NaN``."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _optimizer_params(run: Run) -> list[torch.Tensor]:
    """The tensors this rank's optimizer steps (local shards of FSDP parameters)."""
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    return [local(p) for p in params]


def _gather(value: Any, world_size: int, device: torch.device) -> list[Any]:
    """Every rank's `value` (a picklable object), in rank order (a collective, its waits watched)."""
    if world_size == 1:
        return [value]
    return all_gather_objects(value, device)


@torch.no_grad()
def evaluate(run: Run, prep: Prepared, *, save_to: Path | None = None,
             before_result: Callable[[], None] | None = None,
             held: tuple[Callable[[], None], Callable[[], None]] | None = None) -> tuple[float, float | None]:
    """Mean validation loss of the full assembled model, and its top-1 accuracy on image data (None on
    text), evaluated on rank 0 only; every rank gets both.

    With `save_to`, rank 0 also writes that full model to ``save_to/model.safetensors``
    (`sdp_train.trainer.outputs.save_model`): the file holds exactly the model this loss scores.
    `before_result` (tests only: `sdp_train.trainer.faults`) runs on every rank before rank 0 sends the result;
    `held` (tests only, ``SDP_TEST_HOLD_AT``): two callables run on every rank, before the wait for the result
    (once its broadcast is posted) and after it.

    Rank 0 assembles the full model (`Run.full_state`) and scores the validation shards of every
    rank (``eval_batches`` each), so no other rank ever holds a full model copy; under SDP, rank 0
    holds its own subnetwork's training state plus one full model for the evaluation's duration
    (docs/plan.md states that peak). The validation split is always interleaved (iid) across
    ranks, also when training data is heterogeneous, so that runs with and without
    ``heterogeneous`` are scored on the same batches.
    """
    info = run.info
    full = run.full_state()
    total = torch.zeros(4, dtype=torch.float64, device=run.device)
    if full is not None:
        if isinstance(prep.model_config, UserModel):  # built for real: its non-persistent buffers are computed
            model = prep.model_config.build(run.device).to(run.device)
            model.load_state_dict(full, strict=True)
        else:
            with on_meta():
                model = model_class(prep.model_config)(prep.model_config)
            model.load_state_dict(full, assign=True)  # the assembled tensors themselves: no second copy
            model.to(run.device)  # assembled on CPU (`full_state_dict`): a no-op there, one copy on a GPU
        # the model file holds the statistics this validation uses (the UserModel path copied `full`)
        full |= {n: t for n, t in recalibrate_batch_norm(model, prep, prep.config.workers, run.device).items()
                 if n in full}
        if save_to is not None:
            save_model(save_to, full, config=getattr(model, "config", None))
        total += validation_sums(model, prep, prep.config.workers, run.device)  # every worker's shard, lost or not
        del model, full
    if before_result is not None:
        before_result()
    if info.world_size > 1:  # watched: a survivor blocked here gives up once a loss is being recovered from
        work = dist.broadcast(total, src=0, async_op=True)
        if held is not None:
            held[0]()
        wait(work, total.device)
        if held is not None:
            held[1]()
    return float(total[0] / total[1]), (float(total[2] / total[3]) if total[3] else None)


def bn_recalibration_batches(cfg: TrainConfig) -> int:
    """Training batches per rank over which `recalibrate_batch_norm` recomputes BatchNorm statistics
    (``bn_recalibration``; None: ``eval_batches`` in modes bsdp and nsdp, else 0)."""
    if cfg.bn_recalibration is not None:
        return cfg.bn_recalibration
    return cfg.eval_batches if cfg.mode in ("bsdp", "nsdp") else 0


_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@torch.no_grad()
def recalibrate_batch_norm(model: torch.nn.Module, prep: Prepared, world_size: int, device: torch.device
                           ) -> dict[str, torch.Tensor]:
    """Recompute the running mean and variance of every BatchNorm layer of the full `model` as the
    plain average over the first `bn_recalibration_batches` training batches of every rank's shard,
    forward passes in train mode that update nothing else; returns the new statistics by state-dict
    name (empty where nothing was done: no BatchNorm layer, or a count of 0).

    Under forward masking (B-SDP, N-SDP) a block's statistics are those of its holders' subnetworks,
    whose inputs skip the blocks they do not hold; the assembled full model feeds it other inputs,
    which these statistics match (docs/design.md, "Evaluating the assembled model")."""
    norms = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
    batches = bn_recalibration_batches(prep.config)
    if not norms or not batches:
        return {}
    momenta = [m.momentum for m in norms.values()]
    for m in norms.values():  # new tensors: the assembled ones may be a training rank's own (on CPU)
        m.running_mean, m.running_var = torch.zeros_like(m.running_mean), torch.ones_like(m.running_var)
        m.num_batches_tracked = torch.zeros_like(m.num_batches_tracked)
        m.momentum = None  # a cumulative average over the batches, whatever their order
    model.train()
    try:
        for rank in range(world_size):
            train = build_batches(prep.data, split="train", seed=prep.config.seed, rank=rank, world_size=world_size)
            for _, (inputs, _targets) in zip(range(batches), train.epoch()):
                with forward_precision(prep.config, device):
                    model(inputs.to(device))
    finally:
        for m, momentum in zip(norms.values(), momenta):
            m.momentum = momentum
        model.eval()
    return {f"{name}.{stat}" if name else stat: getattr(m, stat) for name, m in norms.items() for stat in _BN_STATS}


@torch.no_grad()
def validation_sums(model: torch.nn.Module, prep: Prepared, world_size: int, device: torch.device) -> torch.Tensor:
    """``[sum of batch losses, number of batches, correct top-1 predictions, examples]`` (float64) of a
    full `model` over every rank's validation shard, ``eval_batches`` each: what the validation loss
    (the first over the second) and, on image data, the accuracy (the third over the fourth; both 0
    on text) of a run are."""
    cfg = prep.config
    model.eval()
    total = torch.zeros(4, dtype=torch.float64, device=device)
    val_data = dataclasses.replace(prep.data, heterogeneous=False)
    classifies = prep.data.dataset in IMAGE_DATASETS
    for rank in range(world_size):
        val = build_batches(val_data, split="val", seed=cfg.seed, rank=rank, world_size=world_size)
        for _, (inputs, targets) in zip(range(cfg.eval_batches), val.epoch()):
            inputs, targets = inputs.to(device), targets.to(device)
            with forward_precision(cfg, device):
                if classifies:  # class logits of the whole batch: the loss of `train_loss` and the top-1 hits
                    logits = logits_of(model(inputs))
                    loss = loss_fn(logits, targets)
                    total[2] += (logits.argmax(dim=-1) == targets).sum()
                    total[3] += targets.numel()
                else:
                    loss = train_loss(model, inputs, targets, loss_chunks_of(prep))
            total[0] += loss.double()
            total[1] += 1
    return total
