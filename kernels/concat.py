"""Several bucket layouts as one, so that one launch packs or unpacks several buckets.

The sync engine keeps the buffers of its buckets as consecutive slices of one flat buffer (as
Megatron-LM's gradient buffer keeps its buckets), so a layout over the slices of several buckets
addresses them all from one buffer: `concat_layouts` builds it from the buckets' own layouts.
What lands where is unchanged (every element of bucket i goes where bucket i's layout puts it in its
slice); only the tiling is the combined layout's own. Nothing here allocates a buffer or moves data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.errors import LayoutError
from kernels.layout import BucketLayout, SegmentSpec
from kernels.worklist import aligned_offset


def concat_layouts(layouts: Sequence[BucketLayout], tensor_ids: Sequence[Sequence[int]], *,
                   in_norm: Sequence[bool] | None = None) -> tuple[BucketLayout, tuple[int, ...]]:
    """One layout over several buckets whose buffers are consecutive slices of one flat buffer.

    A launch over the result moves every bucket at once: bucket i's buffer is
    ``flat[starts[i] : starts[i] + layouts[i].total_numel]`` (each start aligned, as a segment's),
    its tensor k is tensor ``tensor_ids[i][k]`` of the result, and every element lands where
    bucket i's own layout puts it in its own buffer. A tensor may appear in several buckets (the
    rows of one weight held by different holder sets) if their segments are disjoint.

    Parameters
    ----------
    layouts : sequence of BucketLayout
        On one device, with one block size.
    tensor_ids : sequence of sequence of int
        Per layout, the position of each of its tensors in the result's tensor list; together they
        name every position from 0 up.
    in_norm : sequence of bool, optional
        Per layout, whether its segments count in ``partials`` (`SegmentSpec.in_norm`); default
        as in each layout.

    Returns
    -------
    (BucketLayout, tuple of int)
        The layout and each bucket's start in the flat buffer (allocate at least
        ``starts[-1] + layouts[-1].total_numel`` elements).

    Examples
    --------
    >>> a = BucketLayout([(3,)])
    >>> b = BucketLayout([(4, 2)], [SegmentSpec(0, "rows", (1, 3))])
    >>> both, starts = concat_layouts([a, b], [[0], [1]])
    >>> starts, [(s.offset, s.numel) for s in both.segments], both.gaps
    ((0, 8), [(0, 3), (8, 4)], ((3, 5),))
    """
    if len(tensor_ids) != len(layouts) or (in_norm is not None and len(in_norm) != len(layouts)):
        raise LayoutError(f"{len(layouts)} layouts need as many tensor_ids ({len(tensor_ids)}) and in_norm "
                          f"({'None' if in_norm is None else len(in_norm)})")
    if not layouts:
        raise LayoutError("concat_layouts needs at least one layout")
    first = layouts[0]
    shapes: dict[int, torch.Size] = {}
    specs, starts, end = [], [], 0
    for i, (layout, ids) in enumerate(zip(layouts, tensor_ids)):
        if (layout.device, layout.block_size) != (first.device, first.block_size):
            raise LayoutError(f"layout {i} is on {layout.device} with block_size={layout.block_size}, layout 0 on "
                              f"{first.device} with block_size={first.block_size}")
        if len(ids) != len(layout.shapes):
            raise LayoutError(f"layout {i} has {len(layout.shapes)} tensors, tensor_ids names {len(ids)}")
        for k, shape in zip(ids, layout.shapes):
            if shapes.setdefault(k, shape) != shape:
                raise LayoutError(f"tensor {k} has shape {tuple(shapes[k])} in one layout, {tuple(shape)} in layout {i}")
        starts.append(aligned_offset(end))
        end = starts[-1] + layout.total_numel
        norm = None if in_norm is None else bool(in_norm[i])
        specs += [SegmentSpec(ids[s.tensor_index], s.kind, () if s.kind == "whole" else s.index, s.coverage,
                              s.in_norm if norm is None else norm) for s in layout.segments]
    if sorted(shapes) != list(range(len(shapes))):
        raise LayoutError(f"tensor_ids must name every position from 0 to {len(shapes) - 1}, got {sorted(shapes)}")
    combined = BucketLayout([shapes[k] for k in range(len(shapes))], specs, device=first.device,
                            block_size=first.block_size)
    placed = iter(combined.segments)
    for start, layout in zip(starts, layouts):
        for own, seg in zip(layout.segments, placed):
            assert not own.numel or seg.offset == start + own.offset, (seg, own, start)
    return combined, tuple(starts)
