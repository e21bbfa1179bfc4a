"""Write a comparison's report: compare.json, a Markdown table (compare.md) and PNG plots.

Every ratio is to the DDP run of the same comparison. ``bound x DDP`` is the bound of the theorem
of docs/theory.md that covers the run (`theory.coverage.covered_bound_ratio`) under unit problem
constants (L = sigma = zeta = 1, f(x0) - f* = 1) at the bound-optimal step size, divided by DDP's:
it ranks masks, it does not predict a language model's loss. Runs no theorem covers (forward-masked
B-/N-SDP) get none. Validation loss is that of the full assembled model on the same
held-out batches for every run.

Plots: ``compare_loss.png`` (validation loss against steps and against training FLOPs per rank)
and ``compare_cost.png`` (peak memory per rank stacked by category, buffer and wire bytes per step
per rank, median step time).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sdp_train.loop import _write_atomic  # summary.json's writer: temp name, fsync, rename
from sdp_train.memory import CATEGORIES

if TYPE_CHECKING:
    from sdp_train.compare import Planned, Preset


def build_report(preset_name: str, preset: Preset, planned: list[Planned],
                 summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The comparison as one JSON-ready dict: settings, masks with certificates, one row per run."""
    from sdp_train.compare import machine, preset_dict, today

    ddp = summaries.get("ddp")
    runs: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for p in planned:
        name = p.spec.name
        if p.duplicate_of is not None:
            skipped[name] = f"its designed mask equals {p.duplicate_of}'s (C={p.spec.active} with K={preset.workers})"
            continue
        if name not in summaries:
            skipped[name] = "its mask failed verification"
            continue
        s = summaries[name]
        peak = max(s["peak_memory_bytes"], key=lambda q: q.get("total", 0))
        row = {
            "mode": p.spec.mode, "active": None if p.mask is None else float(p.mask.matrix.mean()),
            "ac": p.spec.ac, "fsdp": p.spec.fsdp, "heterogeneous": p.spec.heterogeneous,
            "flop_matched": p.spec.flop_matched, "steps": s["config"]["steps"],
            "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
            "peak_memory_bytes": peak, "comm_bytes_per_step": s["comm_bytes_per_step"],
            "wire_bytes_per_step": s.get("wire_bytes_per_step"),
            "step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"],
            "flops_per_step": p.flops_per_step, "training_flops": p.flops_per_step * s["config"]["steps"],
            "val_history": [*s.get("val_history", []), {"step": s["config"]["steps"] - 1,
                                                         "val_loss": s["final_val_loss"]}],
            "bound_vs_ddp": None if p.verification is None else p.verification["bound_vs_ddp"],
            "mask_file": s["config"].get("mask"),
        }
        if ddp is not None:
            ref = {"peak_memory": max(q.get("total", 0) for q in ddp["peak_memory_bytes"]),
                   "comm_bytes_per_step": ddp["comm_bytes_per_step"],
                   "wire_bytes_per_step": ddp.get("wire_bytes_per_step"), "step_time_s": ddp["step_time_s"],
                   "final_val_loss": ddp["final_val_loss"],
                   "training_flops": _ddp_flops(planned, ddp)}
            values = {"peak_memory": peak.get("total", 0), **{k: row[k] for k in ref if k != "peak_memory"}}
            for key, base in ref.items():
                row[f"{key}_vs_ddp"] = values[key] / base if base and values[key] is not None else None
        runs[name] = row
    masks = {p.spec.name: p.verification for p in planned if p.verification is not None}
    return {"preset": preset_name, "settings": preset_dict(preset), "date": today(), "machine": machine(),
            "command": f"sdp compare --preset {preset_name}" + (f" --data {preset.data}" if preset.data != "auto" else ""),
            "masks": masks, "runs": runs, "not_run": skipped,
            "notes": list(preset.notes)}


def _ddp_flops(planned: list[Planned], ddp_summary: dict[str, Any]) -> float:
    ddp = next(p for p in planned if p.spec.name == "ddp")
    return ddp.flops_per_step * ddp_summary["config"]["steps"]


def write_report(report: dict[str, Any], out: Path) -> None:
    """compare.json, compare.md and the two plots, each written whole or not at all."""
    _write_atomic(out / "compare.json", json.dumps(report, indent=1))
    _write_atomic(out / "compare.md", markdown_table(report))
    plot(report, out)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(row: dict[str, Any], key: str, digits: int = 2) -> str:
    value = row.get(f"{key}_vs_ddp")
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(report: dict[str, Any]) -> str:
    """The comparison as a Markdown table, one row per run, with ratios to DDP."""
    s = report["settings"]
    lines = [
        f"`{report['command']}`: {s['model']}, {s['workers']} workers, {s['batch_size']} x {s['seq_len']} tokens "
        f"per worker per step, lr {s['lr']}, seed 0; {report['machine']}, {report['date']}. "
        "Ratios (x) are to DDP in the same comparison. Memory is the measured peak of the largest rank "
        "(MiB: parameters / gradients / optimizer / activations). Buffer MiB/step: the sizes of the buffers "
        "passed to collectives per rank; wire MiB/step: what one rank sends under the ring model "
        "(all-reduce 2(c-1)/c of its buffer, all-gather / reduce-scatter / broadcast (c-1)/c; docs/design.md). "
        "bound x: the bound of the theorem that covers the run (docs/theory.md), over DDP's, under unit "
        "constants; '-' where no theorem covers it (forward-masked B-/N-SDP, whose subnetworks are not the "
        "backward-masked algorithm the theorems bound).",
        "",
        "| run | C | steps | val loss | x | train FLOPs x | peak MiB | x | P / G / O / A | buffer MiB/step | x "
        "| wire MiB/step | x | step s | x | bound x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["runs"].items():
        p = r["peak_memory_bytes"]
        parts = " / ".join(f"{p.get(c, 0) / 2**20:.1f}" for c in CATEGORIES[:4])
        active = "1" if r["active"] is None else f"{r['active']:.3g}"
        bound = "-" if r["bound_vs_ddp"] is None else f"{r['bound_vs_ddp']:.2f}"
        lines.append(
            f"| {name} | {active} | {r['steps']} | {r['final_val_loss']:.4f} | {_ratio(r, 'final_val_loss', 3)} "
            f"| {_ratio(r, 'training_flops')} | {_mib(p.get('total', 0))} | {_ratio(r, 'peak_memory')} | {parts} "
            f"| {_mib(r['comm_bytes_per_step'])} | {_ratio(r, 'comm_bytes_per_step')} "
            f"| {'-' if r.get('wire_bytes_per_step') is None else _mib(r['wire_bytes_per_step'])} "
            f"| {_ratio(r, 'wire_bytes_per_step')} | {r['step_time_s']:.3f} "
            f"| {_ratio(r, 'step_time_s')} | {bound} |"
        )
    for name, why in report.get("not_run", {}).items():
        lines.append(f"\nNot run: `{name}`: {why}.")
    for note in report.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out: Path) -> None:
    """compare_loss.png (validation loss vs steps and vs FLOPs) and compare_cost.png (memory, bytes, time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    colors = plt.get_cmap("tab20").colors
    fig, (ax_s, ax_f) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (name, r) in enumerate(runs.items()):
        steps = np.array([v["step"] + 1 for v in r["val_history"]])
        loss = np.array([v["val_loss"] for v in r["val_history"]])
        style = "--" if r["mode"] in ("ddp", "fsdp") else "-"
        kw = {"marker": "o", "ms": 3, "label": name, "color": colors[i % len(colors)]}
        ax_s.plot(steps, loss, style, **kw)
        ax_f.plot(steps * r["flops_per_step"], loss, style, **kw)
    ax_s.set_xlabel("optimizer steps")
    ax_f.set_xlabel("training FLOPs per rank")
    for ax in (ax_s, ax_f):
        ax.set_ylabel("validation loss (full model)")
        ax.grid(alpha=0.3)
    ax_f.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{report['command']}  ({report['date']})")
    fig.tight_layout()
    _save(fig, out / "compare_loss.png")
    plt.close(fig)

    names = list(runs)
    x = np.arange(len(names))
    fig, (ax_m, ax_c, ax_t) = plt.subplots(1, 3, figsize=(16, 5))
    bottom = np.zeros(len(names))
    for cat in CATEGORIES:
        vals = np.array([runs[n]["peak_memory_bytes"].get(cat, 0) / 2**20 for n in names])
        ax_m.bar(x, vals, bottom=bottom, label=cat)
        bottom += vals
    ax_m.set_ylabel("peak memory of the largest rank (MiB)")
    ax_m.legend(fontsize=7)
    ax_c.bar(x - 0.2, [runs[n]["comm_bytes_per_step"] / 2**20 for n in names], width=0.4, color="C4", label="buffer")
    ax_c.bar(x + 0.2, [(runs[n].get("wire_bytes_per_step") or 0) / 2**20 for n in names], width=0.4, color="C6",
             label="wire (ring model)")
    ax_c.set_ylabel("bytes per step per rank (MiB)")
    ax_c.legend(fontsize=7)
    ax_t.bar(x, [runs[n]["step_time_s"] for n in names], color="C5")
    ax_t.set_ylabel("median step time (s)")
    for ax in (ax_m, ax_c, ax_t):
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    fig.suptitle(f"{report['command']}  ({report['date']})")
    fig.tight_layout()
    _save(fig, out / "compare_cost.png")
    plt.close(fig)


def _save(fig, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
