"""The certificate of a mask: every quantity of docs/design.md §3 in one record, as JSON or a table.

The key names of `MaskReport.to_dict` are an output contract used by other tools (``sdp inspect
--json``, ``sdp design --json``); add keys, never rename them. Every number says which theorem of
docs/theory.md uses it and in which regime (`USED_BY`, the ``used_by`` key and the text table's
third column); a number no theorem uses is marked as a diagnostic, not as a condition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from masklab import analysis, failures
from masklab.mask import Mask


USED_BY: dict[str, str] = {
    "active_fraction": "compute per step, (2 + C)/3 of DDP under backward masking (FLOP matching, docs/theory.md §7)",
    "coverage_min": "every theorem needs c_j >= 1; E[1/c_j] is the noise factor of Theorems 1-3",
    "coverage_max": "Theorem 6 (overlap averaging): the step of each block's mean is c_j/K",
    "masking_error": "bias floor of Theorems 1 and 3, backward masking; 0 only when the mask is redrawn every step "
                     "(Theorem 2); static, cyclic, sequence and held masks use the mask in force",
    "variance_inflation": "noise term of Theorems 1-3 (K E[1/c_j]), backward masking",
    "spectral_gap": "overlap averaging only (copies kept, holders average): the per-round consensus rate of a "
                    "balanced mask under a permute schedule redrawn every round (Theorem 4.2); it does not govern a "
                    "static mask's consensus (non-holders never receive the average: no contraction unless "
                    "c_j = K) nor a cyclic or held schedule's (Theorem 4.1: the period's gap g_j); a design figure "
                    "elsewhere; no stepwise theorem (1-3) uses it",
    "spectral_gap_bound": "Theorem 5: the cap (mean coverage - 1)/(K - 1) on gamma; overlap averaging only",
    "optimality_ratio": "Theorem 5: gamma / cap, how close the design is to the best gamma for its coverage; a rate "
                        "only where gamma is one (Theorem 4.2)",
    "cotraining_gap": "diagnostic, used by no theorem: whether the blocks were ever trained together",
    "connected": "overlap averaging only (Theorem 4): necessary, not sufficient, for copies of a static mask to agree; "
                 "not a condition of Theorems 1-3",
    "failures_survived": "diagnostic, used by no theorem: min c_j - 1 workers may be lost at once with every block "
                         "still held by a survivor (the redundancy `sdp train --on-worker-loss continue` goes on from "
                         "without rollback, docs/design.md §7); fatal_sets lists the smallest sets of "
                         "workers whose loss leaves a block without holder (its holder set)",
    "schedule": "which theorem: permute redrawn every step -> Theorem 2/2'; static, cyclic, sequence or held R > 1 -> "
                "Theorem 1 at the mask in force; overlap averaging -> Theorems 4 and 6 with the schedule's period",
}


@dataclass(frozen=True)
class MaskReport:
    """Analysis of one mask (for a schedule: exact expectations over it)."""

    workers: int
    blocks: int
    active_fraction: float
    coverage_min: int
    coverage_max: int
    masking_error: float
    variance_inflation: float
    spectral_gap: float
    spectral_gap_bound: float
    optimality_ratio: float
    cotraining_gap: float
    connected: bool
    construction: str | None
    schedule: str
    schedule_every: int
    failures_survived: int = 0
    fatal_sets: tuple[tuple[int, ...], ...] = ()
    fatal_sets_total: int = 0

    @property
    def masking_error_regime(self) -> str:
        """Which theorem's masking error `masking_error` is."""
        if self.schedule == "permute" and self.schedule_every == 1:
            return "mask redrawn every step: expectation over the schedule (Theorem 2)"
        return "mask in force at each step (Theorem 1; cyclic, sequence and held schedules too)"

    @property
    def fatal_sets_text(self) -> str:
        """The smallest fatal sets as ``{0,1} {0,2} ... (N sets of s workers, n shown)``."""
        shown = " ".join("{" + ",".join(map(str, s)) + "}" for s in self.fatal_sets)
        more = f", {len(self.fatal_sets)} shown" if self.fatal_sets_total > len(self.fatal_sets) else ""
        size = self.failures_survived + 1
        sets, workers = "s" * (self.fatal_sets_total != 1), "s" * (size != 1)
        return f"{shown} ({self.fatal_sets_total} set{sets} of {size} worker{workers}{more})"

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["masking_error_regime"] = self.masking_error_regime
        out["used_by"] = dict(USED_BY)
        return out

    def to_text(self) -> str:
        """A readable two-column table."""
        rows = [
            ("workers (K)", f"{self.workers}", ""),
            ("blocks (B)", f"{self.blocks}", ""),
            ("construction", self.construction or "-", ""),
            ("schedule", self.schedule + ("" if self.schedule == "static" else f" every {self.schedule_every} steps"),
             USED_BY["schedule"]),
            ("active fraction (C)", f"{self.active_fraction:.4f}", USED_BY["active_fraction"]),
            ("coverage min / max", f"{self.coverage_min} / {self.coverage_max}", USED_BY["coverage_min"]),
            ("masking error (eps)", f"{self.masking_error:.6g}", USED_BY["masking_error"]),
            ("variance inflation", f"{self.variance_inflation:.6g}", USED_BY["variance_inflation"]),
            ("spectral gap (gamma)", f"{self.spectral_gap:.6g}", USED_BY["spectral_gap"]),
            ("spectral gap bound", f"{self.spectral_gap_bound:.6g}", USED_BY["spectral_gap_bound"]),
            ("optimality ratio", f"{self.optimality_ratio:.6f}", USED_BY["optimality_ratio"]),
            ("co-training gap", f"{self.cotraining_gap:.6g}", USED_BY["cotraining_gap"]),
            ("mixing graph connected", "yes" if self.connected else "NO", USED_BY["connected"]),
            ("failures survived", f"{self.failures_survived}", USED_BY["failures_survived"]),
        ]
        width = max(len(k) for k, _, _ in rows)
        value_width = max(len(v) for _, v, _ in rows)
        lines = [f"{k:<{width}}  {v:<{value_width}}  {u}".rstrip() for k, v, u in rows]
        lines.append(f"masking error regime: {self.masking_error_regime}")
        lines.append(f"smallest fatal sets (losing one leaves a block without holder): {self.fatal_sets_text}")
        return "\n".join(lines)


def analyze(mask: Mask) -> MaskReport:
    """Compute the full certificate of `mask`.

    >>> r = analyze(Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]]))
    >>> r.coverage_min, r.connected, round(r.optimality_ratio, 9)
    (2, True, 1.0)
    """
    coverage = mask.coverage
    gap = analysis.spectral_gap(mask)
    return MaskReport(
        workers=mask.workers,
        blocks=mask.blocks,
        active_fraction=mask.active_fraction,
        coverage_min=int(coverage.min()),
        coverage_max=int(coverage.max()),
        masking_error=analysis.masking_error(mask),
        variance_inflation=analysis.variance_inflation(mask),
        spectral_gap=gap,
        spectral_gap_bound=analysis.spectral_gap_bound(mask),
        optimality_ratio=analysis.optimality_ratio(mask, gap=gap),
        cotraining_gap=analysis.cotraining_gap(mask),
        connected=analysis.is_connected(mask),
        construction=mask.construction,
        schedule=mask.schedule.kind,
        schedule_every=mask.schedule.every,
        failures_survived=failures.failures_survived(mask),
        fatal_sets=failures.smallest_fatal_sets(mask, limit=failures.FATAL_SETS_SHOWN),
        fatal_sets_total=failures.count_smallest_fatal_sets(mask),
    )
