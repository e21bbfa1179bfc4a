"""Theorem 2' (docs/theory.md): the heterogeneity variance of random holder sets is governed by the
holder-set gap rho_j, not by the trace of the weight covariance.

Exact checks enumerate the holder-set distribution; the simulation checks use the margin of
test_theory_simulate (mean over replicas plus 3 standard errors under the bound).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.mask import Mask, Schedule
from tests.strategies import masks
from theory.bounds import sdp_bound, update_statistics
from theory.errors import TheoryError
from theory.holder_sets import (
    expected_holder_laplacian,
    heterogeneity_variance_coefficient,
    holder_set_gap,
    permute_holder_set_gaps,
    permute_variance_coefficients,
)
from theory.problems import make_quadratic
from theory.simulate import simulate

Z = 3.0
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def _distribution(kind: str, k: int, c: int, rng: np.random.Generator):
    if kind == "all-subsets":  # a permute schedule
        sets = [list(s) for s in itertools.combinations(range(k), c)]
        return sets, np.full(len(sets), 1.0 / len(sets))
    base = rng.choice(k, size=c, replace=False)
    if kind == "rotations":  # uniform marginals, not exchangeable
        sets = [sorted(((base + r) % k).tolist()) for r in range(k)]
        return sets, np.full(k, 1.0 / k)
    sets = [sorted(rng.choice(k, size=int(rng.integers(1, k + 1)), replace=False).tolist()) for _ in range(4)]
    p = rng.random(4) + 0.05
    return sets, p / p.sum()


def _exact_variance(sets, probs, h: np.ndarray) -> float:
    """E||b - E b||^2 with b = sum_k w_k h_k, enumerated over the distribution."""
    k = h.shape[0]
    w = np.zeros((len(sets), k))
    for row, s in zip(w, sets):
        row[s] = 1.0 / len(s)
    b = w @ h
    mean = probs @ b
    return float(probs @ np.sum((b - mean) ** 2, axis=1))


@PROPERTY
@given(k=st.integers(2, 6), data=st.data())
def test_heterogeneity_variance_never_exceeds_kappa_zeta_sq_and_is_attained(k, data):
    c = data.draw(st.integers(1, k), label="c")
    kind = data.draw(st.sampled_from(["all-subsets", "rotations", "arbitrary"]), label="kind")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    sets, probs = _distribution(kind, k, c, rng)
    kappa = heterogeneity_variance_coefficient(sets, probs, k)
    h = rng.standard_normal((k, 3))
    h -= h.mean(axis=0)  # heterogeneity: worker gradients minus their mean
    zeta_sq = float(np.sum(h * h)) / k
    assert _exact_variance(sets, probs, h) <= kappa * zeta_sq * (1 + 1e-9) + 1e-12
    # attained by heterogeneity along the top eigenvector of the projected weight covariance
    w = np.zeros((len(sets), k))
    for row, s in zip(w, sets):
        row[s] = 1.0 / len(s)
    centred = w - probs @ w
    proj = np.eye(k) - 1.0 / k
    _, vecs = np.linalg.eigh(proj @ ((centred * probs[:, None]).T @ centred) @ proj)
    top = vecs[:, -1:] * np.sqrt(k)
    assert _exact_variance(sets, probs, top) == pytest.approx(kappa * float(np.sum(top * top)) / k, abs=1e-9)
    if kind != "arbitrary":  # uniform marginals, fixed size: kappa = 1 - K rho / c
        rho = holder_set_gap(sets, probs, k)
        assert kappa == pytest.approx(1.0 - k * rho / c, abs=1e-9)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(mask=masks(max_workers=7, max_blocks=4))
def test_permute_closed_forms_equal_enumeration_and_are_k_minus_1_below_the_trace(mask):
    k = mask.workers
    for j, c in enumerate(mask.coverage):
        sets = [list(s) for s in itertools.combinations(range(k), int(c))]
        probs = np.full(len(sets), 1.0 / len(sets))
        lap = expected_holder_laplacian(sets, probs, k)
        assert permute_holder_set_gaps(mask)[j] == pytest.approx(holder_set_gap(sets, probs, k), abs=1e-12)
        kappa = permute_variance_coefficients(mask)[j]
        assert kappa == pytest.approx(heterogeneity_variance_coefficient(sets, probs, k), abs=1e-12)
        if k > 1:
            assert kappa * (k - 1) == pytest.approx(k / c - 1, abs=1e-12)  # the old trace coefficient
            assert np.trace(lap) == pytest.approx(c - 1, abs=1e-12)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(mask=masks(max_workers=8, max_blocks=3), data=st.data())
def test_measured_gradient_norm_stays_under_tightened_bound_for_permute(mask, data):
    """The regime where the tightened term dominates: no noise, large heterogeneity, eta near 1/L."""
    sizes = [3] * mask.blocks
    mask = mask.replace(block_sizes=sizes, schedule=Schedule("permute", 1))
    zeta = data.draw(st.floats(0.5, 4.0), label="zeta")
    eta = data.draw(st.sampled_from([0.25, 0.5, 0.7]), label="eta")
    problem = make_quadratic(sizes, mask.workers, smoothness=1.0, sigma=data.draw(st.floats(0.0, 0.5)), zeta=zeta,
                             suboptimality=0.1, condition=data.draw(st.sampled_from([1.0, 4.0])), seed=0)
    result = simulate(problem, mask, eta=eta, steps=60, seeds=48, seed=1)
    assert result.assumptions_hold(problem.constants)
    bound = sdp_bound(mask, problem.constants, eta=eta, steps=60)
    assert result.measured + Z * result.stderr <= bound.total * (1 + 1e-9)


def test_tightened_bound_is_close_where_the_trace_bound_was_k_minus_1_too_large():
    """K = 8, 4 blocks of 4 coordinates each held by 2 workers, permuted every step, sigma = 0,
    zeta = 2, isotropic quadratic, eta = 0.5: tightened bound / measured 1.51, trace bound 10.6."""
    m = np.zeros((8, 4), dtype=np.uint8)
    for j in range(4):
        m[[2 * j, 2 * j + 1], j] = 1
    mask = Mask(m, block_sizes=[4] * 4, schedule=Schedule("permute", 1))
    problem = make_quadratic([4] * 4, 8, smoothness=1.0, sigma=0.0, zeta=2.0, suboptimality=0.1, condition=1.0,
                             seed=0)
    result = simulate(problem, mask, eta=0.5, steps=200, seeds=32, seed=0)
    tight = sdp_bound(mask, problem.constants, eta=0.5, steps=200).total
    _, _, kappa = update_statistics(mask)
    trace = tight + 0.5 * float(np.sum((8 / mask.coverage - 1 - kappa) * problem.constants.zeta_sq))
    assert result.measured + Z * result.stderr <= tight <= 1.6 * result.measured
    assert trace >= 10 * result.measured


def test_holder_set_distribution_errors_name_the_value():
    with pytest.raises(TheoryError, match="probabilities"):
        holder_set_gap([[0], [1]], [0.5, 0.6], 2)
    with pytest.raises(TheoryError, match=r"holder set 1 = \[2\] must be a non-empty subset of range\(2\)"):
        holder_set_gap([[0], [2]], [0.5, 0.5], 2)
