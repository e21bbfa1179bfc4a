"""User-input errors raised by `theory` (all subclass `ValueError`, so the `sdp` dispatcher reports them)."""

from __future__ import annotations


class TheoryError(ValueError):
    """A problem constant, step size, horizon or simulator setting that the theory cannot accept."""


class AssumptionError(TheoryError):
    """A bound was asked for without a constant its theorem needs (e.g. a gradient bound for local steps)."""
