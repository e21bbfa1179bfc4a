"""Statistics over the seeds of ``sdp compare --seeds N``: mean, spread and confidence intervals.

Every system of a comparison trained with seeds 0, 1, ..., N-1 gives N values of each ratio to DDP
the report prints (``*_vs_ddp``: val loss, training FLOPs, peak memory, buffer and wire bytes, step
time), each ratio taken to DDP's run of the same seed. For each, `summarize` gives the mean, the
sample standard deviation (N - 1 in the denominator) and a confidence interval from Student's t
with N - 1 degrees of freedom. The validation loss is also compared by its difference to DDP's,
paired by seed (a seed fixes the model init and the data order of every system alike), and the
difference is called *larger than the seed-to-seed spread* when its interval excludes 0, else
*within the spread* (`paired_difference`); a ratio gets the same verdict when its interval excludes 1.

`seed_statistics` returns, under compare.json's ``seed_stats``::

    {"confidence": 0.95, "seeds": [0, 1, ...],
     "runs": {NAME: {"final_val_loss": S, "final_val_loss_minus_ddp": S + verdict,
                     "final_val_loss_vs_ddp": S + verdict, "peak_memory_vs_ddp": ..., ...}}}

with S = ``{"n", "mean", "sd", "ci_low", "ci_high"}`` (``sd`` and the interval None for one value;
``verdict`` None then, there being no spread to compare with). A ratio that is None in some seed
(a summary without wire bytes) is summarized over the seeds that have it.

Not here: training the seeds (`sdp_train.compare.runner`) and rendering (`sdp_train.compare.report`).
With one seed nothing of this is computed: one seed of a small model is a smoke test.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from sdp_train.errors import ConfigError

LARGER = "larger than the seed-to-seed spread"
WITHIN = "within the spread"


def t_quantile(confidence: float, dof: int) -> float:
    """The two-sided Student-t critical value: P(|T| <= q) = `confidence` for T with `dof` degrees of freedom.

    >>> round(t_quantile(0.95, 1), 3), round(t_quantile(0.95, 4), 3)
    (12.706, 2.776)
    """
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence={confidence} must be in (0, 1)")
    if dof < 1:
        raise ConfigError(f"dof={dof} must be at least 1")
    from scipy.stats import t

    return float(t.ppf((1 + confidence) / 2, dof))


def summarize(values: Sequence[float], *, confidence: float = 0.95) -> dict[str, Any]:
    """Mean, sample standard deviation and Student-t confidence interval of `values`.

    Computed in exact rational arithmetic (`statistics`), so a constant series has spread 0.0
    exactly and its interval is the single point. One value has no spread: ``sd``, ``ci_low``
    and ``ci_high`` are None.

    >>> summarize([1.0, 2.0, 3.0])["sd"], round(summarize([1.0, 2.0, 3.0])["ci_high"], 4)
    (1.0, 4.4841)
    """
    values = [float(v) for v in values]
    if not values:
        raise ConfigError("summarize needs at least one value, got none")
    n = len(values)
    mean = statistics.mean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "ci_low": None, "ci_high": None}
    sd = statistics.stdev(values, mean)
    half = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci_low": mean - half, "ci_high": mean + half}


def verdict(summary: Mapping[str, Any], null: float) -> str | None:
    """`LARGER` when the interval of `summary` excludes `null`, `WITHIN` when it holds it, None without one."""
    if summary["ci_low"] is None:
        return None
    return WITHIN if summary["ci_low"] <= null <= summary["ci_high"] else LARGER


def paired_difference(values: Sequence[float], reference: Sequence[float], *,
                      confidence: float = 0.95) -> dict[str, Any]:
    """`summarize` of ``values[i] - reference[i]`` (pairs: the same seed) with its `verdict` against 0."""
    if len(values) != len(reference):
        raise ConfigError(f"paired values need equal lengths, got {len(values)} and {len(reference)}")
    summary = summarize([v - r for v, r in zip(values, reference)], confidence=confidence)
    return {**summary, "verdict": verdict(summary, 0.0)}


def seed_statistics(runs_by_seed: Mapping[int, Mapping[str, Mapping[str, Any]]], *,
                    confidence: float = 0.95) -> dict[str, Any]:
    """The ``seed_stats`` of compare.json (module doc) from each seed's report rows (``runs`` of `build_report`).

    Each seed must have a ``ddp`` row; a system missing in a seed is summarized over the others.
    """
    seeds = sorted(runs_by_seed)
    missing = [s for s in seeds if "ddp" not in runs_by_seed[s]]
    if not seeds or missing:
        raise ConfigError(f"seed statistics need a ddp run in every seed; seeds {seeds}, without ddp: {missing}")
    names = list(dict.fromkeys(name for s in seeds for name in runs_by_seed[s]))
    runs: dict[str, Any] = {}
    for name in names:
        present = [s for s in seeds if name in runs_by_seed[s]]
        rows = [runs_by_seed[s][name] for s in present]
        ddp = [runs_by_seed[s]["ddp"]["final_val_loss"] for s in present]
        loss = [r["final_val_loss"] for r in rows]
        stats: dict[str, Any] = {
            "final_val_loss": summarize(loss, confidence=confidence),
            "final_val_loss_minus_ddp": paired_difference(loss, ddp, confidence=confidence),
        }
        for key in dict.fromkeys(k for r in rows for k in r if k.endswith("_vs_ddp")):
            ratios = [r[key] for r in rows if r.get(key) is not None]
            if ratios:
                summary = summarize(ratios, confidence=confidence)
                stats[key] = {**summary, "verdict": verdict(summary, 1.0)}
        runs[name] = stats
    return {"confidence": confidence, "seeds": seeds, "runs": runs}
