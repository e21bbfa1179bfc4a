"""Masks that balance bytes, not block counts, and fit each device's memory budget.

`design_for_costs` gives every block `min_coverage` holders and spreads the blocks' bytes so that
the worker holding the most bytes holds as few as the search finds, within each worker's budget
when budgets are given. `masklab.design` balances block counts, which is the same thing only when
every block costs the same and every device is alike; blocks differ (ResNet's and Swin's stages
double their width) and so do devices. This module neither computes costs (`masklab.costs`) nor
analyses the result (`masklab.report`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from masklab.analysis import spectral_gap
from masklab.constructions import SeedLike
from masklab.costs import BlockCosts, bytes_lower_bound, check_coverage, per_worker
from masklab.design import design, exact_design
from masklab.errors import DesignError
from masklab.mask import Mask
from masklab.search import _check_budget, search

CONSTRUCTION = "byte-balance"


def design_for_costs(
    costs: BlockCosts | Sequence[int],
    K: int,
    *,
    min_coverage: int = 2,
    budgets: Sequence[int] | None = None,
    fixed_bytes: int | Sequence[int] | None = None,
    max_groups: int | None = None,
    seed: SeedLike = None,
    starts: int = 4,
    iterations: int | None = None,
) -> Mask:
    """A K x B mask whose largest worker holds few bytes, every block held `min_coverage` times.

    Worker k holds ``fixed_k + sum_j M[k, j] * bytes_j``. The mask minimises the largest of these
    (lexicographically after the budget excess sum_k max(0, bytes_k - budget_k), when budgets are
    given); among masks found with equal bytes it prefers the larger spectral gap. Two candidates:

    1. Greedy and local search. Blocks in decreasing bytes (lowest index first on ties) each go
       to the `min_coverage` workers they take least over budget, then with the fewest bytes, then
       the lowest index (the *plain greedy*: LPT scheduling with copies); with budgets also the
       same with the most room left first; and `starts` greedies that send ties between equally
       loaded workers towards those sharing the fewest blocks with the holders already chosen, then
       at random. A worker left empty takes the lightest block from a holder of several. From the
       start with the least (excess, largest bytes, sum of squared pair overlaps), moves of one
       block between two workers and swaps of two blocks keep every coverage and never empty a row.
       They are taken when they do not raise (excess, largest bytes, sum of squared bytes, sum of
       squared pair overlaps), then (excess, largest bytes, sum of squared pair overlaps), which
       spreads the overlaps as `masklab.search` does, then, while a dense eigensolve is cheap (small
       K), (excess, largest bytes, minus the spectral gap).
    2. The holder sets of a count-balanced design with coverage `min_coverage` (`design`'s exact
       design where one fits, else `masklab.search` from the cyclic mask and `starts` random ones),
       handed to the blocks: heaviest block first to the free set whose workers
       end lowest, then swaps of two blocks' sets. Which block gets which set leaves the mixing
       graph, hence the gap, as it is; with equal block bytes this keeps `design`'s gap.

    With `max_groups` only the second candidate is built, from ``design(K, B, coverage=c,
    max_groups=G)``: handing its sets to other blocks keeps its process groups at most G.

    Guaranteed: every block has exactly `min_coverage` holders (more only for the lightest blocks
    when K > B * min_coverage, so that no worker is empty); every row is non-empty; with budgets,
    every worker's bytes are within its budget, or DesignError; the largest worker's bytes (with
    budgets: the excess, then the largest worker's bytes) are never more than the plain greedy's
    (without `max_groups`); with `max_groups`, at most G process groups.
    Not guaranteed: optimality (the problem is NP-hard; `bytes_lower_bound` says how far off the
    result can be), a connected mixing graph, or few process groups.

    Parameters
    ----------
    costs : BlockCosts or sequence of int
        Bytes per block (>= 1 each); a `BlockCosts` also gives block names and fixed bytes.
    K : int
        Workers.
    min_coverage : int
        Holders per block, in [1, K]; 2 keeps every block on a second worker.
    budgets : sequence of K ints, optional
        Each worker's memory budget in bytes (`masklab.costs.parse_budgets` reads ``80GB,24GB``).
    fixed_bytes : int or sequence of K ints, optional
        Bytes each worker holds whatever its blocks; replaces ``costs.fixed_bytes`` (0 for a plain
        sequence).
    max_groups : int, optional
        At most this many process groups (distinct holder sets of 2 to K - 1 workers).
    seed : int, numpy.random.Generator or None
        Turned once into a generator by ``numpy.random.default_rng``.
    starts : int
        Greedy starts with overlap-spreading, random tie-breaks (>= 0).
    iterations : int, optional
        Moves proposed by each local search; default ``min(100 K c + 20 B, 20_000)``.

    Returns
    -------
    Mask
        Static, with the costs' block names and ``construction="byte-balance"``.

    Raises
    ------
    DesignError
        On invalid input, or when no mask found fits the budgets: the message names the worker most
        over its budget, its bytes and its budget, and says whether no mask can fit.

    Examples
    --------
    >>> from masklab.costs import worker_bytes
    >>> costs = [1, 1, 2, 2, 4, 4, 8, 8]  # four stages, each twice as wide as the last
    >>> m = design_for_costs(costs, 4, seed=0)
    >>> m.coverage.tolist(), worker_bytes(m, costs)
    ([2, 2, 2, 2, 2, 2, 2, 2], [15, 15, 15, 15])
    >>> worker_bytes(design_for_costs(costs, 4, budgets=[40, 40, 10, 10], seed=0), costs)
    [20, 20, 10, 10]
    >>> design_for_costs(costs, 4, budgets=[20, 20, 10, 5], seed=0)
    Traceback (most recent call last):
    ...
    masklab.errors.DesignError: worker 3 would hold 9 bytes (0 fixed + 9 of blocks) but its budget is 5; no mask fits: coverage 2 needs 60 bytes of blocks but the budgets leave room for 55
    """
    costs = costs if isinstance(costs, BlockCosts) else BlockCosts(costs)
    r = check_coverage(min_coverage, K)
    fixed = np.array(per_worker("fixed_bytes", costs.fixed_bytes if fixed_bytes is None else fixed_bytes, K),
                     dtype=np.int64)
    cap = None if budgets is None else np.array(per_worker("budgets", budgets, K, minimum=1), dtype=np.int64)
    _check_budget(starts, iterations, None)
    w = np.array(costs.block_bytes, dtype=np.int64)
    if cap is not None:
        _check_each_worker_fits(w, fixed, cap)
    rng = np.random.default_rng(seed)
    order = np.argsort(-w, kind="stable")
    if iterations is None:
        iterations = int(min(100 * K * r + 20 * w.size, 20_000))
    if max_groups is not None:
        skeleton = design(K, w.size, coverage=r, max_groups=max_groups, seed=rng).matrix.astype(bool)
        held = _permute_columns(skeleton, w, order, fixed, cap, iterations, rng)
        if cap is not None:
            _raise_if_over(held, w, fixed, cap, r)
        return Mask(held.astype(np.uint8), block_names=costs.block_names, construction=CONSTRUCTION)
    rules = ["least"] + (["room"] if cap is not None else []) + ["spread"] * starts
    candidates = [_greedy(w, order, r, fixed, cap, rule, rng) for rule in rules]
    start = min(candidates, key=lambda held: _score(held, w, fixed, cap))
    floor = bytes_lower_bound(costs, K, min_coverage=r, fixed_bytes=fixed.tolist())
    results = [_Search(start, w, fixed, cap).run(iterations, floor, rng)]
    if w.size * r >= K and 1 < r < K:
        skeleton = exact_design(K, w.size, r) or search(K, w.size, coverage=r, seed=rng, starts=starts,
                                                         iterations=iterations)
        skeleton = skeleton.matrix.astype(bool)
        results.append(_permute_columns(skeleton, w, order, fixed, cap, iterations, rng))
    held = min(results, key=lambda h: _score(h, w, fixed, cap)[:2] + (-spectral_gap(Mask(h)),))
    if cap is not None:
        _raise_if_over(held, w, fixed, cap, r)
    return Mask(held.astype(np.uint8), block_names=costs.block_names, construction=CONSTRUCTION)


# -- internals ---------------------------------------------------------------------------------
def _greedy(w: np.ndarray, order: np.ndarray, r: int, fixed: np.ndarray, cap: np.ndarray | None, rule: str,
            rng: np.random.Generator) -> np.ndarray:
    """Each block, heaviest first, to the r workers first in the rule's order; then no row left empty."""
    K, B = fixed.size, w.size
    held = np.zeros((K, B), dtype=bool)
    total = fixed.copy()
    overlaps = np.zeros((K, K), dtype=np.int64)
    index = np.arange(K)
    for j in order:
        over = np.zeros(K, dtype=np.int64) if cap is None else np.maximum(total + w[j] - cap, 0)
        if rule == "spread":
            holders = _spread_pick(over, total, overlaps, r, rng)
        else:
            second = total if rule == "least" else total - cap
            holders = np.lexsort((index, second, over))[:r]
        held[holders, j] = True
        total[holders] += w[j]
        overlaps[np.ix_(holders, holders)] += 1
    for k in np.flatnonzero(~held.any(axis=1)):
        _fill_empty_row(held, w, total, int(k))
    return held


def _permute_columns(skeleton: np.ndarray, w: np.ndarray, order: np.ndarray, fixed: np.ndarray,
                     cap: np.ndarray | None, iterations: int, rng: np.random.Generator) -> np.ndarray:
    """The skeleton's holder sets handed to the blocks so that bytes balance.

    Which block gets which set leaves the multiset of holder sets, hence the mixing graph and its
    spectral gap, unchanged. Blocks, heaviest first, take the free set whose members end lowest
    (excess, largest bytes, summed bytes); then swaps of two blocks' sets that do not raise
    (excess, largest bytes, sum of squared bytes).
    """
    K, B = skeleton.shape
    total = fixed.copy()
    free = np.ones(B, dtype=bool)
    sets = np.empty(B, dtype=np.int64)
    for j in order:
        after = np.where(skeleton, total[:, None] + w[j], 0)
        over = (np.zeros(B, dtype=np.int64) if cap is None
                else np.where(skeleton, np.maximum(after - cap[:, None], 0), 0).sum(axis=0))
        choice = np.lexsort((np.arange(B), after.sum(axis=0), after.max(axis=0), over))
        c = int(choice[free[choice]][0])
        sets[j], free[c] = c, False
        total[skeleton[:, c]] += w[j]
    held = skeleton[:, sets]
    excess = 0 if cap is None else int(np.maximum(total - cap, 0).sum())
    peak = int(total.max())
    for _ in range(iterations):
        key = total if excess == 0 else total - cap
        if rng.random() < 0.5:
            worst = np.flatnonzero(key == key.max())
            mine = np.flatnonzero(held[worst[rng.integers(worst.size)]])
            a = int(mine[rng.integers(mine.size)])
        else:
            a = int(rng.integers(B))
        b = int((a + 1 + rng.integers(B - 1)) % B) if B > 1 else a
        change = (held[:, a] & ~held[:, b]) * (w[b] - w[a]) + (held[:, b] & ~held[:, a]) * (w[a] - w[b])
        moved = np.flatnonzero(change)
        if moved.size == 0:
            continue
        new_total = total + change
        new_excess = 0 if cap is None else int(np.maximum(new_total - cap, 0).sum())
        new_peak = int(new_total.max())
        dsq = sum(int(new_total[k]) ** 2 - int(total[k]) ** 2 for k in moved)
        if (new_excess, new_peak, dsq) > (excess, peak, 0):
            continue
        held[:, [a, b]] = held[:, [b, a]]
        total, excess, peak = new_total, new_excess, new_peak
    return held


def _spread_pick(over: np.ndarray, total: np.ndarray, overlaps: np.ndarray, r: int,
                 rng: np.random.Generator) -> np.ndarray:
    """r workers by (excess, bytes), ties towards the fewest blocks shared with those already picked."""
    K = total.size
    shared = np.zeros(K, dtype=np.int64)
    free = np.ones(K, dtype=bool)
    picked = []
    tie = rng.random(K)
    for _ in range(r):
        candidates = np.flatnonzero(free)
        k = int(candidates[np.lexsort((tie[candidates], shared[candidates], total[candidates], over[candidates]))[0]])
        picked.append(k)
        free[k] = False
        shared += overlaps[k]
    return np.array(picked)


def _fill_empty_row(held: np.ndarray, w: np.ndarray, total: np.ndarray, k: int) -> None:
    """Give empty worker k the lightest block a holder with several blocks can give up, else a copy of it."""
    rows = held.sum(axis=1)
    givers = held & (rows > 1)[:, None]
    movable = np.flatnonzero(givers.any(axis=0))
    j = int(movable[np.argmin(w[movable])]) if movable.size else int(np.argmin(w))
    if movable.size:
        donors = np.flatnonzero(givers[:, j])
        donor = int(donors[np.argmax(total[donors])])
        held[donor, j] = False
        total[donor] -= w[j]
    held[k, j] = True
    total[k] += w[j]


def _score(held: np.ndarray, w: np.ndarray, fixed: np.ndarray, cap: np.ndarray | None) -> tuple[int, int, int]:
    """(budget excess, largest worker's bytes, sum of squared pair overlaps): smaller is better."""
    total = fixed + held.astype(np.int64) @ w
    excess = 0 if cap is None else int(np.maximum(total - cap, 0).sum())
    m = held.astype(np.int64)
    overlaps = (m @ m.T)[np.triu_indices(held.shape[0], k=1)]
    return excess, int(total.max()), int((overlaps * overlaps).sum())


class _Search:
    """Local search state: the mask, each worker's bytes and the pair overlaps, updated move by move.

    A move (k, l, i, j): worker k gives block i to l and takes block j from l (j = -1: takes none).
    k's bytes change by w_j - w_i and l's by the opposite; O[k] changes by d = col_j - col_i
    (zero at k and l) and O[l] by -d, so F = sum_{k<l} O_kl^2 changes by 2 d.(O_k - O_l) + 2 d.d.
    """

    def __init__(self, held: np.ndarray, w: np.ndarray, fixed: np.ndarray, cap: np.ndarray | None) -> None:
        self.held = held.copy()
        self.w = w
        self.cap = cap
        self.columns = np.ascontiguousarray(held.T, dtype=np.int64)  # (B, K): fast column reads
        self.rows = held.sum(axis=1)
        self.total = fixed + held.astype(np.int64) @ w
        self.excess = 0 if cap is None else int(np.maximum(self.total - cap, 0).sum())
        self.peak = int(self.total.max())
        self.sumsq = sum(int(t) * int(t) for t in self.total)
        m = held.astype(np.float64)
        self.overlaps = np.rint(m @ m.T).astype(np.int64)  # exact below 2^53
        upper = np.triu(self.overlaps, k=1)
        self.f = int((upper * upper).sum())
        pairs, s = held.shape[0] * (held.shape[0] - 1) // 2, int(upper.sum())
        base, extra = divmod(s, pairs) if pairs else (0, 0)
        self.f_floor = pairs * base * base + extra * (2 * base + 1)

    def run(self, iterations: int, floor: int, rng: np.random.Generator) -> np.ndarray:
        """Bytes first, then pair overlaps, then the spectral gap itself (while it is cheap); returns the mask."""
        K = self.held.shape[0]
        if K == 1:
            return self.held
        used = self._descend(iterations // 2, rng, with_sumsq=True,
                             done=lambda: self.excess == 0 and self.peak == floor)
        self._descend(iterations - used, rng, with_sumsq=False, done=lambda: self.f == self.f_floor)
        self._raise_gap(min(iterations // 4, int(2e7 // K**3)), iterations, rng)
        return self.held

    def _descend(self, iterations: int, rng: np.random.Generator, *, with_sumsq: bool, done) -> int:
        """Take moves that do not raise (excess, peak, [sum of squared bytes,] F); returns the proposals made."""
        for step in range(iterations):
            if done():
                return step
            move = self._propose(rng)
            if move is None:
                continue
            k, l, i, j = move
            dk, new_excess, new_peak = self._try_bytes(k, l, i, j)
            d = (self.columns[j] if j >= 0 else 0) - self.columns[i]
            d[k] = d[l] = 0
            df = 2 * int(d @ (self.overlaps[k] - self.overlaps[l])) + 2 * int(d @ d)
            dsq = 2 * dk * (int(self.total[k]) - dk - int(self.total[l]) - dk) + 2 * dk * dk
            old = (self.excess, self.peak) + ((self.sumsq,) if with_sumsq else ()) + (self.f,)
            new = (new_excess, new_peak) + ((self.sumsq + dsq,) if with_sumsq else ()) + (self.f + df,)
            if new > old:
                self._undo_bytes(k, l, dk)
                continue
            self._apply(k, l, i, j)
            self.overlaps[k] += d
            self.overlaps[:, k] += d
            self.overlaps[l] -= d
            self.overlaps[:, l] -= d
            self.excess, self.peak, self.sumsq, self.f = new_excess, new_peak, self.sumsq + dsq, self.f + df
        return iterations

    def _raise_gap(self, evaluations: int, proposals: int, rng: np.random.Generator) -> None:
        """Take moves that keep (excess, peak) and do not lower the spectral gap, `evaluations` gaps at most."""
        gap = _dense_gap(self.held)
        for _ in range(proposals):
            if evaluations <= 0:
                return
            move = self._propose(rng)
            if move is None:
                continue
            k, l, i, j = move
            dk, new_excess, new_peak = self._try_bytes(k, l, i, j)
            if (new_excess, new_peak) > (self.excess, self.peak):
                self._undo_bytes(k, l, dk)
                continue
            self._apply(k, l, i, j)
            evaluations -= 1
            new_gap = _dense_gap(self.held)
            if new_gap < gap - 1e-12:  # sideways moves walk the plateaus (a disconnected graph's is 0)
                self._apply(l, k, i, j)
                self._undo_bytes(k, l, dk)
                continue
            self.excess, self.peak, gap = new_excess, new_peak, new_gap
        # overlaps, F and the sum of squares are stale from here on: nothing reads them again

    def _propose(self, rng: np.random.Generator) -> tuple[int, int, int, int] | None:
        """Half the time from a worst worker (most over budget, else most bytes), else from any."""
        K = self.held.shape[0]
        if rng.random() < 0.5:
            key = self.total - self.cap if self.excess > 0 else self.total
            worst = np.flatnonzero(key == key.max())
            k = int(worst[rng.integers(worst.size)])
        else:
            k = int(rng.integers(K))
        l = int((k + 1 + rng.integers(K - 1)) % K)
        only_k = np.flatnonzero(self.held[k] & ~self.held[l])
        if only_k.size == 0:
            return None
        i = int(only_k[rng.integers(only_k.size)])
        only_l = np.flatnonzero(self.held[l] & ~self.held[k])
        if only_l.size and (self.rows[k] == 1 or rng.random() < 0.5):
            return k, l, i, int(only_l[rng.integers(only_l.size)])
        return (k, l, i, -1) if self.rows[k] > 1 else None

    def _try_bytes(self, k: int, l: int, i: int, j: int) -> tuple[int, int, int]:
        """Apply the move's byte changes; returns (k's change, new excess, new peak)."""
        dk = int(self.w[j] if j >= 0 else 0) - int(self.w[i])
        new_excess = self.excess + self._excess_change(k, dk) + self._excess_change(l, -dk)
        self.total[k] += dk
        self.total[l] -= dk
        return dk, new_excess, int(self.total.max()) if dk else self.peak

    def _undo_bytes(self, k: int, l: int, dk: int) -> None:
        self.total[k] -= dk
        self.total[l] += dk

    def _apply(self, k: int, l: int, i: int, j: int) -> None:
        """k gives i to l and takes j from l (bits, columns and row counts; not bytes or overlaps)."""
        self.held[k, i], self.held[l, i] = False, True
        self.columns[i, k], self.columns[i, l] = 0, 1
        if j >= 0:
            self.held[l, j], self.held[k, j] = False, True
            self.columns[j, l], self.columns[j, k] = 0, 1
        else:
            self.rows[k] -= 1
            self.rows[l] += 1

    def _excess_change(self, k: int, dk: int) -> int:
        if self.cap is None or dk == 0:
            return 0
        t, c = int(self.total[k]), int(self.cap[k])
        return max(0, t + dk - c) - max(0, t - c)


def _dense_gap(held: np.ndarray) -> float:
    """lambda_2 of the mixing Laplacian of a static mask, densely (docs/design.md §3)."""
    m = held.astype(np.float64)
    a = (m / m.sum(axis=0)) @ m.T / m.shape[1]
    np.fill_diagonal(a, 0.0)
    return float(np.linalg.eigvalsh(np.diag(a.sum(axis=1)) - a)[1])


def _check_each_worker_fits(w: np.ndarray, fixed: np.ndarray, cap: np.ndarray) -> None:
    """Every worker holds a block: one whose budget cannot take its fixed bytes plus the lightest fails."""
    need = fixed + int(w.min())
    over = np.flatnonzero(need > cap)
    if over.size:
        k = int(over[0])
        raise DesignError(f"worker {k} holds at least {int(need[k])} bytes ({int(fixed[k])} fixed + "
                          f"{int(w.min())} of the lightest block: every worker holds a block) but its budget is "
                          f"{int(cap[k])}; no mask fits")


def _raise_if_over(held: np.ndarray, w: np.ndarray, fixed: np.ndarray, cap: np.ndarray, r: int) -> None:
    """DesignError naming the worker most over its budget, unless every worker fits."""
    blocks = held.astype(np.int64) @ w
    total = fixed + blocks
    excess = total - cap
    if excess.max() <= 0:
        return
    k = int(np.argmax(excess))
    room = np.maximum(cap - fixed, 0)
    whole = int(w.sum())
    heaviest = int(np.argmax(w))
    enough = int((room >= w[heaviest]).sum())
    if enough < r:
        reason = (f"no mask fits: block {heaviest} ({int(w[heaviest])} bytes) needs {r} holders but only {enough} "
                  "workers have that much room left after their fixed bytes")
    elif int(np.minimum(room, whole).sum()) < r * whole:
        reason = (f"no mask fits: coverage {r} needs {r * whole} bytes of blocks but the budgets leave room for "
                  f"{int(np.minimum(room, whole).sum())}")
    else:
        reason = (f"the best mask found exceeds the budgets by {int(np.maximum(excess, 0).sum())} bytes in all "
                  f"and its largest worker holds {int(total.max())} (the search is not exhaustive: a mask "
                  "that fits may exist)")
    raise DesignError(f"worker {k} would hold {int(total[k])} bytes ({int(fixed[k])} fixed + {int(blocks[k])} "
                      f"of blocks) but its budget is {int(cap[k])}; {reason}")
