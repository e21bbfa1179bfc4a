"""`masklab.neuron_design`: N-SDP masks that need no more process groups than B-SDP's.

Each distinct holder set of 2 to K-1 workers is a process group, on NCCL a communicator on every
member's device. One design per layer (the old N-SDP) needed up to layers x groups of them: 62 at
llama-1b, K = 8, C = 0.5, against B-SDP's 18. `neuron_design` takes the layers' B-SDP design as
the family of holder sets, so the count is B-SDP's at most, for every K, C and model shape.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from masklab import DesignError, design, neuron_design
from masklab.analysis import process_group_holder_sets, spectral_gap
from masklab.design import coverage_from_active
from sdp_train.models import get_model_config
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import design_for_model

FEW = settings(max_examples=12, deadline=None)  # each example runs masklab's design search twice


@st.composite
def shapes(draw):
    """(K, layers, groups, c) with groups * c >= K, so every worker can keep a group of every layer."""
    K = draw(st.integers(2, 8))
    layers = draw(st.integers(1, 8))
    groups = draw(st.integers(1, 8))
    c = coverage_from_active(K, draw(st.sampled_from([0.125, 0.25, 0.375, 0.5, 0.69, 0.75, 1.0])))
    assume(groups * c >= K)
    return K, layers, groups, c


@FEW
@given(shape=shapes(), seed=st.integers(0, 2**16))
def test_nsdp_never_needs_more_process_groups_than_bsdp_for_the_same_K_and_C(shape, seed):
    K, layers, groups, c = shape
    mask = neuron_design(K, layers, groups, coverage=c, seed=seed)
    assert (mask.workers, mask.blocks) == (K, layers * groups)
    assert (mask.coverage == c).all()
    assert mask.matrix.reshape(K, layers, groups).any(axis=2).all()  # a group of every layer on every worker
    assert np.array_equal(neuron_design(K, layers, groups, coverage=c, seed=seed).matrix, mask.matrix)
    if layers * c < K:  # B-SDP cannot be designed: there is nothing to compare
        return
    blocks = design(K, layers, coverage=c, seed=seed)
    assert len(process_group_holder_sets(mask)) <= len(process_group_holder_sets(blocks))
    if mask.construction.startswith("shared"):
        # every family set serves `groups` neuron groups: B-SDP's sets, and its mixing graph and gap
        assert process_group_holder_sets(mask) == process_group_holder_sets(blocks)
        assert spectral_gap(mask) == pytest.approx(spectral_gap(blocks), abs=1e-9)


def test_tight_coverage_falls_back_to_cycled_designs_that_stay_connected():
    # groups * c = K: each layer needs two complementary sets, which B-SDP's family lacks; the old
    # per-layer designs were all the same cyclic pair (gap 0), the cycled ones are relabelled
    mask = neuron_design(8, 12, 2, coverage=4, seed=0)
    assert mask.construction.startswith("cycled")
    assert len(process_group_holder_sets(mask)) <= len(process_group_holder_sets(design(8, 12, coverage=4, seed=0)))
    assert spectral_gap(mask) > 0


def test_sdp_train_nsdp_mask_of_llama_1b_needs_bsdps_18_groups_not_62():
    config = get_model_config("llama-1b")
    counts = {mode: len(process_group_holder_sets(design_for_model(TrainConfig(model="llama-1b", mode=mode, workers=8,
                                                                                  active=0.5), config)))
              for mode in ("bsdp", "nsdp")}
    assert counts == {"bsdp": 18, "nsdp": 18}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"active": 0.5, "coverage": 2}, "exactly one of active"),
    ({"coverage": 1}, r"groups \* coverage = 2 \* 1 = 2 < K=8"),
    ({"coverage": 9}, r"coverage=9 must lie in \[1, K\]"),
])
def test_bad_input_names_the_value(kwargs, match):
    with pytest.raises(DesignError, match=match):
        neuron_design(8, 4, 2, **kwargs)


def test_a_forced_construction_must_fit_the_layers_not_one_layer():
    # PG(2, 2) has 7 lines: it fits 7 neuron groups of one layer, but the family is over the 4 layers
    with pytest.raises(DesignError, match=r"design over the layers \(B = 4, 4 layers\): no projective-plane design"):
        neuron_design(7, 4, 7, coverage=3, construction="projective-plane")
    assert neuron_design(7, 7, 7, coverage=3, construction="projective-plane").construction == "shared projective-plane"
