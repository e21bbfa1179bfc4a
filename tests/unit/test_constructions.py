"""Constructions: balance invariants, exact designs reaching the trace bound, difference sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from masklab.analysis import optimality_ratio
from masklab.constructions import (
    affine_plane,
    complete,
    cyclic,
    difference_set_design,
    difference_set_lambda,
    difference_sets,
    paley_difference_set,
    projective_plane,
    random_balanced,
    singer_difference_set,
    twin_prime_difference_set,
)
from masklab.errors import DesignError
from masklab.mask import Mask
from masklab.search import overlap_spread, search

PLANE_ORDERS = [2, 3, 4, 5, 7, 8, 9]


@st.composite
def balanced_parameters(draw, max_k: int = 12, max_b: int = 14) -> tuple[int, int, int]:
    k = draw(st.integers(1, max_k))
    b = draw(st.integers(1, max_b))
    c = draw(st.integers(max(1, -(-k // b)), k))  # B * c >= K
    return k, b, c


def _assert_balanced_with_even_rows(mask: Mask, c: int) -> None:
    assert np.all(mask.coverage == c)
    rows = mask.row_sums
    assert rows.max() - rows.min() <= 1 and rows.min() >= 1


@settings(max_examples=60, deadline=None)
@given(balanced_parameters(), st.integers(0, 2**32 - 1))
def test_random_balanced_covers_every_block_exactly_c_times_with_rows_within_one(params, seed) -> None:
    k, b, c = params
    _assert_balanced_with_even_rows(random_balanced(k, b, coverage=c, seed=seed), c)


@settings(max_examples=60, deadline=None)
@given(balanced_parameters())
def test_cyclic_covers_every_block_exactly_c_times_with_rows_within_one(params) -> None:
    k, b, c = params
    _assert_balanced_with_even_rows(cyclic(k, b, coverage=c), c)


@settings(max_examples=20, deadline=None)
@given(balanced_parameters(), st.integers(0, 2**32 - 1))
def test_random_balanced_is_reproducible_from_its_seed(params, seed) -> None:
    k, b, c = params
    assert random_balanced(k, b, coverage=c, seed=seed) == random_balanced(k, b, coverage=c, seed=seed)


def test_random_balanced_differs_between_seeds() -> None:
    masks = {random_balanced(12, 12, coverage=4, seed=s).matrix.tobytes() for s in range(5)}
    assert len(masks) > 1


def test_complete_is_all_ones_with_coverage_k() -> None:
    m = complete(3, 5)
    assert m.matrix.all() and m.coverage.tolist() == [3] * 5 and m.construction == "complete"


@pytest.mark.parametrize("q", PLANE_ORDERS)
def test_projective_plane_puts_every_pair_of_points_on_exactly_one_line(q: int) -> None:
    m = projective_plane(q)
    v = q * q + q + 1
    assert (m.workers, m.blocks) == (v, v)
    assert np.all(m.coverage == q + 1) and np.all(m.row_sums == q + 1)
    shared = m.matrix.astype(int) @ m.matrix.T
    assert np.all(shared[~np.eye(v, dtype=bool)] == 1)
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("q", PLANE_ORDERS)
def test_affine_plane_puts_every_pair_of_points_on_exactly_one_line(q: int) -> None:
    m = affine_plane(q)
    assert (m.workers, m.blocks) == (q * q, q * q + q)
    assert np.all(m.coverage == q) and np.all(m.row_sums == q + 1)
    shared = m.matrix.astype(int) @ m.matrix.T
    assert np.all(shared[~np.eye(q * q, dtype=bool)] == 1)
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("q", [2, 3, 4])
def test_affine_plane_with_lines_as_workers_is_not_pair_balanced(q: int) -> None:
    assert optimality_ratio(affine_plane(q).transpose()) < 1 - 1e-3


@pytest.mark.parametrize("q", [6, 10, 12])
def test_planes_of_non_prime_power_order_raise_naming_q(q: int) -> None:
    for build in (projective_plane, affine_plane):
        with pytest.raises(DesignError, match=f"q={q}"):
            build(q)


def _brute_force_lambda(elements: tuple[int, ...], v: int) -> set[int]:
    counts = dict.fromkeys(range(1, v), 0)
    for a, b in itertools.permutations(elements, 2):
        counts[(a - b) % v] += 1
    return set(counts.values())


def test_every_listed_difference_set_has_the_difference_property() -> None:
    sets = difference_sets(200)
    for d in sets:
        assert _brute_force_lambda(d.elements, d.v) == {d.lam}
        assert len(d.elements) == d.k and d.k * (d.k - 1) == d.lam * (d.v - 1)
    params = {(d.v, d.k, d.lam) for d in sets}
    assert {(7, 3, 1), (13, 4, 1), (11, 5, 2), (21, 5, 1), (15, 7, 3), (31, 6, 1), (35, 17, 8)} <= params


@pytest.mark.parametrize(
    ("d", "params"),
    [
        (singer_difference_set(3), (13, 4, 1)),
        (singer_difference_set(2, 3), (15, 7, 3)),
        (singer_difference_set(4), (21, 5, 1)),
        (paley_difference_set(11), (11, 5, 2)),
        (twin_prime_difference_set(5), (35, 17, 8)),
    ],
)
def test_difference_set_families_have_their_closed_form_parameters(d, params) -> None:
    assert (d.v, d.k, d.lam) == params


@pytest.mark.parametrize("d", difference_sets(40), ids=lambda d: f"{d.v}-{d.k}")
def test_difference_set_designs_reach_the_trace_bound(d) -> None:
    m = difference_set_design(d.elements, d.v)
    assert np.all(m.coverage == d.k)
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


def test_non_difference_set_is_rejected_with_the_unbalanced_residues() -> None:
    with pytest.raises(DesignError, match=r"residue 3 arises 0 times"):
        difference_set_lambda((0, 1, 2), 7)
    with pytest.raises(DesignError, match="distinct residues mod v=7"):
        difference_set_design((0, 0, 3), 7)


@pytest.mark.parametrize("bad", [lambda: paley_difference_set(13), lambda: twin_prime_difference_set(7),
                                 lambda: singer_difference_set(2, 1)])
def test_difference_set_families_reject_parameters_outside_them(bad) -> None:
    with pytest.raises(DesignError):
        bad()


@pytest.mark.parametrize(
    ("k", "b", "c", "match"),
    [
        (0, 3, 1, "K=0"),
        (3, 0, 1, "B=0"),
        (4, 3, 5, r"coverage=5 must lie in \[1, K\] = \[1, 4\]"),
        (4, 3, 0, "coverage=0"),
        (10, 3, 2, r"B \* coverage = 3 \* 2 = 6 .* K=10"),
        (4, 3, 1.5, "coverage=1.5"),
        (4.0, 3, 1, "K=4.0"),
    ],
)
def test_invalid_balanced_parameters_raise_design_error_naming_them(k, b, c, match) -> None:
    for build in (
        lambda: cyclic(k, b, coverage=c),
        lambda: random_balanced(k, b, coverage=c, seed=0),
        lambda: search(k, b, coverage=c, seed=0),
    ):
        with pytest.raises(DesignError, match=match):
            build()


@settings(max_examples=25, deadline=None)
@given(balanced_parameters(max_k=9, max_b=10), st.integers(0, 2**16))
@example(params=(9, 7, 7), seed=7)  # equal spreads summed in two float orders once compared 16.75 > 16.749...
def test_search_keeps_coverage_and_row_sums_and_never_spreads_overlaps_more(params, seed) -> None:
    k, b, c = params
    start = random_balanced(k, b, coverage=c, seed=seed)
    result = search(k, b, coverage=c, seed=seed, initial=start, iterations=500)
    assert np.all(result.coverage == c)
    assert np.array_equal(np.sort(result.row_sums), np.sort(start.row_sums))
    assert result.construction == "search"
    assert overlap_spread(result) <= overlap_spread(start) or result.matrix.tobytes() == start.matrix.tobytes()


def test_search_rejects_an_initial_mask_of_other_shape_or_coverage() -> None:
    with pytest.raises(DesignError, match=r"shape \(4, 4\), expected \(K, B\) = \(5, 4\)"):
        search(5, 4, coverage=2, initial=cyclic(4, 4, coverage=2))
    with pytest.raises(DesignError, match="block 0 has coverage 2, expected coverage=3"):
        search(4, 4, coverage=3, initial=cyclic(4, 4, coverage=2))
    with pytest.raises(DesignError, match="iterations=-1"):
        search(4, 4, coverage=2, iterations=-1)
