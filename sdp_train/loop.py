"""`train(config)`: the loop every rank runs, and the files rank 0 writes.

``DIR/metrics.jsonl`` gets one line per step (step, loss, lr, grad_norm, step_time_s,
tokens_per_s, comm_bytes) as the run goes; ``DIR/summary.json`` is written last, atomically, so
its presence means the run finished. It holds ``peak_memory_bytes``: per rank, the peak over the
first ``memory_steps`` steps, with its breakdown (`sdp_train.memory`). Validation loss is that of
the full assembled model. With ``checkpoint_every`` the loop writes ``DIR/checkpoints/step_N``
(`sdp_train.checkpoint`); a resumed run keeps the metrics lines of the steps before it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from masklab.io import mask_to_dict
from sdp_train.checkpoint import load_checkpoint, save_checkpoint
from sdp_train.config import TrainConfig
from sdp_train.data import build_batches
from sdp_train.dist import default_device, destroy_distributed, get_dist_info, init_distributed, print0
from sdp_train.memory import MemoryMeter, format_bytes
from sdp_train.models import build_model
from sdp_train.train import Prepared, Run, loss_fn, prepare


def train(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run `cfg` on this rank; rank 0 returns the summary (other ranks None)."""
    prep = prepare(cfg)  # every check before any process group exists
    device = default_device()
    info = get_dist_info()
    if info.world_size != cfg.workers:
        from sdp_train.errors import ConfigError

        raise ConfigError(f"--workers {cfg.workers} but the launcher started {info.world_size} ranks")
    torch.manual_seed(cfg.seed)
    info = init_distributed(device)
    try:
        return _train(prep, info, device)
    finally:
        destroy_distributed()


def _train(prep: Prepared, info, device: torch.device) -> dict[str, Any] | None:
    cfg = prep.config
    out = Path(cfg.out)
    run = Run(prep, info, device)
    batches = build_batches(prep.data, split="train", seed=cfg.seed, rank=info.rank, world_size=info.world_size)
    start = 0 if prep.resume_from is None else load_checkpoint(run, batches, prep.resume_from)
    meter = MemoryMeter(run.model, run.optimizer, device, extra=run.comm_buffers)
    metrics_file = _open_metrics(out, start) if info.is_main else None
    progress = _Progress(cfg.steps, enabled=info.is_main)
    records: list[dict[str, Any]] = []
    val_history: list[dict[str, float]] = []
    try:
        for step in range(start, cfg.steps):
            inputs, targets = (t.to(device) for t in next(batches))
            bytes_before = run.comm_bytes
            measured = meter.measure() if step - start < cfg.memory_steps else nullcontext()
            t0 = time.perf_counter()
            with measured:
                stats = run.step(step, inputs, targets)
            step_time = time.perf_counter() - t0
            tokens = targets.numel() * info.world_size
            record = {"step": step, "loss": stats["loss"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                      "step_time_s": step_time, "tokens_per_s": tokens / step_time,
                      "comm_bytes": run.comm_bytes - bytes_before}
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                val_history.append({"step": step, "val_loss": evaluate(run, prep)})
                record["val_loss"] = val_history[-1]["val_loss"]
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                save_checkpoint(run, batches, step + 1, out / "checkpoints")
            records.append(record)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            progress.update(step, record, meter.peak.get("total"))
        val_loss = evaluate(run, prep)
        peaks = _gather(meter.peak, info.world_size)
    finally:
        progress.close()
        if metrics_file is not None:
            metrics_file.close()
    if not info.is_main:
        return None
    timed = records[1:] if len(records) > 1 else records  # step 0 pays one-off warm-up costs
    summary = {
        "final_train_loss": records[-1]["loss"],
        "final_val_loss": val_loss,
        "val_history": val_history,
        "comm_bytes_per_step": statistics.median(r["comm_bytes"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "world_size": info.world_size,
        "num_params_local": sum(p.numel() for p in run.model.parameters()),
        "peak_memory_bytes": peaks,
        "resumed_from_step": start,
        "config": cfg.to_dict(),
        "mask": None if prep.mask is None else mask_to_dict(prep.mask),
    }
    _write_atomic(out / "summary.json", json.dumps(summary, indent=1))
    print0(f"done: final train loss {summary['final_train_loss']:.4f}, val loss {val_loss:.4f}, "
           f"{summary['comm_bytes_per_step'] / 1e6:.3f} MB sent per step per rank, peak memory "
           f"{format_bytes(max(p.get('total', 0) for p in peaks))} on the largest rank -> {out}")
    return summary


def _open_metrics(out: Path, start: int):
    """metrics.jsonl for writing: fresh, or (resuming) keeping the lines of the steps before `start`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    path = out / "metrics.jsonl"
    kept = []
    if start and path.is_file():
        kept = [line for line in path.read_text(encoding="utf-8").splitlines() if json.loads(line)["step"] < start]
    f = open(path, "w", encoding="utf-8")
    f.writelines(line + "\n" for line in kept)
    return f


def _gather(peak: dict[str, int], world_size: int) -> list[dict[str, int]]:
    """Every rank's peak-memory breakdown, in rank order (a collective)."""
    if world_size == 1:
        return [peak]
    peaks: list[dict[str, int]] = [{}] * world_size
    dist.all_gather_object(peaks, peak)
    return peaks


@torch.no_grad()
def evaluate(run: Run, prep: Prepared) -> float:
    """Mean validation loss of the full assembled model; every rank evaluates its own val shard."""
    cfg, info = prep.config, run.info
    full = run.full_state()
    model = build_model(prep.model_config, seed=cfg.seed, device=run.device)
    model.load_state_dict(full)
    model.eval()
    val = build_batches(prep.data, split="val", seed=cfg.seed, rank=info.rank, world_size=info.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    for _, (inputs, targets) in zip(range(cfg.eval_batches), val.epoch()):
        total[0] += loss_fn(model(inputs.to(run.device)), targets.to(run.device)).double()
        total[1] += 1
    if info.world_size > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Progress:
    """Rank 0's progress bar (rich, on a terminal) or a line every ~10% of the run otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.enabled, self.bar = total, enabled, None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    def update(self, step: int, record: dict[str, Any], peak_bytes: int | None) -> None:
        if not self.enabled:
            return
        info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
        if peak_bytes:
            info += f"  peak {format_bytes(peak_bytes)}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, info=info)
        elif step == 0 or (step + 1) % max(1, self.total // 10) == 0 or step + 1 == self.total:
            print(f"step {step + 1}/{self.total}  {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
