"""Mutation test: the stepwise property test must catch deliberately wrong bounds.

The property (measured mean + 3 standard errors under the bound) runs on problems whose heterogeneity
is aligned with the centred mask columns (the worst case of Lemma 1, docs/theory.md §2), on isotropic
quadratics where the descent lemma is nearly tight. The true Theorem 1/2' bound passes; each mutant
(a dropped term, a wrong coverage weight, a halved optimization term) must fail it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.mask import Mask, Schedule
from theory.bounds import sdp_bound, update_statistics
from theory.problems import make_quadratic
from theory.simulate import simulate

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
