"""Shared helpers for the kernel tests: device, dtypes, hypothesis bucket strategy."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kernels import BucketLayout, SegmentSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# No tolerance table: both backends compute a scaled or accumulated value in float32 with a
# separate multiply and add (the compiled kernels run with FP fusion off) and round it once, to
# nearest even, to the destination dtype, so they agree bit for bit.


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
    if draw(st.booleans()):  # scattered: gathers
        held = draw(st.permutations(range(extent)))[: draw(st.integers(0, extent))]
    else:  # a few ranges of consecutive indices: runs, merged rows, long column runs
        cut = st.one_of(st.integers(0, extent), st.integers(0, extent // 8).map(lambda i: 8 * i))  # aligned runs too
        cuts = sorted(draw(st.lists(cut, max_size=4)))
        held = [i for a, b in zip(cuts[::2], cuts[1::2]) for i in range(a, b)]
    cut = draw(st.integers(0, len(held)))
    # Two segments of one tensor with their own coverage: slices of one weight held by different
    # holder sets (either may be empty).
    return [SegmentSpec(i, kind, tuple(held[:cut]), draw(coverage)), SegmentSpec(i, kind, tuple(held[cut:]), draw(coverage))]


@st.composite
def buckets(draw, max_tensors: int = 4, max_extent: int = 9):
    """(shapes, specs, block_size): 0..max_tensors tensors of 1-3 dims with extents 0..max_extent
    (odd and empty included; or 1-2 dims, one of them 8 * max_extent or 3 less, so that long and
    aligned runs occur), each not held, whole, or split into two rows/cols segments whose indices are
    scattered or a few consecutive ranges."""
    shapes = []
    for _ in range(draw(st.integers(0, max_tensors))):
        shape = draw(st.lists(st.integers(0, max_extent), min_size=1, max_size=3))
        if draw(st.booleans()):
            shape = shape[:2]
            long = draw(st.integers(0, len(shape) - 1))
            shape[long] = draw(st.sampled_from([8 * max_extent, 8 * max_extent - 3]))
        shapes.append(tuple(shape))
    specs = [spec for i, shape in enumerate(shapes) for spec in _split_specs(draw, i, shape)]
    specs = draw(st.permutations(specs))
    return shapes, specs, draw(st.sampled_from([16, 64]))
