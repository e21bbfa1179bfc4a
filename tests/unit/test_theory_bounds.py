"""Bound evaluation (theory.bounds, theory.consensus): closed forms, DDP as a special case, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.analysis import spectral_gap, spectral_gap_bound
from masklab.mask import Mask, Schedule
from tests.strategies import masks
from theory.bounds import (
    ProblemConstants,
    constants_from_totals,
    ddp_bound,
    flop_matched_steps,
    max_step_size,
    optimal_step_size,
    sdp_bound,
)
from theory.consensus import consensus_deviation_bound, consensus_rate
from theory.errors import AssumptionError, TheoryError

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
positive = st.floats(0.01, 10.0)


@PROPERTY
@given(k=st.integers(1, 9), b=st.integers(1, 6), kind=st.sampled_from(["static", "permute", "cyclic"]),
       lip=positive, sigma=positive, zeta=positive, d0=positive, frac=st.floats(0.05, 1.0),
       steps=st.integers(1, 500))
def test_full_coverage_reproduces_ddp_bound_exactly(k, b, kind, lip, sigma, zeta, d0, frac, steps):
    full = Mask(np.ones((k, b)), schedule=Schedule(kind, 1))
    c = constants_from_totals(full, smoothness=lip, sigma=sigma, zeta=zeta, suboptimality=d0)
    eta = frac / lip
    terms = sdp_bound(full, c, eta=eta, steps=steps)
    closed_form = 2 * d0 / (eta * steps) + lip * eta * sigma**2 / k
    assert terms.bias == 0.0 and terms.consensus == 0.0
    assert terms.total == pytest.approx(closed_form, rel=1e-12)
    assert ddp_bound(full, c, eta=eta, steps=steps).total == pytest.approx(closed_form, rel=1e-12)


@PROPERTY
@given(mask=masks(max_workers=8, max_blocks=6), h=st.integers(1, 4), zeta=positive)
def test_bias_term_vanishes_for_redrawn_permutations_and_for_zero_zeta(mask, h, zeta):
    redrawn = mask.replace(schedule=Schedule("permute", h))
    grad = np.ones(mask.blocks)
    c = constants_from_totals(mask, smoothness=1.0, sigma=1.0, zeta=zeta, suboptimality=1.0)
    c = ProblemConstants(c.smoothness, c.sigma_sq, c.zeta_sq, c.suboptimality, grad_sq=grad)
    assert sdp_bound(redrawn, c, eta=0.01, steps=4 * h, local_steps=h).bias == 0.0
    flat = ProblemConstants(1.0, c.sigma_sq, np.zeros(mask.blocks), 1.0, grad_sq=grad)
    assert sdp_bound(mask, flat, eta=0.01, steps=4 * h, local_steps=h).bias == 0.0


def test_static_bias_is_sum_of_masking_error_times_heterogeneity():
    mask = Mask([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]])  # c = 4, 2, 1
    c = ProblemConstants(1.0, np.zeros(3), np.array([1.0, 2.0, 3.0]), 1.0)
    assert sdp_bound(mask, c, eta=1.0, steps=1).bias == pytest.approx(0 * 1 + 1 * 2 + 3 * 3)


def test_held_permutation_is_bounded_like_a_static_mask():
    matrix = [[1, 0], [0, 1], [0, 1], [0, 1]]
    c = constants_from_totals(Mask(matrix), smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    static = sdp_bound(Mask(matrix), c, eta=0.5, steps=10)
    held = sdp_bound(Mask(matrix, schedule=Schedule("permute", 5)), c, eta=0.5, steps=10)
    fresh = sdp_bound(Mask(matrix, schedule=Schedule("permute", 1)), c, eta=0.5, steps=10)
    assert held == static
    assert fresh.bias == 0.0 and fresh.variance > static.variance


def test_step_size_range_and_condition():
    assert max_step_size(2.0) == 0.5 and max_step_size(2.0, local_steps=3) == pytest.approx(1 / 12)
    mask = Mask([[1, 1]])
    c = constants_from_totals(mask, smoothness=2.0, sigma=1.0, zeta=0.0, suboptimality=1.0)
    assert sdp_bound(mask, c, eta=0.5, steps=1).step_size_ok
    assert not sdp_bound(mask, c, eta=0.51, steps=1).step_size_ok


@PROPERTY
@given(mask=masks(max_workers=8, max_blocks=5, schedule=True), steps=st.integers(1, 1000), h=st.integers(1, 3))
def test_optimal_step_size_minimises_the_bound(mask, steps, h):
    mask = mask.replace(schedule=Schedule(mask.schedule.kind, mask.schedule.every * h))
    c = constants_from_totals(mask, smoothness=3.0, sigma=2.0, zeta=1.0, suboptimality=5.0, grad_bound=2.0)
    best = optimal_step_size(mask, c, steps=steps * h, local_steps=h)
    eta_max = max_step_size(3.0, local_steps=h)
    assert 0 < best <= eta_max

    def total(eta):
        return sdp_bound(mask, c, eta=eta, steps=steps * h, local_steps=h).total

    for eta in np.linspace(eta_max / 50, eta_max, 50):
        assert total(best) <= total(eta) * (1 + 1e-7)


def test_flop_matched_steps_closed_form_and_unreachable_floor():
    mask = Mask([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1]], schedule=Schedule("permute", 1))
    c = constants_from_totals(mask, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=10.0)
    match = flop_matched_steps(mask, c, eta=0.1, ddp_steps=1000)
    sdp = sdp_bound(mask, c, eta=0.1, steps=math.ceil(match.sdp_steps))
    assert sdp.total <= match.ddp_bound * (1 + 1e-12)
    # backward masking at C = 0.5: full forward and activation gradients, half the weight gradients
    assert match.compute_fraction == pytest.approx((2 + 0.5) / 3)
    assert match.compute_ratio == pytest.approx(match.sdp_steps * match.compute_fraction / 1000)
    biased = Mask([[1, 0], [0, 1]])
    cb = constants_from_totals(biased, smoothness=1.0, sigma=0.0, zeta=1.0, suboptimality=1.0)
    assert flop_matched_steps(biased, cb, eta=0.5, ddp_steps=10).sdp_steps == math.inf


def test_local_steps_need_a_gradient_bound_and_whole_rounds():
    mask = Mask([[1, 1]])
    c = constants_from_totals(mask, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    with pytest.raises(AssumptionError, match="grad_sq"):
        sdp_bound(mask, c, eta=0.1, steps=4, local_steps=2)
    with pytest.raises(TheoryError, match="steps=5 must be a multiple of local_steps=2"):
        sdp_bound(mask, c, eta=0.1, steps=5, local_steps=2)
    with pytest.raises(TheoryError, match="eta=-1"):
        sdp_bound(mask, c, eta=-1.0, steps=5)
    with pytest.raises(TheoryError, match="constants have 2 blocks but the mask has 1"):
        sdp_bound(Mask([[1]]), c, eta=0.1, steps=5)
    with pytest.raises(TheoryError, match="smoothness=0"):
        ProblemConstants(0.0, np.zeros(1), np.zeros(1), 1.0)


@pytest.mark.parametrize("every", [1, 3])
def test_theorem_3_refuses_a_schedule_that_changes_the_mask_within_a_round_of_local_steps(every):
    """Theorem 3 keeps one mask for each round of H steps; a permute mask redrawn every 1 or 3 steps
    under H = 2 breaks that (the runtime refuses it too), so no bound, step size or FLOP match."""
    mask = Mask([[1, 0], [0, 1]], schedule=Schedule("permute", every))
    c = constants_from_totals(mask, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0, grad_bound=1.0)
    message = f"'permute' schedule every={every} must be a multiple of local_steps=2"
    for evaluate in (lambda: sdp_bound(mask, c, eta=0.1, steps=6, local_steps=2),
                     lambda: optimal_step_size(mask, c, steps=6, local_steps=2),
                     lambda: flop_matched_steps(mask, c, eta=0.1, ddp_steps=6, local_steps=2)):
        with pytest.raises(TheoryError, match=message):
            evaluate()
    aligned = mask.replace(schedule=Schedule("permute", 2 * every))
    assert sdp_bound(aligned, c, eta=0.1, steps=6, local_steps=2).consensus > 0


@PROPERTY
@given(k=st.integers(2, 9), b=st.integers(1, 6), data=st.data())
def test_permute_consensus_rate_equals_gap_for_balanced_masks(k, b, data):
    c = data.draw(st.integers(max(1, -(-k // b)), k))
    m = np.zeros((k, b), dtype=np.uint8)
    for j in range(b):
        m[[(j * c + t) % k for t in range(c)], j] = 1
    mask = Mask(m, schedule=Schedule("permute", 1))
    assert consensus_rate(mask) == pytest.approx(spectral_gap(mask), abs=1e-12)
    assert consensus_rate(mask) == pytest.approx(spectral_gap_bound(mask), abs=1e-12)


def test_fano_plane_attains_the_gap_cap():
    lines = [(0, 1, 2), (0, 3, 4), (0, 5, 6), (1, 3, 5), (1, 4, 6), (2, 3, 6), (2, 4, 5)]
    m = np.zeros((7, 7), dtype=np.uint8)
    for j, line in enumerate(lines):
        m[list(line), j] = 1
    assert spectral_gap(Mask(m)) == pytest.approx(spectral_gap_bound(Mask(m)), rel=1e-12)


def test_consensus_bound_without_a_rate_grows_by_one_increment_per_round():
    """Static mask: block 0's non-holder never sees the average, so sqrt(E Xi_0) grows by at most
    d_0 = eta H sqrt(c (1 - c/K)) G per round (Theorem 4.4); block 1 is held by both and averaged away."""
    mask = Mask([[1, 1], [0, 1]])
    bound = consensus_deviation_bound(mask, np.ones(2), rounds=3, eta=0.1, grad_sq=np.ones(2))
    d = 0.1 * np.sqrt(0.5)
    assert bound == pytest.approx([2.0] + [(1 + d * r) ** 2 for r in (1, 2, 3)], rel=1e-12)
    with pytest.raises(AssumptionError):
        consensus_deviation_bound(mask, np.ones(2), rounds=2, eta=0.1)
