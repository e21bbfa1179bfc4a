"""design_for_costs: coverage and budgets always hold, never worse than the plain greedy, errors name
the worker; the sizes and byte counts of masklab.costs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.analysis import optimality_ratio, process_group_holder_sets
from masklab.balance import design_for_costs
from masklab.costs import BlockCosts, bytes_lower_bound, parse_budgets, parse_bytes, worker_bytes
from masklab.errors import DesignError
from masklab.mask import Mask, Schedule

FAST = {"starts": 1, "iterations": 300}


@st.composite
def problems(draw, *, equal_fixed: bool = False):
    """(costs, K, min_coverage, fixed bytes per worker), small enough for many examples."""
    k = draw(st.integers(1, 6))
    costs = draw(st.lists(st.integers(1, 60), min_size=1, max_size=9))
    r = draw(st.integers(1, k))
    fixed = [draw(st.integers(0, 40))] * k if equal_fixed else draw(st.lists(st.integers(0, 40), min_size=k, max_size=k))
    return costs, k, r, fixed


def plain_greedy(costs, k, r, fixed, budgets=None) -> np.ndarray:
    """Reference LPT with copies: heaviest block first (lowest index on ties), each to the r workers
    least over budget after taking it, then with the fewest bytes, then the lowest index."""
    total = list(fixed)
    held = np.zeros((k, len(costs)), dtype=bool)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):
        over = [0 if budgets is None else max(0, total[q] + costs[j] - budgets[q]) for q in range(k)]
        for q in sorted(range(k), key=lambda q: (over[q], total[q], q))[:r]:
            held[q, j] = True
            total[q] += costs[j]
    return held


@settings(max_examples=40, deadline=None)
@given(problems(), st.lists(st.integers(1, 400), min_size=6, max_size=6), st.integers(0, 2**32 - 1))
def test_budgets_and_coverage_always_hold_when_a_mask_is_returned(problem, budget_pool, seed) -> None:
    costs, k, r, fixed = problem
    budgets = [f + b for f, b in zip(fixed, budget_pool)]
    try:
        m = design_for_costs(costs, k, min_coverage=r, budgets=budgets, fixed_bytes=fixed, seed=seed, **FAST)
    except DesignError as exc:
        worker = int(re.match(r"worker (\d+) ", str(exc)).group(1))
        assert f"its budget is {budgets[worker]}" in str(exc)
        return
    assert m.coverage.min() >= r and m.row_sums.min() >= 1
    if len(costs) * r >= k:
        assert np.all(m.coverage == r)
    assert all(b <= cap for b, cap in zip(worker_bytes(m, costs, fixed_bytes=fixed), budgets))


@settings(max_examples=40, deadline=None)
@given(problems(equal_fixed=True), st.integers(0, 2**32 - 1))
def test_largest_worker_never_holds_more_than_under_the_plain_greedy(problem, seed) -> None:
    costs, k, r, fixed = problem
    if len(costs) * r < k:  # the plain greedy would leave a worker empty
        return
    greedy = plain_greedy(costs, k, r, fixed)
    m = design_for_costs(costs, k, min_coverage=r, fixed_bytes=fixed, seed=seed, **FAST)
    largest = max(worker_bytes(m, costs, fixed_bytes=fixed))
    assert largest <= max(worker_bytes(Mask(greedy), costs, fixed_bytes=fixed))
    assert largest >= bytes_lower_bound(costs, k, min_coverage=r, fixed_bytes=fixed)


@settings(max_examples=40, deadline=None)
@given(problems(), st.lists(st.integers(0, 200), min_size=6, max_size=6), st.integers(0, 2**32 - 1))
def test_budgets_the_plain_greedy_meets_never_raise(problem, slack, seed) -> None:
    costs, k, r, fixed = problem
    greedy = plain_greedy(costs, k, r, fixed)
    if not greedy.any(axis=1).all():
        return
    budgets = [b + s for b, s in zip(worker_bytes(Mask(greedy), costs, fixed_bytes=fixed), slack)]
    m = design_for_costs(costs, k, min_coverage=r, budgets=budgets, fixed_bytes=fixed, seed=seed, **FAST)
    assert all(b <= cap for b, cap in zip(worker_bytes(m, costs, fixed_bytes=fixed), budgets))


def test_a_budget_below_fixed_bytes_plus_the_lightest_block_names_the_worker() -> None:
    with pytest.raises(DesignError, match=r"^worker 2 holds at least 13 bytes \(10 fixed \+ 3 .*budget is 12"):
        design_for_costs([5, 3, 4], 3, budgets=[100, 100, 12], fixed_bytes=10, seed=0)


def test_budgets_too_small_in_total_raise_naming_the_worker_and_no_mask_fits() -> None:
    with pytest.raises(DesignError, match=r"^worker \d would hold \d+ bytes .* but its budget is 7; no mask fits: "
                                          r"coverage 2 needs 24 bytes of blocks but the budgets leave room for 21"):
        design_for_costs([3, 3, 3, 3], 3, budgets=[7, 7, 7], seed=0)


def test_a_block_too_heavy_for_enough_workers_raises() -> None:
    with pytest.raises(DesignError, match=r"no mask fits: block 0 \(50 bytes\) needs 2 holders but only 1 workers"):
        design_for_costs([50, 1, 1], 3, budgets=[60, 40, 40], seed=0)


@pytest.mark.parametrize(("k", "b", "c"), [(4, 6, 2), (7, 7, 3), (9, 12, 3)])
def test_equal_block_bytes_keep_the_exact_design_at_the_trace_bound(k, b, c) -> None:
    m = design_for_costs([7] * b, k, min_coverage=c, fixed_bytes=100, seed=0, **FAST)
    assert max(worker_bytes(m, [7] * b, fixed_bytes=100)) == bytes_lower_bound([7] * b, k, min_coverage=c,
                                                                                fixed_bytes=100)
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)


def test_stages_of_doubling_width_balance_bytes_exactly() -> None:
    costs = BlockCosts([1, 1, 2, 2, 4, 4, 8, 8], block_names=[f"layer{s}.{i}" for s in range(1, 5) for i in range(2)],
                       fixed_bytes=5)
    m = design_for_costs(costs, 4, seed=3)
    assert worker_bytes(m, costs) == [20, 20, 20, 20]
    assert m.block_names == costs.block_names and m.construction == "byte-balance"


def test_design_for_costs_is_reproducible_from_its_seed() -> None:
    costs = [3, 9, 2, 7, 7, 1, 5]
    assert design_for_costs(costs, 5, seed=11) == design_for_costs(costs, 5, seed=11)


def test_more_workers_than_copies_give_the_lightest_block_extra_holders() -> None:
    m = design_for_costs([9, 2], 5, seed=0)
    assert m.row_sums.min() == 1 and m.coverage.tolist() == [2, 3]


def test_worker_bytes_of_a_rotating_schedule_is_the_heaviest_row_for_everyone() -> None:
    m = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]], schedule=Schedule("cyclic", 2))
    assert worker_bytes(m, [10, 1, 1]) == [11, 11, 11]
    assert worker_bytes(m.replace(schedule=Schedule()), [10, 1, 1]) == [11, 2, 11]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"costs": [], "K": 2}, "block_bytes is empty"),
        ({"costs": [1, 0], "K": 2}, r"block_bytes\[1\] = 0 must be an integer >= 1"),
        ({"costs": [1, 2.5], "K": 2}, r"block_bytes\[1\] = 2.5"),
        ({"costs": [1, 2], "K": 0}, "K=0"),
        ({"costs": [1, 2], "K": 2, "min_coverage": 3}, r"min_coverage=3 must lie in \[1, K\]"),
        ({"costs": [1, 2], "K": 2, "budgets": [5]}, "budgets has 1 entries but there are K=2 workers"),
        ({"costs": [1, 2], "K": 2, "budgets": [5, 0]}, r"budgets\[1\] = 0 must be an integer >= 1"),
        ({"costs": [1, 2], "K": 2, "fixed_bytes": -1}, "fixed_bytes = -1"),
        ({"costs": [1, 2], "K": 2, "starts": -1}, "starts=-1"),
        ({"costs": [2**62, 1], "K": 2}, "add up to more than"),
    ],
)
def test_invalid_input_raises_design_error_naming_the_value(kwargs, match) -> None:
    costs, k = kwargs.pop("costs"), kwargs.pop("K")
    with pytest.raises(DesignError, match=match):
        design_for_costs(costs, k, **kwargs)


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GB", 80 * 10**9), ("24GiB", 24 * 2**30), ("24gib", 24 * 2**30), ("1.5 MiB", 1572864), ("4096", 4096),
     ("1kb", 1000), (" 7B ", 7), ("0.5KiB", 512), (12, 12)],
)
def test_parse_bytes_reads_plain_bytes_and_unit_suffixes(text, value) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "0", "0.1", "1e9", "８０GB", "80 GBs", "80  GB", "1,5GB", "inf",
                                  "nan", "9" * 40, "5PB", True, 2**63, 1.5])
def test_parse_bytes_rejects_anything_but_ascii_digits_with_a_known_unit(text) -> None:
    with pytest.raises(DesignError, match="size"):
        parse_bytes(text)


def test_parse_budgets_names_the_worker_of_a_bad_size() -> None:
    assert parse_budgets("80GB,80GB,24GB,24GB") == [80 * 10**9] * 2 + [24 * 10**9] * 2
    with pytest.raises(DesignError, match="budget of worker 2: size '24XB'"):
        parse_budgets("80GB,80GB,24XB")
    with pytest.raises(DesignError, match="budget of worker 1: size ''"):
        parse_budgets("80GB,")


@settings(max_examples=25, deadline=None)
@given(problems(equal_fixed=True), st.integers(0, 8), st.integers(0, 2**32 - 1))
def test_max_groups_byte_balanced_masks_never_exceed_g_groups(problem, g, seed) -> None:
    costs, k, r, fixed = problem
    try:
        m = design_for_costs(costs, k, min_coverage=r, fixed_bytes=fixed, max_groups=g, seed=seed, **FAST)
    except DesignError as exc:
        assert len(costs) * r < k or f"max_groups={g}" in str(exc), str(exc)
        return
    assert len(process_group_holder_sets(m)) <= g
    assert np.all(m.coverage == r) and m.row_sums.min() >= 1


def test_max_groups_byte_balance_keeps_the_repeated_design_gap() -> None:
    costs = [3] * 12 + [5] * 12 + [9] * 12  # three stages of 12 blocks on 9 workers
    m = design_for_costs(costs, 9, min_coverage=3, max_groups=12, seed=0, **FAST)
    assert len(process_group_holder_sets(m)) <= 12
    assert optimality_ratio(m) == pytest.approx(1.0, abs=1e-9)  # the affine plane's 12 lines, each 3 times
    assert max(worker_bytes(m, costs)) == bytes_lower_bound(costs, 9, min_coverage=3)
