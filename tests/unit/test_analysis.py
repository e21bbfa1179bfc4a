"""Invariants of masklab.analysis (docs/design.md §3), checked against independent computations."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab import analysis
from masklab.mask import Mask, Schedule
from masklab.testing import balanced_masks, masks

SETTINGS = settings(max_examples=60, deadline=None)


def _dense_static_weights(m: np.ndarray) -> np.ndarray:
    """a_kl straight from the definition, with Python loops (independent of the vectorised code)."""
    k, b = m.shape
    c = m.sum(axis=0)
    a = np.zeros((k, k))
    for i in range(k):
        for l in range(k):
            if i != l:
                a[i, l] = sum(m[i, j] * m[l, j] / c[j] for j in range(b)) / b
    return a


def _schedule_rounds(mask: Mask) -> list[np.ndarray]:
    """Every equally likely concrete matrix of one schedule round."""
    m = mask.matrix
    if mask.schedule.kind == "cyclic":
        return [np.roll(m, -r, axis=0) for r in range(mask.workers)]
    if mask.schedule.kind == "permute":
        return [m[list(p)] for p in itertools.permutations(range(mask.workers))]
    return [m]


def _lambda2(a: np.ndarray) -> float:
    lap = np.diag(a.sum(axis=1)) - a
    return float(np.sort(np.linalg.eigvalsh(lap))[1])


@given(masks(schedule=True))
@SETTINGS
def test_averaging_operator_is_symmetric_and_doubly_stochastic(mask):
    w = analysis.averaging_operator(mask).toarray()
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert w.min() >= -1e-15


@given(masks(max_workers=6, schedule=True))
@SETTINGS
def test_mixing_graph_is_the_exact_expectation_over_the_schedule(mask):
    rounds = _schedule_rounds(mask)
    expected = sum(_dense_static_weights(r) for r in rounds) / len(rounds)
    np.testing.assert_allclose(analysis.mixing_graph(mask).toarray(), expected, atol=1e-14)
    if mask.workers > 1:
        assert analysis.spectral_gap(mask) == pytest.approx(_lambda2(expected), rel=1e-9, abs=1e-12)


@given(masks(schedule=True))
@SETTINGS
def test_gap_lies_between_zero_and_the_trace_bound_and_bound_is_at_most_one(mask):
    gap, bound = analysis.spectral_gap(mask), analysis.spectral_gap_bound(mask)
    assert 0.0 <= gap <= bound * (1 + 1e-9) + 1e-12
    assert bound <= 1.0


@given(masks(schedule=True))
@SETTINGS
def test_trace_of_laplacian_is_mean_coverage_minus_one(mask):
    trace = analysis.mixing_laplacian(mask).diagonal().sum()
    assert trace == pytest.approx(np.mean(mask.coverage - 1.0), abs=1e-12)


@given(masks(schedule=True))
@SETTINGS
def test_gap_is_positive_iff_networkx_says_the_mixing_graph_is_connected(mask):
    connected = nx.is_connected(analysis.to_networkx(mask))
    assert (analysis.spectral_gap(mask) > 0) == connected == analysis.is_connected(mask)


@given(masks(max_workers=12, max_blocks=12))
@SETTINGS
def test_sparse_and_dense_eigensolvers_agree_to_1e8_relative(mask):
    dense = analysis.spectral_gap(mask, method="dense")
    sparse = analysis.spectral_gap(mask, method="sparse") if mask.workers > 2 else dense
    assert sparse == pytest.approx(dense, rel=1e-8, abs=1e-14)
    if mask.workers > 1 and dense > 0:
        assert dense == pytest.approx(_lambda2(_dense_static_weights(mask.matrix)), rel=1e-8)


def test_sparse_solver_matches_dense_on_a_large_sparse_graph():
    # A 1500-worker ring of windows: sparse, K above the dense threshold, small gap (hard case).
    k = 1500
    m = np.zeros((k, k), dtype=np.uint8)
    for j in range(k):
        m[[j, (j + 1) % k, (j + 7) % k], j] = 1
    mask = Mask(m)
    dense = analysis.spectral_gap(mask, method="dense")
    assert analysis.spectral_gap(mask) == pytest.approx(dense, rel=1e-8)


@given(masks(schedule=True), st.data())
@SETTINGS
def test_gap_is_invariant_under_permuting_workers_or_blocks(mask, data):
    # A cyclic schedule fixes the order of workers up to rotation; the others are unordered.
    if mask.schedule.kind == "cyclic":
        shift = data.draw(st.integers(0, mask.workers - 1))
        rows = [(k + shift) % mask.workers for k in range(mask.workers)]
    else:
        rows = data.draw(st.permutations(range(mask.workers)))
    cols = data.draw(st.permutations(range(mask.blocks)))
    permuted = mask.replace(matrix=mask.matrix[list(rows)][:, list(cols)])
    assert analysis.spectral_gap(permuted) == pytest.approx(analysis.spectral_gap(mask), rel=1e-9, abs=1e-13)
    assert analysis.cotraining_gap(permuted) == pytest.approx(analysis.cotraining_gap(mask), rel=1e-8, abs=1e-12)


@given(balanced_masks())
@SETTINGS
def test_static_masking_error_squared_is_k_over_c_minus_one_for_balanced_masks(mask):
    c = mask.coverage[0]
    assert analysis.masking_error(mask) ** 2 == pytest.approx(mask.workers / c - 1, abs=1e-12)
    assert analysis.variance_inflation(mask) == pytest.approx(mask.workers / c)


@given(masks())
@SETTINGS
def test_masking_error_is_the_distance_of_holder_weights_from_uniform(mask):
    k = mask.workers
    w = mask.matrix / mask.coverage
    expected = np.sqrt(k) * np.linalg.norm(w - 1.0 / k, axis=0)
    np.testing.assert_allclose(analysis.block_masking_errors(mask), expected, atol=1e-12)


@given(masks(max_workers=6))
@SETTINGS
def test_masking_error_is_zero_only_for_a_mask_redrawn_every_update(mask):
    redrawn = mask.replace(schedule=Schedule("permute", 1))
    rounds = _schedule_rounds(redrawn)
    mean_w = sum(r / mask.coverage for r in rounds) / len(rounds)
    np.testing.assert_allclose(mean_w, 1.0 / mask.workers, atol=1e-12)
    assert analysis.masking_error(redrawn) == 0.0
    var = sum(np.sum((r / mask.coverage - mean_w) ** 2, axis=0) for r in rounds) / len(rounds)
    np.testing.assert_allclose(analysis.block_weight_variance(redrawn), var, atol=1e-12)


@given(masks(max_workers=6), st.sampled_from([("permute", 2), ("permute", 5), ("cyclic", 1), ("cyclic", 3)]))
@SETTINGS
def test_held_schedules_have_the_masking_error_of_the_mask_in_force(mask, schedule):
    """A cyclic rotation or a mask held R > 1 steps is correlated with the iterate: the theory bounds
    it through the realised mask (docs/theory.md, Theorem 1), so its eps is the static one, not 0."""
    held = mask.replace(schedule=Schedule(*schedule))
    np.testing.assert_allclose(analysis.block_masking_errors(held), analysis.block_masking_errors(mask), atol=0)
    assert analysis.masking_error(held) == analysis.masking_error(mask)
    np.testing.assert_array_equal(analysis.block_weight_variance(held), np.zeros(mask.blocks))


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_ddp_has_zero_masking_error_unit_variance_inflation_and_gap_one(k):
    mask = Mask(np.ones((k, 7)))
    assert analysis.masking_error(mask) == 0.0
    assert analysis.variance_inflation(mask) == 1.0
    assert analysis.spectral_gap(mask) == pytest.approx(1.0, rel=1e-12)
    assert analysis.optimality_ratio(mask) == pytest.approx(1.0, rel=1e-12)


def test_permute_schedule_attains_the_trace_bound():
    mask = Mask(np.eye(6, dtype=int) + np.roll(np.eye(6, dtype=int), 1, axis=1), schedule=Schedule("permute"))
    assert analysis.optimality_ratio(mask) == pytest.approx(1.0, rel=1e-12)


def test_disconnected_mask_has_gap_exactly_zero():
    mask = Mask([[1, 0], [1, 0], [0, 1], [0, 1]])
    assert analysis.spectral_gap(mask) == 0.0
    assert analysis.spectral_gap(mask, method="dense") == 0.0
    assert not analysis.is_connected(mask)


@given(masks())
@SETTINGS
def test_cotraining_gap_is_networkx_normalized_laplacian_lambda2(mask):
    g = nx.from_scipy_sparse_array(analysis.cotraining_graph(mask))
    if mask.blocks == 1:
        assert analysis.cotraining_gap(mask) == 1.0
        return
    if not nx.is_connected(g):
        assert analysis.cotraining_gap(mask) == 0.0
        return
    expected = np.sort(nx.normalized_laplacian_spectrum(g))[1]
    assert analysis.cotraining_gap(mask) == pytest.approx(expected, rel=1e-8, abs=1e-12)


def test_cotraining_gap_of_a_large_mask_matches_the_dense_computation():
    rng = np.random.default_rng(5)
    m = (rng.random((40, 1100)) < 0.3).astype(np.uint8)
    m[0] = 1
    mask = Mask(m)
    b = m.T.astype(float) @ m
    np.fill_diagonal(b, 0.0)
    d = 1.0 / np.sqrt(b.sum(axis=1))
    expected = np.sort(np.linalg.eigvalsh(np.eye(b.shape[0]) - d[:, None] * b * d[None, :]))[1]
    assert mask.blocks > analysis.DENSE_EIGEN_MAX  # exercises the matrix-free path
    assert analysis.cotraining_gap(mask) == pytest.approx(expected, rel=1e-8)


def test_to_networkx_carries_the_pair_weights():
    mask = Mask([[1, 1, 0], [1, 0, 1], [0, 1, 1]])
    g = analysis.to_networkx(mask)
    assert sorted(g.edges) == [(0, 1), (0, 2), (1, 2)]
    assert g[0][1]["weight"] == pytest.approx(1 / 6)


def test_invalid_eigensolver_method_is_rejected():
    with pytest.raises(ValueError, match="method 'lanczos' is not one of"):
        analysis.spectral_gap(Mask([[1]]), method="lanczos")
