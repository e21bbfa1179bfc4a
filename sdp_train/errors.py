"""User-input errors raised by sdp_train. Every message names the offending field, value or path."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model, subnetwork or data configuration is invalid (bad field, unknown name, wrong mask row)."""


class DataError(ValueError):
    """A data set cannot provide what was asked (too few samples for a batch, bad split, ...)."""


class DataFileError(DataError):
    """A user data file is missing, truncated or not in the expected format."""
