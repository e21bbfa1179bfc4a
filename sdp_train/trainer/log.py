"""What rank 0 shows of a run while it trains: a progress bar or plain lines, and TensorBoard.

- Without ``log_every``: a progress bar (rich) on a terminal, else a line every ~10% of the run.
- With ``log_every=N``: one plain line per N steps (and at the last step) on stdout, flushed at
  once, the same with or without a terminal (for logs, pipes and job schedulers)::

      step 20/50 loss=3.1416 lr=0.003 grad_norm=0.5 step_time_s=0.0123 tokens_per_s=41600 comm_bytes=1048576

- With ``tensorboard``: every metric of metrics.jsonl, and the final validation loss, as scalars of
  torch's ``SummaryWriter`` in ``DIR/tensorboard`` (tags ``train/loss``, ``train/lr``,
  ``train/grad_norm``, ``val/loss``, ``perf/step_time_s``, ``perf/tokens_per_s``,
  ``comm/comm_bytes``, ``comm/wire_bytes``; the global step is metrics.jsonl's ``step``). A run
  resumed at step S purges the events at steps >= S that an earlier attempt wrote.

Not here: metrics.jsonl and summary.json, the record of the run (`sdp_train.trainer.train`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.memory import format_bytes

TENSORBOARD_DIR = "tensorboard"
_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "val/loss",
         "val_accuracy": "val/accuracy",
         "step_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s",
         "comm_bytes": "comm/comm_bytes", "wire_bytes": "comm/wire_bytes"}
_LINE_KEYS = ("loss", "val_loss", "val_accuracy", "lr", "grad_norm", "step_time_s", "tokens_per_s", "comm_bytes", "wire_bytes")


class RunLog:
    """Rank 0's live view of one run (`enabled` False on the other ranks: every method does nothing)."""

    def __init__(self, cfg: TrainConfig, *, start: int, enabled: bool) -> None:
        self.total, self.log_every = cfg.steps, cfg.log_every
        self.enabled = enabled
        self.bar = self.writer = None
        if not enabled:
            return
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(cfg.out) / TENSORBOARD_DIR), purge_step=start or None)
        if not self.log_every and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=self.total, info="", completed=start)
            self.bar.start()

    def update(self, record: dict[str, Any], peak_bytes: int | None) -> None:
        """Show the metrics record of one finished step (as written to metrics.jsonl)."""
        if not self.enabled:
            return
        step = record["step"]
        if self.writer is not None:
            for key, tag in _TAGS.items():
                if record.get(key) is not None:
                    self.writer.add_scalar(tag, record[key], step)
        done = step + 1
        if self.log_every:
            if done % self.log_every == 0 or done == self.total:
                print(f"step {done}/{self.total} {metrics_text(record)}"
                      f"{f' peak_memory={format_bytes(peak_bytes)}' if peak_bytes else ''}", flush=True)
            return
        info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
        if peak_bytes:
            info += f"  peak {format_bytes(peak_bytes)}"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=info)
        elif step == 0 or done % max(1, self.total // 10) == 0 or done == self.total:
            print(f"step {done}/{self.total}  {info}", flush=True)

    def final(self, val_loss: float, val_accuracy: float | None = None) -> None:
        """The validation loss (and accuracy, on image data) of the final full model, at the last step."""
        if self.writer is not None:
            self.writer.add_scalar(_TAGS["val_loss"], val_loss, self.total - 1)
            if val_accuracy is not None:
                self.writer.add_scalar(_TAGS["val_accuracy"], val_accuracy, self.total - 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.writer is not None:
            self.writer.close()  # flushes the event file
            self.writer = None


def metrics_text(record: dict[str, Any]) -> str:
    """``key=value`` of a step's metrics, in metrics.jsonl's names; a skipped step says so.

    >>> metrics_text({"step": 3, "loss": 2.5, "lr": 0.001, "grad_norm": float("nan"), "skipped": True})
    'loss=2.5 lr=0.001 grad_norm=nan skipped'
    """
    parts = [f"{key}={_number(record[key])}" for key in _LINE_KEYS if record.get(key) is not None]
    return " ".join(parts + (["skipped"] if record.get("skipped") else []))


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if math.isfinite(value) and abs(value) >= 1000 else f"{value:.5g}"
