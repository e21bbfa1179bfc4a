"""The property-testing kit (masklab.testing, theory.testing, sdp_train.testing).

Strategies shrink and honour their options, checks fail loudly, the plugin works.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from masklab.analysis import block_masking_errors, is_connected, spectral_gap, spectral_gap_bound
from masklab.errors import MaskError
from masklab.mask import Mask, Schedule
from masklab.testing import (
    assert_covers,
    assert_masking_error_at_most,
    assert_spectral_gap_at_least,
    assert_valid_mask,
    balanced_masks,
    block_designs,
    masks,
    schedules,
)
from sdp_train import testing as model_checks
from sdp_train.testing import BlockMapError, assert_holder_average, assert_subnetwork_consistent, from_sdp_train
from sdp_train.models import get_model_config
from theory.bounds import sdp_bound
from theory.errors import TheoryError
from theory.testing import problem_constants, step_sizes

PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much])
REPO = Path(__file__).resolve().parents[2]


# -- strategies ---------------------------------------------------------------------------------
@PROPERTY
@given(st.data())
def test_masks_honour_sizes_balance_active_window_and_connectivity(data):
    k, b = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    lo = data.draw(st.sampled_from([0.2, 0.5, 0.8]))
    balanced, connected = data.draw(st.booleans()), data.draw(st.booleans())
    mask = data.draw(masks(workers=k, blocks=b, active=(lo, 1.0), balanced=balanced, connected=connected))
    assert (mask.workers, mask.blocks) == (k, b)
    assert lo - 1e-9 <= mask.active_fraction <= 1.0
    assert mask.is_balanced or not balanced
    assert is_connected(mask) or not connected


@PROPERTY
@given(st.data())
def test_masks_with_a_single_active_fraction_get_the_nearest_achievable_one(data):
    k, b = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    active = data.draw(st.sampled_from([0.1, 0.5, 0.9]))
    mask = data.draw(masks(workers=k, blocks=b, active=active))
    feasible = range(max(k, b), k * b + 1)  # fewer ones cannot cover every row and column
    best = min(abs(n - active * k * b) for n in feasible)
    assert abs(mask.matrix.sum() - active * k * b) == pytest.approx(best)


def test_failing_property_reports_the_minimal_three_worker_mask():
    seen: list[Mask] = []

    @settings(database=None, max_examples=200, derandomize=True, deadline=None)
    @given(masks())
    def fewer_than_three_workers(mask):
        seen.append(mask)
        assert mask.workers < 3

    with pytest.raises(AssertionError):
        fewer_than_three_workers()
    assert seen[-1].matrix.tolist() == [[1], [1], [1]]  # Hypothesis replays the shrunk example last


def test_balanced_and_windowed_masks_shrink_to_the_smallest_shape_asked_for():
    shrunk = find(balanced_masks(), lambda m: m.workers >= 3 and m.blocks >= 2, settings=settings(database=None))
    assert (shrunk.workers, shrunk.blocks, int(shrunk.coverage[0])) == (3, 2, 2)
    windowed = find(masks(active=(0.5, 1.0)), lambda m: m.workers >= 2, settings=settings(database=None))
    assert windowed.matrix.shape == (2, 1)


@PROPERTY
@given(block_designs(max_workers=13))
def test_block_designs_reach_the_trace_bound(mask):
    assert mask.is_balanced
    assert_spectral_gap_at_least(mask, spectral_gap_bound(mask), rtol=1e-9)


@PROPERTY
@given(schedules(kinds=("permute", "cyclic"), max_every=3))
def test_schedules_draw_only_the_requested_kinds_and_periods(schedule):
    assert schedule.kind in ("permute", "cyclic") and 1 <= schedule.every <= 3


@PROPERTY
@given(st.data())
def test_problem_constants_and_step_sizes_satisfy_the_theorem_conditions(data):
    mask = data.draw(masks(max_workers=5, max_blocks=4))
    constants = data.draw(problem_constants(blocks=mask.blocks, local_steps=True))
    eta = data.draw(step_sizes(constants.smoothness))
    assert constants.sigma_sq.shape == constants.zeta_sq.shape == constants.grad_sq.shape == (mask.blocks,)
    assert constants.local_smoothness >= constants.smoothness
    terms = sdp_bound(mask, constants, eta=eta, steps=10)
    assert terms.step_size_ok and math.isfinite(terms.total)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: masks(workers=0), "workers=0 must be an integer >= 1"),
        (lambda: masks(max_blocks=0), "max_blocks=0 must be an integer >= 1"),
        (lambda: masks(active=(0.8, 0.2)), r"active=\(0.8, 0.2\) must be"),
        (lambda: schedules(kinds=("sometimes",)), "kinds=\\('sometimes',\\) must be"),
        (lambda: block_designs(max_workers=3), "max_workers=3 must be >= 4"),
    ],
)
def test_strategy_arguments_are_rejected_with_their_values(make, message):
    with pytest.raises(MaskError, match=message):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: problem_constants(blocks=0), "blocks=0 must be an integer >= 1"),
        (lambda: problem_constants(max_value=0.0), "max_value=0.0 must be a finite number >= 0.01"),
        (lambda: step_sizes(1.0, min_fraction=0.0), r"min_fraction=0.0 must be in \(0, 1\]"),
    ],
)
def test_theory_strategy_arguments_are_rejected_with_their_values(make, message):
    with pytest.raises(TheoryError, match=message):
        make()


# -- mask checks --------------------------------------------------------------------------------
def test_assert_valid_mask_names_the_uncovered_block_and_empty_worker():
    assert assert_valid_mask(np.eye(2)).workers == 2
    with pytest.raises(AssertionError, match=r"block 1 \(column 1, 'block1'\) is held by no worker"):
        assert_valid_mask([[1, 0], [1, 0]])
    with pytest.raises(AssertionError, match=r"worker 1 \(row 1\) holds no block"):
        assert_valid_mask([[1, 1], [0, 0]])


@PROPERTY
@given(masks(max_workers=6, max_blocks=6))
def test_assert_covers_passes_at_the_minimum_coverage_and_fails_above_it(mask):
    c_min = int(mask.coverage.min())
    assert_covers(mask, min_coverage=c_min)
    if c_min < mask.workers:
        j = int(np.flatnonzero(mask.coverage == c_min)[0])
        with pytest.raises(AssertionError, match=f"block {j} 'block{j}' c={c_min} holders"):
            assert_covers(mask, min_coverage=c_min + 1)


@PROPERTY
@given(masks(max_workers=6, max_blocks=6, schedule=True))
def test_assert_spectral_gap_at_least_passes_at_the_gap_and_fails_just_above(mask):
    gap = spectral_gap(mask)
    assert_spectral_gap_at_least(mask, gap)
    if gap < 0.99:
        with pytest.raises(AssertionError, match=f"spectral gap {gap:.6g} < required"):
            assert_spectral_gap_at_least(mask, gap + 0.01)


@PROPERTY
@given(masks(max_workers=6, max_blocks=6))
def test_assert_masking_error_at_most_passes_at_the_error_and_lists_the_worst_block_below(mask):
    errors = block_masking_errors(mask)
    assert_masking_error_at_most(mask, float(errors.max()))
    if errors.max() > 0:
        worst = int(np.argmax(errors))
        with pytest.raises(AssertionError, match=f"block {worst} 'block{worst}' eps="):
            assert_masking_error_at_most(mask, float(errors.max()) / 2)


def test_mask_checks_reject_bad_thresholds_with_their_values():
    mask = Mask(np.eye(3))
    with pytest.raises(MaskError, match="min_coverage=4 exceeds the number of workers K=3"):
        assert_covers(mask, min_coverage=4)
    with pytest.raises(MaskError, match=r"gamma=1.5 must be a number in \[0, 1\]"):
        assert_spectral_gap_at_least(mask, 1.5)
    with pytest.raises(MaskError, match="eps=-1 must be"):
        assert_masking_error_at_most(mask, -1)
    with pytest.raises(MaskError, match="expected a masklab.Mask, got ndarray"):
        assert_covers(np.eye(3))


# -- model checks on sdp_train's LLaMA ----------------------------------------------------------
TINY_LLAMA = dict(dim=16, n_layers=3, n_heads=2, hidden_dim=32, neuron_groups=2, max_seq_len=8)
LLAMA_MASKS = {  # coverage below K somewhere, so dividing by K instead of c_j changes the step
    "block": Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]),
    "neuron": Mask([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]]),  # layer 0 of worker 1 keeps one group
}


def _llama(level: str):
    return from_sdp_train(get_model_config("llama-debug", **TINY_LLAMA), level, seed=0)


def _batches(k: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 8), generator=gen) for _ in range(k)]


def _lm_loss(module, tokens):
    logits = module(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_llama_worker_subnetworks_compute_the_full_model_with_other_blocks_zeroed(level):
    model, blocks, subnetwork = _llama(level)
    mask = LLAMA_MASKS[level]
    for worker in range(mask.workers):
        assert_subnetwork_consistent(model, mask, worker, blocks=blocks, subnetwork=subnetwork, inputs=_batches(1)[0])


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_llama_sdp_step_updates_every_block_by_its_holders_mean(level):
    model, blocks, subnetwork = _llama(level)
    mask = LLAMA_MASKS[level]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = assert_holder_average(model, mask, _batches(mask.workers), blocks=blocks, subnetwork=subnetwork,
                                  loss=_lm_loss, lr=0.5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the model is not modified
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_holder_average_check_fails_when_blocks_are_divided_by_k_instead_of_coverage(level, monkeypatch):
    model, blocks, subnetwork = _llama(level)
    mask = LLAMA_MASKS[level]
    monkeypatch.setattr(model_checks, "_average_over_holders", lambda grad_sum, holders: grad_sum / mask.workers)
    with pytest.raises(AssertionError, match=r"differs from the per-block holder mean"):
        assert_holder_average(model, mask, _batches(mask.workers), blocks=blocks, subnetwork=subnetwork,
                              loss=_lm_loss)


def test_subnetwork_check_fails_for_a_subnetwork_that_ignores_the_mask_row():
    model, blocks, _ = _llama("block")

    def whole_model(full, held):
        return full

    with pytest.raises(AssertionError, match=r"worker 0's subnetwork \(holds blocks \[0, 1\] of 3\)"):
        assert_subnetwork_consistent(model, LLAMA_MASKS["block"], 0, blocks=blocks, subnetwork=whole_model,
                                     inputs=_batches(1)[0])


def test_model_checks_reject_a_block_map_that_does_not_fit_the_mask_or_model():
    model, blocks, subnetwork = _llama("block")
    with pytest.raises(BlockMapError, match="the mask has B=2 columns but the block map has 3 blocks"):
        assert_subnetwork_consistent(model, Mask(np.eye(2)), 0, blocks=blocks, subnetwork=subnetwork, inputs=None)
    bad = [[("layers.9.wq.weight", None, ())]] + list(blocks[1:])
    with pytest.raises(BlockMapError, match="block 0 owns 'layers.9.wq.weight', which is not a tensor"):
        assert_subnetwork_consistent(model, Mask([[0, 1, 1], [1, 0, 0]]), 0, blocks=bad, subnetwork=subnetwork, inputs=None)
    with pytest.raises(BlockMapError, match="got 1 batches for K=3 workers"):
        assert_holder_average(model, LLAMA_MASKS["block"], _batches(1), blocks=blocks, subnetwork=subnetwork,
                              loss=_lm_loss)


# -- pytest plugin ------------------------------------------------------------------------------
def _run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # Autoload off: the plugin is loaded once, by -p, whether or not the entry point is installed.
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "masklab.testing.plugin", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_plugin_sdp_check_runs_as_many_examples_as_sdp_max_examples(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        from masklab.testing import assert_covers, masks

        CALLS = []

        def test_masks_are_covered(sdp_check, sdp_max_examples):
            sdp_check(masks(max_workers=4), lambda m: CALLS.append(assert_covers(m)))
            assert 1 <= len(CALLS) <= sdp_max_examples == 4
    """))
    result = _run_pytest(tmp_path, "--sdp-max-examples=4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_plugin_sdp_check_reports_the_shrunk_counterexample(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        from masklab.testing import assert_covers, masks

        def test_every_block_has_two_holders(sdp_check):
            sdp_check(masks(max_workers=4), lambda m: assert_covers(m, min_coverage=min(2, m.workers)))
    """))
    result = _run_pytest(tmp_path, "--sdp-max-examples=50")
    assert result.returncode == 1
    assert "coverage < 2 (K=2 workers): block 0 'block0' c=1 holders (0,)" in result.stdout


def test_plugin_rejects_a_max_examples_below_one_at_startup(tmp_path):
    (tmp_path / "test_user.py").write_text("def test_nothing():\n    pass\n")
    result = _run_pytest(tmp_path, "--sdp-max-examples=0")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--sdp-max-examples=0 must be >= 1" in result.stderr
