"""Image classification data: scikit-learn's bundled digits, and CIFAR-format python batches.

Images are float32 tensors (N, C, H, W), normalised per channel with the training split's mean
and standard deviation, and int64 labels (N,). Ranks get disjoint shards: interleaved (iid) or,
heterogeneous, contiguous ranges of the samples sorted by class (each rank sees few classes).
Nothing is downloaded: digits ship with scikit-learn (imported lazily), CIFAR batches are files
the user names.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sdp_train.data.batches import Batches, shard_items
from sdp_train.errors import ConfigError, DataFileError

CIFAR_SIDE = 32
CIFAR_CHANNELS = 3


def _check_split(split: str) -> None:
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")


def normalize(images: np.ndarray, reference: np.ndarray) -> torch.Tensor:
    """(images - mean) / std per channel, statistics from ``reference`` (N, C, H, W); float32."""
    ref = reference.astype(np.float64)
    mean = ref.mean(axis=(0, 2, 3), keepdims=True)
    std = ref.std(axis=(0, 2, 3), keepdims=True)
    return torch.from_numpy(((images - mean) / np.where(std > 0, std, 1.0)).astype(np.float32))


def digits_split(split: str, *, val_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 8x8 digits of ``sklearn.datasets.load_digits``: images (N, 1, 8, 8), labels (N,).

    Sample ``i`` is in ``"val"`` when ``(i + 1) % val_every == 0``, else in ``"train"``.
    """
    _check_split(split)
    if val_every < 2:
        raise ConfigError(f"val_every must be >= 2, got {val_every}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8), values 0..16
    is_val = (np.arange(len(images)) + 1) % val_every == 0
    keep = is_val if split == "val" else ~is_val
    return normalize(images[keep], images[~is_val]), torch.from_numpy(digits.target[keep].astype(np.int64))


# The globals a CIFAR-format batch (numpy arrays in a dict) needs, under numpy 1.x and 2.x names.
_CIFAR_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
})


class RefusedGlobalError(pickle.UnpicklingError):
    """A pickle names a global outside the allowed set."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``_CIFAR_GLOBALS``; any other is refused."""

    def find_class(self, module: str, name: str):  # noqa: D102 - see class docstring
        if (module, name) not in _CIFAR_GLOBALS:
            raise RefusedGlobalError(
                f"refused to load global {module}.{name}: a CIFAR batch holds only numpy arrays, "
                "lists and dicts (the file may be malicious)"
            )
        return super().find_class(module, name)


def load_cifar_batches(paths: Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray]:
    """Read CIFAR-format python batches: images uint8 (N, 3, 32, 32), labels int64 (N,).

    Each file is a pickled dict with ``b"data"`` (n, 3072) uint8 and ``b"labels"`` (or
    ``b"fine_labels"`` for CIFAR-100) of length n. Pickles can run code, so they are read by
    `RestrictedUnpickler`, which admits only the numpy types such a batch holds and refuses any
    other global (``os.system``, ``builtins.eval``, ...) before it is called. Only files the user
    names are loaded, never files found by searching.

    Raises
    ------
    DataFileError
        A path does not exist, does not unpickle, or holds the wrong keys, dtypes, shapes or negative labels.
    """
    if not paths:
        raise ConfigError("load_cifar_batches needs at least one path")
    images, labels = [], []
    for path in map(Path, paths):
        try:
            if not path.is_file():
                raise DataFileError(f"CIFAR batch {path} does not exist or is not a file")
            with path.open("rb") as f:
                batch = RestrictedUnpickler(f, encoding="bytes").load()
        except RefusedGlobalError as exc:
            raise DataFileError(f"CIFAR batch {path}: {exc}") from None
        except DataFileError:
            raise
        except OSError as exc:
            raise DataFileError(f"CIFAR batch {path} cannot be read: {exc.strerror or exc}") from None
        except Exception as exc:  # unpickling a file of another format can raise almost anything
            raise DataFileError(f"CIFAR batch {path} is not a python pickle: {exc}") from exc
        if not isinstance(batch, dict) or b"data" not in batch:
            raise DataFileError(f"CIFAR batch {path} must be a dict with b'data' and b'labels'")
        label_key = b"labels" if b"labels" in batch else b"fine_labels"
        try:
            data, label = np.asarray(batch[b"data"]), np.asarray(batch.get(label_key, []))
        except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, unconvertible objects
            raise DataFileError(f"CIFAR batch {path}: b'data' and labels must be arrays: {exc}") from None
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != CIFAR_CHANNELS * CIFAR_SIDE**2:
            raise DataFileError(
                f"CIFAR batch {path}: b'data' must be uint8 of shape (n, 3072), got {data.dtype} {data.shape}"
            )
        if label.shape != (data.shape[0],) or not np.issubdtype(label.dtype, np.integer):
            raise DataFileError(
                f"CIFAR batch {path}: labels must be {data.shape[0]} integers, got {label.dtype} {label.shape}"
            )
        if label.size and (label.min() < 0 or label.max() > np.iinfo(np.int64).max):
            raise DataFileError(f"CIFAR batch {path}: labels must be class indices in [0, 2**63), "
                                f"got {label.min()}..{label.max()}")
        images.append(data.reshape(-1, CIFAR_CHANNELS, CIFAR_SIDE, CIFAR_SIDE))
        labels.append(label.astype(np.int64))
    return np.concatenate(images), np.concatenate(labels)


class ImageBatches(Batches):
    """Batches of (images (B, C, H, W) float32, labels (B,) int64) from this rank's shard.

    ``heterogeneous`` gives each rank a contiguous range of the samples sorted (stably) by label;
    otherwise ranks take interleaved samples. See `Batches` for the other parameters.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        heterogeneous: bool = False,
        shuffle: bool = True,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ConfigError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        order = np.argsort(labels.numpy(), kind="stable") if heterogeneous else np.arange(len(labels))
        self.sample_index = order[shard_items(len(labels), rank, world_size, contiguous=heterogeneous)]
        self.images, self.labels = images, labels
        super().__init__(
            len(self.sample_index), batch_size, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle
        )

    def fetch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.sample_index[indices])
        return self.images[rows], self.labels[rows]
