"""Runs of the sync engine's buckets that one kernel launch packs or unpacks.

A launch costs the host about the same whatever it moves (checks, launch plan, Triton's launcher),
so the engine launches per run of buckets, not per bucket: `finish` unpacks every bucket in one
launch, and the buckets that one gradient completes (in N-SDP the holder sets of a layer's MLP
rows) are packed in one. For that the communicating buckets keep their buffers as consecutive
slices of one flat buffer per dtype (as Megatron-LM's gradient buffer holds its buckets), so that
`kernels.concat_layouts` describes any run of them as one layout over one slice of it. Every
element lands where its bucket's own layout puts it, so the buffers, the collectives on them and
the averaged gradients are what per-bucket launches give.

Not here: the plan, the hooks and the collectives (`sdp_train.parallel.sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import kernels


@dataclass(frozen=True)
class BucketRun:
    """Consecutive buckets as one layout: their distinct parameters and, when they communicate,
    the slice of the flat buffer that holds their buffers."""

    layout: kernels.BucketLayout
    params: tuple[nn.Parameter, ...]
    buffer: torch.Tensor | None

    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients; a parameter the forward pass did not use gets a zero one."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]


def place_buffers(buckets: Sequence, buffer_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Give every bucket of `buckets` (``sync._Bucket``, in launch order) its buffer as a slice of one
    flat buffer per dtype (`buffer_dtype`, or the bucket's parameters'), placed as
    `kernels.concat_layouts` places consecutive buckets; return the flat buffers."""
    by_dtype: dict[torch.dtype, list] = {}
    for bucket in buckets:
        by_dtype.setdefault(buffer_dtype or bucket.params[0].dtype, []).append(bucket)
    flats = []
    for dtype, members in by_dtype.items():
        starts, end = [], 0
        for bucket in members:
            starts.append(-(-end // kernels.ALIGN_ELEMENTS) * kernels.ALIGN_ELEMENTS)
            end = starts[-1] + bucket.layout.total_numel
        flat = torch.empty(end, dtype=dtype, device=members[0].layout.device)
        for bucket, start in zip(members, starts):
            bucket.flat, bucket.start = flat, start
            bucket.buffer = flat.narrow(0, start, bucket.layout.total_numel)
        flats.append(flat)
    return flats


def bucket_run(buckets: Sequence, *, in_norm: Sequence[bool] | None = None) -> BucketRun:
    """One layout over `buckets` (consecutive in one flat buffer when they communicate; any buckets
    for a norm alone). With `in_norm`, per bucket whether its squares count in ``partials``."""
    if len(buckets) == 1 and in_norm is None:
        only = buckets[0]
        return BucketRun(only.layout, tuple(only.params), only.buffer if only.flat is not None else None)
    position: dict[nn.Parameter, int] = {}
    for bucket in buckets:
        for p in bucket.params:
            position.setdefault(p, len(position))
    layout, starts = kernels.concat_layouts([b.layout for b in buckets], [[position[p] for p in b.params] for b in buckets],
                                            in_norm=in_norm)
    buffer = None
    if buckets[0].flat is not None:
        first, last = buckets[0], buckets[-1]
        assert all(b.flat is first.flat and b.start - first.start == s for b, s in zip(buckets, starts))
        buffer = first.flat.narrow(0, first.start, last.start + last.layout.total_numel - first.start)
    return BucketRun(layout, tuple(position), buffer)
