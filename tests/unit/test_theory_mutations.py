"""Mutation test: the stepwise and overlap property tests must catch deliberately wrong bounds.

The property (measured mean + 3 standard errors under the bound) runs on problems whose heterogeneity
is aligned with the centred mask columns (the worst case of Lemma 1, docs/theory.md §2), on isotropic
quadratics where the descent lemma is nearly tight. The true Theorem 1/2' bound passes; each mutant
(a dropped term, a wrong coverage weight, a halved optimization term) must fail it. The same for overlap
averaging: Theorem 6 and the consensus-deviation Theorems 4.4/4.6 pass, and each mutant (a dropped term,
a wrong coverage weight, a gap too large) fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.mask import Mask, Schedule
from theory.bounds import ProblemConstants, sdp_bound, update_statistics
from theory.consensus import consensus_deviation_bound, deviation_increments, overlap_bound
from theory.problems import make_quadratic
from theory.simulate import simulate, simulate_consensus

Z = 3.0


def _true(mask, constants, eta, steps):
    return sdp_bound(mask, constants, eta=eta, steps=steps).total


def _no_bias(mask, constants, eta, steps):
    t = sdp_bound(mask, constants, eta=eta, steps=steps)
    return t.total - t.bias


def _ddp_noise_weight(mask, constants, eta, steps):  # sigma_j^2 / K instead of E[1/c_j] sigma_j^2
    t = sdp_bound(mask, constants, eta=eta, steps=steps)
    _, inv_c, _ = update_statistics(mask)
    return t.total - constants.smoothness * eta * float(np.sum((inv_c - 1.0 / mask.workers) * constants.sigma_sq))


def _bias_weighted_by_coverage(mask, constants, eta, steps):  # eps_j^2 c_j / K instead of eps_j^2
    t = sdp_bound(mask, constants, eta=eta, steps=steps)
    eps_sq, _, _ = update_statistics(mask)
    return t.total - t.bias + float(np.sum(eps_sq * mask.coverage / mask.workers * constants.zeta_sq))


def _half_optimization(mask, constants, eta, steps):  # D/(eta T) instead of 2D/(eta T)
    t = sdp_bound(mask, constants, eta=eta, steps=steps)
    return t.total - t.optimization / 2


def _property(bound_fn):
    @settings(max_examples=12, deadline=None, derandomize=True, database=None)
    @given(case=st.sampled_from(["bias", "noise", "optimization"]), workers=st.just(4),
           permute=st.booleans())
    def check(case, workers, permute):
        c = workers // 2
        matrix = np.array([[1 if k // c == j else 0 for j in range(2)] for k in range(workers)])  # two halves
        mask = Mask(matrix, block_sizes=[4, 4], schedule=Schedule("permute", 1) if permute else None)
        sigma, zeta, d = {"bias": (0.0, 2.0, 0.1), "noise": (3.0, 0.0, 0.1), "optimization": (0.0, 0.0, 5.0)}[case]
        problem = make_quadratic([4, 4], workers, smoothness=1.0, sigma=sigma, zeta=zeta, suboptimality=d,
                                 condition=1.0, worker_pattern=matrix, seed=0)  # heterogeneity along w_j - u
        eta, steps = 0.7, 40  # at eta = 1/L the bound is within the 3-s.e. margin
        res = simulate(problem, mask, eta=eta, steps=steps, seeds=32, seed=1)
        assert res.measured + Z * res.stderr <= bound_fn(mask, problem.constants, eta, steps) * (1 + 1e-9)

    return check


def test_true_bound_passes_the_property_on_mask_aligned_heterogeneity():
    _property(_true)()


@pytest.mark.parametrize("mutant", [_no_bias, _ddp_noise_weight, _bias_weighted_by_coverage, _half_optimization])
def test_each_wrong_bound_is_caught_by_the_property(mutant):
    with pytest.raises(AssertionError):
        _property(mutant)()


# Overlap averaging (docs/theory.md §4): Theorem 6 for the copies' mean and Theorems 4.4/4.6 for their
# deviation. The deviation property runs where those bounds are nearly exact: worker gradients that barely
# change over the run (curvature 0.01) with heterogeneity aligned with the mask columns, so every holder
# moves by the same G_j each round; a static mask then grows exactly as Theorem 4.4 says (ratio 1.02). The
# Theorem 6 property runs where its optimization term is nearly tight (isotropic, no noise or heterogeneity,
# eta L = 0.05 over 60 rounds); its bias term is zero there (permute redrawn every round) and loose where it
# is not (held masks), so no bias mutant is listed: see docs/theory.md "How close".


def _deviation_true(mask, eta, rounds, grad_sq):
    return consensus_deviation_bound(mask, np.zeros(mask.blocks), rounds=rounds, eta=eta, grad_sq=grad_sq)


def _deviation_last_round_only(mask, eta, rounds, grad_sq):  # a dropped term: earlier rounds' displacements
    d = deviation_increments(mask, eta=eta, local_steps=1, grad_sq=grad_sq)
    return np.concatenate(([0.0], np.full(rounds, float(d.sum()))))


def _deviation_per_worker_weight(mask, eta, rounds, grad_sq):  # (c_j/K)(1 - c_j/K) instead of c_j (1 - c_j/K)
    return _deviation_true(mask, eta, rounds, grad_sq) / mask.workers


def _deviation_gamma_for_every_schedule(mask, eta, rounds, grad_sq):  # the gap too large: (c_j-1)/(K-1) per round
    return consensus_deviation_bound(mask.replace(schedule=Schedule("permute", 1)), np.zeros(mask.blocks),
                                     rounds=rounds, eta=eta, grad_sq=grad_sq)


def _theorem6_true(mask, constants, eta, steps):
    return overlap_bound(mask, constants, eta=eta, steps=steps).total


def _theorem6_no_coverage_scale(mask, constants, eta, steps):  # K / c_min dropped: each block's mean steps as DDP's
    return _theorem6_true(mask, constants, eta, steps) * float(mask.coverage.min()) / mask.workers


def _theorem6_no_optimization(mask, constants, eta, steps):  # a dropped term: D / (eta T)
    t = overlap_bound(mask, constants, eta=eta, steps=steps)
    return t.total - t.optimization


def _overlap_property(theorem6_fn, deviation_fn):
    @settings(max_examples=10, deadline=None, derandomize=True, database=None)
    @given(case=st.sampled_from(["static", "cyclic", "permute held", "theorem 6"]))
    def check(case):
        if case == "theorem 6":
            matrix = np.array([[1 if (k - j) % 6 < 3 else 0 for j in range(6)] for k in range(6)])
            mask = Mask(matrix, block_sizes=[2] * 6, schedule=Schedule("permute", 1))
            problem = make_quadratic([2] * 6, 6, smoothness=1.0, sigma=0.0, zeta=0.0, suboptimality=5.0,
                                     condition=1.0, seed=0)
            eta, rounds = 0.05, 60
            res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, initial_spread=0.0, seeds=16, seed=1)
            p = problem.constants
            constants = ProblemConstants(p.smoothness, p.sigma_sq, p.zeta_sq, p.suboptimality, p.worker_smoothness,
                                         grad_sq=res.grad_sq_seen)
            assert res.measured + Z * res.stderr <= theorem6_fn(mask, constants, eta, rounds) * (1 + 1e-9)
            return
        matrix = np.array([[1 if (k - j) % 6 < 2 else 0 for j in range(6)] for k in range(6)])
        rounds = 20
        schedule = {"static": None, "cyclic": Schedule("cyclic", 1), "permute held": Schedule("permute", rounds)}[case]
        mask = Mask(matrix, block_sizes=[2] * 6, schedule=schedule)
        problem = make_quadratic([2] * 6, 6, smoothness=0.01, sigma=0.0, zeta=2.0, suboptimality=1.0, condition=1.0,
                                 worker_pattern=matrix, seed=0)  # heterogeneity along the mask columns
        eta = 0.1
        res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, initial_spread=0.0, seeds=16, seed=1)
        dev = res.deviation[:, 1:]
        measured = dev.mean(axis=0) + Z * dev.std(axis=0, ddof=1) / np.sqrt(dev.shape[0])
        assert np.all(measured <= deviation_fn(mask, eta, rounds, res.grad_sq_seen)[1:] * (1 + 1e-9) + 1e-12)

    return check


def test_true_overlap_bounds_pass_the_property():
    _overlap_property(_theorem6_true, _deviation_true)()


@pytest.mark.parametrize(("theorem6_fn", "deviation_fn"), [
    (_theorem6_no_coverage_scale, _deviation_true),
    (_theorem6_no_optimization, _deviation_true),
    (_theorem6_true, _deviation_last_round_only),
    (_theorem6_true, _deviation_per_worker_weight),
    (_theorem6_true, _deviation_gamma_for_every_schedule),
], ids=["theorem6-coverage-scale", "theorem6-no-optimization", "deviation-last-round-only",
        "deviation-per-worker-weight", "deviation-gamma-gap"])
def test_each_wrong_overlap_bound_is_caught_by_the_property(theorem6_fn, deviation_fn):
    with pytest.raises(AssertionError):
        _overlap_property(theorem6_fn, deviation_fn)()
