"""Masked gradient packing and overlap averaging for SDP buckets.

Build a `BucketLayout` once per bucket and mask, then every step `pack` the held slices of the
bucket's gradients into one flat buffer (scaled by 1/c_j, optionally cast to bfloat16), let a
collective sum it among the holders, and `unpack` it back — or do all three with
`overlap_average`; `squared_norm` reads the held slices' share of a clipping norm in place, or
`pack` / `unpack` fill it into ``partials`` in the same launch, and `clip_coefficient` turns a
norm into the clipping factor on the device. Each operation has a fused Triton implementation
(`kernels.triton_ops`, one launch per layout) and a pure-PyTorch reference (`kernels.reference`) with the same semantics;
`kernels.dispatch` picks one. This package does not group blocks into buckets or create process
groups: that is the sync engine in `sdp_train`; `concat_layouts` describes several buckets as one
layout, so that one launch moves them all.
"""

from kernels.clipping import clip_coefficient
from kernels.concat import concat_layouts
from kernels.dispatch import BACKENDS, block_size_for, select_backend
from kernels.errors import BackendUnavailableError, KernelInputError, KernelLimitError, LayoutError
from kernels.layout import SEGMENT_KINDS, BucketLayout, Segment, SegmentSpec
from kernels.ops import overlap_average, pack, squared_norm, unpack
from kernels.worklist import ALIGN_ELEMENTS

__all__ = [
    "ALIGN_ELEMENTS",
    "BACKENDS",
    "SEGMENT_KINDS",
    "BackendUnavailableError",
    "BucketLayout",
    "KernelInputError",
    "KernelLimitError",
    "LayoutError",
    "Segment",
    "SegmentSpec",
    "block_size_for",
    "clip_coefficient",
    "concat_layouts",
    "overlap_average",
    "pack",
    "select_backend",
    "squared_norm",
    "unpack",
]
