"""The training run, top to bottom: config -> mask -> model -> sync -> optimizer -> loop -> summary.

Runs as one process or under torchrun (one rank per worker). ``ddp`` wraps the full model in
``torch.nn.parallel.DistributedDataParallel``, ``fsdp`` shards it with FSDP2 ``fully_shard``
(activation checkpointing and FSDP by `sdp_train.parallelize`). The SDP modes go through the
library API, as a user's loop does: ``bsdp``/``nsdp`` build each worker's forward-masked
subnetwork, ``bbsdp`` the full model with non-held blocks frozen, and
`SubnetworkDataParallel.from_subnetwork` does the rest (holder-set averaging overlapped with
backward, or with ``fsdp=True`` each block sharded among its holders; Bb-SDP's broadcast of new
values after each step; BatchNorm running statistics averaged among their holders; activation
checkpointing). Validation always uses the full assembled model, which only rank 0 builds
(`Run.full_state`).
Everything a run needs is checked by `prepare` before any process group exists.
"""

from __future__ import annotations

import math
import os
import signal
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from masklab import Mask, Schedule, design, load_mask
from sdp_train.checkpoint import check_resumable, find_checkpoint
from sdp_train.config import BASELINES, TrainConfig
from sdp_train.data import DataConfig
from sdp_train.dist import DistInfo
from sdp_train.errors import ConfigError, NonFiniteError
from sdp_train.faults import InjectedFaults
from sdp_train.models import ModelConfig, block_map, build_model, get_model_config, model_class
from sdp_train.models.blocks import SliceSpec
from sdp_train.api import SubnetworkDataParallel
from sdp_train.overlap import OverlapAveraging
from sdp_train.parallelize import parallelize
from sdp_train.sdp_blocks import find_blocks
from sdp_train.sdp_masking import ModelLayout, describe
from sdp_train.sdp_parts import resolve_mask
from sdp_train.subnet import apply_backward_mask, build_worker_model, held_tensors
from sdp_train.user_model import (NEURON_GROUPS as USER_NEURON_GROUPS, UserModel, build_user_model,
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


def user_blocks(cfg: TrainConfig) -> str | list[str] | None:
    """``--blocks`` as `find_blocks` takes it: a pattern, or the names of a comma-separated list."""
    if cfg.blocks is None or "," not in cfg.blocks:
        return cfg.blocks
    return [name.strip() for name in cfg.blocks.split(",") if name.strip()]


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
    where the mode cannot train it: the stepwise modes train static masks, overlap averaging any
    schedule whose R is a multiple of ``local_steps`` (one mask per round of averaging)."""
    if cfg.schedule is not None:
        mask = mask.replace(schedule=Schedule(cfg.schedule, cfg.every))
    schedule = mask.schedule
    if schedule.is_static:
        return mask
    if cfg.mode != "overlap":
        raise ConfigError(f"the mask has a {schedule.kind!r} schedule (every {schedule.every} steps); mode "
                          f"{cfg.mode!r} trains static masks (--schedule static replaces it); schedules train "
                          "with --mode overlap")
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
    """One rank's model, synchronisation and optimizer for a prepared config."""

    def __init__(self, prep: Prepared, info: DistInfo, device: torch.device) -> None:
        cfg, mc = prep.config, prep.model_config
        self.cfg, self.model_config, self.info, self.device = cfg, mc, info, device
        self.mask = prep.mask
        self.run_bytes = ByteCount()  # DDP's buckets, the per-step stats all-reduce, FSDP's collectives
        self.sdp: SubnetworkDataParallel | None = None  # SDP modes: the library API syncs, as for a user's loop
        self.overlap: OverlapAveraging | None = None  # mode overlap: the library API averages every H steps
        self.faults = InjectedFaults.from_environment()  # tests only: read once, two integer compares per step
        if self.uses_fsdp and not dist.is_initialized():
            raise ConfigError(f"mode {cfg.mode!r} with FSDP needs torch.distributed: run under torchrun "
                              f"or with --workers >= 2 (got workers={cfg.workers})")
        world_mesh = DeviceMesh.from_group(dist.group.WORLD, device.type) if self.uses_fsdp else None
        self.fsdp_step_bytes: ByteCount | None = None  # FSDP: counted on the first step, equal on every step
        if isinstance(mc, UserModel):
            self._build_user_model(world_mesh)
        elif cfg.mode == "overlap":
            self.model = build_model(mc, seed=cfg.seed, device=device)
            self._build_overlap(list(block_map(mc).block_names("block")))
        elif cfg.mode in BASELINES:
            self.model = build_model(mc, seed=cfg.seed, device=device)
            self.held_by_rank = [{n: SliceSpec() for n in self.model.state_dict()}] * info.world_size
            parallelize(self.model, activation_checkpointing=cfg.activation_checkpointing,
                        block_meshes=None, root_mesh=world_mesh)
            use_ddp = cfg.mode == "ddp" and info.world_size > 1
            self.train_model: nn.Module = self._wrap_ddp(self.model) if use_ddp else self.model
        else:  # a built-in family builds the worker's part itself; the library API does the rest
            rows = prep.mask.matrix.astype(bool)
            self.held_by_rank = [held_tensors(mc, rows[r], cfg.level) for r in range(info.world_size)]
            if cfg.mode == "bbsdp":
                self.model = build_model(mc, seed=cfg.seed, device=device)
                apply_backward_mask(self.model, mc, rows[info.rank])
            else:
                self.model = build_worker_model(mc, rows[info.rank], cfg.level, seed=cfg.seed, device=device)
            self.sdp = SubnetworkDataParallel.from_subnetwork(
                self.model, layout=family_layout(mc, cfg.level), mask=prep.mask, held_by_rank=self.held_by_rank,
                local_index=self.model.full_index(), masking="backward" if cfg.mode == "bbsdp" else "forward",
                activation_checkpointing=cfg.activation_checkpointing, fsdp=cfg.fsdp,
                values_agree=True)  # every rank built its part from the same seed
            self.train_model = self.sdp
        # overlap averaging trains another set of blocks each round: its optimizer has every parameter
        trainable = [p for p in self.model.parameters() if p.requires_grad or self.overlap is not None]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True,
        )
        if self.sdp is not None:
            self.sdp.register_optimizer(self.optimizer, hook=False)  # `step` calls broadcast_held
        if self.overlap is not None:
            self.overlap.register_optimizer(self.optimizer)  # averages after every local_steps-th step

    def _build_overlap(self, blocks: list[str]) -> None:
        """Mode ``overlap``: this worker's own full copy of the model, wrapped in `OverlapAveraging`
        (activation checkpointing inside each block first, as `parallelize` orders it)."""
        cfg = self.cfg
        self.held_by_rank = [{n: SliceSpec() for n in self.model.state_dict()}] * self.info.world_size
        if cfg.activation_checkpointing:
            parallelize(self.model, activation_checkpointing=True, block_meshes=None, root_mesh=None,
                        blocks=[(n, self.model.get_submodule(n)) for n in blocks])
        self.overlap = OverlapAveraging(self.model, mask=self.mask, blocks=blocks, local_steps=cfg.local_steps,
                                        seed=cfg.seed)
        self.train_model = self.overlap

    def _build_user_model(self, world_mesh: DeviceMesh | None) -> None:
        """A ``FILE.py:FACTORY`` model: built on every rank from the run's seed, then handed to
        `SubnetworkDataParallel` (SDP modes), torch DDP or FSDP2 ``fully_shard`` (the baselines)."""
        cfg, user = self.cfg, self.model_config
        torch.manual_seed(cfg.seed)
        model = user.build(self.device)
        model.to(self.device)
        if cfg.mode == "overlap":
            self.model = model
            self._build_overlap(find_blocks(model, user_blocks(cfg)))
            return
        if cfg.mode in BASELINES:
            self.model = model
            self.held_by_rank = [{n: SliceSpec() for n in model.state_dict()}] * self.info.world_size
            if cfg.activation_checkpointing or world_mesh is not None:
                names = find_blocks(model, user_blocks(cfg))
                blocks = [(n, model.get_submodule(n)) for n in names]
                parallelize(model, activation_checkpointing=cfg.activation_checkpointing, block_meshes=None,
                            root_mesh=world_mesh, blocks=blocks)
            use_ddp = cfg.mode == "ddp" and self.info.world_size > 1
            self.train_model = self._wrap_ddp(model) if use_ddp else model
            return
        self.sdp = SubnetworkDataParallel(
            model, mask=self.mask, blocks=user_blocks(cfg), level=cfg.level,
            masking="backward" if cfg.mode == "bbsdp" else "forward", neuron_groups=USER_NEURON_GROUPS,
            seed=cfg.seed, device=self.device, activation_checkpointing=cfg.activation_checkpointing, fsdp=cfg.fsdp)
        self.model, self.train_model, self.held_by_rank = self.sdp.module, self.sdp, self.sdp.held_by_rank

    def _wrap_ddp(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if self.device.type == "cpu" else [self.device])

        # The reducer (C++) keeps the hook alive and the garbage collector cannot see through it:
        # a hook that referenced this Run strongly would keep the Run, the DDP module and the
        # process group alive past destroy_process_group (see `Run.close`).
        run = weakref.ref(self)

        def counting_allreduce(state, bucket):
            buf = bucket.buffer()
            run().run_bytes.add("all_reduce", buf.numel() * buf.element_size(), run().info.world_size)
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
        return ddp

    def close(self) -> None:
        """Release the hooks, buffers and process-group references this rank's run holds.

        Gradient hooks live in C++ and hold the sync engine, its buffers and its process groups;
        until they are removed, none of it can be freed, so the groups' gloo threads would outlive
        ``destroy_process_group`` and abort the process at interpreter exit. Call once, after the
        last collective (`sdp_train.loop.train` does).
        """
        if self.sdp is not None:
            self.sdp.close()
        self.sdp = self.overlap = None
        self.model = self.train_model = self.optimizer = None

    @property
    def uses_fsdp(self) -> bool:
        return self.cfg.mode == "fsdp" or self.cfg.fsdp

    @property
    def engine(self):
        """The SDP modes' gradient sync engine (`sdp_train.sync.SyncEngine`, from the library API);
        None for the baselines and where no block has two holders."""
        return self.sdp.engine if self.sdp is not None else None

    @property
    def comm_buffers(self) -> list[torch.Tensor]:
        """The sync engine's long-lived bucket buffers (counted as "other" memory)."""
        return [b.buffer for b in self.engine.buckets] if self.engine is not None else []

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of every collective this rank took part in so far (`sdp_train.wire`)."""
        total = ByteCount()
        total += self.run_bytes
        counters = [self.sdp.engine, self.sdp.broadcaster, self.sdp.buffer_averager] if self.sdp is not None else []
        counters += [self.overlap] if self.overlap is not None else []
        for counter in counters:
            if counter is not None:
                total += counter.bytes
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
        """One optimizer step; returns the worker-mean loss, the averaged gradient's norm and ``skipped``.

        The loss and squared gradient norm travel in one all-reduce, so a non-finite value on any
        rank (or in any held block's averaged gradient) is seen by every rank in the same step:
        ``nonfinite='stop'`` raises NonFiniteError everywhere, ``'skip'`` drops this step's update
        on every rank (the learning-rate schedule stays indexed by step).
        """
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        # FSDP's collectives are the same on every step: intercept the first step's, then add those
        counter = FSDPCollectiveBytes() if self.uses_fsdp and self.fsdp_step_bytes is None else None
        with counter if counter is not None else nullcontext():
            loss = loss_fn(self.train_model(inputs), targets)
            if self.faults.nan(step, self.info.rank):
                loss = loss * float("nan")  # NaN loss and NaN gradients on this rank
            loss.backward()
        if counter is not None:
            self.fsdp_step_bytes = counter.bytes
        if self.fsdp_step_bytes is not None:
            self.run_bytes += self.fsdp_step_bytes
        if self.sdp is not None:  # its hooks finished the holder averages (and statistics) when backward returned
            sq_norm = self.sdp.local_grad_sq_norm()
        elif self.overlap is not None:  # every worker's own gradient: the norm reported is their RMS
            sq_norm = _sq_norm(self.model)
        elif self.uses_fsdp:  # every gradient entry lives in exactly one rank's shard
            sq_norm = torch.stack([_local(p.grad).float().pow(2).sum() for p in self.model.parameters()
                                   if p.grad is not None]).sum()
        else:  # DDP: every rank holds the same averaged gradient; rank 0 contributes the norm
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            sq_norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if self.info.rank == 0 \
                else torch.zeros((), device=self.device)
        stats = torch.stack([loss.detach().float(), sq_norm.float()])
        if self.info.world_size > 1:
            dist.all_reduce(stats)
            self.run_bytes.add("all_reduce", stats.numel() * stats.element_size(), self.info.world_size)
        mean_loss, grad_norm = stats[0].item() / self.info.world_size, stats[1].sqrt().item()
        if self.overlap is not None:
            grad_norm /= math.sqrt(self.info.world_size)
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
        # overlap averaging clips each worker's own gradient by its own norm (no gradient is averaged)
        clip_norm = math.sqrt(sq_norm.item()) if self.overlap is not None else grad_norm
        if cfg.grad_clip > 0 and clip_norm > cfg.grad_clip:
            coef = cfg.grad_clip / (clip_norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        if self.sdp is not None:
            self.sdp.broadcast_held()  # backward masking: holders send their blocks' new values
        self.optimizer.zero_grad(set_to_none=False)
        return {"loss": mean_loss, "grad_norm": grad_norm, "lr": lr_at(step, cfg), "skipped": False}

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full assembled model on rank 0 (None on the other ranks); every rank must call it.

        Under SDP the library API assembles it (`SubnetworkDataParallel.full_state_dict`): each
        tensor slice from its lowest-ranked holder, one tensor at a time, summed onto rank 0, so
        no rank but rank 0 ever holds more than its own model and one full tensor. Under FSDP each
        tensor is gathered over the world mesh, in one order on every rank. Under DDP (or on one
        rank) rank 0 already holds the full model: its tensors are returned as they are, not copied
        (read them, do not write them).
        """
        main = self.info.rank == 0
        if self.overlap is not None:  # every tensor averaged over its holders of the last round
            state = self.overlap.full_state_dict(rank0_only=True)
            return state if main else None
        if self.sdp is not None:
            state = self.sdp.full_state_dict(rank0_only=True)
            return state if main else None
        if self.uses_fsdp:
            state = {}
            for name, value in self.model.state_dict().items():
                value = value.full_tensor() if isinstance(value, DTensor) else value  # a collective
                if main:
                    state[name] = value.detach()
            return state if main else None
        return {n: v.detach() for n, v in self.model.state_dict().items()} if main else None

    def consensus_distance(self) -> dict[str, float] | None:
        """Mode ``overlap``: how far the workers' copies are apart, per block, ``other`` and ``total``
        (`OverlapAveraging.consensus_distance`; a collective); None in the other modes, whose holders agree."""
        return self.overlap.consensus_distance() if self.overlap is not None else None

    def schedule_state(self) -> dict[str, int]:
        """What a checkpoint keeps of the mask schedule's position (mode ``overlap``: optimizer steps
        taken, which fix the round and its mask); ``{}`` in the other modes."""
        return self.overlap.schedule_state() if self.overlap is not None else {}

    def load_schedule_state(self, state: dict[str, int]) -> None:
        if self.overlap is not None:
            self.overlap.load_schedule_state(state)


def _sq_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None]
    return torch.stack(grads).sum() if grads else torch.zeros((), device=next(model.parameters()).device)


class FSDPCollectiveBytes(TorchDispatchMode):
    """Counts the bytes of FSDP2's all-gathers and reduce-scatters as they are dispatched.

    Each collective counts its full (unsharded) buffer as buffer bytes, as an all-reduce counts
    its buffer; its group size is the ratio of the full buffer to the shard (FSDP2 pads shards to
    equal size). `Run` uses it for the first step only: intercepting every op costs step time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = ByteCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d._allgather_base_.default:  # (output, input shard, ...)
            self._count("all_gather", full=args[0], shard=args[1])
        elif func is torch.ops.c10d._reduce_scatter_base_.default:  # (output shard, input, ...)
            self._count("reduce_scatter", full=args[1], shard=args[0])
        return func(*args, **(kwargs or {}))

    def _count(self, collective: str, *, full: torch.Tensor, shard: torch.Tensor) -> None:
        ranks = full.numel() // shard.numel() if shard.numel() else 1
        self.bytes.add(collective, full.numel() * full.element_size(), ranks)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def family_layout(config: ModelConfig, level: str) -> ModelLayout:
    """The library API's `ModelLayout` of a built-in family's full model: every tensor's shape and dtype,
    the parameters in state-dict order and the blocks (at block level; N-SDP's columns are their groups)."""
    bmap = block_map(config)
    with torch.device("meta"):  # dtypes of every full-model tensor, including ones not held here
        dtypes = {n: t.dtype for n, t in model_class(config)(config).state_dict().items()}
    tensors = {n: (tuple(shape), dtypes[n]) for n, shape in bmap.shapes.items()}
    params = tuple(n for n in bmap.shapes if n in bmap.parameter_names)
    return ModelLayout(tensors, params, tuple(bmap.block_names("block")), level)
