"""The `Mask` type: an immutable, validated K x B 0/1 matrix with block names, sizes and a schedule.

Row k is worker k's subnetwork, column j is block j; column j's holder set is S_j = {k : M[k, j] = 1}.
This module only validates and represents masks; analysis lives in `masklab.analysis`, constructions
in `masklab.constructions`, and (de)serialisation in `masklab.io`. Invalid input is rejected with a
`MaskError` naming the offending row/column, never silently repaired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from masklab.errors import MaskError

SCHEDULE_KINDS = ("static", "permute", "cyclic", "sequence")
ROW_SCHEDULE_KINDS = ("static", "permute", "cyclic")  # those that reassign one matrix's rows (no masks of their own)


@dataclass(frozen=True)
class Schedule:
    """How the mask changes over training.

    Parameters
    ----------
    kind : {"static", "permute", "cyclic", "sequence"}
        ``static``: the mask never changes. ``permute``: every `every` steps the rows are assigned to
        workers by a fresh uniformly random permutation. ``cyclic``: every `every` steps the rows
        rotate by one worker (worker k takes row (k + r) mod K in round r). ``sequence``: the
        user's masks in turn, each for `every` steps, from the first again after the last; the
        masks live in the `Mask` (``Mask.sequence``), not here.
    every : int
        Steps between redraws (R). Ignored for ``static`` but must still be >= 1.
    """

    kind: str = "static"
    every: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise MaskError(f"schedule kind {self.kind!r} is not one of {SCHEDULE_KINDS}")
        if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)):
            raise MaskError(f"schedule every={self.every!r} must be an integer number of steps")
        if self.every < 1:
            raise MaskError(f"schedule every={self.every} must be >= 1 step")
        object.__setattr__(self, "every", int(self.every))

    @property
    def is_static(self) -> bool:
        return self.kind == "static"


class Mask:
    """An immutable, validated worker x block mask.

    Parameters
    ----------
    matrix : array_like of shape (K, B)
        Entries must be exactly 0 or 1 (bool or numbers). Every block needs a holder and every
        worker a block.
    block_names : sequence of str, optional
        One unique name per block (e.g. ``"layers.3"``). Defaults to ``"block0"``, ``"block1"``, ...
    block_sizes : sequence of int, optional
        Number of parameters in each block (>= 1). Used to spread totals such as sigma^2 over blocks.
    schedule : Schedule, optional
        Defaults to a static mask.
    construction : str, optional
        Free-form name of how the mask was made ("projective-plane", "cyclic", "file", ...).
    rounds : array_like of shape (P, K, B), optional
        With a ``sequence`` schedule (and only then): the P masks in turn, ``rounds[0]`` equal to
        `matrix`. Each must be a valid mask with the same coverage c_j as `matrix` in every
        block: the theorems use c_j (docs/theory.md), so a sequence changes who holds a block,
        never how many. ``Mask.sequence`` builds one from the list of masks.

    Examples
    --------
    >>> m = Mask([[1, 1, 0], [0, 1, 1]])
    >>> m.workers, m.blocks, m.coverage.tolist()
    (2, 3, [1, 2, 1])
    >>> Mask([[1, 0], [1, 0]])
    Traceback (most recent call last):
    ...
    masklab.errors.MaskError: block 1 (column 1, 'block1') is held by no worker
    """

    __slots__ = ("_matrix", "_block_names", "_block_sizes", "_schedule", "_construction", "_rounds")

    def __init__(
        self,
        matrix: Any,
        *,
        block_names: Sequence[str] | None = None,
        block_sizes: Sequence[int] | None = None,
        schedule: Schedule | None = None,
        construction: str | None = None,
        rounds: Any = None,
    ) -> None:
        m = _validated_matrix(matrix)
        workers, blocks = m.shape
        names = _validated_names(block_names, blocks)
        sizes = _validated_sizes(block_sizes, blocks)
        if schedule is None:
            schedule = Schedule()
        if not isinstance(schedule, Schedule):
            raise MaskError(f"schedule must be a masklab.Schedule, got {type(schedule).__name__}")
        _check_covered(m, names)
        m.setflags(write=False)
        self._matrix = m
        self._block_names = names
        self._block_sizes = sizes
        self._schedule = schedule
        self._construction = construction
        self._rounds = _validated_rounds(rounds, m, names, schedule)

    @classmethod
    def sequence(cls, masks: Sequence[Any], *, every: int = 1, block_names: Sequence[str] | None = None,
                 block_sizes: Sequence[int] | None = None, construction: str | None = None) -> Mask:
        """The mask that trains `masks` in turn, each for `every` steps (a ``sequence`` schedule).

        `masks` are K x B matrices (or `Mask` objects, whose matrices are taken) with the same
        coverage in every block; round r trains ``masks[r % len(masks)]``.

        >>> m = Mask.sequence([[[1, 0], [0, 1]], [[0, 1], [1, 0]]], every=3)
        >>> m.round_matrix(3).tolist(), m.round_matrix(6).tolist()
        ([[0, 1], [1, 0]], [[1, 0], [0, 1]])
        """
        if isinstance(masks, (str, bytes)) or not isinstance(masks, Sequence) or len(masks) == 0:
            raise MaskError(f"a mask sequence must be a non-empty list of K x B matrices, got {masks!r}")
        return cls(masks[0], block_names=block_names, block_sizes=block_sizes,
                   schedule=Schedule("sequence", every), construction=construction, rounds=list(masks))

    # -- basic properties -------------------------------------------------------------------
    @property
    def matrix(self) -> np.ndarray:
        """The read-only (K, B) uint8 matrix."""
        return self._matrix

    @property
    def workers(self) -> int:
        """K, the number of workers (rows)."""
        return int(self._matrix.shape[0])

    @property
    def blocks(self) -> int:
        """B, the number of maskable blocks (columns)."""
        return int(self._matrix.shape[1])

    @property
    def block_names(self) -> tuple[str, ...]:
        return self._block_names

    @property
    def block_sizes(self) -> tuple[int, ...] | None:
        return self._block_sizes

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def construction(self) -> str | None:
        return self._construction

    @property
    def rounds(self) -> np.ndarray | None:
        """A ``sequence`` schedule's masks, read-only, shape (P, K, B) (``rounds[0]`` is `matrix`);
        None for the other schedules, whose rounds reassign `matrix`'s rows."""
        return self._rounds

    @property
    def matrices(self) -> tuple[np.ndarray, ...]:
        """The matrices whose rows the schedule hands to workers: a ``sequence``'s rounds, else
        ``(matrix,)`` (``permute`` and ``cyclic`` reassign its rows). Checks and analyses that
        must hold in every round run over these."""
        return (self._matrix,) if self._rounds is None else tuple(self._rounds)

    @property
    def coverage(self) -> np.ndarray:
        """c_j = |S_j| for every block, shape (B,), the same in every round of every schedule."""
        return self._matrix.sum(axis=0, dtype=np.int64)

    @property
    def row_sums(self) -> np.ndarray:
        """Blocks held by each worker, shape (K,)."""
        return self._matrix.sum(axis=1, dtype=np.int64)

    @property
    def active_fraction(self) -> float:
        """C = sum(M) / (K B)."""
        return float(self._matrix.sum(dtype=np.int64)) / (self.workers * self.blocks)

    @property
    def is_balanced(self) -> bool:
        """All coverages equal."""
        c = self.coverage
        return bool(np.all(c == c[0]))

    @property
    def is_regular(self) -> bool:
        """All row sums equal."""
        r = self.row_sums
        return bool(np.all(r == r[0]))

    def holder_set(self, block: int) -> tuple[int, ...]:
        """S_j: the workers holding `block` (for a static mask, or round 0 of a schedule)."""
        if not 0 <= block < self.blocks:
            raise MaskError(f"block index {block} is out of range [0, {self.blocks})")
        return tuple(int(k) for k in np.flatnonzero(self._matrix[:, block]))

    def held_blocks(self, worker: int) -> tuple[int, ...]:
        """Blocks held by `worker` (for a static mask, or round 0 of a schedule)."""
        if not 0 <= worker < self.workers:
            raise MaskError(f"worker index {worker} is out of range [0, {self.workers})")
        return tuple(int(j) for j in np.flatnonzero(self._matrix[worker]))

    # -- schedules --------------------------------------------------------------------------
    def round_matrix(self, step: int, *, seed: int = 0) -> np.ndarray:
        """The concrete (K, B) matrix in force at training `step` under the schedule.

        ``permute`` draws round r's permutation from ``(seed, r)``, so every rank computes the same
        matrix without communicating; ``sequence`` takes ``rounds[r % P]``.
        """
        if step < 0:
            raise MaskError(f"step {step} must be >= 0")
        kind = self._schedule.kind
        if kind == "static":
            return self._matrix
        r = step // self._schedule.every
        if kind == "sequence":
            return self._rounds[r % len(self._rounds)]
        if kind == "cyclic":
            rows = (np.arange(self.workers) + r) % self.workers
        else:
            rows = np.random.default_rng([seed, r]).permutation(self.workers)
        out = self._matrix[rows]
        out.setflags(write=False)
        return out

    # -- derived masks ----------------------------------------------------------------------
    def replace(self, **changes: Any) -> Mask:
        """A copy with some of matrix/block_names/block_sizes/schedule/construction/rounds changed.

        A schedule other than ``sequence`` drops the rounds (the new schedule reassigns `matrix`'s
        rows); a new `matrix` under a ``sequence`` needs new `rounds` too.
        """
        fields = {
            "matrix": self._matrix,
            "block_names": self._block_names,
            "block_sizes": self._block_sizes,
            "schedule": self._schedule,
            "construction": self._construction,
            "rounds": self._rounds,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise MaskError(f"unknown Mask field(s) {sorted(unknown)}; known: {sorted(fields)}")
        fields.update(changes)
        if "rounds" not in changes and (fields["schedule"] or Schedule()).kind != "sequence":
            fields["rounds"] = None  # the new schedule reassigns the matrix's rows
        matrix = fields.pop("matrix")
        return Mask(matrix, **fields)

    def transpose(self) -> Mask:
        """The mask with the roles of workers and blocks swapped (names and sizes dropped)."""
        if self._rounds is not None:
            raise MaskError("a 'sequence' mask has no transpose: its rounds keep coverage, not row sums")
        return Mask(self._matrix.T, schedule=self._schedule, construction=self._construction)

    # -- dunder -----------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mask):
            return NotImplemented
        return (
            np.array_equal(self._matrix, other._matrix)
            and self._block_names == other._block_names
            and self._block_sizes == other._block_sizes
            and self._schedule == other._schedule
            and self._construction == other._construction
            and (self._rounds is None) == (other._rounds is None)
            and (self._rounds is None or np.array_equal(self._rounds, other._rounds))
        )

    def __hash__(self) -> int:
        rounds = None if self._rounds is None else self._rounds.tobytes()
        return hash((self._matrix.shape, self._matrix.tobytes(), self._block_names, self._schedule, rounds))

    def __repr__(self) -> str:
        return (
            f"Mask(workers={self.workers}, blocks={self.blocks}, "
            f"active_fraction={self.active_fraction:.4g}, schedule={self._schedule.kind!r}"
            + (f", every={self._schedule.every}" if not self._schedule.is_static else "")
            + (f", rounds={len(self._rounds)}" if self._rounds is not None else "")
            + (f", construction={self._construction!r}" if self._construction else "")
            + ")"
        )


def _validated_matrix(matrix: Any) -> np.ndarray:
    if isinstance(matrix, Mask):
        return matrix.matrix.copy()
    try:
        a = np.asarray(matrix)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise MaskError(f"mask matrix is not a rectangular array: {exc}") from None
    if a.dtype == object:
        raise MaskError("mask matrix is not a rectangular array of numbers (ragged rows or non-numbers)")
    if a.ndim != 2:
        raise MaskError(f"mask matrix must be 2-D (workers x blocks), got shape {a.shape}")
    workers, blocks = a.shape
    if workers < 1:
        raise MaskError(f"mask needs at least one worker (K >= 1), got shape {a.shape}")
    if blocks < 1:
        raise MaskError(f"mask needs at least one block (B >= 1), got shape {a.shape}")
    if a.dtype != bool and not np.issubdtype(a.dtype, np.number):
        raise MaskError(f"mask entries must be 0 or 1, got dtype {a.dtype}")
    if a.dtype != bool:
        bad = np.argwhere(~((a == 0) | (a == 1)))
        if bad.size:
            k, j = (int(x) for x in bad[0])
            raise MaskError(
                f"mask entry at row {k} (worker {k}), column {j} is {a[k, j].item()!r}; entries must be 0 or 1"
                + (f" ({len(bad)} such entries)" if len(bad) > 1 else "")
            )
    return np.array(a, dtype=np.uint8, order="C", copy=True)  # never alias the caller's array


def _validated_rounds(rounds: Any, matrix: np.ndarray, names: tuple[str, ...],
                      schedule: Schedule) -> np.ndarray | None:
    """A ``sequence`` schedule's masks as one read-only (P, K, B) array, checked round by round."""
    if schedule.kind != "sequence":
        if rounds is not None:
            raise MaskError(f"rounds= (a mask sequence) needs schedule kind 'sequence', got {schedule.kind!r}")
        return None
    if rounds is None:
        raise MaskError("a 'sequence' schedule needs its masks: rounds=[mask0, mask1, ...] (or Mask.sequence)")
    if isinstance(rounds, np.ndarray):
        rounds = list(rounds) if rounds.ndim == 3 else [rounds]
    if isinstance(rounds, (str, bytes)) or not isinstance(rounds, Sequence) or len(rounds) == 0:
        raise MaskError(f"rounds must be a non-empty list of K x B masks, got {type(rounds).__name__}")
    out = []
    for r, value in enumerate(rounds):
        try:
            m = _validated_matrix(value)
            if m.shape != matrix.shape:
                raise MaskError(f"shape {m.shape}, round 0 has {matrix.shape}")
            _check_covered(m, names)
        except MaskError as exc:
            raise MaskError(f"mask sequence round {r}: {exc}") from None
        changed = np.flatnonzero(m.sum(axis=0) != matrix.sum(axis=0))
        if changed.size:
            j = int(changed[0])
            raise MaskError(f"mask sequence round {r}: block {j} ({names[j]!r}) has coverage {int(m[:, j].sum())}, "
                            f"round 0 has {int(matrix[:, j].sum())} ({changed.size} such blocks); every round keeps "
                            "each block's coverage c_j, which the theorems use")
        out.append(m)
    if not np.array_equal(out[0], matrix):
        raise MaskError("mask sequence round 0 must equal the mask's matrix")
    stacked = np.stack(out)
    stacked.setflags(write=False)
    return stacked


def _validated_names(names: Sequence[str] | None, blocks: int) -> tuple[str, ...]:
    if names is None:
        return tuple(f"block{j}" for j in range(blocks))
    if isinstance(names, str):
        raise MaskError("block_names must be a sequence of strings, not one string")
    names = tuple(names)
    if len(names) != blocks:
        raise MaskError(f"block_names has {len(names)} names but the mask has {blocks} blocks")
    for j, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise MaskError(f"block name for column {j} must be a non-empty string, got {name!r}")
    seen: dict[str, int] = {}
    for j, name in enumerate(names):
        if name in seen:
            raise MaskError(f"block name {name!r} is used by columns {seen[name]} and {j}")
        seen[name] = j
    return names


def _validated_sizes(sizes: Sequence[int] | None, blocks: int) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    sizes = tuple(sizes)
    if len(sizes) != blocks:
        raise MaskError(f"block_sizes has {len(sizes)} entries but the mask has {blocks} blocks")
    for j, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise MaskError(f"block size for column {j} must be an integer >= 1, got {s!r}")
    return tuple(int(s) for s in sizes)


def _check_covered(m: np.ndarray, names: tuple[str, ...]) -> None:
    coverage = m.sum(axis=0)
    uncovered = np.flatnonzero(coverage == 0)
    if uncovered.size:
        j = int(uncovered[0])
        more = f" ({uncovered.size} uncovered blocks: {uncovered[:10].tolist()})" if uncovered.size > 1 else ""
        raise MaskError(f"block {j} (column {j}, {names[j]!r}) is held by no worker{more}")
    empty = np.flatnonzero(m.sum(axis=1) == 0)
    if empty.size:
        k = int(empty[0])
        more = f" ({empty.size} empty workers: {empty[:10].tolist()})" if empty.size > 1 else ""
        raise MaskError(f"worker {k} (row {k}) holds no block{more}")
