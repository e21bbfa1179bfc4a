"""The Mask type: validation names the offending row/column; immutability; schedules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from masklab.errors import MaskError
from masklab.mask import Mask, Schedule
from masklab.testing import masks


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[1, 2], [1, 1]], "row 0 (worker 0), column 1 is 2"),
        ([[1, 0.5]], "row 0 (worker 0), column 1 is 0.5"),
        ([[1, -1]], "column 1 is -1"),
        ([[1, 0], [1, 0]], "block 1 (column 1, 'block1') is held by no worker"),
        ([[1, 1], [0, 0]], "worker 1 (row 1) holds no block"),
        ([1, 1], "must be 2-D"),
        ([[[1]]], "must be 2-D"),
        (np.zeros((0, 3)), "at least one worker"),
        (np.zeros((3, 0)), "at least one block"),
        ([[1, 1], [1]], "not a rectangular array"),
        ([["a", "b"]], "entries must be 0 or 1"),
        ([[1, float("nan")]], "column 1 is nan"),
    ],
)
def test_every_kind_of_invalid_mask_is_rejected_naming_the_place(matrix, message):
    with pytest.raises(MaskError) as err:
        Mask(matrix)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_names": ["a"]}, "block_names has 1 names but the mask has 2 blocks"),
        ({"block_names": ["a", "a"]}, "used by columns 0 and 1"),
        ({"block_names": ["a", ""]}, "column 1 must be a non-empty string"),
        ({"block_names": "ab"}, "not one string"),
        ({"block_sizes": [1, 0]}, "block size for column 1 must be an integer >= 1"),
        ({"block_sizes": [1, 2, 3]}, "block_sizes has 3 entries"),
        ({"schedule": "cyclic"}, "must be a masklab.Schedule"),
    ],
)
def test_invalid_names_sizes_and_schedules_are_rejected(kwargs, message):
    with pytest.raises(MaskError) as err:
        Mask([[1, 1]], **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize(("kind", "every", "message"), [("weekly", 1, "not one of"), ("cyclic", 0, ">= 1"),
                                                        ("permute", 1.5, "integer")])
def test_invalid_schedule_is_rejected(kind, every, message):
    with pytest.raises(MaskError, match=message):
        Schedule(kind, every)


def test_mask_is_immutable_and_independent_of_its_input():
    source = np.ones((2, 2), dtype=np.uint8)
    m = Mask(source)
    source[0, 0] = 0
    assert m.matrix[0, 0] == 1
    with pytest.raises(ValueError):
        m.matrix[0, 0] = 0
    with pytest.raises(AttributeError):
        m.foo = 1  # type: ignore[attr-defined]


def test_holder_sets_and_held_blocks_are_transposes():
    m = Mask([[1, 1, 0], [0, 1, 1]])
    assert [m.holder_set(j) for j in range(3)] == [(0,), (0, 1), (1,)]
    assert [m.held_blocks(k) for k in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(MaskError, match="block index 3 is out of range"):
        m.holder_set(3)
    with pytest.raises(MaskError, match="worker index -1 is out of range"):
        m.held_blocks(-1)


@given(masks(schedule=True))
@settings(max_examples=40, deadline=None)
def test_every_round_of_a_schedule_is_a_row_permutation_of_the_mask(mask):
    for step in (0, 1, 7, 100):
        rm = mask.round_matrix(step, seed=3)
        assert sorted(map(bytes, rm)) == sorted(map(bytes, mask.matrix))
        np.testing.assert_array_equal(rm, mask.round_matrix(step, seed=3))


def test_cyclic_schedule_rotates_rows_once_per_round():
    m = Mask(np.eye(3, dtype=int), schedule=Schedule("cyclic", 2))
    np.testing.assert_array_equal(m.round_matrix(0), np.eye(3))
    np.testing.assert_array_equal(m.round_matrix(1), np.eye(3))
    np.testing.assert_array_equal(m.round_matrix(2), np.roll(np.eye(3), -1, axis=0))
    np.testing.assert_array_equal(m.round_matrix(6), np.eye(3))


def test_permute_schedule_redraws_each_round_and_keeps_it_within_a_round():
    m = Mask(np.eye(6, dtype=int), schedule=Schedule("permute", 4))
    assert np.array_equal(m.round_matrix(0, seed=1), m.round_matrix(3, seed=1))
    rounds = {m.round_matrix(4 * r, seed=1).tobytes() for r in range(10)}
    assert len(rounds) > 1


def test_replace_revalidates_and_rejects_unknown_fields():
    m = Mask([[1, 1]])
    assert m.replace(block_names=["x", "y"]).block_names == ("x", "y")
    with pytest.raises(MaskError, match="unknown Mask field"):
        m.replace(colour="red")
    with pytest.raises(MaskError, match="held by no worker"):
        m.replace(matrix=[[1, 0]])


def test_active_fraction_balance_and_regularity():
    m = Mask([[1, 1, 0, 0], [0, 0, 1, 1]])
    assert m.active_fraction == 0.5
    assert m.is_balanced and m.is_regular
    assert not Mask([[1, 1], [1, 0]]).is_balanced
