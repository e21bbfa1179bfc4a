"""User-input errors raised by sdp_train. Every message names the offending field, value or path."""

from __future__ import annotations

EXIT_USAGE = 2
"""Exit status of a command that refused its input (argparse's too), wherever the error was found:
in the launching process or, under ``sdp train``'s own launcher, inside a rank."""


class ConfigError(ValueError):
    """A model, subnetwork or data configuration is invalid (bad field, unknown name, wrong mask row)."""


class BlockMapError(ConfigError):
    """A user's block map or subnetwork does not fit the model or the mask (names, shapes, sizes)."""


class DataError(ValueError):
    """A data set cannot provide what was asked (too few samples for a batch, bad split, ...)."""


class DataFileError(DataError):
    """A user data file is missing, truncated or not in the expected format."""


class NonFiniteError(ArithmeticError):
    """Training produced a non-finite loss or gradient norm and the policy (``nonfinite='stop'``) ends the run.

    Raised on every rank in the same step (the check reads the all-reduced loss and gradient norm), so
    no rank is left waiting in a collective. Not a ``ValueError``: the input was well-formed; the
    optimisation diverged.
    """
