"""Mask constructions: DDP, cyclic windows, random balanced masks and exact 2-designs.

A balanced mask gives every block the same coverage c. Its spectral gap reaches the trace bound
(c - 1)/(K - 1) exactly when every pair of workers shares the same number of blocks (docs/design.md §3),
i.e. when the rows are the points of a 2-design whose blocks are the columns. Projective planes
PG(2, q), affine planes AG(2, q) (workers = points, blocks = lines) and cyclic difference sets give
such designs. This module builds masks for fixed parameters; choosing the construction that fits
given (K, B, c) is `masklab.design`, improving a mask by local search is `masklab.search`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from masklab.errors import DesignError
from masklab.fields import _prime_factors, galois_field, is_prime_power, power_digits, prime_power
from masklab.mask import Mask

SeedLike = int | np.random.Generator | None


def complete(K: int, B: int) -> Mask:
    """Every worker holds every block: DDP, coverage K.

    >>> complete(2, 3).matrix.tolist()
    [[1, 1, 1], [1, 1, 1]]
    """
    _check_sizes(K, B)
    return Mask(np.ones((K, B), dtype=np.uint8), construction="complete")


def cyclic(K: int, B: int, *, coverage: int) -> Mask:
    """Block j is held by the `coverage` consecutive workers floor(j K / B), ... (mod K).

    Every block has exactly `coverage` holders, and row sums differ by at most one (worker k holds
    the blocks whose window start lies among the `coverage` positions up to k). For K = B this is
    the classical cyclic mask: block j is held by workers j, j + 1, ..., j + c - 1 (mod K).

    Raises
    ------
    DesignError
        If K, B < 1, coverage is outside [1, K], or B * coverage < K (some worker would hold nothing).

    Examples
    --------
    >>> cyclic(4, 4, coverage=2).matrix.tolist()
    [[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    c = _check_balanced(K, B, coverage)
    starts = (np.arange(B) * K) // B
    rows = (starts[None, :] + np.arange(c)[:, None]) % K  # (c, B) holders of each block
    m = np.zeros((K, B), dtype=np.uint8)
    m[rows, np.broadcast_to(np.arange(B), rows.shape)] = 1
    return Mask(m, construction="cyclic")


def random_balanced(K: int, B: int, *, coverage: int, seed: SeedLike = None) -> Mask:
    """A random mask in which every block has exactly `coverage` holders and row sums differ by <= 1.

    The B * c holder slots are split into row targets floor(B c / K) or that plus one (a random set
    of workers gets the extra block). Columns are then filled one at a time, each by the `coverage`
    workers with the most blocks still to receive, ties broken at random; this greedy order always
    meets the targets exactly (Gale-Ryser).

    Parameters
    ----------
    seed : int, numpy.random.Generator or None
        Turned once into a generator by ``numpy.random.default_rng``.

    Raises
    ------
    DesignError
        If K, B < 1, coverage is outside [1, K], or B * coverage < K (some worker would hold nothing).

    Examples
    --------
    >>> m = random_balanced(5, 4, coverage=3, seed=0)
    >>> m.coverage.tolist(), sorted(m.row_sums.tolist())
    ([3, 3, 3, 3], [2, 2, 2, 3, 3])
    >>> m == random_balanced(5, 4, coverage=3, seed=0)
    True
    """
    c = _check_balanced(K, B, coverage)
    rng = np.random.default_rng(seed)
    base, extra = divmod(B * c, K)
    remaining = np.full(K, base, dtype=np.int64)
    remaining[rng.permutation(K)[:extra]] += 1
    m = np.zeros((K, B), dtype=np.uint8)
    for j in range(B):
        priority = remaining + rng.random(K)  # integer part first, random tie-break below it
        holders = np.argpartition(-priority, c - 1)[:c]
        m[holders, j] = 1
        remaining[holders] -= 1
    assert not remaining.any(), "greedy fill missed its row targets"
    return Mask(m, construction="random")


def projective_plane(q: int) -> Mask:
    """The incidence matrix of PG(2, q): rows = points, columns = lines, for a prime power q.

    K = B = q^2 + q + 1, every line holds q + 1 points, every point lies on q + 1 lines and every
    pair of points lies on exactly one line, so the spectral gap equals its trace bound. Points and
    lines are the nonzero vectors of GF(q)^3 scaled to a leading 1, in the order (1, a, b),
    (0, 1, a), (0, 0, 1); point x lies on line y iff x . y = 0.

    Raises
    ------
    DesignError
        If q is not a prime power.

    Examples
    --------
    >>> m = projective_plane(2)  # the Fano plane
    >>> m.workers, m.blocks, m.coverage.tolist()
    (7, 7, [3, 3, 3, 3, 3, 3, 3])
    """
    field = galois_field(q)
    q = field.order
    a, b = np.divmod(np.arange(q * q), q)
    ones, zeros = np.ones(q * q, dtype=np.int64), np.zeros(q, dtype=np.int64)
    points = np.concatenate(
        [
            np.stack([ones, a, b], axis=1),
            np.stack([zeros, zeros + 1, np.arange(q)], axis=1),
            np.array([[0, 0, 1]]),
        ]
    )
    mul, add = field.mul, field.add
    terms = [mul[points[:, None, t], points[None, :, t]] for t in range(3)]
    dot = add[add[terms[0], terms[1]], terms[2]]
    return Mask((dot == 0).astype(np.uint8), construction="projective-plane")


def affine_plane(q: int) -> Mask:
    """The incidence matrix of AG(2, q): rows = the q^2 points, columns = the q^2 + q lines.

    Every line holds q points and every pair of points lies on exactly one line, so with workers as
    points the spectral gap equals its trace bound. (The transpose, workers = lines, is not
    pair-balanced: parallel lines share no point.) Built from `projective_plane` by deleting the
    line x_0 = 0 and its points.

    Raises
    ------
    DesignError
        If q is not a prime power.

    Examples
    --------
    >>> m = affine_plane(3)
    >>> m.workers, m.blocks, set(m.coverage.tolist())
    (9, 12, {3})
    """
    plane = projective_plane(q).matrix
    q = int(q)
    return Mask(plane[: q * q, 1:], construction="affine-plane")


class DifferenceSet(NamedTuple):
    """A (v, k, lam) cyclic difference set: every nonzero residue mod v is a difference of exactly
    `lam` ordered pairs of `elements`."""

    v: int
    k: int
    lam: int
    elements: tuple[int, ...]
    family: str


def difference_set_lambda(elements: tuple[int, ...] | list[int], v: int) -> int:
    """lam such that every nonzero residue mod v is d1 - d2 for exactly lam pairs of `elements`.

    Raises
    ------
    DesignError
        If the elements are not distinct residues mod v, or the differences are not balanced (the
        message names the residues with the fewest and the most representations).

    Examples
    --------
    >>> difference_set_lambda([1, 2, 4], 7)
    1
    >>> difference_set_lambda([0, 1, 2], 7)
    Traceback (most recent call last):
    ...
    masklab.errors.DesignError: (0, 1, 2) is not a difference set mod 7: residue 3 arises 0 times, residue 1 arises 2 times
    """
    d = np.asarray(list(elements), dtype=np.int64)
    if v < 2 or d.size < 1 or d.min() < 0 or d.max() >= v or np.unique(d).size != d.size:
        raise DesignError(f"difference set {tuple(d.tolist())} must be distinct residues mod v={v} >= 2")
    diffs = (d[:, None] - d[None, :]) % v
    counts = np.bincount(diffs[~np.eye(d.size, dtype=bool)], minlength=v)[1:]
    lo, hi = int(np.argmin(counts)), int(np.argmax(counts))
    if counts[lo] != counts[hi]:
        raise DesignError(
            f"{tuple(d.tolist())} is not a difference set mod {v}: residue {lo + 1} arises "
            f"{counts[lo]} times, residue {hi + 1} arises {counts[hi]} times"
        )
    return int(counts[0])


def difference_set_design(elements: tuple[int, ...] | list[int], v: int) -> Mask:
    """The symmetric 2-design of a cyclic difference set: block i is held by workers (D + i) mod v.

    K = B = v and c = k = |D|; any two workers share lam blocks, so the gap equals its trace bound.

    >>> difference_set_design([1, 2, 4], 7).coverage.tolist()
    [3, 3, 3, 3, 3, 3, 3]
    """
    difference_set_lambda(elements, v)
    d = np.asarray(list(elements), dtype=np.int64)
    m = np.zeros((v, v), dtype=np.uint8)
    m[(d[:, None] + np.arange(v)[None, :]) % v, np.arange(v)[None, :]] = 1
    return Mask(m, construction="difference-set")


def singer_difference_set(q: int, m: int = 2) -> DifferenceSet:
    """The Singer difference set of the hyperplanes of PG(m, q).

    v = (q^(m+1) - 1)/(q - 1), k = (q^m - 1)/(q - 1), lam = (q^(m-1) - 1)/(q - 1): the exponents
    i < v for which alpha^i has trace 0 over GF(q), alpha a primitive element of GF(q^(m+1)).

    >>> singer_difference_set(2)
    DifferenceSet(v=7, k=3, lam=1, elements=(1, 2, 4), family='singer')
    """
    p, n = prime_power(q)
    if m < 2:
        raise DesignError(f"Singer difference sets need dimension m >= 2, got m={m}")
    big = q ** (m + 1) - 1
    v = big // (q - 1)
    digits = power_digits(p, n * (m + 1))  # alpha^i for i < q^(m+1) - 1
    i = np.arange(v)
    trace = sum(digits[(i * q**t) % big] for t in range(m + 1)) % p
    elements = tuple(int(x) for x in np.flatnonzero(~trace.any(axis=1)))
    return DifferenceSet(v, len(elements), difference_set_lambda(elements, v), elements, "singer")


def paley_difference_set(p: int) -> DifferenceSet:
    """The quadratic residues mod a prime p = 3 (mod 4): a (p, (p-1)/2, (p-3)/4) difference set.

    >>> paley_difference_set(7).elements
    (1, 2, 4)
    """
    if not (p > 3 and _prime_factors(p) == [p] and p % 4 == 3):
        raise DesignError(f"Paley difference sets need a prime p = 3 (mod 4) above 3, got p={p}")
    elements = tuple(sorted({x * x % p for x in range(1, p)}))
    return DifferenceSet(p, len(elements), difference_set_lambda(elements, p), elements, "paley")


def twin_prime_difference_set(p: int) -> DifferenceSet:
    """The twin-prime difference set mod v = p (p + 2) for primes p and p + 2.

    In Z_p x Z_(p+2) (= Z_v by the Chinese remainder theorem): the pairs (x, y) with x, y nonzero
    and chi(x) chi(y) = 1 (chi the quadratic character), plus all (x, 0).

    >>> twin_prime_difference_set(3)[:3]
    (15, 7, 3)
    """
    if not (p > 1 and _prime_factors(p) == [p] and _prime_factors(p + 2) == [p + 2]):
        raise DesignError(f"twin-prime difference sets need primes p and p + 2, got p={p}")
    v = p * (p + 2)
    g = np.arange(v)
    x, y = g % p, g % (p + 2)
    chi_x, chi_y = _quadratic_character(p)[x], _quadratic_character(p + 2)[y]
    keep = (y == 0) | ((x != 0) & (chi_x * chi_y == 1))
    elements = tuple(int(e) for e in np.flatnonzero(keep))
    return DifferenceSet(v, len(elements), difference_set_lambda(elements, v), elements, "twin-prime")


def difference_sets(v_max: int, *, v_min: int = 1) -> list[DifferenceSet]:
    """The library's cyclic difference sets with v_min <= v <= v_max, one per (v, k), sorted.

    Families: Singer (PG(m, q) hyperplanes), Paley (primes 3 mod 4) and twin primes; where two give
    the same (v, k) the first in that order is kept. Every set is checked for the difference
    property as it is built. Complements (v, v - k, v - 2k + lam) are left to the caller.

    >>> [(d.v, d.k, d.lam) for d in difference_sets(16)]
    [(7, 3, 1), (11, 5, 2), (13, 4, 1), (15, 7, 3)]
    """
    found: dict[tuple[int, int], DifferenceSet] = {}
    for v, k, build in _difference_set_candidates(v_max):
        if v >= v_min and (v, k) not in found:
            found[(v, k)] = build()
    return [found[key] for key in sorted(found)]


# -- internals ---------------------------------------------------------------------------------
def _difference_set_candidates(v_max: int):
    """(v, k, builder) for every family member with v <= v_max, from closed-form parameters."""
    q = 2
    while q * q + q + 1 <= v_max:
        if is_prime_power(q):
            m = 2
            while (q ** (m + 1) - 1) // (q - 1) <= v_max:
                yield (q ** (m + 1) - 1) // (q - 1), (q**m - 1) // (q - 1), _bind(singer_difference_set, q, m)
                m += 1
        q += 1
    for p in range(7, v_max + 1, 4):
        if _prime_factors(p) == [p]:
            yield p, (p - 1) // 2, _bind(paley_difference_set, p)
    p = 3
    while p * (p + 2) <= v_max:
        if _prime_factors(p) == [p] and _prime_factors(p + 2) == [p + 2]:
            yield p * (p + 2), (p * (p + 2) - 1) // 2, _bind(twin_prime_difference_set, p)
        p += 2


def _bind(func, *args):
    return lambda: func(*args)


def _quadratic_character(p: int) -> np.ndarray:
    """chi(x) for x in Z_p: 0 at 0, +1 on nonzero squares, -1 elsewhere."""
    chi = -np.ones(p, dtype=np.int64)
    chi[0] = 0
    chi[(np.arange(1, p) ** 2) % p] = 1
    return chi


def _check_sizes(K: int, B: int) -> None:
    for name, value in (("K", K), ("B", B)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DesignError(f"{name}={value!r} must be an integer")
        if value < 1:
            raise DesignError(f"{name}={value} must be >= 1")


def _check_balanced(K: int, B: int, coverage: int) -> int:
    """Validate (K, B, c) for a balanced mask and return c as an int."""
    _check_sizes(K, B)
    if isinstance(coverage, bool) or not isinstance(coverage, (int, np.integer)):
        raise DesignError(f"coverage={coverage!r} must be an integer number of holders per block")
    if not 1 <= coverage <= K:
        raise DesignError(f"coverage={coverage} must lie in [1, K] = [1, {K}]")
    if B * coverage < K:
        raise DesignError(
            f"B * coverage = {B} * {coverage} = {B * coverage} holder slots cannot give each of "
            f"K={K} workers a block; need B * coverage >= K"
        )
    return int(coverage)
