"""Gradients as one rank holds them: the local tensor of a DTensor, a squared norm, clipping.

Used by the library (`SubnetworkDataParallel.clip_grad_norm_`) and by ``sdp train``'s step alike,
so there is one clipping and one DTensor-to-local helper. Nothing here reads a device value on
the host: norms stay 0-d device tensors and the clipping factor is applied with one foreach
multiply (``kernels.clip_coefficient``, a ``torch.where``), as torch's
``clip_grad_norm_(foreach=True)`` does. Not here: which slices count towards a norm (the sync
engine's partials, `sdp_train.parallel.sync`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

import kernels


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (FSDP), without importing ``torch.distributed.tensor``: no DTensor exists
    before that module is imported, and importing it (with sympy) costs a process about a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """`t`'s local shard when it is a DTensor (FSDP), else `t` itself."""
    return t.to_local() if is_dtensor(t) else t


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The local gradients of `params` that exist."""
    return [local(p.grad) for p in params if p.grad is not None]


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of `grads` in float32, a 0-d tensor on `device` (zero when there are none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], total_sq: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` (local tensors) in place so that a gradient of squared norm `total_sq` has norm at
    most `max_norm`: ``max_norm / (norm + 1e-6)`` above it, 1 otherwise, decided on the device."""
    if grads:
        torch._foreach_mul_(grads, kernels.clip_coefficient(total_sq, max_norm))
