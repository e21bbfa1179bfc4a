"""The training run, top to bottom: config -> mask -> model -> sync -> optimizer -> loop -> summary.

Runs as one process or under torchrun (one rank per worker). `prepare` checks everything a run
needs before any process group exists. `Run` holds one rank's model, its mode's synchronisation
and the optimizer: the mode is one `sdp_train.modes.ModeSync` (``ddp``: torch DDP; ``fsdp``: FSDP2
``fully_shard``; ``bsdp``/``nsdp``/``bbsdp``: the library API `SubnetworkDataParallel`, as a
user's loop uses it; ``overlap``: `OverlapAveraging`), so `Run.step` is one step for every mode.
Validation always uses the full assembled model, which only rank 0 builds (`Run.full_state`).
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from masklab import Mask, Schedule, design, load_mask
from sdp_train.checkpoint import check_resumable, find_checkpoint
from sdp_train.config import BASELINES, SCHEDULED_MODES, TrainConfig
from sdp_train.data import DataConfig
from sdp_train.dist import DistInfo
from sdp_train.errors import ConfigError, NonFiniteError
from sdp_train.faults import InjectedFaults
from sdp_train.models import ModelConfig, block_map, get_model_config
from sdp_train.modes import ModeSync, build_sync, user_blocks
from sdp_train.sdp_blocks import find_blocks
from sdp_train.sdp_masking import describe
from sdp_train.sdp_parts import resolve_mask
from sdp_train.subnet import held_tensors
from sdp_train.user_model import (NEURON_GROUPS as USER_NEURON_GROUPS, build_user_model,
                                  describe_user_model, is_user_model, logits_of)
from sdp_train.wire import ByteCount


@dataclass(frozen=True)
class Prepared:
    """What `prepare` validated: the config, the model shape and the mask (None for DDP)."""

    config: TrainConfig
    model_config: ModelConfig
    mask: Mask | None
    data: DataConfig
    resume_from: Path | None = None
    """The checkpoint directory to continue from, already checked against this run."""


def prepare(cfg: TrainConfig) -> Prepared:
    """Check config, model and mask together; raise ConfigError before anything distributed starts."""
    if is_user_model(cfg.model):
        return _prepare_user_model(cfg)
    preset = get_model_config(cfg.model)
    is_lm = hasattr(preset, "vocab_size")
    data = _data_config(cfg, is_lm)
    model_config = get_model_config(cfg.model, **{**_image_fields(preset, data), **cfg.model_overrides})
    if is_lm and cfg.seq_len > model_config.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds {cfg.model}'s max_seq_len={model_config.max_seq_len}")
    _check_model_fits_data(cfg, model_config, data)
    mask = None if cfg.mode in BASELINES else _mask_for_model(cfg, model_config)
    resume_from = None
    if cfg.resume is not None:
        resume_from = find_checkpoint(cfg.resume)
        check_resumable(resume_from, cfg, model_config, mask)
    return Prepared(cfg, model_config, mask, data, resume_from)


_IMAGE_SHAPE = {"digits": (1, 8), "cifar": (3, 32)}  # dataset -> (channels, side)


def _image_fields(preset: ModelConfig, data: DataConfig) -> dict[str, int]:
    """The config fields an image dataset decides: ``in_channels`` (digits are 1-channel 8x8 images,
    CIFAR batches RGB 32x32) and, for a model built for one image side (Swin), ``image_size``."""
    if data.dataset not in _IMAGE_SHAPE:
        return {}
    channels, side = _IMAGE_SHAPE[data.dataset]
    return {"in_channels": channels, **({"image_size": side} if hasattr(preset, "image_size") else {})}


def _prepare_user_model(cfg: TrainConfig) -> Prepared:
    """`prepare` for ``--model FILE.py:FACTORY``: import it, check it against the data, find its blocks
    and resolve the mask for its layout, all on a meta-device instance."""
    model = build_user_model(cfg.model, cfg.model_overrides, "meta")
    user = describe_user_model(cfg.model, cfg.model_overrides, model)
    explicit = cfg.data.partition(":")[0] != "auto"
    data = _data_config(cfg, user.data == "text", any_kind=explicit)
    if data.dataset == "stdlib-bytes" and user.vocab_size is not None and user.vocab_size < 256:
        raise ConfigError(f"model {cfg.model!r} embeds {user.vocab_size} token ids; the stdlib byte data "
                          "needs at least 256 (one id per byte)")
    _probe_user_model(cfg, model, data)
    mask = None
    if cfg.mode not in BASELINES or cfg.blocks is not None or cfg.mode == "fsdp":
        names = find_blocks(model, user_blocks(cfg))
        if cfg.mode not in BASELINES:
            layout = describe(model, names, cfg.level, neuron_groups=USER_NEURON_GROUPS)
            mask = resolve_mask(cfg.mask, None if cfg.mask is not None else cfg.active, cfg.workers, layout,
                                seed=cfg.seed, construction=cfg.construction, schedules=True)
            mask = with_schedule(cfg, mask)
    resume_from = None
    if cfg.resume is not None:
        resume_from = find_checkpoint(cfg.resume)
        check_resumable(resume_from, cfg, user, mask)
    return Prepared(cfg, user, mask, data, resume_from)


@torch.no_grad()
def _probe_user_model(cfg: TrainConfig, model: nn.Module, data: DataConfig) -> None:
    """Call the meta-device model on a batch shaped like the data's and check the logits' shape, so a
    model that does not fit the data fails here once instead of on every rank at step 0. A model
    that cannot run on the meta device (data-dependent Python, ``.item()``) is not probed."""
    if data.dataset in _IMAGE_SHAPE:
        channels, side = _IMAGE_SHAPE[data.dataset]
        inputs, what = torch.empty(2, channels, side, side, device="meta"), f"{data.dataset} images (2, {channels}, {side}, {side})"
    else:
        inputs, what = torch.empty(2, cfg.seq_len, dtype=torch.long, device="meta"), f"token ids (2, {cfg.seq_len})"
    try:
        logits = logits_of(model(inputs))
    except (NotImplementedError, RuntimeError) as exc:
        if "meta" in str(exc).lower() or isinstance(exc, NotImplementedError):
            return
        raise ConfigError(f"model {cfg.model!r} fails on a batch of {what}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's forward: one line naming the model and the input it got
        raise ConfigError(f"model {cfg.model!r} fails on a batch of {what}: {type(exc).__name__}: {exc}") from exc
    classes = 256 if data.dataset == "stdlib-bytes" else 10
    expected = (2, cfg.seq_len) if what.startswith("token") else (2,)
    if tuple(logits.shape[:-1]) != expected or (data.dataset != "token-bin" and logits.shape[-1] < classes):
        raise ConfigError(f"model {cfg.model!r} returns logits of shape {tuple(logits.shape)} for {what}; "
                          f"expected ({', '.join(map(str, expected))}, N) with N >= {classes} "
                          f"{'token ids' if what.startswith('token') else 'classes'}")


def _check_model_fits_data(cfg: TrainConfig, model_config: ModelConfig, data: DataConfig) -> None:
    """Refuse a model whose inputs or outputs cannot match the data (else a crash at step 0 on every rank).

    Token-bin shards are uint16 of an unknown tokenizer: their ids are not scanned here.
    """
    if data.dataset == "stdlib-bytes" and model_config.vocab_size < 256:
        raise ConfigError(f"model {cfg.model!r} has vocab_size={model_config.vocab_size}; the stdlib byte data "
                          "needs at least 256 (one id per byte)")
    if data.dataset in _IMAGE_SHAPE:
        channels, side = _IMAGE_SHAPE[data.dataset]
        if model_config.num_classes < 10:
            raise ConfigError(f"model {cfg.model!r} has num_classes={model_config.num_classes}; "
                              f"{data.dataset} has 10 classes")
        if model_config.in_channels != channels:
            raise ConfigError(f"model {cfg.model!r} has in_channels={model_config.in_channels}; "
                              f"{data.dataset} images have {channels}")
        size = getattr(model_config, "image_size", side)
        if size != side:
            raise ConfigError(f"model {cfg.model!r} has image_size={size}; {data.dataset} images are {side} x {side}")
        patch = getattr(model_config, "patch_size", None)
        if patch is not None and side % patch:
            raise ConfigError(f"model {cfg.model!r} has patch_size={patch}, which does not divide "
                              f"the {side} x {side} {data.dataset} images")


def _mask_for_model(cfg: TrainConfig, model_config: ModelConfig) -> Mask:
    bmap = block_map(model_config)
    blocks = bmap.num_blocks(cfg.level)
    if cfg.mask is not None:
        mask = load_mask(cfg.mask)
    else:
        mask = design_for_model(cfg, model_config)
    if mask.workers != cfg.workers:
        raise ConfigError(f"the mask has {mask.workers} workers (rows) but the run has --workers {cfg.workers}")
    if mask.blocks != blocks:
        raise ConfigError(f"the mask has {mask.blocks} blocks (columns) but {cfg.model} has {blocks} "
                          f"maskable blocks at level {cfg.level!r} (mode {cfg.mode})")
    mask = with_schedule(cfg, mask)
    for k in range(mask.workers):  # the model's structural rules, per worker (raises ConfigError)
        try:
            held_tensors(model_config, mask.matrix[k], cfg.level)
        except ConfigError as exc:
            raise ConfigError(f"mask row {k} (worker {k}) does not fit {cfg.model}: {exc}") from None
    return mask


def with_schedule(cfg: TrainConfig, mask: Mask) -> Mask:
    """`mask` under the run's schedule (``--schedule``/``--every`` replace the mask file's), refused
    where the mode cannot train it: forward masking (bsdp, nsdp) trains static masks, Bb-SDP any
    schedule, overlap averaging any whose R is a multiple of ``local_steps`` (one mask per round of
    averaging)."""
    if cfg.schedule is not None:
        mask = mask.replace(schedule=Schedule(cfg.schedule, cfg.every))
    schedule = mask.schedule
    if schedule.is_static:
        return mask
    if cfg.mode not in SCHEDULED_MODES:
        raise ConfigError(f"the mask has a {schedule.kind!r} schedule (every {schedule.every} steps); mode "
                          f"{cfg.mode!r} trains static masks (--schedule static replaces it); schedules train "
                          "with --mode bbsdp or overlap")
    if schedule.every % cfg.local_steps:
        raise ConfigError(f"the mask's {schedule.kind!r} schedule changes it every {schedule.every} steps, not a "
                          f"multiple of local_steps={cfg.local_steps} (--local-steps): each round of averaging "
                          "must train under one mask")
    return mask


def design_for_model(cfg: TrainConfig, model_config: ModelConfig) -> Mask:
    """The mask `sdp train --active C` uses: one design over the blocks, or one per layer for neurons.

    At neuron level every layer gets its own (K x groups) design, so each worker keeps a fraction C
    of every layer's neurons (the paper's N-SDP) and no layer loses all its neurons on a worker.
    """
    bmap = block_map(model_config)
    names = list(bmap.block_names(cfg.level))
    if cfg.level == "block":
        mask = design(cfg.workers, len(names), active=cfg.active, construction=cfg.construction, seed=cfg.seed)
        return mask.replace(block_names=names)
    groups = model_config.neuron_groups
    layers = [design(cfg.workers, groups, active=cfg.active, construction=cfg.construction, seed=cfg.seed + i)
              for i in range(len(names) // groups)]
    return Mask(np.hstack([m.matrix for m in layers]), block_names=names,
                construction=f"per-layer {layers[0].construction}")


def _data_config(cfg: TrainConfig, is_lm: bool, *, any_kind: bool = False) -> DataConfig:
    kind, _, where = cfg.data.partition(":")
    files: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    if kind == "auto":
        kind = "stdlib-bytes" if is_lm else "digits"
    elif kind == "stdlib":
        kind = "stdlib-bytes"
    elif kind in ("bin", "cifar"):
        root = Path(where)
        if not root.is_dir():
            raise ConfigError(f"data {cfg.data!r}: {root} is not a directory")
        pattern = "*.bin" if kind == "bin" else "data_batch_*"
        files = tuple(str(p) for p in sorted(root.glob(pattern)))
        val = tuple(str(p) for p in sorted(root.glob("val*.bin" if kind == "bin" else "test_batch")))
        files = tuple(f for f in files if f not in val)
        kind = "token-bin" if kind == "bin" else "cifar"
        if not files:
            raise ConfigError(f"data {cfg.data!r}: no training files ({pattern}) in {root}")
        if not val:
            raise ConfigError(f"data {cfg.data!r}: no validation files "
                              f"({'val*.bin' if kind == 'token-bin' else 'test_batch'}) in {root}")
    if (kind in ("stdlib-bytes", "token-bin")) != is_lm and not any_kind:
        raise ConfigError(f"data {cfg.data!r} does not fit model {cfg.model!r}")
    return DataConfig(dataset=kind, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_bytes=cfg.max_data_bytes,
                      heterogeneous=cfg.heterogeneous, train_files=files, val_files=val)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a model's logits (a tensor, or a user model's output: `logits_of`)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Run:
    """One rank's model, synchronisation and optimizer for a prepared config.

    The mode's synchronisation is one `sdp_train.modes.ModeSync` (`build_sync`), so the step below
    is the same for every mode.
    """

    def __init__(self, prep: Prepared, info: DistInfo, device: torch.device) -> None:
        cfg = prep.config
        self.cfg, self.model_config, self.info, self.device = cfg, prep.model_config, info, device
        self.mask = prep.mask
        self.run_bytes = ByteCount()  # the per-step stats all-reduce
        self.faults = InjectedFaults.from_environment()  # tests only: read once, two integer compares per step
        self.sync: ModeSync | None = build_sync(prep, info, device)
        self.model, self.train_model = self.sync.model, self.sync.train_model
        trainable = self.sync.trainable()
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True,
        )
        self.sync.attach(self.optimizer)

    def close(self) -> None:
        """Release the hooks, buffers and process-group references this rank's run holds.

        Gradient hooks live in C++ and hold the sync engine, its buffers and its process groups;
        until they are removed, none of it can be freed, so the groups' gloo threads would outlive
        ``destroy_process_group`` and abort the process at interpreter exit. Call once, after the
        last collective (`sdp_train.loop.train` does).
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
        """Buffer and wire bytes of every collective this rank took part in so far (`sdp_train.wire`)."""
        total = ByteCount()
        total += self.run_bytes
        total += self.sync.bytes
        return total

    @property
    def comm_bytes(self) -> int:
        """Buffer bytes so far: the sizes of the buffers passed to collectives."""
        return self.bytes.buffer

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sent so far under the ring model of `sdp_train.wire`."""
        return self.bytes.wire

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float | bool]:
        """One optimizer step; returns the worker-mean loss, the gradient norm and ``skipped``.

        The loss and squared gradient norm travel in one all-reduce, so a non-finite value on any
        rank (or in any held block's averaged gradient) is seen by every rank in the same step:
        ``nonfinite='stop'`` raises NonFiniteError everywhere, ``'skip'`` drops this step's update
        on every rank (the learning-rate schedule stays indexed by step). The norm is that of the
        averaged gradient, each block counted once (under overlap averaging, whose workers keep
        their own gradients, the root mean square of the workers' norms, and each clips by its own).
        """
        cfg, sync = self.cfg, self.sync
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with sync.step_context():
            loss = loss_fn(self.train_model(inputs), targets)
            if self.faults.nan(step, self.info.rank):
                loss = loss * float("nan")  # NaN loss and NaN gradients on this rank
            loss.backward()
        own_sq = sync.grad_sq_norm()
        stats = torch.stack([loss.detach().float(), own_sq.float()])
        if self.info.world_size > 1:
            dist.all_reduce(stats)
            self.run_bytes.add("all_reduce", stats.numel() * stats.element_size(), self.info.world_size)
        mean_loss = stats[0].item() / self.info.world_size
        grad_norm, clip_norm = sync.norms(stats[1].item(), own_sq)
        if self.faults.kill(step, self.info.rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            if cfg.nonfinite == "stop":
                raise NonFiniteError(
                    f"step {step}: non-finite training state (mean loss {mean_loss}, averaged gradient norm "
                    f"{grad_norm}, over {self.info.world_size} rank(s)); nonfinite='stop' ends the run "
                    f"(--nonfinite skip skips such steps; a lower --lr may avoid them)")
            self.optimizer.zero_grad(set_to_none=False)
            return {"loss": mean_loss, "grad_norm": grad_norm, "lr": lr_at(step, cfg), "skipped": True}
        if cfg.grad_clip > 0 and clip_norm > cfg.grad_clip:
            coef = cfg.grad_clip / (clip_norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        sync.after_step()
        self.optimizer.zero_grad(set_to_none=False)
        return {"loss": mean_loss, "grad_norm": grad_norm, "lr": lr_at(step, cfg), "skipped": False}

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

    @property
    def mask_change_bytes(self) -> int | None:
        """Buffer bytes of the optimizer state moved at mask changes so far (Bb-SDP under a schedule),
        None where nothing moves."""
        moved = self.sync.mask_change_bytes
        return None if moved is None else moved.buffer
