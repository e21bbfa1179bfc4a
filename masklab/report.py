"""The certificate of a mask: every quantity of docs/design.md §3 in one record, as JSON or a table.

The key names of `MaskReport.to_dict` are an output contract used by other tools (``sdp inspect
--json``, ``sdp design --json``); add keys, never rename them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from masklab import analysis
from masklab.mask import Mask


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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def to_text(self) -> str:
        """A readable two-column table."""
        rows = [
            ("workers (K)", f"{self.workers}"),
            ("blocks (B)", f"{self.blocks}"),
            ("construction", self.construction or "-"),
            ("schedule", self.schedule + ("" if self.schedule == "static" else f" every {self.schedule_every} steps")),
            ("active fraction (C)", f"{self.active_fraction:.4f}"),
            ("coverage min / max", f"{self.coverage_min} / {self.coverage_max}"),
            ("masking error (eps)", f"{self.masking_error:.6g}"),
            ("variance inflation", f"{self.variance_inflation:.6g}"),
            ("spectral gap (gamma)", f"{self.spectral_gap:.6g}"),
            ("spectral gap bound", f"{self.spectral_gap_bound:.6g}"),
            ("optimality ratio", f"{self.optimality_ratio:.6f}"),
            ("co-training gap", f"{self.cotraining_gap:.6g}"),
            ("mixing graph connected", "yes" if self.connected else "NO"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


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
    )
