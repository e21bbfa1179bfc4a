"""Bytes per block and per worker: what a mask puts in each worker's memory, and sizes as users write them.

`BlockCosts` holds one byte count per maskable block and the *fixed* bytes every worker holds
whatever the mask (the shared parameters: embedding, stem, final norm, head, with their gradients
and optimizer state). `worker_bytes` is what a mask puts on each worker, `bytes_lower_bound` what
no mask of a given coverage can beat, `parse_bytes` reads sizes such as ``80GB`` or ``24GiB``.
Designing a mask for costs is `masklab.balance`; costs files are read and written by `masklab.io`.
Where the numbers come from (a model's memory model) is not masklab's business: ``sdp plan`` or
the user provides them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from masklab.errors import DesignError, MaskError
from masklab.mask import Mask

MAX_BYTES = 2**62  # sizes and sums stay exact in int64 below this (4 EiB)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]*)", re.ASCII)


@dataclass(frozen=True)
class BlockCosts:
    """Bytes that holding each maskable block costs a worker, plus the bytes no mask removes.

    Parameters
    ----------
    block_bytes : sequence of int
        One count >= 1 per block, in mask column order (parameters, gradients, optimizer state and
        whatever else the worker keeps for the block).
    block_names : sequence of str, optional
        One unique name per block, carried into the designed mask (e.g. ``"layers.3"``).
    fixed_bytes : int
        Bytes every worker holds whatever its blocks (>= 0).
    source : str, optional
        Free-form note of where the numbers come from (``"sdp plan llama-134m bsdp float32"``).

    Examples
    --------
    >>> BlockCosts([4, 4, 16], fixed_bytes=10).total_block_bytes
    24
    >>> BlockCosts([4, 0])
    Traceback (most recent call last):
    ...
    masklab.errors.DesignError: block_bytes[1] = 0 must be an integer >= 1
    """

    block_bytes: tuple[int, ...]
    block_names: tuple[str, ...] | None = None
    fixed_bytes: int = 0
    source: str | None = None

    def __post_init__(self) -> None:
        sizes = _checked_sizes("block_bytes", self.block_bytes, minimum=1)
        if not sizes:
            raise DesignError("block_bytes is empty: give one byte count per maskable block")
        object.__setattr__(self, "block_bytes", sizes)
        if self.block_names is not None:
            names = tuple(self.block_names)
            try:  # the mask's own checks of names, one message per rule
                Mask([[1] * len(sizes)], block_names=names)
            except MaskError as exc:
                raise DesignError(str(exc)) from None
            object.__setattr__(self, "block_names", names)
        object.__setattr__(self, "fixed_bytes", _checked_size("fixed_bytes", self.fixed_bytes, minimum=0))
        if self.source is not None and not isinstance(self.source, str):
            raise DesignError(f"source must be a string or None, got {self.source!r}")
        if self.total_block_bytes + self.fixed_bytes > MAX_BYTES:
            raise DesignError(f"the blocks ({self.total_block_bytes} bytes) and fixed bytes ({self.fixed_bytes}) "
                              f"add up to more than {MAX_BYTES} bytes")

    @property
    def blocks(self) -> int:
        """B, the number of blocks."""
        return len(self.block_bytes)

    @property
    def total_block_bytes(self) -> int:
        """Bytes of all blocks together, as one worker holding every block would."""
        return sum(self.block_bytes)


def worker_bytes(mask: Mask, costs: BlockCosts | Sequence[int], *,
                 fixed_bytes: int | Sequence[int] | None = None) -> list[int]:
    """Bytes each worker holds under `mask`: its fixed bytes plus the bytes of the blocks it holds.

    For a schedule, the most worker k holds in any round: a ``sequence`` takes the largest of its
    rounds per worker; ``permute`` and ``cyclic`` hand every row to every worker in turn, so each
    worker gets its fixed bytes plus the heaviest row.

    Parameters
    ----------
    costs : BlockCosts or sequence of int
        Bytes per block (B entries).
    fixed_bytes : int or sequence of K ints, optional
        Replaces ``costs.fixed_bytes`` (0 for a plain sequence); one value per worker when devices
        carry different fixed loads.

    Examples
    --------
    >>> worker_bytes(Mask([[1, 1, 0], [0, 1, 1]]), [4, 2, 1], fixed_bytes=10)
    [16, 13]
    """
    costs = costs if isinstance(costs, BlockCosts) else BlockCosts(costs)
    if mask.blocks != costs.blocks:
        raise DesignError(f"the mask has {mask.blocks} blocks but the costs name {costs.blocks}")
    fixed = per_worker("fixed_bytes", costs.fixed_bytes if fixed_bytes is None else fixed_bytes, mask.workers)
    w = np.asarray(costs.block_bytes, dtype=np.int64)
    rows = np.max([m.astype(np.int64) @ w for m in mask.matrices], axis=0)
    if mask.schedule.kind in ("permute", "cyclic"):
        rows = np.full_like(rows, rows.max())
    return [int(f + r) for f, r in zip(fixed, rows)]


def bytes_lower_bound(costs: BlockCosts | Sequence[int], K: int, *, min_coverage: int = 2,
                      fixed_bytes: int | Sequence[int] | None = None) -> int:
    """Bytes on the largest worker that no K x B mask with every block held >= `min_coverage` times beats.

    The largest of three bounds: the blocks' ``min_coverage`` copies poured into the K workers
    above their fixed bytes (no worker holding a block twice); the heaviest block's holders, one of
    which carries at least the ``min_coverage``-th smallest fixed bytes; and the worker with the
    most fixed bytes, which holds at least the lightest block (no row is empty).

    Examples
    --------
    >>> bytes_lower_bound([3, 3, 3, 3], 4)  # 8 copies of 3 bytes over 4 workers
    6
    >>> bytes_lower_bound([10, 1, 1], 3)    # the 10-byte block sits on 2 workers
    10
    """
    costs = costs if isinstance(costs, BlockCosts) else BlockCosts(costs)
    r = check_coverage(min_coverage, K)
    fixed = per_worker("fixed_bytes", costs.fixed_bytes if fixed_bytes is None else fixed_bytes, K)
    total = costs.total_block_bytes
    need = r * total
    lo, hi = max(fixed), max(fixed) + total  # at hi every worker can take every block
    while lo < hi:  # smallest T with sum_k min(T - f_k, total) >= need
        mid = (lo + hi) // 2
        if sum(min(mid - f, total) for f in fixed) >= need:
            hi = mid
        else:
            lo = mid + 1
    return max(lo, sorted(fixed)[r - 1] + max(costs.block_bytes), max(fixed) + min(costs.block_bytes))


def parse_bytes(text: str | int) -> int:
    """A size in bytes: plain digits, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB.

    ASCII digits only, with an optional decimal part and one optional space before the unit
    (case-insensitive); a fractional byte count is rounded down. Integers are taken as they are.

    >>> parse_bytes("80GB"), parse_bytes("24GiB"), parse_bytes("1.5 MiB"), parse_bytes(4096)
    (80000000000, 25769803776, 1572864, 4096)
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        value = int(text)
    else:
        match = _SIZE.fullmatch(text.strip(" ")) if isinstance(text, str) else None
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS or len(match.group(1)) > 30:
            raise DesignError(f"size {text!r} is not a number of bytes: give digits (e.g. 25769803776) or a number "
                              "with a unit KB/MB/GB/TB or KiB/MiB/GiB/TiB (e.g. 24GiB, 80GB)")
        value = int(Fraction(match.group(1)) * _UNITS[unit])
    if not 0 < value <= MAX_BYTES:
        raise DesignError(f"size {text!r} must be at least 1 byte and at most {MAX_BYTES} bytes")
    return value


def parse_budgets(text: str) -> list[int]:
    """One size per worker from a comma-separated list, e.g. ``"80GB,80GB,24GB,24GB"``.

    >>> parse_budgets("1KiB, 2000")
    [1024, 2000]
    """
    if not isinstance(text, str) or not text.strip():
        raise DesignError(f"budgets {text!r}: give one size per worker, separated by commas (e.g. 80GB,80GB,24GB)")
    budgets = []
    for k, item in enumerate(text.split(",")):
        try:
            budgets.append(parse_bytes(item))
        except DesignError as exc:
            raise DesignError(f"budget of worker {k}: {exc}") from None
    return budgets


def per_worker(name: str, value: int | Sequence[int], K: int, *, minimum: int = 0) -> list[int]:
    """`value` as K sizes: an integer repeated K times, or a sequence of exactly K integers."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return [_checked_size(name, value, minimum=minimum)] * K
    sizes = _checked_sizes(name, value, minimum=minimum)
    if len(sizes) != K:
        raise DesignError(f"{name} has {len(sizes)} entries but there are K={K} workers")
    return list(sizes)


def check_coverage(min_coverage: int, K: int) -> int:
    """`min_coverage` as an int in [1, K]."""
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise DesignError(f"K={K!r} must be an integer >= 1")
    if isinstance(min_coverage, bool) or not isinstance(min_coverage, (int, np.integer)):
        raise DesignError(f"min_coverage={min_coverage!r} must be an integer number of holders per block")
    if not 1 <= min_coverage <= K:
        raise DesignError(f"min_coverage={min_coverage} must lie in [1, K] = [1, {K}]")
    return int(min_coverage)


def _checked_sizes(name: str, values: Sequence[int], *, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise DesignError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    return tuple(_checked_size(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values))


def _checked_size(name: str, value: int, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= MAX_BYTES:
        raise DesignError(f"{name} = {value!r} must be an integer >= {minimum}"
                          + (f" and <= {MAX_BYTES}" if isinstance(value, (int, np.integer)) and value > 0 else ""))
    return int(value)
