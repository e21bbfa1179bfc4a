"""One rank's run: its model, its mode's synchronisation and the optimizer (`Run`), the learning-rate
schedule (`lr_at`) and the loss (`train_loss`: the model's chunked loss for the built-in language
models, `loss_fn` of the logits otherwise).

`Run` holds the mode's synchronisation as one `sdp_train.trainer.modes.ModeSync` (``ddp``: torch DDP;
``fsdp``: FSDP2 ``fully_shard``; ``bsdp``/``nsdp``/``bbsdp``: the library API
`SubnetworkDataParallel`, as a user's loop uses it; ``overlap``: `OverlapAveraging`), so
`Run.step` is one step for every mode. Validation always uses the full assembled model, which
only rank 0 builds (`Run.full_state`).

Not here: the checks of a config (`sdp_train.trainer.prepare`) and the loop, metrics and files of a run
(`sdp_train.trainer.train`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdp_train.errors import NonFiniteError
from sdp_train.models import family_of
from sdp_train.parallel import grads
from sdp_train.parallel.dist import DistInfo, wait
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.wire import ByteCount
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.faults import InjectedFaults, die
from sdp_train.trainer.modes import ModeSync, build_sync
from sdp_train.trainer.prepare import Prepared
from sdp_train.trainer.user_model import UserModel, logits_of


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def forward_precision(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    """Where the forward and the loss run: under ``torch.autocast`` in bfloat16 for ``dtype='bfloat16'``
    (parameters, gradients and optimizer state stay float32), else as they are (a disabled autocast)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a model's logits (a tensor, or a user model's output: `logits_of`)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_chunks: int) -> torch.Tensor:
    """The loss of one batch, in training and validation: with ``loss_chunks`` >= 1 the model's own, its
    head computed that many chunks of tokens at a time (``forward(inputs, targets, loss_chunks=N)``, a
    family with ``chunked_loss``), else `loss_fn` of its logits. Called through the mode's wrapper
    (DDP, FSDP, `SubnetworkDataParallel`), so every mode computes its loss alike."""
    if loss_chunks:
        return model(inputs, targets, loss_chunks=loss_chunks)
    return loss_fn(model(inputs), targets)


def loss_chunks_of(prep: Prepared) -> int:
    """``loss_chunks`` of the run's config for a built-in family with a chunked loss, else 0 (full logits)."""
    model_config = prep.model_config
    if isinstance(model_config, UserModel) or not family_of(model_config).chunked_loss:
        return 0
    return prep.config.loss_chunks


class StepStats(Mapping):
    """One step's ``loss`` (the worker mean), ``grad_norm``, ``lr`` and ``skipped`` (non-finite), kept
    as device tensors and read on the host only when looked up, so that `Run.step` does not wait."""

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, nonfinite: torch.Tensor) -> None:
        self._values = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": nonfinite}

    def __getitem__(self, key: str) -> float | bool:
        value = self._values[key]
        if not isinstance(value, torch.Tensor):
            return value
        return bool(value) if value.dtype == torch.bool else value.item()

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class Run:
    """One rank's model, synchronisation and optimizer for a prepared config.

    The mode's synchronisation is one `sdp_train.trainer.modes.ModeSync` (`build_sync`), so the step below
    is the same for every mode.
    """

    def __init__(self, prep: Prepared, info: DistInfo, device: torch.device, *, joining: Rounds | None = None
                 ) -> None:
        """`joining`: this rank joins a run in progress (`sdp_train.trainer.membership`), at that position of
        the designed schedule (`build_sync`); call `welcome` next."""
        cfg = prep.config
        self.cfg, self.model_config, self.info, self.device = cfg, prep.model_config, info, device
        self.mask = prep.mask
        self.loss_chunks = loss_chunks_of(prep)
        self.run_bytes = ByteCount()  # the per-step stats all-reduce
        self.retired_bytes = ByteCount()  # of syncs that a lost worker retired (`continue_with`)
        self.steps_applied = 0  # optimizer steps this rank has taken (what survivors agree on)
        self.applied_stats: StepStats | None = None  # the last applied step's values (`step`)
        self.faults = InjectedFaults.from_environment()  # tests only: read once, two integer compares per step
        self.sync: ModeSync | None = build_sync(prep, info, device, joining=joining)
        self.model, self.train_model = self.sync.model, self.sync.train_model
        trainable = self.sync.trainable()
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
            # skipping a non-finite step on the device takes the fused kernel's found_inf (GradScaler's way)
            **({"fused": True} if cfg.nonfinite == "skip" else {"foreach": True}),
        )
        self.sync.attach(self.optimizer)

    def close(self) -> None:
        """Release the hooks, buffers and process-group references this rank's run holds.

        Gradient hooks live in C++ and hold the sync engine, its buffers and its process groups;
        until they are removed, none of it can be freed, so the groups' gloo threads would outlive
        ``destroy_process_group`` and abort the process at interpreter exit. Call once, after the
        last collective (`sdp_train.trainer.train.train` does).
        """
        if self.sync is not None:
            self.sync.close()
        self.sync = self.model = self.train_model = self.optimizer = None

    @property
    def comm_buffers(self) -> list[torch.Tensor]:
        """The mode's long-lived communication buffers (counted as "other" memory)."""
        return self.sync.buffers

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of every collective this rank took part in so far (`sdp_train.parallel.wire`)."""
        total = ByteCount()
        total += self.run_bytes
        total += self.retired_bytes
        total += self.sync.bytes
        return total

    @property
    def comm_bytes(self) -> int:
        """Buffer bytes so far: the sizes of the buffers passed to collectives."""
        return self.bytes.buffer

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sent so far under the ring model of `sdp_train.parallel.wire`."""
        return self.bytes.wire

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepStats:
        """One optimizer step; returns the worker-mean loss, the gradient norm and ``skipped``, as device
        tensors read only when looked up (`StepStats`): the step itself never waits for the device.

        The loss and squared gradient norm travel in one all-reduce, so a non-finite value on any
        rank (or in any held block's averaged gradient) is seen by every rank in the same step, and
        decided on the device: ``nonfinite='skip'`` drops this step's update on every rank (the
        fused AdamW's ``found_inf``, as torch's GradScaler does; the learning-rate schedule and a
        mask schedule stay indexed by step), ``'stop'`` raises NonFiniteError everywhere when the
        step's values are read (`finish`, one step late in `sdp_train.trainer.train`). The norm is
        that of the averaged gradient, each block counted once (under overlap averaging and local
        steps, whose workers keep their own gradients, the root mean square of the workers' norms,
        and each clips by its own); clipping is `sdp_train.parallel.grads.clip_`, the library's.
        """
        cfg, sync = self.cfg, self.sync
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with sync.step_context():
            with forward_precision(cfg, self.device):
                loss = train_loss(self.train_model, inputs, targets, self.loss_chunks)
            if self.faults.nan(step, self.info.rank):
                loss = loss * float("nan")  # NaN loss and NaN gradients on this rank
            loss.backward()
        own_sq = sync.grad_sq_norm()
        stats = torch.stack([loss.detach().float(), own_sq.float()])
        if self.info.world_size > 1:
            wait(dist.all_reduce(stats, async_op=True), stats.device)
            self.run_bytes.add("all_reduce", stats.numel() * stats.element_size(), self.info.world_size)
        if self.faults.kill(step, self.info.rank):
            die()
        grad_norm, clip_sq = sync.norms(stats[1], own_sq)
        nonfinite = ~torch.isfinite(stats).all()
        if cfg.grad_clip > 0:
            grads.clip_(grads.grads_of(self.model.parameters()), clip_sq, cfg.grad_clip)
        if cfg.nonfinite == "skip":
            self.optimizer.found_inf = nonfinite.float()
        # set before the optimizer step, whose post-hooks may communicate (overlap averaging averages
        # there, Bb-SDP sends the new values in `after_step`): a worker lost then interrupts a step that
        # every survivor has applied, so they go on with the next, not rerun it (`train_prepared`)
        self.steps_applied = step + 1
        self.applied_stats = StepStats(stats[0] / self.info.world_size, grad_norm, lr, nonfinite)
        self.optimizer.step()
        sync.after_step()
        if step + 1 < cfg.steps:  # after the last step no round follows: nothing may move for one
            sync.enter_next_round()
        self.optimizer.zero_grad(set_to_none=False)
        return self.applied_stats

    def continue_with(self, mask, rows, info: DistInfo, vote=None, *, restore=None) -> None:
        """Train on in a new world of survivors (`sdp_train.trainer.membership.Survival.recover`, after the
        old sync's `close`): the mode's sync rebuilt for the survivors' `mask` (`ModeSync.for_survivors`),
        the same model and optimizer, no gradient left of the interrupted step. `vote`: a move to restore
        coverage is all or nothing across the survivors (`sdp_train.parallel.changes.MoveVote`); when it
        fails, this rank's state is what it was before (static masks: the old sync stays; under a schedule the
        survivors' sync is in force, the change to the restored round no longer due). `restore` (under a
        schedule, ``--restore-coverage``): every round from now on under the mask restoring its designed
        coverage for the survivors, the round in force's at once (`ModeSync.enter_next_round`: what a
        survivor newly holds, with its optimizer state, from its lowest-ranked surviving holder), its
        bytes in the sync's `moved_bytes`."""
        sync = self.sync.for_survivors(mask, rows, info, self.optimizer, vote, restore=restore)
        self.retired_bytes += self.sync.bytes
        self.sync = sync
        self.info, self.mask = info, mask
        self.model, self.train_model = self.sync.model, self.sync.train_model
        self.sync.attach(self.optimizer)
        if restore is not None and self.sync.schedule_rounds is not None:
            before = self.sync.mask_change_bytes.buffer
            self.sync.enter_next_round(vote)  # after `attach`: the optimizer's state moves, its groups gain
            self.sync.moved_bytes = self.sync.mask_change_bytes.buffer - before
        self.optimizer.zero_grad(set_to_none=False)

    def admit(self, mask, workers, joiners, info: DistInfo, *, welcome_mask=None) -> None:
        """Train on in a new world that workers join (`sdp_train.trainer.membership.Survival.admit`, after the
        old sync's `close`): the mode's sync rebuilt over `welcome_mask` (the members' rows in force, the
        joiners' designed rows; None: the designed `mask`) for `workers`, the new world's rows of the
        designed mask, by `ModeSync.for_joiners`, the same model and optimizer; then the joiners' state
        comes (`welcome`), a member only sending. Going to `mask` is `to_designed`, called next."""
        self.retired_bytes += self.sync.bytes
        self.mask = mask if welcome_mask is None else welcome_mask
        self.sync = self.sync.for_joiners(self.mask, info, workers)
        self.info = info
        self.model, self.train_model = self.sync.model, self.sync.train_model
        self.sync.attach(self.optimizer)
        self.welcome(joiners)

    def welcome(self, joiners, mask=None, vote=None) -> None:
        """The ranks `joiners` receive their values, buffers and optimizer state from the other holders
        (every rank of the new world, members after `admit`, joiners after `__init__`), under the mask
        in force; then, with `mask`, `to_designed` (`vote` as there)."""
        self.sync.welcome(joiners, self.optimizer)
        self.to_designed(mask, vote)

    def to_designed(self, mask=None, vote=None) -> None:
        """Where `mask` (the designed one's rows) differs from the mask in force (members whose rows were
        restored for the survivors of a loss), every rank of the new world goes to `mask`: a member gains
        what its row now gives it from its lowest-ranked holder, with the optimizer state, and drops the
        rest (`ModeSync.for_survivors` with every worker kept). Under a schedule that change is the one
        `Rounds.for_joiners` made due, made here by the schedule's mover (`ModeSync.enter_next_round`). All
        or nothing across the new world (`vote`, `sdp_train.parallel.changes.MoveVote`): when it fails every
        rank is at its state from before, the sync in force the welcome's (with a static mask closed; under
        a schedule the change no longer due)."""
        if mask is not None and not np.array_equal(mask.matrix, self.mask.matrix):
            welcomed = self.sync.moved_bytes
            if self.sync.schedule_rounds is not None:
                before = self.sync.mask_change_bytes.buffer
                self.sync.enter_next_round(vote)
                self.mask = mask
                self.sync.moved_bytes = welcomed + self.sync.mask_change_bytes.buffer - before
            else:
                self.sync.close()
                self.continue_with(mask, range(self.info.world_size), self.info, vote)
                self.sync.moved_bytes += welcomed
        self.optimizer.zero_grad(set_to_none=False)

    def finish(self, step: int, stats: Mapping[str, Any]) -> dict[str, float | bool]:
        """A step's values read on the host (a synchronisation: call it a step late); under
        ``nonfinite='stop'`` a non-finite step raises NonFiniteError, on every rank alike."""
        values = dict(stats)
        if values["skipped"] and self.cfg.nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: non-finite training state (mean loss {values['loss']}, averaged gradient norm "
                f"{values['grad_norm']}, over {self.info.world_size} rank(s)); nonfinite='stop' ends the run "
                f"(--nonfinite skip skips such steps; a lower --lr may avoid them)")
        return values

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full assembled model on rank 0 (None on the other ranks); every rank must call it.

        Under SDP the library API assembles it (`SubnetworkDataParallel.full_state_dict`): each
        tensor slice from its lowest-ranked holder, one tensor at a time, summed onto rank 0, so
        no rank but rank 0 ever holds more than its own model and one full tensor. Under overlap
        averaging each tensor is its holders' average in the last round. Under FSDP each tensor is
        gathered over the world mesh, in one order on every rank. Under DDP (or on one rank) rank 0
        already holds the full model: its tensors are returned as they are, not copied (read them,
        do not write them).
        """
        return self.sync.full_state()

    def consensus_distance(self) -> dict[str, float] | None:
        """Mode ``overlap``: how far the workers' copies are apart, per block, ``other`` and ``total``
        (`OverlapAveraging.consensus_distance`; a collective); None in the other modes, whose holders agree."""
        return self.sync.consensus_distance()

    def schedule_state(self) -> dict[str, int]:
        """What a checkpoint keeps of the mask schedule's position (under a schedule: optimizer steps
        taken, which fix the round and its mask); ``{}`` in the other runs."""
        return self.sync.schedule_state()

    def load_schedule_state(self, state: dict[str, int]) -> None:
        self.sync.load_schedule_state(state)

    def enter_next_round(self) -> None:
        """Make the mask change due at a checkpoint taken at the end of a round (`ModeSync.enter_next_round`;
        every rank, after the checkpoint's state is loaded and only when a step follows)."""
        self.sync.enter_next_round()

    @property
    def mask_change_bytes(self) -> int | None:
        """Buffer bytes of the optimizer state moved at mask changes so far (Bb-SDP under a schedule),
        None where nothing moves."""
        moved = self.sync.mask_change_bytes
        return None if moved is None else moved.buffer

    @property
    def mask_change_seconds(self) -> float | None:
        """Wall time of the mask changes made so far (a schedule), None where nothing moves."""
        return self.sync.mask_change_seconds
