"""design(): exact designs where they fit, otherwise search never worse than its baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.analysis import optimality_ratio, process_group_holder_sets, spectral_gap
from masklab.constructions import cyclic, random_balanced
from masklab.design import coverage_from_active, design, exact_designs, group_tradeoff, list_constructions
from masklab.errors import DesignError


@st.composite
def balanced_parameters(draw) -> tuple[int, int, int]:
    k = draw(st.integers(2, 10))
    b = draw(st.integers(1, 12))
    c = draw(st.integers(max(1, -(-k // b)), k))
    return k, b, c


@settings(max_examples=30, deadline=None)
@given(balanced_parameters(), st.integers(0, 2**32 - 1))
def test_design_is_never_worse_than_best_of_cyclic_and_20_random(params, seed) -> None:
    k, b, c = params
    rng = np.random.default_rng(seed)
    baselines = [cyclic(k, b, coverage=c)] + [random_balanced(k, b, coverage=c, seed=rng) for _ in range(20)]
    best = max(spectral_gap(m) for m in baselines)
    m = design(k, b, coverage=c, seed=seed)
    assert np.all(m.coverage == c)
    assert spectral_gap(m) >= best - 1e-12


@settings(max_examples=10, deadline=None)
@given(balanced_parameters(), st.integers(0, 2**32 - 1))
def test_design_is_reproducible_from_its_seed(params, seed) -> None:
    k, b, c = params
    assert design(k, b, coverage=c, seed=seed) == design(k, b, coverage=c, seed=seed)


def test_design_picks_the_projective_plane_for_7_7_3() -> None:
    m = design(7, 7, coverage=3)
    assert m.construction == "projective-plane"
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


def test_design_picks_the_affine_plane_with_points_as_workers_for_9_12_3() -> None:
    m = design(9, 12, coverage=3)
    assert m.construction == "affine-plane"
    assert (m.workers, m.blocks) == (9, 12)
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


def test_design_does_not_use_the_affine_plane_with_lines_as_workers() -> None:
    assert design(12, 9, coverage=4, seed=0).construction == "search"
    with pytest.raises(DesignError, match="no affine-plane design has K=12, B=9, coverage=4"):
        design(12, 9, coverage=4, construction="affine-plane")


def test_every_listed_exact_design_is_returned_by_design_at_the_trace_bound() -> None:
    listed = exact_designs(40)
    assert (13, 13, 4, "projective-plane") in listed and (16, 20, 4, "affine-plane") in listed
    assert (11, 11, 5, "difference-set") in listed
    for k, b, c, name in listed:
        m = design(k, b, coverage=c)
        assert (m.workers, m.blocks, m.construction) == (k, b, name)
        assert np.all(m.coverage == c)
        assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("construction", ["cyclic", "random", "search", "auto"])
def test_named_constructions_report_their_name_and_keep_coverage(construction: str) -> None:
    m = design(10, 10, coverage=4, construction=construction, seed=1)
    expected = "search" if construction == "auto" else construction
    assert m.construction == expected and np.all(m.coverage == 4)


def test_complete_needs_coverage_k() -> None:
    assert design(4, 3, active=1.0, construction="complete").matrix.all()
    assert design(4, 3, coverage=4).construction == "complete"
    with pytest.raises(DesignError, match="all K=4 workers; got coverage=2"):
        design(4, 3, coverage=2, construction="complete")


@pytest.mark.parametrize(
    ("construction", "k", "b", "c", "match"),
    [
        ("projective-plane", 8, 8, 3, r"PG\(2, q\) needs K = B = q\^2 \+ q \+ 1"),
        ("projective-plane", 7, 7, 2, "coverage=2"),
        ("difference-set", 9, 9, 4, "no difference-set design has K=9, B=9, coverage=4"),
    ],
)
def test_forced_exact_construction_that_does_not_fit_raises(construction, k, b, c, match) -> None:
    with pytest.raises(DesignError, match=match):
        design(k, b, coverage=c, construction=construction)


@pytest.mark.parametrize(("k", "active", "c"), [(8, 0.5, 4), (5, 0.5, 3), (8, 0.01, 1), (7, 0.43, 3), (6, 1.0, 6)])
def test_active_fraction_maps_to_rounded_clipped_coverage(k: int, active: float, c: int) -> None:
    assert coverage_from_active(k, active) == c
    assert np.all(design(k, k, active=active, construction="cyclic").coverage == c)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"K": 0, "B": 4, "coverage": 1}, "K=0"),
        ({"K": 4, "B": 0, "coverage": 1}, "B=0"),
        ({"K": 4, "B": 4}, "exactly one of active .* got active=None, coverage=None"),
        ({"K": 4, "B": 4, "active": 0.5, "coverage": 2}, "got active=0.5, coverage=2"),
        ({"K": 4, "B": 4, "active": 0.0}, r"active=0.0 must lie in \(0, 1\]"),
        ({"K": 4, "B": 4, "active": 1.5}, r"active=1.5 must lie in \(0, 1\]"),
        ({"K": 4, "B": 4, "coverage": 5}, r"coverage=5 must lie in \[1, K\] = \[1, 4\]"),
        ({"K": 9, "B": 2, "coverage": 3}, r"B \* coverage = 2 \* 3 = 6"),
        ({"K": 4, "B": 4, "coverage": 2, "construction": "fancy"}, "construction='fancy' is not one of"),
    ],
)
def test_invalid_parameters_raise_design_error_naming_the_value(kwargs, match) -> None:
    k, b = kwargs.pop("K"), kwargs.pop("B")
    with pytest.raises(DesignError, match=match):
        design(k, b, **kwargs)


def test_list_constructions_names_every_accepted_construction() -> None:
    names = list_constructions()
    assert {"auto", "complete", "cyclic", "random", "projective-plane", "affine-plane", "difference-set", "search"} == set(names)


# -- max_groups ----------------------------------------------------------------------------------
def _groups(mask) -> int:
    return len(process_group_holder_sets(mask))


@settings(max_examples=25, deadline=None)
@given(balanced_parameters(), st.integers(0, 12), st.integers(0, 2**32 - 1))
def test_max_groups_results_never_exceed_g_groups(params, g, seed) -> None:
    k, b, c = params
    try:
        m = design(k, b, coverage=c, max_groups=g, seed=seed)
    except DesignError as exc:
        assert g < -(-k // c), str(exc)
        assert f"max_groups={g}" in str(exc)
        return
    assert _groups(m) <= g
    assert np.all(m.coverage == c) and m.row_sums.min() >= 1


@settings(max_examples=15, deadline=None)
@given(balanced_parameters(), st.integers(0, 2**32 - 1))
def test_max_groups_large_enough_returns_the_unconstrained_design(params, seed) -> None:
    k, b, c = params
    free = design(k, b, coverage=c, seed=seed)
    limited = design(k, b, coverage=c, max_groups=_groups(free), seed=seed)
    assert limited == free and limited.construction == free.construction
    assert spectral_gap(limited) == spectral_gap(free)


def test_repeating_an_exact_design_keeps_the_trace_bound_with_as_few_groups_as_its_columns() -> None:
    m = design(9, 36, coverage=3, max_groups=12, seed=0)
    assert m.construction == "affine-plane-repeated" and _groups(m) == 12
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)
    assert _groups(design(9, 36, coverage=3, seed=0)) > 12


def test_group_tradeoff_lists_the_unconstrained_design_first_then_fewer_groups() -> None:
    masks = group_tradeoff(8, 24, coverage=4, max_groups=6, seed=1)
    assert masks[0] == design(8, 24, coverage=4, seed=1)
    assert _groups(masks[0]) > 6 and all(_groups(m) <= 6 for m in masks[1:])
    chosen = design(8, 24, coverage=4, max_groups=6, seed=1)
    assert spectral_gap(chosen) == max(spectral_gap(m) for m in masks[1:])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_groups": 3}, r"max_groups=3: holder sets of coverage=2 workers cover all K=8 workers only with at "
                            r"least ceil\(K / c\) = 4"),
        ({"max_groups": -1}, r"max_groups=-1 must be an integer >= 0"),
        ({"max_groups": 2.5}, r"max_groups=2.5 must be an integer >= 0"),
        ({"max_groups": 4, "construction": "cyclic"}, "max_groups applies to construction='auto', not 'cyclic'"),
    ],
)
def test_bad_max_groups_raise_design_error_naming_the_value(kwargs, match) -> None:
    with pytest.raises(DesignError, match=match):
        design(8, 16, coverage=2, seed=0, **kwargs)
