"""Bucket layouts: where each held slice of each gradient tensor lives in one flat buffer.

A `BucketLayout` is built once per mask (not per step) from the shapes of a bucket's tensors and a
list of `SegmentSpec` (which tensor, which part of it, with what coverage). It validates the specs,
assigns every segment an int64 offset in the flat buffer, and precomputes, on the bucket's device,
the metadata tensors the fused Triton launch reads (segment table, index values, tile work-list)
plus the per-segment scale 1/c_j. Packing and unpacking every step then allocate nothing.

This module only describes placements; moving data is `kernels.reference` / `kernels.triton_ops`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.errors import KernelLimitError, LayoutError

SEGMENT_KINDS = ("whole", "rows", "cols")
DEFAULT_BLOCK_SIZE = 1024
# Columns of `BucketLayout.segment_table`, one row per segment (read by the Triton kernels).
TABLE_TENSOR, TABLE_OFFSET, TABLE_NUMEL, TABLE_INDEX_START = 0, 1, 2, 3
TABLE_INDEX_LEN, TABLE_EXTENT, TABLE_INNER, TABLE_IS_WHOLE = 4, 5, 6, 7
TABLE_WIDTH = 8
MAX_GRID_TILES = 2**31 - 1  # CUDA limit on grid dimension x


@dataclass(frozen=True)
class SegmentSpec:
    """The part of one tensor that a worker holds, as the caller describes it.

    Parameters
    ----------
    tensor_index : int
        Position of the tensor in the bucket's tensor list.
    kind : {"whole", "rows", "cols"}
        ``whole``: the entire tensor (block-level masks). ``rows``: the entries ``t[index]`` along
        dim 0 (e.g. the held neurons of an MLP up-projection, shape (d_ff, d)). ``cols``: the
        entries ``t[:, index]`` along dim 1 (the matching inputs of the down-projection, shape
        (d, d_ff), or input channels of a conv weight).
    index : sequence of int or 1-D integer tensor
        Held rows/columns, in buffer order; empty for ``whole``. No duplicates.
    coverage : int
        c_j, the number of workers holding this segment (>= 1); its scale is 1/c_j.
    """

    tensor_index: int
    kind: str = "whole"
    index: tuple[int, ...] = ()
    coverage: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise LayoutError(f"segment kind {self.kind!r} is not one of {SEGMENT_KINDS}")
        for name in ("tensor_index", "coverage"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"segment {name}={value!r} must be an int")
        if self.tensor_index < 0:
            raise LayoutError(f"segment tensor_index={self.tensor_index} must be >= 0")
        if self.coverage < 1:
            raise LayoutError(f"segment coverage={self.coverage} must be >= 1 (every block needs a holder)")
        index = self.index
        if isinstance(index, torch.Tensor):
            if index.dim() != 1 or index.is_floating_point() or index.is_complex():
                raise LayoutError(f"segment index must be a 1-D integer tensor, got {index.dtype} of shape {tuple(index.shape)}")
            index = index.tolist()
        index = tuple(int(i) for i in index)
        if self.kind == "whole" and index:
            raise LayoutError(f"a 'whole' segment of tensor {self.tensor_index} takes no index, got {len(index)} values")
        if len(set(index)) != len(index):
            duplicates = sorted({i for i in index if index.count(i) > 1})
            raise LayoutError(f"segment of tensor {self.tensor_index} repeats {self.kind} {duplicates}")
        object.__setattr__(self, "index", index)


@dataclass(frozen=True)
class Segment:
    """A `SegmentSpec` placed in the flat buffer by a `BucketLayout`.

    The source tensor is viewed as (outer, extent, inner) and the segment is
    ``t.view(outer, extent, inner)[:, index, :]`` flattened: ``whole`` is (1, 1, numel) with index
    (0,), ``rows`` is (1, shape[0], prod(shape[1:])), ``cols`` is (shape[0], shape[1],
    prod(shape[2:])). It occupies ``buffer[offset : offset + numel]``.
    """

    tensor_index: int
    kind: str
    index: tuple[int, ...]
    coverage: int
    offset: int
    numel: int
    outer: int
    extent: int
    inner: int

    @property
    def scale(self) -> float:
        """1/c_j: the factor that turns a sum over the holders into their average."""
        return 1.0 / self.coverage


def _place(spec: SegmentSpec, shape: torch.Size, offset: int) -> Segment:
    numel = math.prod(shape)
    if spec.kind == "whole":
        outer, extent, inner, index = 1, 1, numel, (0,)
    else:
        dim = 0 if spec.kind == "rows" else 1
        if len(shape) <= dim:
            raise LayoutError(f"{spec.kind!r} segment of tensor {spec.tensor_index} needs >= {dim + 1} dims, shape is {tuple(shape)}")
        outer, extent, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
        index = spec.index
        bad = [i for i in index if not 0 <= i < extent]
        if bad:
            raise LayoutError(f"{spec.kind} {bad} of tensor {spec.tensor_index} out of range [0, {extent}) for shape {tuple(shape)}")
    seg_numel = outer * len(index) * inner
    return Segment(spec.tensor_index, spec.kind, index, spec.coverage, offset, seg_numel, outer, extent, inner)


def _check_disjoint(segments: Sequence[Segment]) -> None:
    """Two segments of one tensor must not share an element, or unpack's result would depend on order.

    Rows and cols segments of one tensor always share t[r, c, ...] when both are non-empty.
    """
    by_tensor: dict[int, list[tuple[int, Segment]]] = {}
    for j, seg in enumerate(segments):
        if seg.numel:
            by_tensor.setdefault(seg.tensor_index, []).append((j, seg))
    for tensor_index, members in by_tensor.items():
        for a, (j, first) in enumerate(members):
            for k, second in members[a + 1 :]:
                if first.kind == "whole" or second.kind == "whole" or first.kind != second.kind:
                    shared = "elements"
                else:
                    common = sorted(set(first.index) & set(second.index))
                    if not common:
                        continue
                    shared = f"{first.kind} {common}"
                raise LayoutError(
                    f"segments {j} ({first.kind}) and {k} ({second.kind}) of tensor {tensor_index} overlap in {shared}; "
                    "each element of a tensor may be held by at most one segment of a bucket"
                )


class BucketLayout:
    """Placement of a bucket's held slices in one flat buffer, built once per mask.

    Parameters
    ----------
    shapes : sequence of shapes
        Shape of every tensor of the bucket, in the order the tensors are passed to `pack`.
    specs : sequence of SegmentSpec, optional
        Held parts in buffer order. Default: every tensor whole with coverage 1.
    device : torch.device or str
        Device of the tensors; the launch metadata is stored there.
    block_size : int
        Elements per Triton program (a power of two in [16, 65536]).

    Attributes
    ----------
    segments : tuple of Segment
    total_numel : int
        Elements of the flat buffer that the segments fill.
    inverse_coverage : torch.Tensor
        (n_segments,) float32 on `device`: 1/c_j, the `scale` that averages over holders.
    segment_table : torch.Tensor
        (n_segments, 8) int64 on `device`, columns TABLE_*.
    index_values : torch.Tensor
        (sum of index lengths,) int64 on `device`: all rows/cols indices, concatenated.
    tile_segment, tile_start : torch.Tensor
        (n_tiles,) int32 and int64 on `device`: the work-list, one entry per Triton program.

    Examples
    --------
    >>> layout = BucketLayout([(4, 3), (3, 4)], [SegmentSpec(0, "rows", (0, 2), coverage=2),
    ...                                         SegmentSpec(1, "cols", (0, 2), coverage=2)])
    >>> [(s.offset, s.numel) for s in layout.segments], layout.total_numel
    ([(0, 6), (6, 6)], 12)
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        specs: Sequence[SegmentSpec] | None = None,
        *,
        device: torch.device | str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.shapes = tuple(torch.Size(s) for s in shapes)
        if specs is None:
            specs = [SegmentSpec(i) for i in range(len(self.shapes))]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 16 <= block_size <= 2**16 or block_size & (block_size - 1):
            raise LayoutError(f"block_size={block_size!r} must be a power of two in [16, 65536]")
        self.block_size = block_size
        self.device = _normalize_device(device)
        segments, offset = [], 0
        for j, spec in enumerate(specs):
            if not isinstance(spec, SegmentSpec):
                raise LayoutError(f"spec {j} is a {type(spec).__name__}, expected SegmentSpec")
            if spec.tensor_index >= len(self.shapes):
                raise LayoutError(f"spec {j} names tensor_index {spec.tensor_index}, but the bucket has {len(self.shapes)} tensors")
            segment = _place(spec, self.shapes[spec.tensor_index], offset)
            segments.append(segment)
            offset += segment.numel
        _check_disjoint(segments)
        self.segments = tuple(segments)
        self.total_numel = offset
        self._build_metadata()
        self._pointer_key: tuple[int, ...] | None = None
        self._pointer_table = torch.empty(0, dtype=torch.int64, device=self.device)

    def _build_metadata(self) -> None:
        rows, index_values, start = [], [], 0
        for seg in self.segments:
            is_whole = seg.kind == "whole"
            rows.append([seg.tensor_index, seg.offset, seg.numel, start, len(seg.index), seg.extent, seg.inner, int(is_whole)])
            if not is_whole:
                index_values.extend(seg.index)
                start += len(seg.index)
        cpu = dict(dtype=torch.int64)
        table = torch.tensor(rows, **cpu).reshape(len(rows), TABLE_WIDTH)
        numels = table[:, TABLE_NUMEL]
        tiles_per_segment = (numels + self.block_size - 1) // self.block_size  # (S,)
        n_tiles = int(tiles_per_segment.sum())
        if n_tiles > MAX_GRID_TILES:
            raise KernelLimitError(
                f"bucket needs {n_tiles} tiles of block_size={self.block_size}, above the grid limit {MAX_GRID_TILES}; "
                "raise block_size or split the bucket"
            )
        segment_ids = torch.arange(len(rows), **cpu)
        tile_segment = torch.repeat_interleave(segment_ids, tiles_per_segment)  # (T,)
        first_tile = torch.cumsum(tiles_per_segment, 0) - tiles_per_segment  # (S,)
        tile_start = (torch.arange(n_tiles, **cpu) - first_tile[tile_segment]) * self.block_size  # (T,)
        coverage = torch.tensor([float(s.coverage) for s in self.segments], dtype=torch.float32)
        self.segment_table = table.to(self.device)
        self.index_values = torch.tensor(index_values, **cpu).to(self.device)
        self.tile_segment = tile_segment.to(torch.int32).to(self.device)
        self.tile_start = tile_start.to(self.device)
        self.inverse_coverage = (1.0 / coverage).to(self.device)
        self.index_tensors = tuple(
            None if seg.kind == "whole" else self.index_values.narrow(0, int(table[j, TABLE_INDEX_START]), len(seg.index))
            for j, seg in enumerate(self.segments)
        )

    @property
    def num_tiles(self) -> int:
        """Programs in one fused launch (one per `block_size` elements of each segment)."""
        return self.tile_start.numel()

    def pointer_table(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(n_tensors,) int64 on `device`: each tensor's data_ptr(), as the Triton kernels read them.

        Cached by address: gradients that keep their storage across steps (``zero_grad(
        set_to_none=False)``, or views into one flat gradient buffer) cost nothing per step;
        otherwise one small host-to-device copy of len(tensors) int64.
        """
        key = tuple(t.data_ptr() for t in tensors)
        if key != self._pointer_key:
            self._pointer_table = torch.tensor(key, dtype=torch.int64).to(self.device)
            self._pointer_key = key
        return self._pointer_table

    def __repr__(self) -> str:
        kinds = {k: sum(s.kind == k for s in self.segments) for k in SEGMENT_KINDS}
        return (
            f"BucketLayout(tensors={len(self.shapes)}, segments={len(self.segments)} {kinds}, "
            f"total_numel={self.total_numel}, device={self.device}, block_size={self.block_size})"
        )


def _normalize_device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
