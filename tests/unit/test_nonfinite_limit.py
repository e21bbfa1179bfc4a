"""``nonfinite='skip'`` has a limit: ``max_consecutive_skips`` non-finite steps in a row end the run.

Before, 9 of 10 steps could be skipped and the run exited 0 with a summary of an untrained model.
"""

from __future__ import annotations

import pytest

from sdp_train.errors import ConfigError, NonFiniteError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.run import Run
from sdp_train.trainer.train import train

TINY = {"model": "llama-debug", "model_overrides": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},
        "mode": "ddp", "workers": 1, "steps": 8, "batch_size": 2, "seq_len": 16, "max_data_bytes": 100_000,
        "memory_steps": 0, "eval_batches": 1, "nonfinite": "skip"}


def test_too_many_consecutive_skipped_steps_stop_the_run_but_isolated_ones_do_not(tmp_path, monkeypatch):
    step = Run.step
    diverged_from = {"step": 3}

    def nonfinite_from(self, i, inputs, targets):
        stats = step(self, i, inputs, targets)
        return {**stats, "skipped": i >= diverged_from["step"] or i == 1}

    monkeypatch.setattr(Run, "step", nonfinite_from)
    with pytest.raises(NonFiniteError, match="step 5: 3 non-finite steps in a row"):
        train(TrainConfig(**TINY, max_consecutive_skips=3, out=str(tmp_path / "a")))
    assert not (tmp_path / "a" / "summary.json").exists()
    diverged_from["step"] = 99  # only step 1 skipped
    summary = train(TrainConfig(**TINY, max_consecutive_skips=3, out=str(tmp_path / "b")))
    assert summary["skipped_steps"] == [1]


def test_the_limit_is_validated():
    with pytest.raises(ConfigError, match="max_consecutive_skips=0"):
        TrainConfig(max_consecutive_skips=0)
