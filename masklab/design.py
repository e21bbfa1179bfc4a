"""Pick a mask for (K, B, coverage): an exact 2-design where the library has one, else search.

`design` is the entry point users call. With ``construction="auto"`` it returns an exact balanced
incomplete block design (projective plane, affine plane or cyclic difference set, or the complement
of one, in the orientation whose worker pairs are balanced) when one has exactly the requested
(K, B, c); its spectral gap equals the trace bound, so nothing balanced can beat it. Otherwise it
runs `masklab.search.search` from the best of the cyclic mask and 20 random balanced masks, and never
returns anything worse than that start. The constructions themselves live in
`masklab.constructions`; this module only matches parameters to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from masklab.analysis import optimality_ratio, process_group_holder_sets, spectral_gap
from masklab.constructions import (
    SeedLike,
    _check_balanced,
    _check_sizes,
    affine_plane,
    complete,
    cyclic,
    difference_set_design,
    difference_sets,
    projective_plane,
    random_balanced,
)
from masklab.errors import DesignError
from masklab.failures import check_tolerates, checked_tolerate
from masklab.fields import is_prime_power
from masklab.mask import Mask
from masklab.search import OPTIMAL_TOLERANCE, search

CONSTRUCTIONS = (
    "auto",
    "complete",
    "cyclic",
    "random",
    "projective-plane",
    "affine-plane",
    "difference-set",
    "search",
)
EXACT_FAMILIES = ("projective-plane", "affine-plane", "difference-set")  # tried in this order

_REQUIREMENTS = {
    "projective-plane": "PG(2, q) needs K = B = q^2 + q + 1 for a prime power q, with coverage q + 1 "
    "(or q^2 for its complement)",
    "affine-plane": "AG(2, q) needs K = q^2 workers and B = q^2 + q blocks for a prime power q, with "
    "coverage q (or q^2 - q for its complement); workers = lines is not pair-balanced",
    "difference-set": "a cyclic difference set needs K = B = v with coverage k (or v - k) for one of "
    "the library's (v, k, lam) sets (see masklab.constructions.difference_sets)",
}


def list_constructions() -> tuple[str, ...]:
    """The names `design` accepts for `construction`.

    >>> list_constructions()[:3]
    ('auto', 'complete', 'cyclic')
    """
    return CONSTRUCTIONS


def coverage_from_active(K: int, active: float) -> int:
    """The coverage c for active fraction C: round(C K) (halves round up), clipped to [1, K].

    >>> coverage_from_active(8, 0.5), coverage_from_active(8, 0.01), coverage_from_active(5, 0.5)
    (4, 1, 3)
    """
    _check_sizes(K, 1)
    if isinstance(active, bool) or not isinstance(active, (int, float, np.integer, np.floating)):
        raise DesignError(f"active={active!r} must be a number in (0, 1]")
    if not 0 < active <= 1:
        raise DesignError(f"active={active} must lie in (0, 1]")
    return int(min(K, max(1, math.floor(active * K + 0.5))))


ACTIVE_TOLERANCE = 0.005
"""How far c/K may lie from an active fraction C that `exact_coverage` accepts: half a unit of C's
second decimal, so the paper's C = 0.69 is K = 16, c = 11 (0.6875) and never K = 4, c = 3 (0.75)."""


def exact_coverage(K: int, active: float, *, tolerance: float = ACTIVE_TOLERANCE) -> int:
    """The coverage c whose c/K is `active` within `tolerance`; else a `DesignError` naming the
    fractions K workers realise nearest to it and the fewest workers (and the fewest that are a
    multiple of K) that realise it.

    `coverage_from_active` rounds to the nearest c whatever the distance; this is the check for
    callers that promise the C asked for (``sdp train --active``).

    >>> exact_coverage(16, 0.69), exact_coverage(8, 0.375), exact_coverage(3, 2 / 3)
    (11, 3, 2)
    >>> try:
    ...     exact_coverage(4, 0.69)
    ... except DesignError as exc:
    ...     print(exc)
    C = 0.69 is not c/K within 0.005 for K = 4 workers (nearest: C = 0.5 with c = 2, C = 0.75 with c = 3); it needs K = 13 (c = 9), or with a multiple of 4 workers K = 16 (c = 11)
    """
    c = coverage_from_active(K, active)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise DesignError(f"tolerance={tolerance!r} must be a number in [0, 1)")
    if abs(c / K - active) <= tolerance:
        return c

    def realises(k: int) -> int | None:
        ck = coverage_from_active(k, active)
        return ck if abs(ck / k - active) <= tolerance else None

    around = sorted({min(K, max(1, math.floor(active * K))), min(K, max(1, math.ceil(active * K)))})
    nearest = ", ".join(f"C = {x / K:.4g} with c = {x}" for x in around)
    fewest = next((k for k in range(1, 2**20) if realises(k) is not None), None)
    multiple = next((k for k in range(K, 2**20, K) if realises(k) is not None), None)
    needs = "no K up to 2^20 realises it" if fewest is None else f"it needs K = {fewest} (c = {realises(fewest)})"
    if multiple is not None and multiple != fewest:
        needs += f", or with a multiple of {K} workers K = {multiple} (c = {realises(multiple)})"
    raise DesignError(f"C = {active:g} is not c/K within {tolerance:g} for K = {K} workers (nearest: {nearest}); "
                      f"{needs}")


def design(
    K: int,
    B: int,
    *,
    active: float | None = None,
    coverage: int | None = None,
    construction: str = "auto",
    max_groups: int | None = None,
    tolerate: int | None = None,
    seed: SeedLike = None,
) -> Mask:
    """A balanced K x B mask with coverage c and, for ``"auto"``, the largest spectral gap found.

    Parameters
    ----------
    K, B : int
        Workers and blocks, both >= 1.
    active, coverage : float or int
        Exactly one: the active fraction C in (0, 1], turned into c by `coverage_from_active`, or
        the number of holders per block c in [1, K]. B * c >= K is required so no worker is empty.
        With `tolerate` and neither, c = tolerate + 1.
    construction : str
        ``"auto"``: an exact 2-design whose (K, B, c) matches (tried in the order of
        `EXACT_FAMILIES`, complements and either orientation included, accepted only when its
        optimality ratio is 1 within 1e-9), the complete mask when c = K, else `search` seeded from
        the cyclic mask and 20 random balanced masks. Any other name of `list_constructions` forces
        that construction and raises when it does not fit.
    max_groups : int, optional
        With ``"auto"``: at most this many process groups, i.e. distinct holder sets of 2 to K - 1
        workers (`masklab.analysis.process_group_holder_sets`). The ``"auto"`` mask when it has
        few enough, else the mask of `group_tradeoff` with the largest gap among those that do.
    tolerate : int, optional
        The simultaneous worker losses the mask must survive with every block still held
        (`masklab.failures`): every c_j >= tolerate + 1, else a `DesignError` that says which
        coverage (or active fraction) would do; 0 <= tolerate <= K - 1.
    seed : int, numpy.random.Generator or None
        Turned once into a generator by ``numpy.random.default_rng`` and handed on.

    Returns
    -------
    Mask
        With ``construction`` set to the name used (``"<family>-complement"`` for a complement).

    Raises
    ------
    DesignError
        On invalid parameters or a forced construction that does not fit them.

    Examples
    --------
    >>> design(7, 7, coverage=3).construction
    'projective-plane'
    >>> design(9, 12, active=1 / 3).construction
    'affine-plane'
    >>> m = design(10, 10, coverage=4, seed=0)
    >>> m.construction, m.coverage.tolist() == [4] * 10
    ('search', True)
    >>> design(7, 14, coverage=3, max_groups=7).construction  # 14 blocks on the Fano plane's 7 lines
    'projective-plane-repeated'
    >>> int(design(8, 8, tolerate=2, seed=0).coverage.min())  # any 2 workers may be lost
    3
    """
    if construction not in CONSTRUCTIONS:
        raise DesignError(f"construction={construction!r} is not one of {CONSTRUCTIONS}")
    _check_sizes(K, B)
    c = _requested_coverage(K, B, active, coverage, tolerate)
    if tolerate is not None:
        return check_tolerates(_design(K, B, c, construction, max_groups, seed), tolerate)
    return _design(K, B, c, construction, max_groups, seed)


def _requested_coverage(K: int, B: int, active: float | None, coverage: int | None, tolerate: int | None) -> int:
    """The checked coverage c of (active | coverage | tolerate alone), at least tolerate + 1."""
    if tolerate is not None:
        tolerate = checked_tolerate(tolerate, K)
        if active is None and coverage is None:
            coverage = tolerate + 1
    if (active is None) == (coverage is None):
        raise DesignError(
            f"give exactly one of active (C in (0, 1]) and coverage (c in [1, K]); "
            f"got active={active!r}, coverage={coverage!r}"
        )
    c = _check_balanced(K, B, coverage_from_active(K, active) if coverage is None else coverage)
    if tolerate is not None and c < tolerate + 1:
        asked = f"coverage={c}" if active is None else f"active={active} gives coverage {c} of K={K}"
        raise DesignError(f"tolerate={tolerate} needs every block on at least {tolerate + 1} workers, but {asked}: "
                          f"ask for coverage >= {tolerate + 1} (active >= {(tolerate + 1) / K:.4g})")
    return c


def _design(K: int, B: int, c: int, construction: str, max_groups: int | None, seed: SeedLike) -> Mask:
    """`design` with checked sizes and coverage."""
    rng = np.random.default_rng(seed)
    if max_groups is not None:
        if construction != "auto":
            raise DesignError(f"max_groups applies to construction='auto', not {construction!r}")
        return pick_within_groups(_group_candidates(K, B, c, _checked_groups(max_groups), rng), max_groups)
    if construction == "auto":
        return _auto(K, B, c, rng)
    if construction in EXACT_FAMILIES:
        mask = _exact_design(construction, K, B, c)
        if mask is None:
            raise DesignError(f"no {construction} design has K={K}, B={B}, coverage={c}: {_REQUIREMENTS[construction]}")
        return mask
    if construction == "complete":
        if c != K:
            raise DesignError(f"construction 'complete' gives every block all K={K} workers; got coverage={c}")
        return complete(K, B)
    if construction == "cyclic":
        return cyclic(K, B, coverage=c)
    if construction == "random":
        return random_balanced(K, B, coverage=c, seed=rng)
    return search(K, B, coverage=c, seed=rng)


def group_tradeoff(
    K: int,
    B: int,
    *,
    active: float | None = None,
    coverage: int | None = None,
    max_groups: int,
    tolerate: int | None = None,
    seed: SeedLike = None,
) -> list[Mask]:
    """The masks ``design(K, B, ..., max_groups=G)`` chooses from, the unconstrained design first.

    A mask needs one process group per distinct holder set of 2 to K - 1 workers. The ``"auto"``
    design of (K, B, c) comes first (drawn from the seed's generator first, so it is the mask
    `design` returns without `max_groups`); when it has at most G groups it is the only one.
    Otherwise, for each g tried, a K x g design with coverage c (``"auto"``: exact where one
    exists, else searched) whose columns are repeated: block j takes the holder set of column
    j mod g, so the mask has at most g groups. When g divides B every set serves B / g blocks and
    the mixing graph, hence the spectral gap and optimality ratio, is exactly the K x g design's;
    otherwise the first B mod g sets serve one block more. g is tried at min(G, B), at the largest
    divisor of B not above it, and wherever an exact design (K, g, c) exists, for
    g >= ceil(K / c) (so that every worker is in some set). The gap against the number of groups
    is the trade-off `sdp design --max-groups` prints. `tolerate` is `design`'s: every mask then
    has coverage at least tolerate + 1.

    Raises
    ------
    DesignError
        On invalid parameters, or when G < ceil(K / c) and the unconstrained design has more than
        G groups: sets of c workers cover all K workers only with ceil(K / c) of them.

    Examples
    --------
    >>> from masklab.analysis import process_group_holder_sets as groups, spectral_gap
    >>> [(len(groups(m)), round(spectral_gap(m), 4)) for m in group_tradeoff(7, 14, coverage=3, max_groups=7, seed=0)]
    [(14, 0.3333), (7, 0.3333)]
    """
    _check_sizes(K, B)
    c = _requested_coverage(K, B, active, coverage, tolerate)
    return _group_candidates(K, B, c, _checked_groups(max_groups), np.random.default_rng(seed))


def pick_within_groups(masks: list[Mask], max_groups: int) -> Mask:
    """The mask with at most `max_groups` process groups and the largest spectral gap (fewer groups,
    then the earlier mask, on ties): what `design` returns from `group_tradeoff`'s list.

    >>> from masklab.constructions import complete, cyclic
    >>> pick_within_groups([cyclic(4, 4, coverage=2), complete(4, 4)], 2).construction
    'complete'
    """
    fitting = [m for m in masks if _groups(m) <= _checked_groups(max_groups)]
    if not fitting:
        raise DesignError(f"none of the {len(masks)} masks has at most max_groups={max_groups} process groups")
    return max(fitting, key=lambda m: (spectral_gap(m), -_groups(m)))


def exact_design(K: int, B: int, coverage: int) -> Mask | None:
    """The exact 2-design `design` returns for (K, B, c) with ``construction="auto"``, or None if none fits.

    >>> exact_design(7, 7, 3).construction, exact_design(8, 8, 3)
    ('projective-plane', None)
    """
    c = _check_balanced(K, B, coverage)
    for family in EXACT_FAMILIES:
        mask = _exact_design(family, K, B, c)
        if mask is not None:
            return mask
    return None


def exact_designs(K_max: int) -> list[tuple[int, int, int, str]]:
    """Every (K, B, c, construction) with K <= K_max for which `design` returns an exact 2-design.

    One entry per (K, B, c), sorted; the name is the one ``design(K, B, coverage=c)`` reports.

    >>> exact_designs(9)
    [(4, 6, 2, 'affine-plane'), (7, 7, 3, 'projective-plane'), (7, 7, 4, 'projective-plane-complement'), (9, 12, 3, 'affine-plane'), (9, 12, 6, 'affine-plane-complement')]
    """
    _check_sizes(K_max, 1)
    found: dict[tuple[int, int, int], str] = {}

    def add(k: int, b: int, c: int, name: str) -> None:
        found.setdefault((k, b, c), name)

    for q in range(2, math.isqrt(K_max) + 1):
        if is_prime_power(q) and q * q + q + 1 <= K_max:
            v = q * q + q + 1
            add(v, v, q + 1, "projective-plane")
            add(v, v, q * q, "projective-plane-complement")
    for q in range(2, math.isqrt(K_max) + 1):
        if is_prime_power(q):
            add(q * q, q * q + q, q, "affine-plane")
            add(q * q, q * q + q, q * q - q, "affine-plane-complement")
    for d in difference_sets(K_max):
        add(d.v, d.v, d.k, "difference-set")
        add(d.v, d.v, d.v - d.k, "difference-set-complement")
    return [(*key, found[key]) for key in sorted(found)]


# -- internals ---------------------------------------------------------------------------------
def _auto(K: int, B: int, c: int, rng: np.random.Generator) -> Mask:
    """``construction="auto"``: an exact design, the complete mask, else search."""
    mask = exact_design(K, B, c)
    if mask is not None:
        return mask
    if c == K:
        return complete(K, B)
    return search(K, B, coverage=c, seed=rng)


def _groups(mask: Mask) -> int:
    return len(process_group_holder_sets(mask))


def _checked_groups(max_groups: int) -> int:
    if isinstance(max_groups, bool) or not isinstance(max_groups, (int, np.integer)) or max_groups < 0:
        raise DesignError(f"max_groups={max_groups!r} must be an integer >= 0")
    return int(max_groups)


def _group_candidates(K: int, B: int, c: int, G: int, rng: np.random.Generator) -> list[Mask]:
    """`group_tradeoff` with checked arguments."""
    masks = [_auto(K, B, c, rng)]
    if _groups(masks[0]) <= G:
        return masks
    least, most = -(-K // c), min(G, B)
    if least > most:
        raise DesignError(f"max_groups={G}: holder sets of coverage={c} workers cover all K={K} workers only with "
                          f"at least ceil(K / c) = {least} distinct sets" + (f" (and B={B} blocks)" if B < least else "")
                          + f"; the unconstrained design has {_groups(masks[0])} process groups")
    divisors = [g for g in range(least, most + 1) if B % g == 0]
    sizes = {most, *divisors[-1:]} | {g for g in range(least, most + 1) if exact_design(K, g, c) is not None}
    for g in sorted(sizes):
        base = _auto(K, g, c, rng)
        masks.append(Mask(base.matrix[:, np.arange(B) % g], construction=f"{base.construction}-repeated"))
    return masks


def _exact_design(family: str, K: int, B: int, c: int) -> Mask | None:
    """The first mask of `family` (any orientation, or complement) with shape (K, B), coverage c
    and optimality ratio 1, or None."""
    for base in _family_bases(family, K, B):
        for name, matrix in _variants(family, base.matrix):
            if matrix.shape != (K, B) or np.any(matrix.sum(axis=0) != c) or not matrix.sum(axis=1).all():
                continue
            mask = Mask(matrix, construction=name)
            if optimality_ratio(mask) >= 1 - OPTIMAL_TOLERANCE:
                return mask
    return None


def _family_bases(family: str, K: int, B: int) -> Iterator[Mask]:
    """The family's masks with shape (K, B) or (B, K), built only when the sizes fit."""
    builders: list[Callable[[], Mask]] = []
    small, large = min(K, B), max(K, B)
    if family == "projective-plane" and K == B:
        q = (math.isqrt(4 * K - 3) - 1) // 2
        if q >= 2 and q * q + q + 1 == K and is_prime_power(q):
            builders.append(lambda: projective_plane(q))
    elif family == "affine-plane":
        q = math.isqrt(small)
        if q >= 2 and q * q == small and large == q * q + q and is_prime_power(q):
            builders.append(lambda: affine_plane(q))
    elif family == "difference-set" and K == B:
        for d in difference_sets(K, v_min=K):
            builders.append(lambda d=d: difference_set_design(d.elements, d.v))
    return (build() for build in builders)


def _variants(family: str, matrix: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    complement = (1 - matrix).astype(np.uint8)
    for name, m in ((family, matrix), (f"{family}-complement", complement)):
        yield name, m
        yield name, np.ascontiguousarray(m.T)
