"""The survivors' mask that restores the designed coverage after a loss (`masklab.survivors`), against
brute force: every block on min(c, K - |D|) survivors, and no other matching of the design's rows to
the survivors moves fewer block bytes. The run that moves the blocks: tests/distributed/test_worker_loss.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab import Mask, Schedule
from masklab.errors import MaskError
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
    else:
        assert new.coverage.tolist() == [target] * mask.blocks


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
