"""``sdp train --dtype bfloat16``: forward and loss under autocast, float32 master weights.

One rank's `Run` in this process (no launch): the bfloat16 steps' losses and the validation loss
differ from float32's by bfloat16 rounding only (so autocast was on), and parameters, gradients and
AdamW state stay float32; an unknown dtype is one error line before anything starts."""

from __future__ import annotations

import pytest
import torch

from sdp_train.cli import main
from sdp_train.data import build_batches
from sdp_train.parallel.dist import DistInfo
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run
from sdp_train.trainer.train import validation_sums


def _steps(dtype: str) -> tuple[list[float], float, set[torch.dtype]]:
    cfg = TrainConfig(model="llama-debug", mode="bsdp", active=1.0, workers=1, steps=3, batch_size=2, seq_len=16,
                      max_data_bytes=100_000, warmup_steps=0, eval_batches=1, dtype=dtype)
    prep = prepare(cfg)
    run = Run(prep, DistInfo(0, 1, 0), torch.device("cpu"))
    try:
        batches = build_batches(prep.data, split="train", seed=0, rank=0, world_size=1)
        losses = [float(run.step(s, *next(batches))["loss"]) for s in range(cfg.steps)]
        total = validation_sums(run.model, prep, 1, torch.device("cpu"))
        state = [t for s in run.optimizer.state.values() for t in s.values() if t.dim() > 0]
        dtypes = {t.dtype for t in [*run.model.parameters(), *(p.grad for p in run.model.parameters()), *state]}
        return losses, float(total[0] / total[1]), dtypes
    finally:
        run.close()


def test_bfloat16_trains_under_autocast_with_float32_master_weights():
    f32, bf16 = _steps("float32"), _steps("bfloat16")
    assert f32[2] == bf16[2] == {torch.float32}
    assert bf16[0][0] != f32[0][0] and bf16[0] == pytest.approx(f32[0], rel=0.01)  # same data, init, steps
    assert bf16[1] != f32[1] and bf16[1] == pytest.approx(f32[1], rel=0.01)


def test_an_unknown_dtype_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dtype", "float16", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
