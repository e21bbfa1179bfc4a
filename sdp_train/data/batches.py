"""Deterministic, resumable per-rank batch streams.

A `Batches` object owns one rank's shard of a data set and maps a step number to a batch: with
``shuffle`` the items are permuted once per epoch by a generator seeded with
(seed, rank, epoch), otherwise they come in order. Batch ``s`` depends only on (seed, rank,
world_size, s), so ``state_dict()`` is just the step and resuming reproduces the same stream.
Shards of different ranks are disjoint. Not here: reading files (see `text` and `images`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np
import torch

from sdp_train.errors import ConfigError, DataError


def check_rank(rank: int, world_size: int) -> None:
    """Raise `ConfigError` unless ``0 <= rank < world_size``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def shard_items(num_items: int, rank: int, world_size: int, *, contiguous: bool) -> np.ndarray:
    """Item indices of ``rank``: interleaved (``i % world_size == rank``) or one contiguous range."""
    check_rank(rank, world_size)
    if contiguous:
        return np.array_split(np.arange(num_items), world_size)[rank]
    return np.arange(rank, num_items, world_size)


class Batches(ABC):
    """One rank's infinite stream of (inputs, targets) batches; subclasses implement `fetch`.

    Parameters
    ----------
    num_items : int
        Items in this rank's shard.
    batch_size : int
        Items per batch; an epoch is ``num_items // batch_size`` batches (the tail is dropped).
    seed, rank, world_size : int
        Identify the stream; recorded in `state_dict` and checked on load.
    shuffle : bool
        Permute items once per epoch (training) or keep their order (evaluation).
    """

    def __init__(
        self, num_items: int, batch_size: int, *, seed: int, rank: int, world_size: int, shuffle: bool
    ) -> None:
        check_rank(rank, world_size)
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if num_items < batch_size:
            raise DataError(
                f"rank {rank} of {world_size} has {num_items} items, fewer than batch_size={batch_size}; "
                "use more data, a smaller batch or fewer ranks"
            )
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.step = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.num_items // self.batch_size

    def indices(self, step: int) -> np.ndarray:
        """Positions in this rank's shard of the items of batch ``step``, shape (batch_size,)."""
        epoch, i = divmod(step, len(self))
        order = np.arange(self.num_items)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.rank, epoch]).permutation(self.num_items)
        return order[i * self.batch_size : (i + 1) * self.batch_size]

    @abstractmethod
    def fetch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the shard items at ``indices``."""

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``step`` (does not move the stream)."""
        return self.fetch(self.indices(step))

    def epoch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of epoch 0 in order, e.g. one evaluation pass (does not move the stream)."""
        return (self.batch(s) for s in range(len(self)))

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Position of the stream (and the identity it must be resumed with)."""
        return {"step": self.step, "seed": self.seed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["step"]``; seed, rank and world_size must match this stream's."""
        for key in ("seed", "rank", "world_size"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"cannot resume a data stream with {key}={getattr(self, key)} "
                    f"from a state with {key}={state.get(key)}"
                )
        if not isinstance(state.get("step"), int) or state["step"] < 0:
            raise ConfigError(f"state['step'] must be an int >= 0, got {state.get('step')!r}")
        self.step = state["step"]
