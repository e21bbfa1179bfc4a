"""`DataConfig` and `build_batches`: the one entry point the training loop needs for data.

>>> config = DataConfig(dataset="digits", batch_size=16)
>>> batches = build_batches(config, split="train", seed=0, rank=1, world_size=4)
>>> images, labels = next(batches)
>>> tuple(images.shape), tuple(labels.shape)
((16, 1, 8, 8), (16,))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sdp_train.data.batches import Batches
from sdp_train.data.images import ImageBatches, digits_split, load_cifar_batches, normalize
from sdp_train.data.shards import DTYPES
from sdp_train.data.text import TokenBatches, load_token_shard, stdlib_corpus
from sdp_train.errors import ConfigError, DataError, DataFileError

DATASETS: tuple[str, ...] = ("stdlib-bytes", "digits", "token-bin", "cifar")
IMAGE_DATASETS: tuple[str, ...] = ("digits", "cifar")
"""The classification datasets of `DATASETS`: (images, class labels), scored by accuracy too."""


@dataclass(kw_only=True)
class DataConfig:
    """Which data set, how it is split between train/val and between ranks, and batch shapes."""

    dataset: str = "stdlib-bytes"
    """One of ``DATASETS``: stdlib-bytes and token-bin are language modelling, digits and cifar images."""
    batch_size: int = 8
    """Samples (rows) per batch on each rank."""
    seq_len: int = 128
    """Tokens per input row (language modelling only)."""
    max_bytes: int = 2_000_000
    """stdlib-bytes: bytes read in all (train + val); keeps CI small."""
    val_every: int = 10
    """stdlib-bytes / digits: every ``val_every``-th file / sample is validation."""
    heterogeneous: bool = False
    """Shard by file (text) or by class (images) instead of interleaving: non-iid workers."""
    train_files: tuple[str, ...] = ()
    """token-bin / cifar: training files (.bin token shards / CIFAR pickles the user trusts)."""
    val_files: tuple[str, ...] = ()
    """token-bin / cifar: validation files."""
    token_dtype: str = "uint16"
    """token-bin: the shards' id type, ``uint16`` or ``uint32`` (their ``shards.json``; uint16 without one)."""
    token_vocab: int | None = None
    """token-bin: the tokenizer's vocabulary size from ``shards.json``; None when unknown."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}; known datasets: {', '.join(DATASETS)}")
        for field in ("batch_size", "seq_len", "max_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{field} must be a positive int, got {value!r}")
        if isinstance(self.val_every, bool) or not isinstance(self.val_every, int) or self.val_every < 2:
            raise ConfigError(f"val_every must be an int >= 2, got {self.val_every!r}")
        self.train_files, self.val_files = tuple(map(str, self.train_files)), tuple(map(str, self.val_files))
        if self.token_dtype not in DTYPES:
            raise ConfigError(f"token_dtype {self.token_dtype!r} is not one of {', '.join(DTYPES)}")
        if self.dataset in ("token-bin", "cifar") and not self.train_files:
            raise ConfigError(f"dataset {self.dataset!r} needs train_files")


def build_batches(config: DataConfig, *, split: str, seed: int, rank: int, world_size: int) -> Batches:
    """This rank's batch stream of ``split`` (``"train"`` shuffled, ``"val"`` in order).

    For an evaluation over the whole validation set on one process, pass ``rank=0,
    world_size=1`` and iterate ``.epoch()``.
    """
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    if split == "val" and config.dataset in ("token-bin", "cifar") and not config.val_files:
        raise ConfigError(f"dataset {config.dataset!r} has no val_files")
    files = config.train_files if split == "train" else config.val_files
    try:
        return _build(config, split, files, seed=seed, rank=rank, world_size=world_size)
    except DataError as exc:
        if isinstance(exc, DataFileError):  # already names its file
            raise
        where = f" in {', '.join(sorted({str(Path(f).parent) for f in files}))}" if files else ""
        raise DataError(f"{config.dataset} {split} split{where}: {exc}") from None


def _build(config: DataConfig, split: str, files: tuple[str, ...], *, seed: int, rank: int,
           world_size: int) -> Batches:
    stream = {"seed": seed, "rank": rank, "world_size": world_size, "heterogeneous": config.heterogeneous,
              "shuffle": split == "train", "batch_size": config.batch_size}
    if config.dataset == "stdlib-bytes":
        segments = stdlib_corpus(split=split, max_bytes=config.max_bytes, val_every=config.val_every)
        return TokenBatches(segments, seq_len=config.seq_len, **stream)
    if config.dataset == "token-bin":
        return TokenBatches([load_token_shard(f, config.token_dtype) for f in files], seq_len=config.seq_len, **stream)
    if config.dataset == "digits":
        images, labels = digits_split(split, val_every=config.val_every)
        return ImageBatches(images, labels, **stream)
    train_images, train_labels = load_cifar_batches(config.train_files)
    images, labels = (train_images, train_labels) if split == "train" else load_cifar_batches(files)
    return ImageBatches(normalize(images, train_images), torch.from_numpy(np.asarray(labels)), **stream)
