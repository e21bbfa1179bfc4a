"""Errors raised by masklab.testing for bad arguments (a failed check is an `AssertionError`)."""

from __future__ import annotations

from masklab.errors import MaskError


class BlockMapError(MaskError):
    """A user's block map or subnetwork does not fit the model or the mask (names, shapes, sizes)."""
