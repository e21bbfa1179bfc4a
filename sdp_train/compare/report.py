"""Write a comparison's report: compare.json, a Markdown table (compare.md) and PNG plots.

The report is the dict `sdp_train.compare.runner.build_report` makes; this module only renders it and
imports nothing of `sdp_train.compare.runner` (one direction: compare -> compare_report).

Every ratio is to the DDP run of the same comparison. ``bound x`` is the bound of the theorem of
docs/theory.md that covers the run (`theory.coverage.covered_bound_ratio`) under unit problem
constants (L = sigma = zeta = 1, f(x0) - f* = 1) at the bound-optimal step size, divided by DDP's.
No theorem covers an ``sdp train`` run (AdamW, warm-up, cosine decay, clipping; every theorem is
for constant-step SGD), so the column shows in parentheses the same ratio for plain constant-step
SGD with the run's mask (``sgd_bound_vs_ddp``): a design figure that ranks masks, labelled as such,
not a guarantee; '-' where no theorem covers even that (forward masking). Validation loss is that of the full assembled model on the same
held-out batches for every run.

Plots: ``compare_loss.png`` (validation loss against steps and against training FLOPs per rank)
and ``compare_cost.png`` (peak memory per rank stacked by category, buffer and wire bytes per step
per rank, median step time), both of seed 0's runs; with overlap-averaging runs (``--preset
cpu-overlap``) also ``compare_consensus.png`` (`plot_consensus`) and a table of their consensus
distances beside Theorem 4's rates (`consensus_table`).

With ``--seeds N`` (N > 1) compare.md adds a table over the seeds (`seed_table`) and compare.json
the keys ``seeds``, ``seed_runs`` and ``seed_stats`` (`sdp_train.compare.stats` documents them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from masklab.io import atomic_write, atomic_write_text
from sdp_train.trainer.memory import CATEGORIES


def write_report(report: dict[str, Any], out: Path) -> None:
    """compare.json, compare.md and the two plots, each written whole or not at all."""
    atomic_write_text(out / "compare.json", json.dumps(report, indent=1) + "\n")
    atomic_write_text(out / "compare.md", markdown_table(report) + "\n")
    plot(report, out)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(row: dict[str, Any], key: str, digits: int = 2) -> str:
    value = row.get(f"{key}_vs_ddp")
    return "-" if value is None else f"{value:.{digits}f}"


def _bound_cell(row: dict[str, Any]) -> str:
    """The covering theorem's ratio, else the constant-step-SGD design figure in parentheses, else '-'."""
    if row.get("bound_infinite"):
        return "inf"
    if row["bound_vs_ddp"] is not None:
        return f"{row['bound_vs_ddp']:.2f}"
    if row.get("sgd_bound_infinite"):
        return "(inf)"
    return "-" if row.get("sgd_bound_vs_ddp") is None else f"({row['sgd_bound_vs_ddp']:.2f})"


def markdown_table(report: dict[str, Any]) -> str:
    """The comparison as a Markdown table, one row per run, with ratios to DDP."""
    s = report["settings"]
    accuracy = any(r.get("final_val_accuracy") is not None for r in report["runs"].values())
    batch = f"{s['batch_size']} images" if accuracy else f"{s['batch_size']} x {s['seq_len']} tokens"
    lines = [
        f"`{report['command']}`: {s['model']}, {s['workers']} workers, {batch} "
        f"per worker per step, lr {s['lr']}, seed 0; {report['machine']}, {report['date']}. "
        "Ratios (x) are to DDP in the same comparison. Memory is the measured peak of the largest rank "
        "(MiB: parameters / gradients / optimizer / activations). Buffer MiB/step: the sizes of the buffers "
        "passed to collectives per rank; wire MiB/step: what one rank sends under the ring model "
        "(all-reduce 2(c-1)/c of its buffer, all-gather / reduce-scatter / broadcast (c-1)/c; docs/design.md). "
        "bound x: the bound of the theorem that covers the run (docs/theory.md), over DDP's, under unit "
        "constants. In parentheses, for runs no theorem covers (AdamW, warm-up, cosine decay or clipping: every "
        "theorem is for constant-step SGD), the same ratio for constant-step SGD with the run's mask: a design "
        "figure (heuristic), not a guarantee for the run; for overlap averaging it is Theorem 6's, for the mean "
        "of all K copies. '-' where no theorem covers even that (forward-masked B-/N-SDP, whose subnetworks are "
        "not the backward-masked algorithm the theorems bound), 'inf' where it gives no finite bound."
        + (" val acc: top-1 accuracy of the final full model on the validation batches; - DDP: its difference "
           "to DDP's, in percentage points." if accuracy else ""),
        "",
        "| run | C | steps | val loss | x" + (" | val acc | - DDP" if accuracy else "")
        + " | train FLOPs x | peak MiB | x | P / G / O / A | buffer MiB/step | x | wire MiB/step | x | step s | x "
        "| bound x |",
        "|---|---:|---:|---:|---:" + ("|---:|---:" if accuracy else "") + "|---:|---:|---:|---|---:|---:|---:|---:"
        "|---:|---:|---:|",
    ]
    for name, r in report["runs"].items():
        p = r["peak_memory_bytes"]
        parts = " / ".join(f"{p.get(c, 0) / 2**20:.1f}" for c in CATEGORIES[:4])
        active = "1" if r["active"] is None else f"{r['active']:.3g}"
        bound = _bound_cell(r)
        lines.append(
            f"| {name} | {active} | {r['steps']} | {r['final_val_loss']:.4f} | {_ratio(r, 'final_val_loss', 3)} "
            + (_accuracy_cells(r) if accuracy else "") +
            f"| {_ratio(r, 'training_flops')} | {_mib(p.get('total', 0))} | {_ratio(r, 'peak_memory')} | {parts} "
            f"| {_mib(r['comm_bytes_per_step'])} | {_ratio(r, 'comm_bytes_per_step')} "
            f"| {'-' if r.get('wire_bytes_per_step') is None else _mib(r['wire_bytes_per_step'])} "
            f"| {_ratio(r, 'wire_bytes_per_step')} | {r['step_time_s']:.3f} "
            f"| {_ratio(r, 'step_time_s')} | {bound} |"
        )
    if any("consensus_history" in r for r in report["runs"].values()):
        lines += ["", *consensus_table(report)]
    if "seed_stats" in report:
        lines += ["", *seed_table(report)]
    for name, why in report.get("not_run", {}).items():
        lines.append(f"\nNot run: `{name}`: {why}.")
    for note in report.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def _accuracy_cells(row: dict[str, Any]) -> str:
    acc, diff = row.get("final_val_accuracy"), row.get("final_val_accuracy_minus_ddp")
    return (f"| {'-' if acc is None else f'{acc:.2%}'} "
            f"| {'-' if diff is None else f'{100 * diff:+.2f}'} ")


def consensus_table(report: dict[str, Any]) -> list[str]:
    """The lines of the overlap-averaging table: per run its schedule, H, the mask's spectral gap
    gamma(M), Theorem 4's gap g of the schedule (per period of P rounds) and the per-round factor
    (1 - g)^(1/P) it guarantees for the copies' disagreement without training, and the measured
    consensus distance (sum over blocks and the shared parameters) at the middle and the end."""
    lines = [
        "Overlap averaging (copies kept; each block averaged among its current holders every H steps). "
        "gamma(M): the spectral gap of the mask matrix (a permute schedule's expected graph has the same gap "
        "for every mask of one coverage); g: Theorem 4's gap of the schedule's expected mixing operator, "
        "per period of P rounds, and (1 - g)^(1/P) the per-round contraction of the copies' disagreement it "
        "guarantees when nothing trains; consensus distance: sum over blocks of the mean squared distance of "
        "the workers' copies from their average (compare_consensus.png plots it against step).",
        "",
        "| run | schedule | H | gamma(M) | g (P) | (1 - g)^(1/P) | consensus distance, middle | at the end |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["runs"].items():
        if "consensus_history" not in r:
            continue
        history, gap, period = r["consensus_history"], r["consensus_gap"], r["consensus_period"]
        middle = history[(len(history) - 1) // 2]
        lines.append(f"| {name} | {r['schedule']} | {r['local_steps']} | {r['spectral_gap']:.3f} | {gap:.3f} "
                     f"({period}) | {(1 - gap) ** (1 / period):.3f} | {middle['total']:.4g} (step "
                     f"{middle['step'] + 1}) | {history[-1]['total']:.4g} |")
    return lines


SEED_RATIOS = (("val loss x", "final_val_loss_vs_ddp"), ("train FLOPs x", "training_flops_vs_ddp"),
               ("peak x", "peak_memory_vs_ddp"), ("buffer x", "comm_bytes_per_step_vs_ddp"),
               ("wire x", "wire_bytes_per_step_vs_ddp"), ("step s x", "step_time_s_vs_ddp"))
"""The table's ratios to DDP, as (column, compare.json key), that the seed table repeats over seeds."""


def _interval(stat: dict[str, Any] | None, digits: int) -> str:
    if stat is None:
        return "-"
    if stat["ci_low"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['ci_low']:.{digits}f}, {stat['ci_high']:.{digits}f}]"


def seed_table(report: dict[str, Any]) -> list[str]:
    """The lines of the table over seeds (``seed_stats``, `sdp_train.compare.stats`): per run the mean
    val loss and its spread, the paired difference to DDP with its interval and verdict, and every
    ratio to DDP as mean [interval]."""
    stats = report["seed_stats"]
    seeds = stats["seeds"]
    pct = f"{100 * stats['confidence']:g}%"
    dof = len(seeds) - 1
    lines = [
        f"Over {len(seeds)} seeds ({', '.join(map(str, seeds))}; the table above is seed {seeds[0]}'s). Each system "
        "keeps its one mask, so the spread is that of model init and data order. mean ± sd: sample standard "
        f"deviation; [a, b]: {pct} Student-t confidence interval ({dof} degree{'s' * (dof != 1)} of freedom). "
        "- DDP: the val loss minus DDP's at the same seed (paired by seed), 'larger than the seed-to-seed "
        "spread' when its interval excludes 0.",
        "",
        "| run | val loss (mean ± sd) | - DDP | difference to DDP | "
        + " | ".join(col for col, _ in SEED_RATIOS) + " |",
        "|---|---:|---:|---|" + "---:|" * len(SEED_RATIOS),
    ]
    for name, r in stats["runs"].items():
        loss, diff = r["final_val_loss"], r["final_val_loss_minus_ddp"]
        spread = "" if loss["sd"] is None else f" ± {loss['sd']:.4f}"
        ratios = " | ".join(_interval(r.get(key), 3 if key == "final_val_loss_vs_ddp" else 2)
                            for _, key in SEED_RATIOS)
        lines.append(f"| {name} | {loss['mean']:.4f}{spread} | {_interval(diff, 4)} | {diff['verdict'] or '-'} "
                     f"| {ratios} |")
    return lines


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
    if any("consensus_history" in r for r in runs.values()):
        plot_consensus(report, out)


def plot_consensus(report: dict[str, Any], out: Path) -> None:
    """compare_consensus.png: each overlap-averaging run's measured consensus distance against step
    (solid), and from each measured point the decay Theorem 4 guarantees over the next evaluation
    interval when nothing trains, (1 - g)^floor(rounds / P) (dotted): where the measurement stays
    above it, training (local steps) adds the disagreement the averages take away."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, r) in enumerate((n, r) for n, r in report["runs"].items() if "consensus_history" in r):
        steps = np.array([h["step"] + 1 for h in r["consensus_history"]])
        total = np.array([h["total"] for h in r["consensus_history"]])
        color = f"C{i}"
        ax.plot(steps, total, "-o", ms=3, color=color,
                label=f"{name}: gamma(M) {r['spectral_gap']:.3f}, g {r['consensus_gap']:.3f}")
        for (s0, x0), s1 in zip(zip(steps, total), steps[1:]):
            span = np.arange(s0, s1 + 1)
            rounds = (span - s0) // r["local_steps"]
            ax.plot(span, x0 * (1 - r["consensus_gap"]) ** (rounds // r["consensus_period"]), ":", color=color)
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("consensus distance (sum over blocks)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{report['command']}  ({report['date']}): measured (solid), Theorem 4 without training (dotted)",
                 fontsize=8)
    fig.tight_layout()
    _save(fig, out / "compare_consensus.png")
    plt.close(fig)


def _save(fig, path: Path) -> None:
    atomic_write(path, lambda name: fig.savefig(name, format="png", dpi=110))
