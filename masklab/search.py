"""Local search for balanced masks with a large spectral gap.

For a balanced mask (every block held by c workers) the mixing-graph weights are
a_kl = O_kl / (B c), with O = M M^T the pair overlaps, and the sum of the off-diagonal overlaps is
fixed at B c (c - 1). The gap reaches its trace bound exactly when all overlaps are equal
(docs/design.md §3), so the search minimises the sum of squared overlaps, which pulls them together; the
spectral gap itself is computed only for the starting point and the result, and the result is
returned only if it lowered that sum (exactly, in integers) and raised the gap. Moves swap two blocks between two workers (k gives up i and takes j, l the
reverse), which keeps every row sum and every coverage. This module does not pick constructions
(see `masklab.design`).
"""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np

from masklab.analysis import optimality_ratio, spectral_gap
from masklab.constructions import SeedLike, _check_balanced, cyclic, random_balanced
from masklab.errors import DesignError
from masklab.mask import Mask

OPTIMAL_TOLERANCE = 1e-9  # optimality ratio within this of 1 counts as attaining the trace bound


def search(
    K: int,
    B: int,
    *,
    coverage: int,
    seed: SeedLike = None,
    initial: Mask | None = None,
    starts: int = 20,
    iterations: int | None = None,
    time_limit: float | None = None,
) -> Mask:
    """A balanced K x B mask with coverage c whose spectral gap is found by local search.

    Starts from `initial`, or else from the best (by spectral gap, earliest on ties) of
    ``cyclic(K, B, coverage=c)`` followed by `starts` masks ``random_balanced(K, B, coverage=c,
    seed=rng)`` drawn in order from ``rng = numpy.random.default_rng(seed)`` before anything else.
    The result is never worse than that start: every block keeps exactly c holders, every row sum
    is kept, and the start is returned unless the search both lowered the sum of squared pair
    overlaps (an exact integer) and raised the gap.

    Parameters
    ----------
    coverage : int
        c, holders per block, in [1, K] with B * c >= K.
    seed : int, numpy.random.Generator or None
        Turned once into a generator by ``numpy.random.default_rng``.
    initial : Mask, optional
        A K x B mask with every coverage equal to c to improve instead of the default starts.
    starts : int
        Random balanced starting masks drawn when `initial` is None (>= 0).
    iterations : int, optional
        Proposed swaps. Default ``min(200 K c, 100_000, 3e7 // (K + B + 200))``, about one or
        two seconds whatever the size; 0 returns the start.
    time_limit : float, optional
        Wall-clock seconds after which the search stops early. Without it the result depends only
        on the arguments; with it, also on the machine's speed.

    Raises
    ------
    DesignError
        If the parameters are inconsistent, or `initial` does not have shape (K, B) and coverage c.

    Examples
    --------
    >>> from masklab.analysis import optimality_ratio
    >>> m = search(7, 7, coverage=3, seed=0)
    >>> m.coverage.tolist(), round(optimality_ratio(m), 6)
    ([3, 3, 3, 3, 3, 3, 3], 1.0)
    """
    c = _check_balanced(K, B, coverage)
    _check_budget(starts, iterations, time_limit)
    rng = np.random.default_rng(seed)
    if initial is None:
        candidates = [cyclic(K, B, coverage=c)]
        candidates += [random_balanced(K, B, coverage=c, seed=rng) for _ in range(starts)]
    else:
        candidates = [_checked_initial(initial, K, B, c)]
    gaps = [spectral_gap(m) for m in candidates]
    best = int(np.argmax(gaps))
    start, start_gap = candidates[best], gaps[best]
    if iterations is None:
        iterations = _default_iterations(K, B, c)
    if iterations == 0 or c in (1, K) or optimality_ratio(start, gap=start_gap) >= 1 - OPTIMAL_TOLERANCE:
        return start.replace(construction="search")
    deadline = None if time_limit is None else time.monotonic() + time_limit
    improved = Mask(_swap_search(start.matrix, c, iterations, rng, deadline), construction="search")
    # Sideways moves alone leave F, and with it the overlap spread, unchanged: such a result is no
    # improvement by the search's own (exact, integer) measure, whatever rounding does to its gap.
    if _overlap_square_sum(improved.matrix) < _overlap_square_sum(start.matrix) and spectral_gap(improved) > start_gap:
        return improved
    return start.replace(construction="search")


def overlap_spread(mask: Mask) -> float:
    """Sum over worker pairs k < l of (O_kl - mean overlap)^2, O = M M^T: 0 iff all pairs share equally.

    This is the quantity the search drives down (up to a constant that depends only on the
    coverage); for a balanced mask it is 0 exactly when the gap equals its trace bound. It is
    computed exactly, as the rational F - S^2 / P (F the sum of squared overlaps, S their sum, P the
    number of pairs) rounded once to a float, so masks with equal overlaps get equal spreads
    whatever the order of their rows.

    >>> from masklab.constructions import projective_plane
    >>> overlap_spread(projective_plane(3))
    0.0
    """
    overlaps = _pair_overlaps(mask.matrix)
    if overlaps.size == 0:
        return 0.0
    total = int(overlaps.sum())
    return float(Fraction(_overlap_square_sum(mask.matrix)) - Fraction(total * total, overlaps.size))


# -- internals ---------------------------------------------------------------------------------
def _pair_overlaps(matrix: np.ndarray) -> np.ndarray:
    """O_kl = |row k AND row l| for k < l, in exact integers."""
    m = matrix.astype(np.int64)
    return (m @ m.T)[np.triu_indices(m.shape[0], k=1)]


def _overlap_square_sum(matrix: np.ndarray) -> int:
    """F = sum_{k<l} O_kl^2, the search's objective, as a Python integer."""
    overlaps = _pair_overlaps(matrix)
    return int((overlaps * overlaps).sum())


def _default_iterations(K: int, B: int, c: int) -> int:
    """About 1-2 s of swaps: each costs ~15 us plus O(K + B), so the count shrinks as K + B grows."""
    return int(min(200 * K * c, 100_000, 3e7 // (K + B + 200)))


def _swap_search(
    start: np.ndarray, c: int, iterations: int, rng: np.random.Generator, deadline: float | None
) -> np.ndarray:
    """Descend on F = sum_{k<l} O_kl^2 with sideways moves; F never rises, so the last matrix is the best."""
    held = start.astype(bool)
    columns = np.ascontiguousarray(start.T, dtype=np.int64)  # (B, K): fast column reads
    K, B = held.shape
    as_float = start.astype(np.float64)
    overlaps = np.rint(as_float @ as_float.T).astype(np.int64)  # BLAS; exact below 2^53
    pairs = K * (K - 1) // 2
    base, extra = divmod(B * c * (c - 1) // 2, pairs)
    floor = pairs * base * base + extra * (2 * base + 1)  # F when the overlaps are as equal as possible
    f = int((np.triu(overlaps, k=1) ** 2).sum())
    first = rng.integers(K, size=iterations)
    second = (first + 1 + rng.integers(K - 1, size=iterations)) % K
    picks = rng.random((iterations, 2))
    for step in range(iterations):
        if f == floor or (deadline is not None and step % 256 == 0 and time.monotonic() > deadline):
            break
        k, l = first[step], second[step]
        only_k = np.flatnonzero(held[k] > held[l])
        only_l = np.flatnonzero(held[l] > held[k])
        if only_k.size == 0 or only_l.size == 0:
            continue
        i = only_k[int(picks[step, 0] * only_k.size)]
        j = only_l[int(picks[step, 1] * only_l.size)]
        d = columns[j] - columns[i]  # change of O[k, :] when k gives up i and takes j; O[l, :] gets -d
        d[k] = d[l] = 0
        delta = 2 * int(d @ (overlaps[k] - overlaps[l])) + 2 * int(d @ d)
        if delta > 0:  # sideways moves (delta == 0) are taken: they walk across plateaus of F
            continue
        held[k, i] = held[l, j] = False
        held[k, j] = held[l, i] = True
        columns[i, k] = columns[j, l] = 0
        columns[j, k] = columns[i, l] = 1
        overlaps[k] += d
        overlaps[:, k] += d
        overlaps[l] -= d
        overlaps[:, l] -= d
        f += delta
    return held.astype(np.uint8)


def _checked_initial(initial: Mask, K: int, B: int, c: int) -> Mask:
    if not isinstance(initial, Mask):
        raise DesignError(f"initial must be a masklab.Mask, got {type(initial).__name__}")
    if initial.matrix.shape != (K, B):
        raise DesignError(f"initial mask has shape {initial.matrix.shape}, expected (K, B) = ({K}, {B})")
    bad = np.flatnonzero(initial.coverage != c)
    if bad.size:
        j = int(bad[0])
        raise DesignError(
            f"initial mask block {j} has coverage {int(initial.coverage[j])}, expected coverage={c} "
            f"({bad.size} blocks differ)"
        )
    return initial


def _check_budget(starts: int, iterations: int | None, time_limit: float | None) -> None:
    if isinstance(starts, bool) or not isinstance(starts, (int, np.integer)) or starts < 0:
        raise DesignError(f"starts={starts!r} must be an integer >= 0")
    if iterations is not None and (
        isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 0
    ):
        raise DesignError(f"iterations={iterations!r} must be an integer >= 0")
    if time_limit is not None and not time_limit > 0:
        raise DesignError(f"time_limit={time_limit!r} must be a positive number of seconds")
