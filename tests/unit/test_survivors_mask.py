"""The survivors' mask that restores the designed coverage after a loss (`masklab.survivors`), against
brute force: every block on min(c, K - |D|) survivors, every survivor within its memory budget, and no
other matching of the design's rows to the survivors (that fits their budgets) moves fewer block bytes.
The run that moves the blocks: tests/distributed/test_worker_loss.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from masklab import Mask, Schedule
from masklab.errors import DesignError, MaskError
from masklab.failures import is_fatal, survivors_mask
from masklab.survivors import matched_rows, restored_mask
from masklab.testing.strategies import masks


@settings(max_examples=40, deadline=None)
@given(mask=masks(workers=st.integers(2, 6), max_blocks=8), data=st.data())
def test_a_restored_mask_holds_every_block_on_the_designed_coverage_of_survivors(mask, data):
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers - 1))
    if is_fatal(mask, lost):
        with pytest.raises(MaskError, match="loses every holder"):
            restored_mask(mask, lost, seed=0)
        return
    new = restored_mask(mask, lost, seed=0)
    kept = survivors_mask(mask, lost)
    target = min(int(mask.coverage.min()), kept.workers)
    assert new.workers == mask.workers - len(lost) and new.blocks == mask.blocks
    assert new.block_names == mask.block_names
    if int(kept.coverage.min()) >= target:  # nothing fell below: the survivors' rows as they are
        assert new.matrix.tolist() == kept.matrix.tolist()
    else:  # the designed coverage, or more where fewer holder slots than survivors would leave one without a block
        assert new.coverage.tolist() == [max(target, -(-kept.workers // mask.blocks))] * mask.blocks
        assert new.matrix.any(axis=1).all()


@settings(max_examples=30, deadline=None)
@given(old=st.integers(2, 5).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=k, max_size=k),
    st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=k, max_size=k),
    st.lists(st.integers(1, 9), min_size=5, max_size=5))))
def test_the_matched_rows_move_the_fewest_block_bytes_of_any_matching(old):
    old_rows, new_rows, sizes = (np.array(x) for x in old)

    def moved(order) -> int:  # bytes of the blocks worker k holds in row order[k] and did not hold
        return int((((new_rows[list(order)] == 1) & (old_rows == 0)) * sizes).sum())

    best = min(moved(p) for p in itertools.permutations(range(len(old_rows))))
    assert moved(matched_rows(old_rows, new_rows, sizes)) == best


def test_n_sdp_keeps_a_neuron_group_of_every_block_on_every_survivor():
    from masklab import neuron_design

    mask = neuron_design(4, 3, 4, coverage=2, seed=1)
    new = restored_mask(mask, [2], coverage=2, groups=4, seed=1)
    assert new.coverage.tolist() == [2] * 12
    assert new.matrix.reshape(3, 3, 4).any(axis=2).all()


def test_a_schedule_is_refused_naming_the_round_to_pass():
    mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]], schedule=Schedule("permute"))
    with pytest.raises(MaskError, match="round_matrix"):
        restored_mask(mask, [0])


@settings(max_examples=30, deadline=None)
@given(old=st.integers(2, 5).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=k, max_size=k),
    st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=k, max_size=k),
    st.lists(st.integers(1, 9), min_size=5, max_size=5),
    st.lists(st.lists(st.booleans(), min_size=k, max_size=k), min_size=k, max_size=k))))
def test_the_matched_rows_are_the_best_matching_that_fits_or_none_fits(old):
    old_rows, new_rows, sizes, fits = (np.array(x) for x in old)

    def moved(order) -> int:
        return int((((new_rows[list(order)] == 1) & (old_rows == 0)) * sizes).sum())

    allowed = [p for p in itertools.permutations(range(len(old_rows))) if all(fits[k, r] for k, r in enumerate(p))]
    if not allowed:
        with pytest.raises(DesignError, match="budget"):
            matched_rows(old_rows, new_rows, sizes, fits=fits)
        return
    order = matched_rows(old_rows, new_rows, sizes, fits=fits)
    assert all(fits[k, r] for k, r in enumerate(order))
    assert moved(order) == min(moved(p) for p in allowed)


def _survivable_loss(mask: Mask, data) -> set[int]:
    """A set of lost rows that leaves every block a holder and at least two survivors."""
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers - 2))
    assume(not is_fatal(mask, lost))
    return lost


@settings(max_examples=40, deadline=None)
@given(mask=masks(workers=st.integers(3, 6), max_blocks=7), data=st.data())
def test_survivors_with_budgets_get_the_coverage_within_their_budgets_or_one_error(mask, data):
    lost = _survivable_loss(mask, data)
    sizes = data.draw(st.lists(st.integers(1, 50), min_size=mask.blocks, max_size=mask.blocks))
    fixed = data.draw(st.integers(0, 20))
    budgets = data.draw(st.lists(st.integers(1, fixed + sum(sizes)), min_size=mask.workers, max_size=mask.workers))
    kept = survivors_mask(mask, lost)
    target = min(int(mask.coverage.min()), kept.workers)
    try:
        new = restored_mask(mask, lost, sizes=sizes, budgets=budgets, fixed_bytes=fixed, seed=0)
    except DesignError as exc:  # one line naming a worker over its budget
        assert "budget" in str(exc) and "\n" not in str(exc)
        return
    if int(kept.coverage.min()) >= target:
        assert new.matrix.tolist() == kept.matrix.tolist()
        return
    survivors = [k for k in range(mask.workers) if k not in lost]
    assert (new.coverage >= target).all() and new.matrix.any(axis=1).all()
    assert ((new.matrix @ sizes) + fixed <= np.array(budgets)[survivors]).all()


@settings(max_examples=20, deadline=None)
@given(mask=masks(workers=st.integers(3, 6), max_blocks=7), data=st.data())
def test_equal_block_sizes_restore_as_block_counts_do(mask, data):
    lost = _survivable_loss(mask, data)
    size = data.draw(st.integers(1, 9))
    same = restored_mask(mask, lost, sizes=[size] * mask.blocks, seed=0)
    assert same.matrix.tolist() == restored_mask(mask, lost, seed=0).matrix.tolist()


def test_budgets_are_refused_for_neuron_groups_fixed_bytes_need_budgets_and_sizes_must_fit_the_mask():
    from masklab import neuron_design

    mask = neuron_design(4, 3, 4, coverage=2, seed=1)
    with pytest.raises(DesignError, match="neuron"):
        restored_mask(mask, [2], groups=4, budgets=[10**6] * 4)
    with pytest.raises(DesignError, match="sizes has 2 entries but the mask has 12 blocks"):
        restored_mask(mask, [2], sizes=[1, 2])
    with pytest.raises(DesignError, match="budgets has 2 entries but there are K=3 workers"):
        restored_mask(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), [0], budgets=[9, 9])
    with pytest.raises(DesignError, match="fixed_bytes=5 counts against budgets, and budgets is None"):
        restored_mask(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), [0], fixed_bytes=5)


@pytest.mark.parametrize("groups", [None, 1])
def test_a_restore_with_fewer_holder_slots_than_survivors_raises_the_coverage_so_each_holds_a_part(groups):
    # block 0 on workers 0 and 1, block 1 on the other four; after losing worker 0 the designed
    # coverage 2 gives 2 blocks x 2 = 4 holder slots for 5 survivors (hypothesis found it): the
    # restore raises the coverage to ceil(5 / 2) = 3 rather than refuse the survivors a mask
    mask = Mask([[1, 0], [1, 0], [0, 1], [0, 1], [0, 1], [0, 1]])
    new = restored_mask(mask, [0], groups=groups, seed=0)
    assert new.workers == 5 and new.matrix.any(axis=1).all() and (new.coverage >= 3).all()
    assert new.matrix.tolist() == restored_mask(mask, [0], groups=groups, sizes=[4, 4], seed=0).matrix.tolist()
