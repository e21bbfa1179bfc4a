"""Mask invariant checks for any pytest suite: they raise `AssertionError` with a readable message.

Like ``numpy.testing`` and ``torch.testing``, a failed check is an `AssertionError` whose message
names the offending blocks/workers and every number involved; a check called with a bad argument
(a negative threshold, ...) raises `MaskError`, a `ValueError`. Model-level checks (a user's
``torch.nn.Module`` and block map) are in `sdp_train.testing`; this module needs no torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from masklab.analysis import (
    block_masking_errors,
    is_connected,
    masking_error,
    optimality_ratio,
    spectral_gap,
    spectral_gap_bound,
)
from masklab.errors import MaskError
from masklab.mask import Mask

__all__ = ["assert_covers", "assert_masking_error_at_most", "assert_spectral_gap_at_least", "assert_valid_mask"]

_SHOWN = 10  # offending blocks listed in a message before "... and N more"


def assert_valid_mask(mask: Any) -> Mask:
    """Assert that `mask` (a `Mask` or a K x B array) is a valid mask and return it as a `Mask`.

    Valid (docs/design.md §2): 2-D, entries 0/1, every block held by some worker, every worker holding
    some block.

    >>> assert_valid_mask([[1, 0], [0, 1]]).coverage.tolist()
    [1, 1]
    >>> assert_valid_mask([[1, 0], [1, 0]])
    Traceback (most recent call last):
    ...
    AssertionError: not a valid mask: block 1 (column 1, 'block1') is held by no worker
    """
    try:
        return mask.replace() if isinstance(mask, Mask) else Mask(mask)
    except MaskError as exc:
        raise AssertionError(f"not a valid mask: {exc}") from None


def assert_covers(mask: Mask, min_coverage: int = 1) -> None:
    """Assert that every block is held by at least `min_coverage` workers (c_j >= min_coverage).

    >>> assert_covers(Mask([[1, 1], [0, 1]]), min_coverage=2)
    Traceback (most recent call last):
    ...
    AssertionError: 1 of 2 blocks have coverage < 2 (K=2 workers): block 0 'block0' c=1 holders (0,)
    """
    _check_mask(mask)
    if isinstance(min_coverage, bool) or not isinstance(min_coverage, (int, np.integer)) or min_coverage < 1:
        raise MaskError(f"min_coverage={min_coverage!r} must be an integer >= 1")
    if min_coverage > mask.workers:
        raise MaskError(f"min_coverage={min_coverage} exceeds the number of workers K={mask.workers}")
    low = np.flatnonzero(mask.coverage < min_coverage)
    if low.size:
        listed = "; ".join(
            f"block {j} {mask.block_names[j]!r} c={int(mask.coverage[j])} holders {mask.holder_set(int(j))}"
            for j in low[:_SHOWN]
        )
        raise AssertionError(
            f"{low.size} of {mask.blocks} blocks have coverage < {min_coverage} (K={mask.workers} workers): "
            f"{listed}{_more(low.size)}"
        )


def assert_spectral_gap_at_least(mask: Mask, gamma: float, *, rtol: float = 1e-9) -> None:
    """Assert gamma(M) >= `gamma` (up to a relative tolerance `rtol` for the eigensolver).

    The message gives the gap, the trace bound it can reach at this coverage, the optimality ratio
    and whether the mixing graph is connected.

    >>> assert_spectral_gap_at_least(Mask([[1, 0], [0, 1]]), 0.1)
    Traceback (most recent call last):
    ...
    AssertionError: spectral gap 0 < required 0.1 for Mask(workers=2, blocks=2, active_fraction=0.5, schedule='static'): mixing graph disconnected; trace bound (mean coverage - 1)/(K - 1) = 0 < 0.1, so no mask with this coverage reaches it
    """
    _check_mask(mask)
    _check_fraction("gamma", gamma)
    gap = spectral_gap(mask)
    if gap < gamma * (1 - rtol):
        bound = spectral_gap_bound(mask)
        connected = "connected" if is_connected(mask) else "disconnected"
        reach = (
            f" < {gamma:.6g}, so no mask with this coverage reaches it" if bound < gamma * (1 - rtol)
            else f", optimality ratio {optimality_ratio(mask, gap=gap):.6g}"
        )
        raise AssertionError(
            f"spectral gap {gap:.6g} < required {gamma:.6g} for {mask!r}: mixing graph {connected}; "
            f"trace bound (mean coverage - 1)/(K - 1) = {bound:.6g}{reach}"
        )


def assert_masking_error_at_most(mask: Mask, eps: float, *, rtol: float = 1e-9) -> None:
    """Assert eps(M) = max_j eps_j <= `eps`, listing the blocks over the limit with their coverage.

    >>> assert_masking_error_at_most(Mask([[1, 1], [1, 0]]), 0.5)
    Traceback (most recent call last):
    ...
    AssertionError: masking error 1 > allowed 0.5 (K=2, schedule 'static'); 1 of 2 blocks over: block 1 'block1' eps=1 c=1
    """
    _check_mask(mask)
    if not (isinstance(eps, (int, float, np.floating)) and math.isfinite(eps) and eps >= 0):
        raise MaskError(f"eps={eps!r} must be a finite number >= 0")
    if masking_error(mask) <= eps * (1 + rtol):
        return
    per_block = block_masking_errors(mask)
    over = np.flatnonzero(per_block > eps * (1 + rtol))
    over = over[np.argsort(-per_block[over], kind="stable")]
    listed = "; ".join(
        f"block {j} {mask.block_names[j]!r} eps={per_block[j]:.6g} c={int(mask.coverage[j])}" for j in over[:_SHOWN]
    )
    raise AssertionError(
        f"masking error {per_block.max():.6g} > allowed {eps:.6g} (K={mask.workers}, schedule "
        f"{mask.schedule.kind!r}); {over.size} of {mask.blocks} blocks over: {listed}{_more(over.size)}"
    )


def _check_mask(mask: Any) -> None:
    if not isinstance(mask, Mask):
        raise MaskError(f"expected a masklab.Mask, got {type(mask).__name__}; wrap arrays with Mask(...)")


def _check_fraction(name: str, value: Any) -> None:
    if not (isinstance(value, (int, float, np.floating)) and 0.0 <= value <= 1.0):
        raise MaskError(f"{name}={value!r} must be a number in [0, 1]")


def _more(n: int) -> str:
    return f" ... and {n - _SHOWN} more" if n > _SHOWN else ""
