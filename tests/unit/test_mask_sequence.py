"""A user-given sequence of masks (schedule kind ``sequence``): validation, the file format, and
analysis that is the exact mean over its rounds. The sequence of a mask's K rotations is the
``cyclic`` schedule, so every quantity masklab and theory compute for it must equal cyclic's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab import Mask, Schedule, load_mask, save_mask
from masklab.analysis import (
    block_masking_errors,
    cotraining_gap,
    cotraining_graph,
    is_connected,
    mixing_graph,
    process_group_holder_sets,
    spectral_gap,
    spectral_gap_bound,
)
from masklab.errors import MaskError, MaskFileError
from masklab.io import mask_from_dict, mask_to_dict
from masklab.testing import mask_sequences, masks
from theory.bounds import drift_block_weights
from theory.consensus import consensus_period, consensus_rates, mixing_operator


def _rotations(mask: Mask, every: int) -> Mask:
    k = mask.workers
    return Mask.sequence([mask.matrix[(np.arange(k) + r) % k] for r in range(k)], every=every,
                         block_sizes=mask.block_sizes)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(mask=masks(max_workers=7, max_blocks=6), every=st.integers(1, 3))
def test_the_sequence_of_k_rotations_is_the_cyclic_schedule(mask, every):
    cyclic, sequence = mask.replace(schedule=Schedule("cyclic", every)), _rotations(mask, every)
    for step in range(2 * mask.workers * every + 1):
        assert np.array_equal(cyclic.round_matrix(step), sequence.round_matrix(step)), step
    np.testing.assert_allclose(mixing_graph(sequence).toarray(), mixing_graph(cyclic).toarray(), atol=1e-12)
    assert spectral_gap(sequence) == pytest.approx(spectral_gap(cyclic), abs=1e-9)  # eigensolver vs closed form
    assert is_connected(sequence) == is_connected(cyclic)
    assert cotraining_gap(sequence) == pytest.approx(cotraining_gap(cyclic), abs=1e-9)
    np.testing.assert_allclose(block_masking_errors(sequence), block_masking_errors(cyclic))
    assert consensus_period(sequence) == consensus_period(cyclic)
    np.testing.assert_allclose(consensus_rates(sequence), consensus_rates(cyclic), atol=1e-9)
    for j in range(mask.blocks):
        np.testing.assert_allclose(mixing_operator(sequence, j), mixing_operator(cyclic, j), atol=1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(mask=mask_sequences(max_workers=6, max_blocks=5, max_rounds=4))
def test_a_sequence_trains_its_rounds_in_turn_and_is_analysed_as_their_mean(mask, tmp_path_factory):
    rounds, every = mask.rounds, mask.schedule.every
    assert np.array_equal(rounds[0], mask.matrix)
    for step in range(3 * len(rounds) * every):
        assert np.array_equal(mask.round_matrix(step), rounds[(step // every) % len(rounds)])
    for m in rounds:  # coverage is every round's
        assert np.array_equal(m.sum(axis=0), mask.coverage)
    statics = [Mask(m) for m in rounds]
    np.testing.assert_allclose(mixing_graph(mask).toarray(),
                               np.mean([mixing_graph(s).toarray() for s in statics], axis=0), atol=1e-12)
    np.testing.assert_allclose(cotraining_graph(mask).toarray(),
                               np.mean([cotraining_graph(s).toarray() for s in statics], axis=0), atol=1e-12)
    assert spectral_gap(mask) <= spectral_gap_bound(mask) + 1e-9  # trace(L) is every round's
    # Lemma 2's drift weights: the worst round's, block by block
    np.testing.assert_allclose(drift_block_weights(mask), np.max([drift_block_weights(s) for s in statics], axis=0))
    assert len(mask.matrices) == len(rounds) and all(np.array_equal(a, b) for a, b in zip(mask.matrices, rounds))
    groups = set(process_group_holder_sets(mask))
    assert all(set(process_group_holder_sets(s)) <= groups for s in statics)
    path = save_mask(mask, tmp_path_factory.mktemp("seq") / "m.json")
    assert load_mask(path) == mask
    assert mask_from_dict(json.loads(json.dumps(mask_to_dict(mask)))) == mask


def test_a_sequence_mask_differs_from_one_with_other_rounds():
    a = Mask.sequence([[[1, 0], [0, 1]], [[0, 1], [1, 0]]])
    b = Mask.sequence([[[1, 0], [0, 1]], [[1, 0], [0, 1]]])
    assert a != b and hash(a) != hash(b)
    assert a.replace(schedule=Schedule("permute", 2)).rounds is None  # another schedule reassigns round 0's rows
    assert a.replace(schedule=Schedule("sequence", 4)).round_matrix(4).tolist() == [[0, 1], [1, 0]]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: Mask.sequence([]), "non-empty list"),
    (lambda: Mask.sequence([[[1, 0], [0, 1]], [[1, 1], [1, 0]]]),
     r"round 1: block 0 \('block0'\) has coverage 2, round 0 has 1 \(1 such blocks\)"),
    (lambda: Mask.sequence([[[1, 0], [0, 1]], [[1, 0, 1], [0, 1, 0]]]), r"round 1: shape \(2, 3\)"),
    (lambda: Mask.sequence([[[1, 0], [0, 1]], [[1, 1], [0, 0]]]), r"round 1: worker 1 \(row 1\) holds no block"),
    (lambda: Mask.sequence([[[1, 0], [0, 1]], [[1, 0], [2, 1]]]), "round 1: mask entry at row 1"),
    (lambda: Mask([[1]], schedule=Schedule("sequence")), "needs its masks"),
    (lambda: Mask([[1]], rounds=[[[1]]]), "needs schedule kind 'sequence', got 'static'"),
    (lambda: Mask([[1, 0], [0, 1]], schedule=Schedule("sequence"), rounds=[[[0, 1], [1, 0]]]), "round 0 must equal"),
    (lambda: Mask.sequence([[[1, 0], [0, 1]]]).transpose(), "no transpose"),
])
def test_bad_sequences_are_refused_naming_the_round(call, message):
    with pytest.raises(MaskError, match=message):
        call()


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["schedule"].pop("rounds"), "kind 'sequence' needs 'rounds'"),
    (lambda d: d["schedule"].update(rounds=[]), "kind 'sequence' needs 'rounds'"),
    (lambda d: d["schedule"]["rounds"][1].append("10"), "schedule round 1: field 'rows' has 3 rows"),
    (lambda d: d["schedule"]["rounds"].__setitem__(1, ["11", "00"]), "round 1: worker 1 .* holds no block"),
    (lambda d: d["schedule"].update(kind="cyclic"), "'rounds' belongs to kind 'sequence', not 'cyclic'"),
])
def test_a_damaged_sequence_file_names_the_file_and_the_round(tmp_path, change, message):
    data = mask_to_dict(Mask.sequence([[[1, 0], [0, 1]], [[0, 1], [1, 0]]], every=2))
    change(data)
    path = tmp_path / "seq.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MaskFileError, match=f"{path}.*{message}"):
        load_mask(path)
