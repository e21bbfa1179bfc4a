"""Seed statistics of ``sdp compare --seeds N``: Student-t intervals that hold the mean, shrink with
more data, vanish for a constant series, and a verdict that flips when a difference moves off 0."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.compare.stats import LARGER, WITHIN, paired_difference, seed_statistics, summarize, t_quantile
from sdp_train.errors import ConfigError

VALUES = st.lists(st.floats(-10.0, 10.0, allow_nan=False, allow_subnormal=False), min_size=2, max_size=12)


def _width(s: dict) -> float:
    return s["ci_high"] - s["ci_low"]


def test_t_quantiles_match_the_table_and_the_interval_its_closed_form():
    # two-sided 95% critical values of Student's t (any statistics table)
    assert [round(t_quantile(0.95, d), 3) for d in (1, 2, 3, 4, 9)] == [12.706, 4.303, 3.182, 2.776, 2.262]
    s = summarize([2.0, 4.0])  # mean 3, sd sqrt(2), half-width 12.706 * sqrt(2) / sqrt(2)
    assert (s["n"], s["mean"], s["sd"]) == (2, 3.0, pytest.approx(math.sqrt(2)))
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((3 - 12.7062, 3 + 12.7062), abs=1e-4)


def test_one_value_has_no_spread_and_bad_input_is_refused():
    assert summarize([1.5]) == {"n": 1, "mean": 1.5, "sd": None, "ci_low": None, "ci_high": None}
    assert paired_difference([2.0], [1.0])["verdict"] is None
    with pytest.raises(ConfigError, match="at least one value"):
        summarize([])
    with pytest.raises(ConfigError, match="equal lengths, got 2 and 3"):
        paired_difference([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="confidence=1.5"):
        t_quantile(1.5, 3)


@settings(max_examples=60, deadline=None)
@given(VALUES)
def test_interval_contains_the_mean_and_sd_is_the_sample_sd(values):
    s = summarize(values)
    assert s["ci_low"] <= s["mean"] <= s["ci_high"]
    mean = math.fsum(values) / len(values)
    assert s["mean"] == pytest.approx(mean, abs=1e-12)
    assert s["sd"] == pytest.approx(math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)),
                                    abs=1e-9)  # the sample sd: n - 1 in the denominator


@settings(max_examples=60, deadline=None)
@given(VALUES.filter(lambda v: max(v) - min(v) > 1e-3))
def test_interval_shrinks_with_more_identical_data(values):
    once, twice = summarize(values), summarize(values * 2)
    assert _width(twice) < _width(once)
    assert _width(summarize(values, confidence=0.99)) > _width(once)  # more confidence, wider


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e6, 1e6, allow_nan=False), st.integers(2, 10))
def test_constant_series_has_zero_spread_and_a_point_interval(value, n):
    s = summarize([value] * n)
    assert s["sd"] == 0.0 and s["ci_low"] == s["mean"] == s["ci_high"] == value


@settings(max_examples=60, deadline=None)
@given(VALUES, st.floats(1.0, 100.0), st.booleans())
def test_verdict_flips_when_the_difference_moves_far_from_zero(values, margin, negative):
    centred = values + [-v for v in values]  # mean exactly 0: 0 is inside its interval
    zero = [0.0] * len(centred)
    assert paired_difference(centred, zero)["verdict"] == WITHIN
    shift = (_width(summarize(centred)) + margin) * (-1 if negative else 1)
    shifted = paired_difference([v + shift for v in centred], zero)
    assert shifted["verdict"] == LARGER
    assert paired_difference(centred, [-shift] * len(centred))["verdict"] == LARGER  # same, from the reference


def test_seed_statistics_pair_by_seed_and_give_every_ratio_a_verdict():
    def row(loss, memory_ratio, wire_ratio=None):
        return {"final_val_loss": loss, "peak_memory_vs_ddp": memory_ratio, "wire_bytes_per_step_vs_ddp": wire_ratio}

    # DDP's loss moves a lot between seeds; B-SDP is worse by 0.1 at every seed: paired, that is
    # far outside the spread, though the two losses' own intervals overlap
    by_seed = {0: {"ddp": row(2.0, 1.0, 1.0), "bsdp": row(2.1, 0.5)},
               1: {"ddp": row(3.0, 1.0, 1.0), "bsdp": row(3.1, 0.5, 0.4)},
               2: {"ddp": row(2.5, 1.0, 1.0), "bsdp": row(2.6, 0.5, 0.5)}}
    stats = seed_statistics(by_seed)
    assert stats["seeds"] == [0, 1, 2] and stats["confidence"] == 0.95
    ddp, bsdp = stats["runs"]["ddp"], stats["runs"]["bsdp"]
    assert ddp["final_val_loss_minus_ddp"]["verdict"] == WITHIN and ddp["peak_memory_vs_ddp"]["verdict"] == WITHIN
    diff = bsdp["final_val_loss_minus_ddp"]
    assert diff["mean"] == pytest.approx(0.1) and diff["sd"] == pytest.approx(0.0, abs=1e-12)
    assert diff["verdict"] == LARGER
    assert bsdp["final_val_loss"]["ci_low"] < ddp["final_val_loss"]["ci_high"]
    assert bsdp["peak_memory_vs_ddp"] == {"n": 3, "mean": 0.5, "sd": 0.0, "ci_low": 0.5, "ci_high": 0.5,
                                          "verdict": LARGER}
    assert bsdp["wire_bytes_per_step_vs_ddp"]["n"] == 2  # seed 0's summary had no wire bytes
    with pytest.raises(ConfigError, match="without ddp: \\[1\\]"):
        seed_statistics({0: by_seed[0], 1: {"bsdp": by_seed[1]["bsdp"]}})
