"""User-input errors raised by masklab. Every message names the offending row, column, field or value."""

from __future__ import annotations


class MaskError(ValueError):
    """A mask (matrix, schedule, names, sizes) violates a rule of docs/design.md §2."""


class MaskFileError(MaskError):
    """A mask file cannot be read: missing, truncated, of another format or an unknown version."""


class DesignError(ValueError):
    """The parameters of a requested design are inconsistent (e.g. coverage larger than K)."""


class CostsFileError(DesignError):
    """A costs file (bytes per block, `masklab.io.load_costs`) cannot be read or holds invalid costs."""
