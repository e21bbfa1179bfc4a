"""Everything a run needs, checked before any process group exists: `prepare` turns a `TrainConfig`
into a `Prepared` run (model config or user model, mask, data, checkpoint to resume).

`prepare` refuses a bad config, model, mask, data source or checkpoint with one `ConfigError`
that names what is wrong, so that ``sdp train`` fails in the launching process before any rank
starts. It designs the mask of ``--active C`` (`design_for_model`), applies a schedule
(`with_schedule`) and probes a user's model on the meta device against the data.

Not here: building the rank's model and its synchronisation (`sdp_train.trainer.run`, `sdp_train.trainer.modes`)
and the loop (`sdp_train.trainer.train`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from masklab import Mask, Schedule, design, load_mask, neuron_design
from sdp_train.data import DataConfig
from sdp_train.data.shards import SIDECAR, ShardFormat, check_listed, read_format
from sdp_train.data.text import token_beyond
from sdp_train.errors import ConfigError
from sdp_train.models import ModelConfig, block_map, data_kind, get_model_config
from sdp_train.models.llama import LlamaConfig
from sdp_train.models.subnet import held_tensors
from sdp_train.parallel.discovery import find_blocks
from sdp_train.parallel.masking import describe
from sdp_train.parallel.parts import resolve_mask
from sdp_train.trainer.checkpoint import check_resumable, find_checkpoint
from sdp_train.trainer.config import BASELINES, SCHEDULED_MODES, TrainConfig
from sdp_train.trainer.user_model import NEURON_GROUPS as USER_NEURON_GROUPS
from sdp_train.trainer.user_model import (
    build_user_model,
    describe_user_model,
    is_user_model,
    logits_of,
    user_blocks,
    user_mlp,
)


@dataclass(frozen=True)
class Prepared:
    """What `prepare` validated: the config, the model shape and the mask (None for DDP)."""

    config: TrainConfig
    model_config: ModelConfig
    mask: Mask | None
    data: DataConfig
    resume_from: Path | None = None
    """The checkpoint directory to continue from, already checked against this run."""
    blocks: tuple[str, ...] | None = None
    """A user model's maskable blocks, found here on a batch shaped like the data's (discovery checks
    that they are residual) and trained by every rank; None for a built-in family or a baseline
    that needs none."""


def prepare(cfg: TrainConfig) -> Prepared:
    """Check config, model and mask together; raise ConfigError before anything distributed starts."""
    if is_user_model(cfg.model):
        return _prepare_user_model(cfg)
    preset = get_model_config(cfg.model)
    is_lm = data_kind(preset) == "text"
    data = _data_config(cfg, is_lm)
    sized = _image_fields(preset, data)
    try:
        model_config = get_model_config(cfg.model, **{**sized, **cfg.model_overrides})
    except ConfigError as exc:
        if "image_size" not in sized or "image_size" in cfg.model_overrides:
            raise
        side = sized["image_size"]  # the model was not built for the data's images: say so, and which would do
        raise ConfigError(f"{exc}: the images of --data {cfg.data} are {side} x {side}"
                          f"{'; --data cifar:DIR gives 32 x 32 ones' if side != 32 else ''}") from None
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


def image_side(data: DataConfig) -> int:
    """The side of an image dataset's images (digits 8, CIFAR 32); 8, `sdp plan`'s default, for text."""
    return _IMAGE_SHAPE.get(data.dataset, (1, 8))[1]


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
    inputs = _probe_user_model(cfg, model, data)
    mask, names = None, None
    if cfg.mode not in BASELINES or cfg.blocks is not None or cfg.mode == "fsdp":
        names = find_blocks(model, user_blocks(cfg), example=inputs)
        if cfg.mode not in BASELINES:
            layout = describe(model, names, cfg.level, neuron_groups=USER_NEURON_GROUPS, mlp=user_mlp(cfg))
            mask = resolve_mask(cfg.mask, None if cfg.mask is not None else cfg.active, cfg.workers, layout,
                                seed=cfg.seed, construction=cfg.construction, schedules=True)
            mask = with_schedule(cfg, mask, USER_NEURON_GROUPS)
    resume_from = None
    if cfg.resume is not None:
        resume_from = find_checkpoint(cfg.resume)
        check_resumable(resume_from, cfg, user, mask)
    return Prepared(cfg, user, mask, data, resume_from, blocks=None if names is None else tuple(names))


@torch.no_grad()
def _probe_user_model(cfg: TrainConfig, model: nn.Module, data: DataConfig) -> torch.Tensor:
    """Call the meta-device model on a batch shaped like the data's and check the logits' shape, so a
    model that does not fit the data fails here once instead of on every rank at step 0. A model
    that cannot run on the meta device (data-dependent Python, ``.item()``) is not probed. Returns
    the batch (meta tensors), with which block discovery checks its lists."""
    if data.dataset in _IMAGE_SHAPE:
        channels, side = _IMAGE_SHAPE[data.dataset]
        inputs, what = torch.empty(2, channels, side, side, device="meta"), f"{data.dataset} images (2, {channels}, {side}, {side})"
    else:
        inputs, what = torch.empty(2, cfg.seq_len, dtype=torch.long, device="meta"), f"token ids (2, {cfg.seq_len})"
    try:
        logits = logits_of(model(inputs))
    except (NotImplementedError, RuntimeError) as exc:
        if "meta" in str(exc).lower() or isinstance(exc, NotImplementedError):
            return inputs
        raise ConfigError(f"model {cfg.model!r} fails on a batch of {what}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's forward: one line naming the model and the input it got
        raise ConfigError(f"model {cfg.model!r} fails on a batch of {what}: {type(exc).__name__}: {exc}") from exc
    classes = 256 if data.dataset == "stdlib-bytes" else 10
    expected = (2, cfg.seq_len) if what.startswith("token") else (2,)
    if tuple(logits.shape[:-1]) != expected or (data.dataset != "token-bin" and logits.shape[-1] < classes):
        raise ConfigError(f"model {cfg.model!r} returns logits of shape {tuple(logits.shape)} for {what}; "
                          f"expected ({', '.join(map(str, expected))}, N) with N >= {classes} "
                          f"{'token ids' if what.startswith('token') else 'classes'}")
    return inputs


def _check_model_fits_data(cfg: TrainConfig, model_config: ModelConfig, data: DataConfig) -> None:
    """Refuse a model whose inputs or outputs cannot match the data (else a crash at step 0 on every rank).

    Token-bin shards may be of another tokenizer: their ids are scanned by `check_token_ids`,
    once in the launching process rather than here, on every rank.
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


def check_token_ids(prep: Prepared) -> None:
    """Refuse ``bin:DIR`` shards of a larger vocabulary than the model's (their ``shards.json``), or
    holding a token id the model cannot embed, naming the shard and position.

    Else every rank would end in ``IndexError: index out of range in self`` at the first batch that
    holds one (GPT-2 ids on a 32,000-word model). One pass over each shard's memory map: the
    launching process calls this once, before any rank starts. Models without an embedding whose
    size is known (a user's model without ``nn.Embedding``) are not checked.
    """
    vocab = getattr(prep.model_config, "vocab_size", None)
    if prep.data.dataset != "token-bin" or vocab is None:
        return
    if prep.data.token_vocab is not None and prep.data.token_vocab > vocab:
        where = Path(prep.data.train_files[0]).parent / SIDECAR
        raise ConfigError(f"data {prep.config.data!r} (--data): {where} says the shards hold ids of a "
                          f"{prep.data.token_vocab}-id vocabulary; model {prep.config.model!r} embeds "
                          f"{vocab} (vocab_size); give the model vocab_size >= {prep.data.token_vocab}")
    found = token_beyond((*prep.data.train_files, *prep.data.val_files), vocab, prep.data.token_dtype)
    if found is not None:
        path, position, token = found
        raise ConfigError(f"data {prep.config.data!r} (--data): token id {token} at position {position} of {path} "
                          f"is beyond the vocabulary of model {prep.config.model!r} (vocab_size={vocab}: ids "
                          f"0..{vocab - 1}); the shards are of another tokenizer, or the model needs a larger "
                          f"vocab_size")


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
    mask = with_schedule(cfg, mask, model_config.neuron_groups if isinstance(model_config, LlamaConfig) else None)
    if cfg.on_worker_loss == "continue" and not mask.schedule.is_static and cfg.restore_coverage and (
            cfg.mode == "overlap"):
        raise ConfigError(f"on_worker_loss='continue' (--on-worker-loss) with restore_coverage (--restore-coverage) "
                          f"in mode 'overlap' needs a static mask; the mask has a {mask.schedule.kind!r} schedule "
                          "(--schedule static replaces it)")
    if cfg.restore_coverage and cfg.mode == "nsdp" and not isinstance(model_config, LlamaConfig):
        raise ConfigError(f"restore_coverage=True (--restore-coverage) in mode 'nsdp' re-cuts LLaMA MLPs and those of "
                          f"--model FILE.py:FACTORY, not the channels of {cfg.model!r}")
    for r, matrix in enumerate(mask.matrices):  # the model's structural rules, per worker and round
        for k in range(mask.workers):
            try:
                held_tensors(model_config, matrix[k], cfg.level)
            except ConfigError as exc:
                where = f" of sequence round {r}" if mask.rounds is not None else ""
                raise ConfigError(f"mask row {k} (worker {k}){where} does not fit {cfg.model}: {exc}") from None
    return mask


def with_schedule(cfg: TrainConfig, mask: Mask, groups: int | None = None) -> Mask:
    """`mask` under the run's schedule (``--schedule``/``--every`` replace the mask file's; a file's
    ``sequence`` is replaced by round 0 under the schedule named), refused
    where the mode cannot train it: FSDP trains static masks; B-SDP and Bb-SDP any schedule; N-SDP
    any under which every worker keeps a neuron group of every block, for models whose MLPs the
    library cuts (LLaMA and user models: ``groups``, the neuron groups per block; None for the
    others); overlap averaging any whose R is a multiple of ``local_steps`` (one mask per round)."""
    if cfg.schedule is not None:
        mask = mask.replace(schedule=Schedule(cfg.schedule, cfg.every))
    schedule = mask.schedule
    if schedule.is_static:
        return mask
    if cfg.mode not in SCHEDULED_MODES:
        raise ConfigError(f"the mask has a {schedule.kind!r} schedule (every {schedule.every} steps); mode "
                          f"{cfg.mode!r} trains static masks (--schedule static replaces it); schedules train "
                          "with --mode bsdp, nsdp, bbsdp or overlap")
    if cfg.mode == "nsdp":
        if groups is None:
            raise ConfigError(f"the mask has a {schedule.kind!r} schedule; N-SDP trains schedules for LLaMA models "
                              f"and --model-class ones, not {cfg.model!r} (--schedule static replaces it)")
        empty = [(r, k, j) for r, matrix in enumerate(mask.matrices)
                 for k, row in enumerate(matrix.reshape(mask.workers, -1, groups))
                 for j, held in enumerate(row.any(axis=1)) if not held]
        if empty:
            r, k, j = empty[0]
            where = f" of sequence round {r}" if mask.rounds is not None else ""
            raise ConfigError(f"the mask has a {schedule.kind!r} schedule, and under one N-SDP keeps some neuron "
                              f"group of every block on every worker: row {k}{where} holds none of block {j} "
                              f"({len(empty)} such)")
    if cfg.fsdp:
        raise ConfigError(f"the mask has a {schedule.kind!r} schedule (every {schedule.every} steps); with --fsdp "
                          "FSDP's holder meshes are fixed when the run starts (--schedule static replaces it)")
    if schedule.every % cfg.local_steps:
        raise ConfigError(f"the mask's {schedule.kind!r} schedule changes it every {schedule.every} steps, not a "
                          f"multiple of local_steps={cfg.local_steps} (--local-steps): each round of averaging "
                          "must train under one mask")
    return mask


def design_for_model(cfg: TrainConfig, model_config: ModelConfig) -> Mask:
    """The mask `sdp train --active C` uses: one design over the blocks, or for neurons
    `masklab.neurons.neuron_design`, whose layers share the holder sets of the blocks' design.

    At neuron level every worker keeps some neuron group of every layer, about C of them on average,
    and the run needs no more process groups than B-SDP with the same K, C and seed.
    """
    bmap = block_map(model_config)
    names = list(bmap.block_names(cfg.level))
    if cfg.level == "block":
        mask = design(cfg.workers, len(names), active=cfg.active, construction=cfg.construction, seed=cfg.seed)
        return mask.replace(block_names=names)
    groups = model_config.neuron_groups
    mask = neuron_design(cfg.workers, len(names) // groups, groups, active=cfg.active, construction=cfg.construction,
                         seed=cfg.seed)
    return mask.replace(block_names=names)


DATA_SOURCES = ("auto", "stdlib", "digits", "bin:DIR", "cifar:DIR")  # what TrainConfig.data may say


def _data_config(cfg: TrainConfig, is_lm: bool, *, any_kind: bool = False) -> DataConfig:
    kind, colon, where = cfg.data.partition(":")
    files: tuple[str, ...] = ()
    val: tuple[str, ...] = ()
    shards = ShardFormat()
    if kind not in ("auto", "stdlib", "digits", "bin", "cifar"):
        raise ConfigError(f"data {cfg.data!r} (--data) is not one of {', '.join(DATA_SOURCES)}")
    if kind in ("auto", "stdlib", "digits") and colon:
        raise ConfigError(f"data {cfg.data!r} (--data): {kind} takes no argument, got {where!r}")
    if kind in ("bin", "cifar") and not where:
        raise ConfigError(f"data {cfg.data!r} (--data): {kind}:DIR needs the directory of its "
                          f"{'shards' if kind == 'bin' else 'batches'}")
    if kind == "auto":
        kind = "stdlib-bytes" if is_lm else "digits"
    elif kind == "stdlib":
        kind = "stdlib-bytes"
    elif kind in ("bin", "cifar"):
        root = Path(where)
        if not root.is_dir():
            raise ConfigError(f"data {cfg.data!r}: {root} is not a directory")
        # CIFAR-10's python batches are data_batch_1..5 and test_batch; CIFAR-100's are train and test
        cifar100 = kind == "cifar" and (root / "train").is_file() and not any(root.glob("data_batch_*"))
        pattern, val_pattern = (("*.bin", "val*.bin") if kind == "bin" else ("train", "test") if cifar100
                                else ("data_batch_*", "test_batch"))
        files = tuple(str(p) for p in sorted(root.glob(pattern)))
        val = tuple(str(p) for p in sorted(root.glob(val_pattern)))
        files = tuple(f for f in files if f not in val)
        kind = "token-bin" if kind == "bin" else "cifar"
        if not files:
            also = "" if kind == "token-bin" else ", or train and test for CIFAR-100"
            raise ConfigError(f"data {cfg.data!r}: no training files ({pattern}{also}) in {root}")
        if not val:
            raise ConfigError(f"data {cfg.data!r}: no validation files ({val_pattern}) in {root}")
        if kind == "token-bin":
            shards = read_format(root)
            check_listed(root, shards, (*files, *val))
    if (kind in ("stdlib-bytes", "token-bin")) != is_lm and not any_kind:
        raise ConfigError(f"data {cfg.data!r} does not fit model {cfg.model!r}")
    return DataConfig(dataset=kind, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_bytes=cfg.max_data_bytes,
                      heterogeneous=cfg.heterogeneous, train_files=files, val_files=val, token_dtype=shards.dtype,
                      token_vocab=shards.vocab_size)
