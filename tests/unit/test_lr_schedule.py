"""`lr_at`: linear warm-up to `lr`, then cosine decay to ``lr * min_lr_ratio`` at the last step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.run import lr_at


def test_warmup_is_linear_and_reaches_lr_at_its_last_step():
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, steps=20, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_cosine_decay_has_its_closed_form_midpoint_and_end():
    cfg = TrainConfig(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.2)
    assert lr_at(0, cfg) == pytest.approx(1.0)
    assert lr_at(5, cfg) == pytest.approx(0.2 + 0.5 * 0.8)  # cos(pi/2) = 0
    assert lr_at(10, cfg) == pytest.approx(0.2)
    assert lr_at(7, cfg) == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi * 0.7)))


def test_steps_past_the_end_stay_at_the_floor():
    cfg = TrainConfig(lr=2.0, warmup_steps=2, steps=6, min_lr_ratio=0.5)
    assert lr_at(6, cfg) == lr_at(100, cfg) == pytest.approx(1.0)


@settings(max_examples=50, deadline=None)
@given(steps=st.integers(1, 200), warmup=st.integers(0, 50), ratio=st.floats(0.0, 1.0))
def test_lr_rises_during_warmup_then_never_rises_and_stays_between_floor_and_lr(steps, warmup, ratio):
    cfg = TrainConfig(lr=1e-2, warmup_steps=warmup, steps=steps, min_lr_ratio=ratio)
    lrs = [lr_at(s, cfg) for s in range(steps + 1)]
    rising, decaying = lrs[:warmup], lrs[warmup:]
    assert all(a < b for a, b in zip(rising, rising[1:]))
    assert all(b <= a * (1 + 1e-12) for a, b in zip(decaying, decaying[1:]))
    assert all(0 < lr <= cfg.lr * (1 + 1e-12) for lr in rising)
    assert all(cfg.lr * ratio * (1 - 1e-12) <= lr <= cfg.lr * (1 + 1e-12) for lr in decaying)
