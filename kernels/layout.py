"""Bucket layouts: where each held slice of each gradient tensor lives in one flat buffer.

A `BucketLayout` is built once per mask (not per step) from the shapes of a bucket's tensors and a
list of `SegmentSpec` (which tensor, which part of it, with what coverage). It validates the specs,
assigns every segment an int64 offset in the flat buffer (a multiple of `kernels.ALIGN_ELEMENTS`, so that
every segment starts 16-byte aligned; the few padding elements between segments are zeros after
`pack`), and precomputes, on the bucket's device, the work list the fused Triton launch reads
(`kernels.worklist`) plus the per-segment scale 1/c_j. Packing and unpacking every step then
allocate nothing.

Nothing here blocks the host on the device. All host-to-device copies go through `upload` (pinned
memory, ``non_blocking``): a layout's metadata is one copy, shared by every live layout with the
same description (an engine rebuilt while the old one lives copies nothing), and the table of
tensor addresses the kernels read is cached per address set, a few sets per layout, so gradients
that alternate among a few addresses (``zero_grad()`` with set_to_none and the caching allocator)
copy nothing in a steady state.

This module only describes placements; moving data is `kernels.reference` / `kernels.triton_ops`.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.errors import LayoutError
from kernels.worklist import aligned_offset, build_work_list

SEGMENT_KINDS = ("whole", "rows", "cols")
DEFAULT_BLOCK_SIZE = 1024
# A program has at most 1024 threads: past 16384 elements each thread would hold more than 16
# and the compiled kernels spill registers (tests/kernels/test_gpu_codegen.py).
MAX_BLOCK_SIZE = 2**14
# Address sets whose pointer table a layout keeps: set_to_none and the caching allocator give one to
# three in a steady state; more than that reuploads (a small copy that does not block).
POINTER_TABLES_PER_LAYOUT = 8
# Launch plans a layout keeps (`BucketLayout.launch_plan`): one per operation (pack, unpack, a norm) and address set.
LAUNCH_PLANS_PER_LAYOUT = 3 * POINTER_TABLES_PER_LAYOUT


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without blocking the host: the package's one host-to-device copy.

    On CUDA the values go through pinned memory with ``non_blocking=True``; torch's pinned-memory
    allocator keeps the staging memory until the copy has run, so `host` may be freed at once.
    Elsewhere a plain ``to``.
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
    in_norm : bool
        Whether the segment's squares count in the ``partials`` of `pack`, `unpack` and
        `squared_norm` (False: a slice whose share of a clipping norm another rank counts).
    """

    tensor_index: int
    kind: str = "whole"
    index: tuple[int, ...] = ()
    coverage: int = 1
    in_norm: bool = True

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
        if not isinstance(self.in_norm, bool):
            raise LayoutError(f"segment in_norm={self.in_norm!r} must be a bool")
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
    prod(shape[2:])). It occupies ``buffer[offset : offset + numel]``; a non-empty segment's
    offset is a multiple of `kernels.ALIGN_ELEMENTS`.
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
    in_norm: bool = True

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
    return Segment(spec.tensor_index, spec.kind, index, spec.coverage, offset, seg_numel, outer, extent, inner,
                   spec.in_norm)


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
        Elements per Triton program (a power of two in [16, MAX_BLOCK_SIZE]).

    Attributes
    ----------
    segments : tuple of Segment
    total_numel : int
        Elements of the flat buffer: the end of the last non-empty segment. Allocate buffers of
        this size; it includes the padding that aligns each segment (`gaps`).
    gaps : tuple of (int, int)
        (start, length) of each run of padding elements in the buffer; `pack` writes zeros there.
    inverse_coverage : torch.Tensor
        (n_segments,) float32 on `device`: 1/c_j, the `scale` that averages over holders.
    norm_flags : torch.Tensor
        (n_segments,) int32 on `device`: 1 where the segment's squares count in ``partials``
        (`SegmentSpec.in_norm`), else 0.
    index_values : torch.Tensor
        (sum of index lengths,) int64 on `device`: all rows/cols indices, concatenated.
    index_tensors : tuple of (torch.Tensor or None)
        Per segment, its view of `index_values` (None for whole tensors).
    descriptors : torch.Tensor
        (n_tiles, DESC_WIDTH) int64 on `device`: the work list, one row per Triton program (see
        `kernels.worklist`); the zero tiles that clear `gaps` come last.
    column_offsets : torch.Tensor
        int32 on `device`: the tensor-side column offsets the gather tiles read.
    run_cols, gather_cols : int
        Width of the run and gather tiles (powers of two, chosen to minimise the tile count).
    num_data_tiles : int
        Tiles that move data (all but the zero tiles): the grid of `unpack`.

    Examples
    --------
    >>> layout = BucketLayout([(4, 3), (3, 4)], [SegmentSpec(0, "rows", (0, 2), coverage=2),
    ...                                         SegmentSpec(1, "cols", (0, 2), coverage=2)])
    >>> [(s.offset, s.numel) for s in layout.segments], layout.total_numel, layout.gaps
    ([(0, 6), (8, 6)], 14, ((6, 2),))
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
        if (isinstance(block_size, bool) or not isinstance(block_size, int) or not 16 <= block_size <= MAX_BLOCK_SIZE
                or block_size & (block_size - 1)):
            raise LayoutError(f"block_size={block_size!r} must be a power of two in [16, {MAX_BLOCK_SIZE}]")
        self.block_size = block_size
        self.device = _normalize_device(device)
        segments, gaps, offset = [], [], 0
        for j, spec in enumerate(specs):
            if not isinstance(spec, SegmentSpec):
                raise LayoutError(f"spec {j} is a {type(spec).__name__}, expected SegmentSpec")
            if spec.tensor_index >= len(self.shapes):
                raise LayoutError(f"spec {j} names tensor_index {spec.tensor_index}, but the bucket has {len(self.shapes)} tensors")
            segment = _place(spec, self.shapes[spec.tensor_index], offset)
            if segment.numel and aligned_offset(offset) > offset:
                gaps.append((offset, aligned_offset(offset) - offset))
                segment = _place(spec, self.shapes[spec.tensor_index], aligned_offset(offset))
            segments.append(segment)
            offset = segment.offset + segment.numel
        _check_disjoint(segments)
        self.segments = tuple(segments)
        self.gaps = tuple(gaps)
        self.total_numel = offset
        self._build_metadata()
        self._pointer_tables: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._launch_plans: OrderedDict[tuple, Any] = OrderedDict()

    def _build_metadata(self) -> None:
        key = (self.device, self.block_size, self.shapes, self.gaps,
               tuple((s.tensor_index, s.kind, s.index, s.coverage, s.offset, s.in_norm) for s in self.segments))
        metadata = _METADATA.get(key)
        if metadata is None:
            metadata = _DeviceMetadata(build_work_list(self.segments, self.gaps, self.block_size), self.segments, self.device)
            _METADATA[key] = metadata
        self._metadata = metadata  # keeps the shared entry alive as long as this layout
        self.descriptors, self.column_offsets = metadata.descriptors, metadata.column_offsets
        self.index_values, self.inverse_coverage = metadata.index_values, metadata.inverse_coverage
        self.norm_flags = metadata.norm_flags
        self.run_cols, self.gather_cols, self.num_data_tiles = metadata.run_cols, metadata.gather_cols, metadata.num_data_tiles
        starts = np.cumsum([0] + [len(s.index) if s.kind != "whole" else 0 for s in self.segments])
        self.index_tensors = tuple(
            None if seg.kind == "whole" else self.index_values.narrow(0, int(starts[j]), len(seg.index))
            for j, seg in enumerate(self.segments)
        )

    @property
    def num_tiles(self) -> int:
        """Programs of one fused pack launch (unpack runs the first `num_data_tiles` of them)."""
        return self.descriptors.shape[0]

    @property
    def num_norm_partials(self) -> int:
        """Length of the float32 ``partials`` that `pack`, `unpack` and `squared_norm` fill: their sum is the
        squared norm of the held slices (one partial per data tile; 0 when nothing is held)."""
        return self.num_data_tiles

    def pointer_table(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(n_tensors,) int64 on `device`: each tensor's data_ptr(), as the Triton kernels read them.

        Cached per address set (the last `POINTER_TABLES_PER_LAYOUT`): gradients that keep their
        storage, or come back at one of a few addresses, cost nothing per step; a new set costs one
        small `upload` of len(tensors) int64, which does not block the host.
        """
        key = tuple(t.data_ptr() for t in tensors)
        table = self._pointer_tables.get(key)
        if table is not None:
            self._pointer_tables.move_to_end(key)
            return table
        table = upload(torch.from_numpy(np.array(key, dtype=np.int64)), self.device)
        self._pointer_tables[key] = table
        if len(self._pointer_tables) > POINTER_TABLES_PER_LAYOUT:
            self._pointer_tables.popitem(last=False)
        return table

    def launch_plan(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()`` for a launch whose operands `key` describes, cached for the last
        `LAUNCH_PLANS_PER_LAYOUT` keys (see `kernels.triton_ops`): a launch on operands the layout
        has seen skips the checks and work whose outcome `key` determines."""
        plan = self._launch_plans.get(key)
        if plan is not None:
            self._launch_plans.move_to_end(key)
            return plan
        plan = self._launch_plans[key] = build()
        if len(self._launch_plans) > LAUNCH_PLANS_PER_LAYOUT:
            self._launch_plans.popitem(last=False)
        return plan

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


def _words(values: np.ndarray) -> np.ndarray:
    """`values` (4- or 8-byte items) as int64 words, padded to an even count: 16-byte aligned sections."""
    raw = np.ascontiguousarray(values).view(np.uint8)
    words = np.zeros(-(-len(raw) // 16) * 2, dtype=np.int64)
    words.view(np.uint8)[: len(raw)] = raw
    return words


class _DeviceMetadata:
    """A layout's launch metadata on its device: one `upload`, then views of it by dtype.

    Shared by the live layouts of one description through `_METADATA`, which holds it weakly: it
    is freed with the last layout that uses it.
    """

    def __init__(self, work, segments: Sequence[Segment], device: torch.device) -> None:
        self.run_cols, self.gather_cols, self.num_data_tiles = work.run_cols, work.gather_cols, work.num_data_tiles
        # Never empty: the kernels take its address even when no tile gathers.
        columns = work.columns if len(work.columns) else np.zeros(1, dtype=np.int32)
        index_values = np.array([i for seg in segments if seg.kind != "whole" for i in seg.index], dtype=np.int64)
        inverse_coverage = np.float32(1.0) / np.array([s.coverage for s in segments], dtype=np.float32)
        norm_flags = np.array([s.in_norm for s in segments], dtype=np.int32)
        sections = [_words(work.descriptors.ravel()), _words(index_values), _words(columns), _words(inverse_coverage),
                    _words(norm_flags)]
        starts = np.cumsum([0] + [len(w) for w in sections])
        blob = upload(torch.from_numpy(np.concatenate(sections)), device)
        descriptors, index, cols, scale, flags = (blob[a:b] for a, b in zip(starts[:-1], starts[1:]))
        self.descriptors = descriptors[: work.descriptors.size].view(work.descriptors.shape)
        self.index_values = index[: len(index_values)]
        self.column_offsets = cols.view(torch.int32)[: len(columns)]
        self.inverse_coverage = scale.view(torch.float32)[: len(inverse_coverage)]
        self.norm_flags = flags.view(torch.int32)[: len(norm_flags)]


_METADATA: weakref.WeakValueDictionary[tuple, _DeviceMetadata] = weakref.WeakValueDictionary()
