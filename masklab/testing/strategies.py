"""Hypothesis strategies for SDP masks, schedules and exact designs.

Masks are built from small integers, booleans and permutations, never from floats or rejection of
large arrays, so Hypothesis shrinks a failing example to the fewest workers and blocks and to the
simplest matrix (all holders forced to the lowest index). Every strategy returns objects that are
valid by construction (`Mask` validates them again). This module does not check invariants (see
`masklab.testing.asserts`); the theory's problem constants and step sizes are drawn by
`theory.testing`, above masklab.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from masklab.analysis import is_connected
from masklab.design import design, exact_designs
from masklab.errors import MaskError
from masklab.mask import ROW_SCHEDULE_KINDS, Mask, Schedule

IntLike = int | st.SearchStrategy[int] | None
ActiveLike = float | tuple[float, float] | None

__all__ = ["balanced_masks", "block_designs", "mask_sequences", "masks", "schedules"]


def schedules(*, kinds: tuple[str, ...] = ROW_SCHEDULE_KINDS, max_every: int = 5) -> st.SearchStrategy[Schedule]:
    """A `Schedule` of one of ``kinds`` redrawn every 1..`max_every` steps; shrinks to static, every=1.

    ``sequence`` is not among them: its masks live in the `Mask` (draw those with `mask_sequences`).

    >>> from hypothesis import find
    >>> find(schedules(), lambda s: True)
    Schedule(kind='static', every=1)
    """
    unknown = [k for k in kinds if k not in ROW_SCHEDULE_KINDS]
    if not kinds or unknown:
        raise MaskError(f"kinds={kinds!r} must be a non-empty subset of {ROW_SCHEDULE_KINDS}")
    if max_every < 1:
        raise MaskError(f"max_every={max_every!r} must be >= 1")
    return st.builds(Schedule, st.sampled_from(kinds), st.integers(1, max_every))


def masks(
    *,
    workers: IntLike = None,
    blocks: IntLike = None,
    max_workers: int = 8,
    max_blocks: int = 10,
    active: ActiveLike = None,
    balanced: bool = False,
    connected: bool = False,
    schedule: bool | st.SearchStrategy[Schedule] = False,
) -> st.SearchStrategy[Mask]:
    """Valid masks (every block held, every worker holding a block); shrinks to 1 x 1.

    Parameters
    ----------
    workers, blocks : int or strategy of int, optional
        K and B: a fixed number, or a strategy; default 1..`max_workers` and 1..`max_blocks`.
    max_workers, max_blocks : int
        Upper ends of the default ranges of K and B.
    active : float or (float, float), optional
        The active fraction C = sum(M) / (K B): a float asks for the nearest achievable C, a pair
        (lo, hi) for C in [lo, hi] (sizes where no valid mask has such a C are skipped).
    balanced : bool
        Every block has the same coverage c.
    connected : bool
        The worker mixing graph is connected (spectral gap > 0); drawn by filtering.
    schedule : bool or strategy of Schedule
        ``True`` draws from `schedules()`; ``False`` gives static masks.

    Examples
    --------
    >>> from hypothesis import find
    >>> find(masks(), lambda m: m.workers >= 3).matrix.tolist()
    [[1], [1], [1]]
    """
    k_strategy = _sizes(workers, max_workers, "workers")
    b_strategy = _sizes(blocks, max_blocks, "blocks")
    window = _active_window(active)
    schedule_strategy = _schedule_strategy(schedule)
    build = _balanced_mask if balanced else _mask
    strategy = build(k_strategy, b_strategy, window, schedule_strategy)
    return strategy.filter(is_connected) if connected else strategy


def mask_sequences(*, max_rounds: int = 3, max_every: int = 3, **mask_options) -> st.SearchStrategy[Mask]:
    """Masks with a ``sequence`` schedule of 1..`max_rounds` rounds, each kept 1..`max_every` steps.

    Round 0 is drawn by ``masks(**mask_options)``; every later round shuffles each block's holders
    among the workers independently (so coverage is kept, as a sequence requires, and rounds are
    not mere row permutations), rejecting draws that leave a worker without a block.

    >>> from hypothesis import find
    >>> find(mask_sequences(), lambda m: True).rounds.shape
    (1, 1, 1)
    """
    if max_rounds < 1 or max_every < 1:
        raise MaskError(f"max_rounds={max_rounds!r} and max_every={max_every!r} must be >= 1")

    @st.composite
    def build(draw) -> Mask:
        base = draw(masks(**mask_options))
        rounds = [base.matrix]
        for _ in range(draw(st.integers(1, max_rounds)) - 1):
            columns = [draw(st.permutations(list(col))) for col in base.matrix.T]
            matrix = np.array(columns, dtype=np.uint8).T
            if (matrix.sum(axis=1) == 0).any():
                continue  # a worker left without a block: not a valid mask, keep fewer rounds
            rounds.append(matrix)
        return Mask.sequence(rounds, every=draw(st.integers(1, max_every)), block_sizes=base.block_sizes,
                             block_names=base.block_names)

    return build()


def balanced_masks(
    *, workers: IntLike = None, blocks: IntLike = None, max_workers: int = 8, max_blocks: int = 10,
    active: ActiveLike = None,
) -> st.SearchStrategy[Mask]:
    """Static masks in which every block has the same coverage c: ``masks(balanced=True, ...)``."""
    return masks(
        workers=workers, blocks=blocks, max_workers=max_workers, max_blocks=max_blocks, active=active, balanced=True
    )


def block_designs(*, max_workers: int = 13) -> st.SearchStrategy[Mask]:
    """The library's exact 2-designs (`masklab.design.exact_designs`) with K <= `max_workers`.

    Their spectral gap equals the trace bound; shrinks towards the smallest design (K=4, B=6).
    """
    if max_workers < 4:
        raise MaskError(f"max_workers={max_workers!r} must be >= 4: the smallest exact design has K=4")
    entries = exact_designs(max_workers)
    return st.sampled_from(entries).map(lambda e: design(e[0], e[1], coverage=e[2]))


# -- internals ---------------------------------------------------------------------------------
def _sizes(value: IntLike, maximum: int, what: str) -> st.SearchStrategy[int]:
    if isinstance(value, st.SearchStrategy):
        return value
    if value is None:
        if isinstance(maximum, bool) or not isinstance(maximum, int) or maximum < 1:
            raise MaskError(f"max_{what}={maximum!r} must be an integer >= 1")
        return st.integers(1, maximum)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise MaskError(f"{what}={value!r} must be an integer >= 1 or a strategy of integers")
    return st.just(int(value))


def _active_window(active: ActiveLike) -> tuple[float, float] | None:
    if active is None:
        return None
    lo, hi = (active, active) if isinstance(active, (int, float)) else tuple(active)
    if not (0.0 < lo <= hi <= 1.0):
        raise MaskError(f"active={active!r} must be a fraction in (0, 1] or a pair 0 < lo <= hi <= 1")
    return float(lo), float(hi)


def _schedule_strategy(schedule: bool | st.SearchStrategy[Schedule]) -> st.SearchStrategy[Schedule]:
    if isinstance(schedule, st.SearchStrategy):
        return schedule
    if not isinstance(schedule, bool):
        raise MaskError(f"schedule={schedule!r} must be a bool or a strategy of Schedule")
    return schedules() if schedule else st.just(Schedule())


def _ones_range(cells: int, low: int, window: tuple[float, float] | None, step: int = 1) -> list[int]:
    """Feasible counts n of ones (multiples of `step`, low <= n <= cells) for the active window."""
    counts = range(low, cells + 1, step) if step == 1 else range(step * -(-low // step), cells + 1, step)
    if window is None:
        return list(counts)
    lo, hi = window
    if lo == hi:  # a single float: the achievable count nearest to lo * cells
        return [min(counts, key=lambda n: (abs(n - lo * cells), n))] if len(counts) else []
    return [n for n in counts if lo * cells - 1e-9 <= n <= hi * cells + 1e-9]


@st.composite
def _mask(draw, k_s, b_s, window, schedule_s) -> Mask:
    k, b = draw(k_s), draw(b_s)
    if window is None:
        # Free bits, then one holder forced into every empty column and row: all-False bits and
        # holder index 0 are what Hypothesis shrinks to, so counterexamples come out minimal.
        bits = draw(st.lists(st.booleans(), min_size=k * b, max_size=k * b))
        m = np.array(bits, dtype=np.uint8).reshape(k, b)
        for j in np.flatnonzero(m.sum(axis=0) == 0):
            m[draw(st.integers(0, k - 1)), j] = 1
        for i in np.flatnonzero(m.sum(axis=1) == 0):
            m[i, draw(st.integers(0, b - 1))] = 1
    else:
        counts = _ones_range(k * b, max(k, b), window)
        if not counts:
            draw(st.nothing())
        n = draw(st.sampled_from(counts))
        # A spine of max(k, b) ones (i mod k, i mod b) covers every row and column; the rest of the
        # n ones go to distinct other cells.
        m = np.zeros((k, b), dtype=np.uint8)
        i = np.arange(max(k, b))
        m[i % k, i % b] = 1
        free = np.flatnonzero(m.ravel() == 0)
        extra = draw(st.lists(st.sampled_from(free.tolist()), min_size=n - i.size, max_size=n - i.size,
                              unique=True)) if n > i.size else []
        m.ravel()[extra] = 1
        m = m[draw(st.permutations(range(k)))]
    return Mask(m, schedule=draw(schedule_s))


@st.composite
def _balanced_mask(draw, k_s, b_s, window, schedule_s) -> Mask:
    k, b = draw(k_s), draw(b_s)
    coverages = [n // b for n in _ones_range(k * b, b * -(-k // b), window, step=b)]
    if not coverages:
        draw(st.nothing())
    c = draw(st.sampled_from(coverages))
    order = draw(st.permutations(range(k)))
    m = np.zeros((k, b), dtype=np.uint8)
    # Column j takes c consecutive workers of a permutation starting at j*c: every worker is
    # reached because b*c >= k, and each column has exactly c distinct holders.
    for j in range(b):
        for t in range(c):
            m[order[(j * c + t) % k], j] = 1
    return Mask(m, schedule=draw(schedule_s))
