"""theory.coverage: which theorem covers a run, and its bound ratio only for covered runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from masklab.mask import Mask, Schedule
from theory.bounds import ddp_bound, optimal_step_size, sdp_bound
from theory.constants import worst_case_constants
from theory.coverage import covered_bound_ratio, covering_theorem
from theory.errors import TheoryError


def _ring(schedule: Schedule = Schedule()) -> Mask:
    m = np.zeros((4, 4), dtype=np.uint8)
    for j in range(4):
        m[[j, (j + 1) % 4], j] = 1
    return Mask(m, schedule=schedule)


@pytest.mark.parametrize("mode", ["bsdp", "nsdp"])
@pytest.mark.parametrize("schedule", [Schedule(), Schedule("permute", 1), Schedule("cyclic", 2)])
def test_forward_masked_runs_are_not_covered_by_the_backward_masked_theorem(mode, schedule):
    assert not covering_theorem(mode, schedule).covered
    assert "forward masking" in covering_theorem(mode, schedule).regime
    assert covered_bound_ratio(mode, _ring(schedule), steps=100) is None


@pytest.mark.parametrize(("schedule", "h", "overlap", "theorem"), [
    (Schedule(), 1, False, "Theorem 1"),
    (Schedule("cyclic", 1), 1, False, "Theorem 1"),
    (Schedule("permute", 3), 1, False, "Theorem 1"),
    (Schedule("permute", 1), 1, False, "Theorem 2'"),
    (Schedule("permute", 2), 2, False, "Theorem 3"),
    (Schedule("cyclic", 2), 2, True, "Theorem 6"),
])
def test_backward_masked_runs_name_their_theorem(schedule, h, overlap, theorem):
    assert covering_theorem("bbsdp", schedule, local_steps=h, overlap=overlap).theorem == theorem


def test_bound_ratio_is_the_worst_split_bound_at_best_step_sizes():
    mask = _ring(Schedule("permute", 1))
    c = worst_case_constants(mask, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    sdp = sdp_bound(mask, c, eta=optimal_step_size(mask, c, steps=120), steps=120).total
    full = mask.replace(matrix=np.ones((4, 4)))
    ddp = ddp_bound(mask, c, eta=optimal_step_size(full, c, steps=120), steps=120).total
    assert covered_bound_ratio("bbsdp", mask, steps=120) == pytest.approx(sdp / ddp)
    assert covered_bound_ratio("ddp", None, steps=120) == 1.0


def test_overlap_averaging_ratio_is_infinite_without_a_gap_and_finite_with_a_schedule():
    assert covered_bound_ratio("bbsdp", _ring(), steps=120, overlap=True) == math.inf
    assert math.isfinite(covered_bound_ratio("bbsdp", _ring(Schedule("cyclic", 1)), steps=120, overlap=True))


def test_unknown_mode_is_refused_naming_it():
    with pytest.raises(TheoryError, match="mode='sgd' is not one of"):
        covering_theorem("sgd")


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "bbsdp"])
@pytest.mark.parametrize(("rule", "named"), [
    ({"optimizer": "adamw"}, "adamw"), ({"lr_schedule": "warmup"}, "warmup step size"),
    ({"lr_schedule": "cosine"}, "cosine step size"), ({"clipping": True}, "gradient clipping"),
    ({"optimizer": "adamw", "lr_schedule": "warmup+cosine", "clipping": True}, "adamw, warmup+cosine step size"),
])
def test_no_theorem_covers_adamw_warmup_cosine_or_clipping(mode, rule, named):
    for overlap in (False, True):
        coverage = covering_theorem(mode, Schedule("permute", 1), overlap=overlap, **rule)
        assert coverage.theorem is None and named in coverage.regime and "constant step" in coverage.regime
        assert covered_bound_ratio(mode, _ring(Schedule("permute", 1)), steps=120, overlap=overlap, **rule) is None
    assert covering_theorem(mode).covered  # plain constant-step SGD stays covered


def test_unknown_training_rule_is_refused_naming_it():
    with pytest.raises(TheoryError, match="optimizer='adam' is not one of"):
        covering_theorem("bbsdp", optimizer="adam")
    with pytest.raises(TheoryError, match="lr_schedule='step' is not one of"):
        covering_theorem("bbsdp", lr_schedule="step")
