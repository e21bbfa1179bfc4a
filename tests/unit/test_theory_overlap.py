"""Overlap averaging with schedules (docs/theory.md §4): Theorem 4 (consensus) and Theorem 6
(convergence of the copies' mean), checked against `simulate_consensus`.

Margins as in test_theory_simulate: the mean over replicas plus 3 standard errors under the bound.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from masklab.analysis import spectral_gap
from masklab.mask import Mask, Schedule
from tests.strategies import masks
from theory.bounds import ProblemConstants
from theory.consensus import (
    bias_cancels_over_period,
    block_deviation_bound,
    consensus_deviation_bound,
    consensus_period,
    _deviation_factors,
    _held_bias,
    consensus_rates,
    deviation_increments,
    directional_factors,
    exported_overlap_bound,
    mixing_operator,
    overlap_bound,
    per_round_factor,
    period_overlap_bound,
    round_moments,
    size_weighted_gap,
)
import theory.deviation as deviation_module
from theory.deviation import gram_deviation, permute_deviation
from theory.problems import make_quadratic
from theory.errors import TheoryError
from theory.simulate import simulate_consensus

Z = 3.0


def _cyclic_k6_c3() -> Mask:
    rows = [[1 if (k - j) % 6 < 3 else 0 for j in range(6)] for k in range(6)]
    return Mask(rows, block_sizes=[2] * 6, schedule=Schedule("cyclic", 1))


def _scheduled(mask: Mask, kind: str, every: int, data) -> Mask:
    """`mask` under `kind`; a ``sequence`` of 2 or 3 rounds, each shuffling every block's holders."""
    if kind != "sequence":
        return mask.replace(schedule=Schedule(kind, every))
    rounds = [mask.matrix]
    for _ in range(data.draw(st.integers(1, 2), label="extra rounds")):
        shuffled = np.array([data.draw(st.permutations(list(col)), label="holders") for col in mask.matrix.T]).T
        assume(bool(shuffled.sum(axis=1).all()))
        rounds.append(shuffled)
    return Mask.sequence(rounds, every=every, block_sizes=mask.block_sizes)


def _constants_seen(problem, res, *, per_round: bool = False) -> ProblemConstants:
    """The problem's constants with the largest gradient second moment the run met (the bound's G_j^2), and
    with `per_round` each round's (A6r); a draw whose heterogeneity exceeded the stated zeta is not the
    bound's case and is discarded."""
    c = problem.constants
    assume(bool(np.all(res.zeta_sq_seen <= c.zeta_sq * (1 + 1e-9) + 1e-9)))
    return ProblemConstants(c.smoothness, c.sigma_sq, c.zeta_sq, c.suboptimality, c.worker_smoothness,
                            grad_sq=res.grad_sq_seen, round_grad_sq=res.round_grad_sq_seen if per_round else None)


def _one_round(mask: Mask, e: np.ndarray) -> float:
    """Xi after one holder averaging of a block-uniform deviation e (one value per worker)."""
    sizes = mask.block_sizes or (1,) * mask.blocks
    after = 0.0
    for j, d in enumerate(sizes):
        held = mask.matrix[:, j] > 0
        ej = np.where(held, e[held].mean(), e)
        after += d * np.sum((ej - ej.mean()) ** 2)
    return after


def test_theorem_4_3_needs_size_weights_blocks_of_100_and_1():
    mask = Mask([[1, 1], [0, 1]], block_sizes=[100, 1])  # block 0 held by worker 0 only
    e = np.array([1.0, -1.0])
    ratio = _one_round(mask, e) / (101 * np.sum(e * e))
    assert ratio == pytest.approx(100 / 101)  # 0.990
    assert spectral_gap(mask) == pytest.approx(0.5)  # the old claim: ratio <= 0.5
    assert ratio > 1 - spectral_gap(mask)
    assert ratio <= 1 - size_weighted_gap(mask) + 1e-12


@settings(max_examples=30, deadline=None, derandomize=True)
@given(mask=masks(max_workers=8, max_blocks=6), data=st.data())
def test_block_uniform_deviation_contracts_by_size_weighted_gap_in_one_round(mask, data):
    sizes = data.draw(st.lists(st.integers(1, 100), min_size=mask.blocks, max_size=mask.blocks), label="sizes")
    mask = mask.replace(block_sizes=sizes)
    e = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed")).standard_normal(mask.workers)
    e -= e.mean()
    assert _one_round(mask, e) <= (1 - size_weighted_gap(mask)) * sum(sizes) * np.sum(e * e) * (1 + 1e-9) + 1e-12


def test_cyclic_schedule_contracts_although_no_single_round_does():
    """The old module said "no positive rate" for cyclic; K = 6, c = 3, every = 1 contracts."""
    mask = _cyclic_k6_c3()
    assert consensus_period(mask) == 6
    assert per_round_factor(mask) == pytest.approx(np.full(6, 0.649147), abs=1e-6)  # guaranteed
    problem = make_quadratic([2] * 6, 6, smoothness=1.0, sigma=0.0, zeta=0.0, suboptimality=1.0, seed=0)
    res = simulate_consensus(problem, mask, rounds=60, seeds=16, seed=0)
    xi = res.deviation.mean(axis=0)
    measured_rate = (xi[60] / xi[30]) ** (1 / 30)
    assert measured_rate == pytest.approx(0.525, abs=0.01)  # the 0.526: the asymptotic rate
    assert measured_rate <= per_round_factor(mask).max()
    bounds = np.stack([consensus_deviation_bound(mask, xi0, rounds=60) for xi0 in res.initial])
    assert np.all(res.deviation <= bounds * (1 + 1e-9) + 1e-12)  # deterministic schedule: per seed


@settings(max_examples=20, deadline=None, derandomize=True)
@given(mask=masks(max_workers=5, max_blocks=3))
def test_permute_mixing_operator_is_the_expected_projection(mask):
    k = mask.workers
    permuted = mask.replace(schedule=Schedule("permute", 1))
    for j, c in enumerate(mask.coverage):
        sets = list(itertools.combinations(range(k), int(c)))
        expected = np.zeros((k, k))
        for s in sets:
            p = np.eye(k)
            p[np.ix_(s, s)] = 1.0 / c
            expected += p / len(sets)
        np.testing.assert_allclose(mixing_operator(permuted, j), expected, atol=1e-12)
    assert consensus_rates(permuted) == pytest.approx((mask.coverage - 1) / max(k - 1, 1), abs=1e-12) or k == 1


@settings(max_examples=20, deadline=None, derandomize=True)
@given(mask=masks(max_workers=6, max_blocks=3), data=st.data())
def test_consensus_deviation_stays_under_theorem_4_for_every_schedule(mask, data):
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind = data.draw(st.sampled_from(["static", "permute", "cyclic", "sequence"]), label="kind")
    every = h * data.draw(st.integers(1, 3), label="rounds per mask")
    mask = _scheduled(mask.replace(block_sizes=[2] * mask.blocks), kind, every, data)
    eta = data.draw(st.sampled_from([0.0, 0.05]), label="eta")
    problem = make_quadratic([2] * mask.blocks, mask.workers, smoothness=1.0, sigma=0.5, zeta=1.0,
                             suboptimality=1.0, seed=3)
    rounds = 2 * consensus_period(mask, local_steps=h) + 1
    res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, local_steps=h, seeds=64, seed=4)
    grad_sq = res.grad_sq_seen if eta > 0 else None
    per_round = {"round_grad_sq": res.round_grad_sq_seen, "sigma_sq": problem.constants.sigma_sq} if eta > 0 else {}
    for moments in ({}, per_round):  # A6 for the whole run, then A6r round by round with the noise split off
        per_seed = np.stack([consensus_deviation_bound(mask, xi0, rounds=rounds, eta=eta, local_steps=h,
                                                       grad_sq=grad_sq, **moments) for xi0 in res.initial])
        if eta == 0.0 and kind != "permute":  # deterministic: the bound holds seed by seed
            assert np.all(res.deviation <= per_seed * (1 + 1e-9) + 1e-12)
            continue
        excess = (res.deviation - per_seed)[:, 1:]  # paired by seed: the starting spread cancels; round 0 is x_0
        stderr = excess.std(axis=0, ddof=1) / np.sqrt(excess.shape[0])
        assert np.all(excess.mean(axis=0) + Z * stderr <= 1e-9 * per_seed.mean(axis=0)[1:] + 1e-12)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(mask=masks(max_workers=6, max_blocks=3), data=st.data())
def test_mean_of_copies_and_exported_model_stay_under_theorem_6(mask, data):
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind = data.draw(st.sampled_from(["permute", "cyclic", "static", "sequence"]), label="kind")
    mask = _scheduled(mask.replace(block_sizes=[2] * mask.blocks), kind, h, data)
    problem = make_quadratic([2] * mask.blocks, mask.workers, smoothness=1.0, sigma=data.draw(st.floats(0, 1)),
                             zeta=data.draw(st.floats(0, 2)), suboptimality=1.0, seed=5)
    eta = data.draw(st.floats(0.2, 1.0), label="eta * 12 L H") / (12 * h)
    rounds = data.draw(st.integers(2, 20), label="rounds")
    res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, local_steps=h, initial_spread=0.0,
                             seeds=48, seed=6)
    for per_round in (False, True):  # G_j^2 for the whole run (A6), then round by round (A6r)
        constants = _constants_seen(problem, res, per_round=per_round)
        bound = overlap_bound(mask, constants, eta=eta, steps=rounds * h, local_steps=h)
        assert bound.step_size_ok
        assert res.measured + Z * res.stderr <= bound.total * (1 + 1e-9)
        exported = res.exported_grad_norm_sq.mean(axis=1)  # each block its holders' mean (Corollary 6.1)
        assert exported.mean() + Z * exported.std(ddof=1) / np.sqrt(exported.size) \
            <= exported_overlap_bound(mask, constants, eta=eta, steps=rounds * h, local_steps=h) * (1 + 1e-9)


def test_overlap_bound_is_infinite_without_a_gap_and_finite_with_one():
    static = Mask([[1, 1], [1, 0], [0, 1]], block_sizes=[2, 2])
    c = ProblemConstants(1.0, np.ones(2), np.ones(2), 1.0, grad_sq=np.ones(2))
    assert overlap_bound(static, c, eta=0.01, steps=10).consensus == np.inf
    cyclic = static.replace(schedule=Schedule("cyclic", 1))
    assert np.isfinite(overlap_bound(cyclic, c, eta=0.01, steps=10).total)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(mask=masks(max_workers=6, max_blocks=3), data=st.data())
def test_theorem_4_6_holds_for_deterministic_schedules_with_mask_aligned_heterogeneity(mask, data):
    """Theorem 4.6 (directional, per round) on the worst case: heterogeneity along the mask columns."""
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind = data.draw(st.sampled_from(["cyclic", "sequence"]), label="kind")
    every = h * data.draw(st.integers(1, 2), label="rounds per mask")
    mask = _scheduled(mask.replace(block_sizes=[2] * mask.blocks), kind, every, data)
    problem = make_quadratic([2] * mask.blocks, mask.workers, smoothness=1.0, sigma=0.0, zeta=2.0,
                             suboptimality=1.0, worker_pattern=mask.matrix, seed=7)
    rounds = 2 * consensus_period(mask, local_steps=h) + 2
    res = simulate_consensus(problem, mask, rounds=rounds, eta=1.0 / (4 * h), local_steps=h, initial_spread=0.0,
                             seeds=4, seed=8)
    for per_round in ({}, {"round_grad_sq": res.round_grad_sq_seen, "sigma_sq": problem.constants.sigma_sq}):
        bound = consensus_deviation_bound(mask, np.zeros(mask.blocks), rounds=rounds, eta=1.0 / (4 * h),
                                          local_steps=h, grad_sq=res.grad_sq_seen, **per_round)
        assert np.all(res.deviation <= bound * (1 + 1e-9) + 1e-12)  # sigma = 0, deterministic masks: per seed


@settings(max_examples=20, deadline=None, derandomize=True)
@given(mask=masks(max_workers=7, max_blocks=3), data=st.data())
def test_theorem_4_6_factors_never_exceed_theorem_4_4(mask, data):
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind = data.draw(st.sampled_from(["static", "cyclic", "sequence"]), label="kind")
    mask = _scheduled(mask, kind, h * data.draw(st.integers(1, 3), label="rounds per mask"), data)
    period = consensus_period(mask, local_steps=h)
    rounds = 3 * period + 1
    start, injected = directional_factors(mask, rounds, local_steps=h)
    old_start, old_injected = _deviation_factors(consensus_rates(mask, local_steps=h), period, rounds)
    assert np.all(start <= old_start + 1e-9) and np.all(injected <= old_injected + 1e-9)
    # one round: its own direction only (none when every worker holds the block)
    assert injected[1] == pytest.approx(np.where(mask.coverage < mask.workers, 1.0, 0.0))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(mask=masks(max_workers=6, max_blocks=3), data=st.data())
def test_theorem_6_2_bounds_the_mean_at_period_starts_for_held_masks(mask, data):
    """Theorem 6.2 on the worst case of Lemma 1: heterogeneity along the mask columns, a mask held over rounds."""
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind, every = data.draw(st.sampled_from([("cyclic", 1), ("cyclic", 2), ("permute", 2), ("permute", 3)]),
                            label="schedule")
    mask = mask.replace(block_sizes=[2] * mask.blocks, schedule=Schedule(kind, every * h))
    period = consensus_period(mask, local_steps=h)
    assume(period > 1)
    problem = make_quadratic([2] * mask.blocks, mask.workers, smoothness=1.0, sigma=data.draw(st.floats(0, 1)),
                             zeta=2.0, suboptimality=1.0, worker_pattern=mask.matrix, seed=9)
    eta = data.draw(st.floats(0.2, 1.0), label="eta * 4 L P H") / (4 * period * h)
    rounds = period * data.draw(st.integers(1, 4), label="periods")
    res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, local_steps=h, initial_spread=0.0,
                             seeds=32, seed=10)
    at_starts = res.mean_grad_norm_sq[:, ::period].mean(axis=1)  # rounds is a multiple of the period
    for per_round in (False, True):
        bound = period_overlap_bound(mask, _constants_seen(problem, res, per_round=per_round), eta=eta,
                                     steps=rounds * h, local_steps=h)
        assert at_starts.mean() + Z * at_starts.std(ddof=1) / np.sqrt(at_starts.size) <= bound.total * (1 + 1e-9)


def test_theorem_6_2_refuses_schedules_it_does_not_cover():
    mask = Mask([[1, 1], [1, 0], [0, 1]], block_sizes=[2, 2])
    c = ProblemConstants(1.0, np.ones(2), np.ones(2), 1.0, grad_sq=np.ones(2))
    with pytest.raises(TheoryError, match="static"):
        period_overlap_bound(mask, c, eta=0.01, steps=10)
    with pytest.raises(TheoryError, match="Theorem 6's case"):
        period_overlap_bound(mask.replace(schedule=Schedule("permute", 1)), c, eta=0.01, steps=10)
    unbalanced = Mask.sequence([[[1, 1], [1, 0], [0, 1]], [[1, 1], [0, 1], [1, 0]]], every=1, block_sizes=[2, 2])
    with pytest.raises(TheoryError, match="equally often"):
        period_overlap_bound(unbalanced, c, eta=0.01, steps=10)
    assert np.isfinite(period_overlap_bound(mask.replace(schedule=Schedule("cyclic", 1)), c, eta=0.01,
                                            steps=30).total)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(mask=masks(max_workers=7, max_blocks=3), data=st.data())
def test_theorems_4_7_and_4_8_never_exceed_theorems_4_4_and_4_6(mask, data):
    """With one G_j^2 for the run and no noise split, the new bounds are at most the ones they replace."""
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind = data.draw(st.sampled_from(["static", "cyclic", "sequence", "permute"]), label="kind")
    mask = _scheduled(mask, kind, h * data.draw(st.integers(1, 3), label="rounds per mask"), data)
    period = consensus_period(mask, local_steps=h)
    rounds = 3 * period + 1
    xi0 = np.asarray(data.draw(st.lists(st.floats(0, 4), min_size=mask.blocks, max_size=mask.blocks), label="xi0"))
    d_sq = deviation_increments(mask, eta=0.1, local_steps=h, grad_sq=np.ones(mask.blocks))
    start, injected = _deviation_factors(consensus_rates(mask, local_steps=h), period, rounds, mask=mask,
                                         local_steps=h)
    older = (start * np.sqrt(xi0) + injected * np.sqrt(d_sq)) ** 2
    drift = np.full((rounds, mask.blocks), 0.1 * h)  # eta H G_j with G_j = 1
    wired = block_deviation_bound(mask, xi0, local_steps=h, drift=drift, noise=np.zeros_like(drift))
    assert np.all(wired <= older * (1 + 1e-9) + 1e-12)
    if kind == "permute":
        newer = permute_deviation(mask.coverage, mask.workers, period, xi0, drift, np.zeros_like(drift))
    else:
        held = np.stack([mask.round_matrix(t * h) > 0 for t in range(period)])
        newer = gram_deviation(held, xi0, drift, np.zeros_like(drift))[0]
    assert np.all(newer <= older * (1 + 1e-9) + 1e-12)


def test_theorem_4_8_is_exact_for_two_workers_holding_one_block_each():
    """K = 2, c = 1, permuted every round, each holder moving by -eta h_k with h = (z, -z): whichever worker
    holds, the copies part by eta ||z|| more, so E Xi(r) = r^2 eta^2 ||z||^2 / 2; Theorem 4.8 gives exactly that."""
    mask = Mask([[1, 0], [0, 1]], block_sizes=[2, 2], schedule=Schedule("permute", 1))
    drift = np.full((6, 2), 0.3)  # eta H G_j
    bound = permute_deviation(mask.coverage, 2, 1, np.zeros(2), drift, np.zeros_like(drift))
    np.testing.assert_allclose(bound[:, 0], np.arange(7) ** 2 * 0.3**2 / 2, rtol=1e-12)
    assert block_deviation_bound(mask, np.zeros(2), local_steps=1, drift=drift, noise=np.zeros_like(drift)) \
        == pytest.approx(bound, rel=1e-12)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(mask=masks(max_workers=6, max_blocks=3), data=st.data())
def test_theorem_6_or_6_3_bounds_the_mean_for_held_masks_with_mask_aligned_heterogeneity(mask, data):
    """The smaller of Theorems 6 and 6.3 on held masks, heterogeneity along the mask columns, horizons that end
    inside a period (the bias of its rounds does not cancel) or on a period's end."""
    h = data.draw(st.sampled_from([1, 2]), label="local_steps")
    kind, every = data.draw(st.sampled_from([("cyclic", 1), ("cyclic", 2), ("permute", 2), ("permute", 3)]),
                            label="schedule")
    mask = mask.replace(block_sizes=[2] * mask.blocks, schedule=Schedule(kind, every * h))
    assume(bias_cancels_over_period(mask, local_steps=h))
    problem = make_quadratic([2] * mask.blocks, mask.workers, smoothness=1.0, sigma=data.draw(st.floats(0, 1)),
                             zeta=2.0, suboptimality=1.0, worker_pattern=mask.matrix, seed=11)
    eta = data.draw(st.floats(0.2, 1.0), label="eta * 12 L H") / (12 * h)
    rounds = data.draw(st.integers(2, 3 * consensus_period(mask, local_steps=h) + 1), label="rounds")
    res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, local_steps=h, initial_spread=0.0,
                             seeds=32, seed=12)
    for per_round in (False, True):
        bound = overlap_bound(mask, _constants_seen(problem, res, per_round=per_round), eta=eta, steps=rounds * h,
                              local_steps=h)
        assert res.measured + Z * res.stderr <= bound.total * (1 + 1e-9)


def test_theorem_6_3_applies_only_where_the_bias_cancels_over_a_period():
    mask = Mask([[1, 1], [1, 0], [0, 1]], block_sizes=[2, 2])
    assert not bias_cancels_over_period(mask)  # static
    assert not bias_cancels_over_period(mask.replace(schedule=Schedule("permute", 1)))  # Theorem 2's case
    assert bias_cancels_over_period(mask.replace(schedule=Schedule("permute", 2)))
    assert bias_cancels_over_period(mask.replace(schedule=Schedule("cyclic", 1)))
    unbalanced = Mask.sequence([[[1, 1], [1, 0], [0, 1]], [[1, 1], [0, 1], [1, 0]]], every=1, block_sizes=[2, 2])
    assert not bias_cancels_over_period(unbalanced)
    c = ProblemConstants(1.0, np.zeros(2), np.full(2, 4.0), 1.0, grad_sq=np.ones(2))
    cyclic = mask.replace(schedule=Schedule("cyclic", 1))
    held = overlap_bound(cyclic, c, eta=0.01, steps=30)
    assert held.bias < overlap_bound(cyclic.replace(schedule=Schedule("cyclic", 30)), c, eta=0.01, steps=30).bias


@settings(max_examples=8, deadline=None, derandomize=True)
@given(kind=st.sampled_from([("cyclic", 1), ("cyclic", 2), ("permute", 3)]), c=st.sampled_from([2, 3]),
       rounds=st.sampled_from([7, 20]))
def test_theorem_6_3_bias_charge_covers_the_simulated_bias_cross_term(kind, c, rounds):
    """(1/R) sum_r E[-<a_r, Lambda b_r>] <= extra + sqrt(2 x M_a), M_a = (1/R) sum_r E||a_r||_Lambda^2: the bias part
    of Theorem 6.3's proof with alpha chosen after the expectation, heterogeneity along the mask columns."""
    matrix = np.array([[1 if (k - j) % 6 < c else 0 for j in range(6)] for k in range(6)])
    mask = Mask(matrix, block_sizes=[2] * 6, schedule=Schedule(kind[0], kind[1]))
    problem = make_quadratic([2] * 6, 6, smoothness=1.0, sigma=0.5, zeta=2.0, suboptimality=1.0,
                             worker_pattern=matrix, seed=13)
    eta = 1.0 / 6
    res = simulate_consensus(problem, mask, rounds=rounds, eta=eta, initial_spread=0.0, seeds=32, seed=14)
    constants = _constants_seen(problem, res, per_round=True)
    moment = round_moments(mask, eta=eta, local_steps=1, rounds=rounds, grad_sq=constants.grad_sq,
                           round_grad_sq=constants.round_grad_sq, sigma_sq=constants.sigma_sq)[2]
    x, extra = _held_bias(mask, constants, eta=eta, local_steps=1, moment=moment)
    per_seed = -res.bias_cross.mean(axis=1)
    charged = extra + np.sqrt(2.0 * x * res.weighted_grad_sq.mean())
    assert per_seed.mean() + Z * per_seed.std(ddof=1) / np.sqrt(per_seed.size) <= charged * (1 + 1e-9)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(period=st.integers(1, 3), start=st.sampled_from([0.0, 1e4]), seed=st.integers(0, 2**16))
def test_theorem_4_8_steady_state_shortcut_never_undercuts_the_recursion(period, start, seed):
    """With the same drift and noise every round the period map's fixed point ends the loop early; the values it
    fills in must bound the recursion's from above (and stay close to them)."""
    rng = np.random.default_rng(seed)
    coverage, rounds = np.array([2.0, 3.0, 5.0, 6.0]), 3000
    drift, noise = (np.tile(rng.uniform(0, 1, 4), (rounds, 1)) for _ in range(2))
    fast = permute_deviation(coverage, 6, period, np.full(4, start), drift, noise)
    varied = drift.copy()
    varied[-1] *= 1 + 1e-15  # not every round alike: no shortcut, the recursion runs to the end
    assert deviation_module._steady_state(*(np.ones(4),) * 3, varied, noise, period) is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deviation_module, "_steady_state", lambda *args: None)
        slow = permute_deviation(coverage, 6, period, np.full(4, start), drift, noise)
    assert np.all(fast >= slow * (1 - 1e-12))
    np.testing.assert_allclose(fast, slow, rtol=1e-9)
