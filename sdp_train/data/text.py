"""Language-modelling data: bytes of the Python standard library, and pre-tokenized ``.bin`` shards
(their format: `sdp_train.data.shards`).

Both are lists of 1-D token arrays ("segments", one per file) cut into windows of ``seq_len + 1``
tokens starting every ``seq_len`` tokens (a window never crosses files). A window gives inputs
``w[:-1]`` and next-token targets ``w[1:]``. Ranks get disjoint sets of windows: interleaved (iid)
or contiguous ranges of the sorted files (heterogeneous; a file may be split between two
neighbouring ranks). Nothing is downloaded.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sdp_train.data.batches import Batches, shard_items
from sdp_train.data.shards import DTYPES
from sdp_train.errors import ConfigError, DataError, DataFileError

EXCLUDED_DIRS: frozenset[str] = frozenset({"site-packages", "dist-packages"})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of the running interpreter's standard library, sorted by relative path.

    Installed third-party packages (``site-packages``) are excluded so the corpus depends on the
    Python version only.
    """
    return list(_python_files(Path(sysconfig.get_paths()["stdlib"] if root is None else root)))


@functools.lru_cache(maxsize=4)
def _python_files(root: Path) -> tuple[Path, ...]:
    """`stdlib_files` under `root`, walked once per process (a rank builds the train and the
    validation split, each of which lists the standard library's thousands of files)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: site-packages can be huge
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    if not files:
        raise DataError(f"no *.py files under the standard library directory {root}")
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_corpus(*, split: str, max_bytes: int, val_every: int = 10) -> list[np.ndarray]:
    """Byte arrays (uint8) of the standard library's source files in ``split``.

    Files are read in sorted order until ``max_bytes`` bytes in all (both splits; the last file is
    truncated); file ``i`` of those goes to ``"val"`` when ``(i + 1) % val_every == 0``, else to
    ``"train"``.
    """
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    if max_bytes < 1 or val_every < 2:
        raise ConfigError(f"need max_bytes >= 1 and val_every >= 2, got {max_bytes}, {val_every}")
    segments, total = [], 0
    for i, path in enumerate(stdlib_files()):
        if total >= max_bytes:
            break
        data = np.frombuffer(path.read_bytes()[: max_bytes - total], dtype=np.uint8)
        total += data.size
        if ((i + 1) % val_every == 0) == (split == "val"):
            segments.append(data)
    return segments


def load_token_shard(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """Memory-map a pre-tokenized shard: raw little-endian token ids of `dtype` (``uint16`` or
    ``uint32``; `sdp_train.data.shards`), no header.

    Raises
    ------
    DataFileError
        The path does not exist, is not a file, is empty or not a whole number of ids.
    """
    path, code = Path(path), DTYPES[dtype]
    itemsize = np.dtype(code).itemsize
    try:
        if not path.is_file():
            raise DataFileError(f"token shard {path} does not exist or is not a file")
        size = path.stat().st_size
        if size == 0 or size % itemsize:
            raise DataFileError(f"token shard {path} has {size} bytes; a {dtype} shard needs a positive multiple "
                                f"of {itemsize}")
        return np.memmap(path, dtype=code, mode="r")
    except OSError as exc:  # unreadable, name too long, ...
        raise DataFileError(f"token shard {path} cannot be read: {exc.strerror or exc}") from None


def token_beyond(paths: Sequence[str | Path], vocab_size: int, dtype: str = "uint16") -> tuple[str, int, int] | None:
    """The first token id >= `vocab_size` in the shards `paths` of `dtype`, as (path, position, id), or None.

    One pass over each shard's memory map (the position is looked up only when there is one);
    nothing to read when `vocab_size` exceeds every id of `dtype`.
    """
    if vocab_size > np.iinfo(dtype).max:
        return None
    for path in paths:
        shard = load_token_shard(path, dtype)
        if int(shard.max()) >= vocab_size:
            position = int(np.argmax(shard >= vocab_size))
            return str(path), position, int(shard[position])
    return None


class TokenBatches(Batches):
    """Batches of (inputs, targets), both int64 (B, T), from this rank's windows of ``segments``.

    Parameters
    ----------
    segments : sequence of numpy.ndarray
        1-D token arrays (uint8 bytes, uint16 or uint32 ids), one per file, in file order.
    seq_len : int
        T, tokens per input row.
    batch_size : int
        B, rows per batch.
    seed, rank, world_size : int
        Identify the stream (see `Batches`).
    heterogeneous : bool
        Contiguous ranges of windows (by file) per rank instead of interleaved windows.
    shuffle : bool
        Permute windows each epoch (training) or keep file order (evaluation).
    """

    def __init__(
        self,
        segments: Sequence[np.ndarray],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        heterogeneous: bool = False,
        shuffle: bool = True,
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        counts = [max(0, (len(seg) - 1) // seq_len) for seg in segments]
        seg_of_window = np.repeat(np.arange(len(segments)), counts)
        # only segments with windows: for the others seq_len may exceed int64 (a huge --seq-len)
        start_of_window = np.concatenate([np.arange(n) * seq_len for n in counts if n] or [np.zeros(0, np.int64)])
        mine = shard_items(len(seg_of_window), rank, world_size, contiguous=heterogeneous)
        self.segments, self.seq_len = list(segments), seq_len
        self.window_segment, self.window_start = seg_of_window[mine], start_of_window[mine]  # (N_rank,)
        super().__init__(len(mine), batch_size, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)

    def fetch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack(
            [
                np.asarray(self.segments[s][t : t + self.seq_len + 1], dtype=np.int64)
                for s, t in zip(self.window_segment[indices], self.window_start[indices])
            ]
        )  # (B, T + 1)
        windows = torch.from_numpy(rows)
        return windows[:, :-1], windows[:, 1:]
