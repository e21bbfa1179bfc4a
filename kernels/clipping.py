"""Gradient clipping decided on the device: the factor from a squared norm, with no host synchronisation.

`squared_norm` (or the ``partials`` that `pack` / `unpack` fill in the same launch) leaves a
bucket's share of a clipping norm on the device; summed over buckets (and ranks) it gives the
squared norm, from which `clip_coefficient` computes the factor as a device tensor, to be applied
with one ``torch._foreach_mul_(grads, coefficient)``. No Python branch reads the norm, so the host
never waits for the device. This module does not sum over ranks, decide what to do with a
non-finite norm, or touch gradients.
"""

from __future__ import annotations

import math

import torch

from kernels.errors import KernelInputError


def clip_coefficient(squared_norm: torch.Tensor, max_norm: float, *, eps: float = 1e-6) -> torch.Tensor:
    """The factor that clips a gradient of squared 2-norm `squared_norm` to `max_norm`, on its device.

    ``max_norm / (norm + eps)`` where ``norm = sqrt(squared_norm) > max_norm``, else 1, computed
    without reading the norm on the host (``torch.where``, not an ``if``). A NaN norm gives 1 and
    an infinite one 0: decide about non-finite norms separately (``torch.isfinite``).

    Parameters
    ----------
    squared_norm : torch.Tensor
        0-d floating tensor, e.g. the sum of the buckets' ``partials``.
    max_norm : float
        Finite, > 0.
    eps : float
        >= 0, added to the norm as torch's ``clip_grad_norm_`` does.

    Returns
    -------
    torch.Tensor
        0-d float32 on ``squared_norm.device``.

    Examples
    --------
    >>> import torch
    >>> clip_coefficient(torch.tensor(16.0), 2.0, eps=0.0), clip_coefficient(torch.tensor(1.0), 2.0)
    (tensor(0.5000), tensor(1.))
    """
    if not isinstance(squared_norm, torch.Tensor) or squared_norm.dim() != 0 or not squared_norm.is_floating_point():
        got = (f"{squared_norm.dtype} of shape {tuple(squared_norm.shape)}" if isinstance(squared_norm, torch.Tensor)
               else type(squared_norm).__name__)
        raise KernelInputError(f"squared_norm must be a 0-d floating tensor, got {got}")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) or max_norm <= 0:
        raise KernelInputError(f"max_norm={max_norm!r} must be a finite number > 0")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise KernelInputError(f"eps={eps!r} must be a finite number >= 0")
    norm = squared_norm.float().sqrt()
    return torch.where(norm > max_norm, max_norm / (norm + eps), torch.ones_like(norm))
