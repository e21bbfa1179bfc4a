"""Random holder sets: the per-block holder-set gap rho_j and the coefficient it gives (Theorem 2').

A block's holder set S is drawn afresh for every update from some distribution over subsets of
the K workers (for a ``permute`` schedule redrawn every update: a uniformly random set of size
c_j). Its weights are w = 1_S / |S|. Two numbers of that distribution enter the theory:

* rho = lambda_2(E L_S), L_S = I_S - 1_S 1_S^T / |S| (docs/theory.md §4): the per-round
  contraction of overlap averaging, and
* kappa = K lambda_max(Cov(w) on 1-perp): the heterogeneity-variance coefficient of Theorem 2',
  E||b - E b||^2 <= kappa zeta^2. With uniform marginals and |S| = c it equals 1 - K rho / c.

This module evaluates both, for an explicit distribution and in closed form for a mask's schedule;
it evaluates no convergence bound (see `theory.bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from masklab.mask import Mask
from theory.errors import TheoryError


def expected_holder_laplacian(
    holder_sets: Sequence[Sequence[int]], probabilities: Sequence[float], workers: int
) -> np.ndarray:
    """E[L_S] over the given distribution of holder sets, shape (K, K).

    >>> expected_holder_laplacian([[0, 1], [1, 2], [0, 2]], [1/3] * 3, 3).round(6).tolist()[0]
    [0.333333, -0.166667, -0.166667]
    """
    sets, probs = _check_distribution(holder_sets, probabilities, workers)
    out = np.zeros((workers, workers))
    for s, p in zip(sets, probs):
        out[s, s] += p
        out[np.ix_(s, s)] -= p / len(s)
    return out


def holder_set_gap(holder_sets: Sequence[Sequence[int]], probabilities: Sequence[float], workers: int) -> float:
    """rho = lambda_2(E L_S), in [0, 1]; 1.0 for a single worker.

    >>> round(holder_set_gap([[0, 1], [1, 2], [0, 2]], [1/3] * 3, 3), 12)  # (c - 1)/(K - 1)
    0.5
    """
    lap = expected_holder_laplacian(holder_sets, probabilities, workers)
    if workers == 1:
        return 1.0
    return float(max(np.linalg.eigvalsh(lap)[1], 0.0))


def heterogeneity_variance_coefficient(
    holder_sets: Sequence[Sequence[int]], probabilities: Sequence[float], workers: int
) -> float:
    """kappa = K lambda_max(P Cov(w) P), P the projection on 1-perp: E||b - E b||^2 <= kappa zeta^2.

    Valid for any distribution; with uniform marginals and a fixed size c it equals 1 - K rho / c.

    >>> round(heterogeneity_variance_coefficient([[0, 1], [1, 2], [0, 2]], [1/3] * 3, 3), 12)
    0.25
    """
    sets, probs = _check_distribution(holder_sets, probabilities, workers)
    weights = np.zeros((len(sets), workers))
    for row, s in zip(weights, sets):
        row[s] = 1.0 / len(s)
    mean = probs @ weights
    centred = weights - mean
    cov = (centred * probs[:, None]).T @ centred
    proj = np.eye(workers) - 1.0 / workers
    return float(max(workers * np.linalg.eigvalsh(proj @ cov @ proj)[-1], 0.0))


def permute_holder_set_gaps(mask: Mask) -> np.ndarray:
    """rho_j = (c_j - 1)/(K - 1) per block, shape (B,): the gap of a uniformly random c_j-subset.

    A ``permute`` schedule gives block j exactly that holder-set distribution. 1.0 when K = 1.

    >>> permute_holder_set_gaps(Mask([[1, 1], [1, 0], [0, 1]])).tolist()
    [0.5, 0.5]
    """
    k = mask.workers
    if k == 1:
        return np.ones(mask.blocks)
    return (mask.coverage.astype(float) - 1.0) / (k - 1.0)


def permute_variance_coefficients(mask: Mask) -> np.ndarray:
    """kappa_j = 1 - K rho_j / c_j = (K - c_j) / (c_j (K - 1)) per block for a ``permute`` schedule.

    K - 1 times smaller than the trace coefficient K E||w_j - E w_j||^2 = K/c_j - 1 (0 when K = 1).

    >>> permute_variance_coefficients(Mask([[1, 1], [1, 0], [0, 1]])).tolist()
    [0.25, 0.25]
    """
    k = mask.workers
    c = mask.coverage.astype(float)
    return np.maximum(1.0 - k * permute_holder_set_gaps(mask) / c, 0.0)


def _check_distribution(holder_sets, probabilities, workers: int) -> tuple[list[np.ndarray], np.ndarray]:
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise TheoryError(f"workers={workers!r} must be an integer >= 1")
    probs = np.asarray(probabilities, dtype=float)
    sets = [np.asarray(sorted(set(int(k) for k in s)), dtype=int) for s in holder_sets]
    if probs.shape != (len(sets),) or not np.all(np.isfinite(probs)) or np.any(probs < 0) \
            or not abs(probs.sum() - 1.0) <= 1e-9:
        raise TheoryError(f"probabilities={probabilities!r} must be {len(sets)} numbers >= 0 summing to 1")
    for i, s in enumerate(sets):
        if s.size == 0 or s[0] < 0 or s[-1] >= workers:
            raise TheoryError(f"holder set {i} = {list(holder_sets[i])!r} must be a non-empty subset of "
                              f"range({workers})")
    return sets, probs
