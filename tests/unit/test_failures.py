"""How many worker losses a mask survives, its fatal sets, and designs that must tolerate F losses."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab import Mask, analyze
from masklab.design import coverage_from_active, design, group_tradeoff
from masklab.errors import DesignError, MaskError
from masklab.failures import (
    count_smallest_fatal_sets,
    failures_survived,
    is_fatal,
    smallest_fatal_sets,
    survivors_mask,
)
from masklab.testing.strategies import mask_sequences, masks

SMALL = dict(max_workers=6, max_blocks=6)


def _uncovered(mask: Mask, lost) -> bool:
    """By brute force: some round has a block all of whose holders are in `lost`."""
    return any(any(set(np.flatnonzero(col)) <= set(lost) for col in m.T) for m in mask.matrices)


@settings(max_examples=40, deadline=None)
@given(st.one_of(masks(**SMALL, schedule=True), mask_sequences(**SMALL)))
def test_survives_min_coverage_minus_one_and_fatal_sets_are_exactly_the_smallest_fatal_losses(mask):
    survived = failures_survived(mask)
    assert survived == int(mask.coverage.min()) - 1
    workers = range(mask.workers)
    for size in range(survived + 1):  # every loss of at most `survived` workers leaves each block a holder
        for lost in itertools.combinations(workers, size):
            assert not _uncovered(mask, lost) and not is_fatal(mask, lost)
    fatal = smallest_fatal_sets(mask)
    assert len(fatal) == count_smallest_fatal_sets(mask) >= 1
    for lost in fatal:  # losing any fatal set leaves a block uncovered
        assert len(lost) == survived + 1 and _uncovered(mask, lost) and is_fatal(mask, lost)
    # and they are all the fatal sets of that size, found by brute force
    brute = tuple(s for s in itertools.combinations(workers, survived + 1) if _uncovered(mask, s))
    assert fatal == brute


@settings(max_examples=40, deadline=None)
@given(masks(**SMALL), st.data())
def test_survivors_mask_drops_the_lost_rows_or_refuses_a_fatal_loss(mask, data):
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), max_size=mask.workers))
    if is_fatal(mask, lost):
        with pytest.raises(MaskError, match="block .* loses every holder|no survivor"):
            survivors_mask(mask, lost)
        return
    survivors = survivors_mask(mask, lost)
    kept = [k for k in range(mask.workers) if k not in lost]
    assert survivors.matrix.tolist() == mask.matrix[kept].tolist()
    assert survivors.block_names == mask.block_names


@st.composite
def tolerate_parameters(draw):
    k = draw(st.integers(1, 9))
    b = draw(st.integers(1, 9))
    f = draw(st.integers(0, k))
    how = draw(st.sampled_from(["alone", "coverage", "active"]))
    return k, b, f, how, draw(st.integers(1, k)), draw(st.floats(0.05, 1.0))


@settings(max_examples=40, deadline=None)
@given(tolerate_parameters())
def test_design_with_tolerate_has_min_coverage_at_least_f_plus_one_or_raises_one_line(params):
    k, b, f, how, c, active = params
    kwargs = {"alone": {}, "coverage": {"coverage": c}, "active": {"active": active}}[how]
    asked = {"alone": f + 1, "coverage": c, "active": coverage_from_active(k, active)}[how]
    try:
        mask = design(k, b, tolerate=f, seed=0, **kwargs)
    except DesignError as err:
        assert "\n" not in str(err)
        assert not (f < k and f + 1 <= asked <= k and b * asked >= k)  # refused only when impossible
        return
    assert int(mask.coverage.min()) >= f + 1
    assert failures_survived(mask) >= f


def test_tolerate_alone_gives_coverage_f_plus_one_and_the_refusals_say_why():
    assert design(8, 8, tolerate=2, seed=0).coverage.tolist() == [3] * 8
    assert all(m.coverage.min() >= 3 for m in group_tradeoff(8, 8, tolerate=2, max_groups=4, seed=0))
    with pytest.raises(DesignError, match=r"tolerate=2 needs every block on at least 3 workers, but active=0.25 "
                                          r"gives coverage 2 of K=8: ask for coverage >= 3 \(active >= 0.375\)"):
        design(8, 8, active=0.25, tolerate=2)
    with pytest.raises(DesignError, match="tolerate=4 is impossible with K=4 workers"):
        design(4, 4, tolerate=4)
    with pytest.raises(DesignError, match="must be an integer >= 0"):
        design(4, 4, coverage=2, tolerate=-1)


def test_the_certificate_reports_survived_losses_and_a_bounded_list_of_fatal_sets():
    report = analyze(design(16, 16, coverage=2, seed=0)).to_dict()
    assert report["failures_survived"] == 1
    assert report["fatal_sets_total"] == 16 and len(report["fatal_sets"]) == 10
    assert all(len(s) == 2 for s in report["fatal_sets"])
    text = analyze(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])).to_text()
    assert "{0,1} {0,2} {1,2} (3 sets of 2 workers)" in text
