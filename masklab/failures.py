"""How many worker losses a mask survives, and which sets of workers are fatal.

A set of workers is *fatal* when losing all of them at once leaves some block with no holder: that
is, when it contains a holder set S_j. So a mask survives any ``min_j c_j - 1`` simultaneous
losses with every block still held (`failures_survived`), and the smallest fatal sets are the
distinct holder sets of minimum size (`smallest_fatal_sets`); every fatal set contains one holder
set, so `is_fatal` decides any set. These are properties of the mask: continuing a run from the
survivors without a checkpoint is the runtime's job (docs/design.md §7, "Losing a worker"), which
this module neither does nor assumes.

Computed, as `masklab.analysis.process_group_holder_sets` is, on ``mask.matrix`` for static masks
and round 0 of ``permute`` and ``cyclic`` (later rounds move the holder sets, so which sets are
fatal changes, but never their size: a schedule keeps every c_j), on every round of a ``sequence``.
This module does not pick the survivors' new mask beyond dropping the lost rows (`survivors_mask`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from masklab.errors import DesignError, MaskError
from masklab.mask import Mask

FATAL_SETS_SHOWN = 10  # how many smallest fatal sets a certificate lists


def failures_survived(mask: Mask) -> int:
    """``min_j c_j - 1``: any this many workers may be lost at once and every block keeps a holder.

    >>> failures_survived(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]))
    1
    >>> failures_survived(Mask([[1, 0], [0, 1]]))
    0
    """
    return int(min(int(m.sum(axis=0).min()) for m in mask.matrices)) - 1


def smallest_fatal_sets(mask: Mask, *, limit: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The distinct holder sets of minimum size, sorted: the smallest sets of workers whose loss
    leaves a block without holder (each has ``failures_survived(mask) + 1`` workers).

    Parameters
    ----------
    mask : Mask
    limit : int, optional
        Return at most this many (the first in sorted order); `count_smallest_fatal_sets` says how
        many there are.

    Examples
    --------
    >>> smallest_fatal_sets(Mask([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1]]))
    ((0, 1), (0, 2), (1, 2))
    >>> smallest_fatal_sets(Mask([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1]]), limit=1)
    ((0, 1),)
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0):
        raise MaskError(f"limit={limit!r} must be an integer >= 0 or None")
    sets = _smallest(mask)
    return sets if limit is None else sets[:limit]


def count_smallest_fatal_sets(mask: Mask) -> int:
    """How many distinct holder sets have the minimum size (`smallest_fatal_sets` without a limit).

    >>> count_smallest_fatal_sets(Mask([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1]]))
    3
    """
    return len(_smallest(mask))


def is_fatal(mask: Mask, lost: Iterable[int]) -> bool:
    """Whether losing the workers `lost` at once leaves some block (in some round) without holder.

    >>> m = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    >>> is_fatal(m, [0]), is_fatal(m, [0, 2])
    (False, True)
    """
    rows = _lost_rows(mask, lost)
    return any(not m[~rows].any(axis=0).all() for m in mask.matrices)


def survivors_mask(mask: Mask, lost: Iterable[int]) -> Mask:
    """The static mask of the surviving workers: ``mask.matrix`` without the rows of `lost`, with
    the block names and sizes kept; the blocks the lost workers held stay with their other holders.

    For a schedule, pass the round in force (``Mask(mask.round_matrix(step))``). Raises `MaskError`
    naming the first block whose every holder is lost, since no survivor can continue it (the run
    has to restart from a checkpoint), and when no worker survives.

    >>> survivors_mask(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), [1]).matrix.tolist()
    [[1, 1, 0], [1, 0, 1]]
    """
    rows = _lost_rows(mask, lost)
    if rows.all():
        raise MaskError(f"every one of the {mask.workers} workers is lost: no survivor holds anything")
    held = mask.matrix[~rows].any(axis=0)
    if not held.all():
        j = int(np.flatnonzero(~held)[0])
        raise MaskError(f"block {j} ({mask.block_names[j]}) loses every holder {mask.holder_set(j)}: no survivor "
                        "holds it, so training cannot continue without a checkpoint")
    return Mask(mask.matrix[~rows], block_names=mask.block_names, block_sizes=mask.block_sizes,
                construction=mask.construction)


def check_tolerates(mask: Mask, tolerate: int) -> Mask:
    """`mask` when it survives `tolerate` simultaneous losses, else a `DesignError` naming the block.

    >>> check_tolerates(Mask([[1, 0], [1, 1]]), 1)
    Traceback (most recent call last):
    ...
    masklab.errors.DesignError: tolerate=1 needs every block on at least 2 workers, but block 1 has 1 holder
    """
    tolerate = checked_tolerate(tolerate, mask.workers)
    for m in mask.matrices:
        coverage = m.sum(axis=0)
        if coverage.min() < tolerate + 1:
            j = int(np.argmin(coverage))
            raise DesignError(f"tolerate={tolerate} needs every block on at least {tolerate + 1} workers, but "
                              f"block {j} has {int(coverage[j])} holder{'s' if coverage[j] != 1 else ''}")
    return mask


def checked_tolerate(tolerate: int, workers: int) -> int:
    """`tolerate` as an int, or a `DesignError`: 0 <= tolerate <= K - 1 (a block on all K workers
    survives K - 1 losses, and no mask survives the loss of every worker)."""
    if isinstance(tolerate, bool) or not isinstance(tolerate, (int, np.integer)) or tolerate < 0:
        raise DesignError(f"tolerate={tolerate!r} must be an integer >= 0 (the worker losses to survive)")
    if tolerate >= workers:
        raise DesignError(f"tolerate={tolerate} is impossible with K={workers} workers: a block held by all "
                          f"of them survives at most {workers - 1} losses")
    return int(tolerate)


def _smallest(mask: Mask) -> tuple[tuple[int, ...], ...]:
    columns = np.unique(np.hstack(mask.matrices).astype(bool), axis=1).T  # one row per distinct holder set
    size = int(columns.sum(axis=1).min())
    return tuple(sorted(tuple(int(k) for k in np.flatnonzero(c)) for c in columns if c.sum() == size))


def _lost_rows(mask: Mask, lost: Iterable[int]) -> np.ndarray:
    rows = np.zeros(mask.workers, dtype=bool)
    for k in lost:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < mask.workers:
            raise MaskError(f"lost worker {k!r} is not a worker index in [0, {mask.workers})")
        rows[k] = True
    return rows
