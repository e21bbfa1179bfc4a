"""Shared helpers for the kernel tests: device, tolerance table, hypothesis bucket strategy."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kernels import BucketLayout, SegmentSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Scaled / cast / accumulated values are computed in float32 and rounded once to the key dtype;
# two backends may differ by one ulp of it (a GPU may fuse multiply-add, flipping one rounding).
# One ulp relative, plus float16's smallest subnormal. Plain copies are compared bit-exactly.
TOLERANCES = {
    torch.float32: dict(rtol=2**-22, atol=0.0),
    torch.bfloat16: dict(rtol=2**-7, atol=0.0),
    torch.float16: dict(rtol=2**-10, atol=2**-24),
}


def tolerance(*dtypes: torch.dtype) -> dict[str, float]:
    """The loosest entry of TOLERANCES among `dtypes` (e.g. source and buffer dtype)."""
    return max((TOLERANCES[d] for d in dtypes), key=lambda tol: tol["rtol"])


def make_tensors(shapes, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 4).to(dtype).to(DEVICE) for s in shapes]


def held_masks(layout: BucketLayout) -> list[torch.Tensor]:
    """Per tensor, a bool mask of the entries some segment holds (built from the segment fields)."""
    masks = [torch.zeros(shape, dtype=torch.bool) for shape in layout.shapes]
    for seg in layout.segments:
        view = masks[seg.tensor_index].view(seg.outer, seg.extent, seg.inner)
        view[:, list(seg.index), :] = True
    return [m.to(DEVICE) for m in masks]


def _split_specs(draw, i: int, shape: tuple[int, ...]) -> list[SegmentSpec]:
    kinds = ["none", "whole", "rows"] + (["cols"] if len(shape) >= 2 else [])
    kind = draw(st.sampled_from(kinds))
    coverage = st.integers(1, 4)
    if kind == "none":
        return []
    if kind == "whole":
        return [SegmentSpec(i, "whole", coverage=draw(coverage))]
    extent = shape[0] if kind == "rows" else shape[1]
    held = draw(st.permutations(range(extent)))[: draw(st.integers(0, extent))]
    cut = draw(st.integers(0, len(held)))
    # Two segments of one tensor with their own coverage: slices of one weight held by different
    # holder sets (either may be empty).
    return [SegmentSpec(i, kind, tuple(held[:cut]), draw(coverage)), SegmentSpec(i, kind, tuple(held[cut:]), draw(coverage))]


@st.composite
def buckets(draw, max_tensors: int = 4, max_extent: int = 9):
    """(shapes, specs, block_size): 0..max_tensors tensors of 1-3 dims with extents 0..max_extent
    (odd and empty included), each not held, whole, or split into two rows/cols segments."""
    shapes = [
        tuple(draw(st.lists(st.integers(0, max_extent), min_size=1, max_size=3)))
        for _ in range(draw(st.integers(0, max_tensors)))
    ]
    specs = [spec for i, shape in enumerate(shapes) for spec in _split_specs(draw, i, shape)]
    specs = draw(st.permutations(specs))
    return shapes, specs, draw(st.sampled_from([16, 64]))
