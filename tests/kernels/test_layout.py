"""BucketLayout and its work list: aligned offsets, every element moved once, int64 past 2**31, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from kernel_cases import DEVICE, buckets

from kernels import ALIGN_ELEMENTS, BucketLayout, KernelLimitError, LayoutError, SegmentSpec
from kernels.triton_ops import tile_descriptor
from kernels.worklist import DESC_WIDTH, KIND_GATHER, KIND_RUN_ALIGNED, KIND_ZERO

BIG = 2**31  # past int32
LOW = 2**32 - 1
FIELDS = ("tensor_start", "buffer_start", "tensor_stride", "buffer_stride", "nrows", "ncols", "tensor", "segment", "kind", "col_start")


def decode(descriptors: torch.Tensor) -> dict[str, np.ndarray]:
    """The descriptor fields, unpacked on the host as kernels.worklist documents them."""
    d = descriptors.cpu().numpy()
    return dict(tensor_start=d[:, 0], buffer_start=d[:, 1], tensor_stride=d[:, 2] & LOW, buffer_stride=d[:, 2] >> 32,
                nrows=d[:, 3] & LOW, ncols=d[:, 3] >> 32, tensor=d[:, 4] & LOW, segment=d[:, 4] >> 32, kind=d[:, 5],
                col_start=d[:, 6])


def expected_moves(layout: BucketLayout) -> list[tuple[int, int, int]]:
    """(tensor, tensor element, buffer element) of every held element, from the segment definition."""
    moves = []
    for seg in layout.segments:
        e = np.arange(seg.numel)
        a, rest = np.divmod(e, max(1, len(seg.index) * seg.inner))
        j, c = np.divmod(rest, max(1, seg.inner))
        src = (a * seg.extent + np.asarray(seg.index, dtype=np.int64)[j] if seg.numel else e) * seg.inner + c
        moves += zip([seg.tensor_index] * seg.numel, src.tolist(), (seg.offset + e).tolist())
    return sorted(moves)


def simulated_moves(layout: BucketLayout) -> tuple[list[tuple[int, int, int]], list[int]]:
    """What the data tiles move, element by element, and the buffer elements the zero tiles clear."""
    f, columns = decode(layout.descriptors), layout.column_offsets.cpu().numpy()
    moves, zeros = [], []
    for i in range(layout.num_tiles):
        r, k = np.arange(f["nrows"][i])[:, None], np.arange(f["ncols"][i])[None, :]
        b = f["buffer_start"][i] + r * f["buffer_stride"][i] + k
        if f["kind"][i] == KIND_ZERO:
            assert i >= layout.num_data_tiles  # zero tiles come last: unpack never runs them
            zeros += b.ravel().tolist()
            continue
        assert i < layout.num_data_tiles
        cols = columns[f["col_start"][i] + k] if f["kind"][i] == KIND_GATHER else k
        in_tile = r * f["tensor_stride"][i] + cols
        assert int(in_tile.max()) < BIG and int((r * f["buffer_stride"][i] + k).max()) < BIG  # int32 in-tile offsets
        assert f["ncols"][i] <= (layout.gather_cols if f["kind"][i] == KIND_GATHER else layout.run_cols)
        assert f["nrows"][i] * (layout.gather_cols if f["kind"][i] == KIND_GATHER else layout.run_cols) <= layout.block_size
        if f["kind"][i] == KIND_RUN_ALIGNED:
            aligned = [f["tensor_start"][i], f["buffer_start"][i], f["ncols"][i]]
            aligned += [f["tensor_stride"][i], f["buffer_stride"][i]] if f["nrows"][i] > 1 else []
            assert all(v % ALIGN_ELEMENTS == 0 for v in aligned), {n: f[n][i] for n in FIELDS}
        t = f["tensor_start"][i] + in_tile
        moves += zip([int(f["tensor"][i])] * t.size, t.ravel().tolist(), b.ravel().tolist())
    return sorted(moves), sorted(zeros)


@settings(max_examples=40, deadline=None, database=None)
@given(bucket=buckets(max_tensors=6))
def test_segments_are_placed_in_spec_order_at_aligned_offsets_with_recorded_gaps(bucket):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, block_size=block)
    end, gaps = 0, []
    for spec, seg in zip(specs, layout.segments, strict=True):
        assert seg.tensor_index == spec.tensor_index and seg.coverage == spec.coverage
        if seg.numel:
            assert seg.offset % ALIGN_ELEMENTS == 0 and 0 <= seg.offset - end < ALIGN_ELEMENTS
            gaps += [(end, seg.offset - end)] if seg.offset > end else []
        else:
            assert seg.offset == end
        end = seg.offset + seg.numel
    assert layout.total_numel == end and layout.gaps == tuple(gaps)


@settings(max_examples=40, deadline=None, database=None)
@given(bucket=buckets(max_tensors=6))
def test_work_list_moves_every_held_element_to_its_buffer_slot_exactly_once(bucket):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, block_size=block)
    moves, zeros = simulated_moves(layout)
    assert moves == expected_moves(layout)
    assert zeros == sorted(i for start, length in layout.gaps for i in range(start, start + length))


def test_rows_merge_into_runs_long_column_runs_stay_runs_and_scattered_columns_gather():
    # (6144, 16) up-projection rows 0..2047 (one merged run), a (16, 6144) down-projection whose
    # columns 0..2047 are one long run per row, and 40 scattered columns of a third: gathers.
    scattered = list(range(0, 80, 2))
    layout = BucketLayout([(6144, 16), (16, 6144), (16, 100)], [SegmentSpec(0, "rows", range(2048)),
                          SegmentSpec(1, "cols", range(2048)), SegmentSpec(2, "cols", scattered)])
    f = decode(layout.descriptors)
    kinds = {j: set(f["kind"][f["segment"] == j].tolist()) for j in range(3)}
    assert kinds == {0: {KIND_RUN_ALIGNED}, 1: {KIND_RUN_ALIGNED}, 2: {KIND_GATHER}}
    assert (f["segment"] == 0).sum() == 2048 * 16 // layout.block_size  # full tiles, no per-row work
    assert layout.column_offsets.tolist() == scattered  # int32 offsets stored once, reused by all 16 rows
    assert f["nrows"][f["segment"] == 2].tolist() == [16]
    assert simulated_moves(layout)[0] == expected_moves(layout)


def test_offsets_past_2_pow_31_are_exact_int64_without_allocating_tensors():
    rows = 2**21 + 2**13
    shapes = [(2**20, 2**11), (3, 5), (rows, 2**10 + 1)]
    specs = [SegmentSpec(0), SegmentSpec(1, "rows", [2]), SegmentSpec(2, "cols", [1024, 0])]
    layout = BucketLayout(shapes, specs, block_size=2**14)
    assert [s.offset for s in layout.segments] == [0, BIG, BIG + 8]
    assert layout.total_numel == BIG + 8 + 2 * rows and layout.gaps == ((BIG + 5, 3),)
    f = decode(layout.descriptors)
    assert layout.descriptors.dtype == torch.int64
    data = f["kind"] != KIND_ZERO
    assert int(f["buffer_start"][data & (f["segment"] == 0)].max()) == BIG - 2**14
    assert f["buffer_start"][~data].tolist() == [BIG + 5]
    cols = data & (f["segment"] == 2)
    last = int(np.flatnonzero(cols)[-1])  # the last gather tile: its tensor rows start past 2**31
    assert f["tensor_start"][last] == (rows - f["nrows"][last]) * 1025 > BIG
    assert f["buffer_start"][last] == BIG + 8 + 2 * (rows - f["nrows"][last])


@triton.jit
def _probe_descriptor(descriptors, out):
    tile = tl.program_id(0)
    fields = tile_descriptor(descriptors, tile)
    for i in tl.static_range(10):
        tl.store(out + tile * 10 + i, fields[i].to(tl.int64))


def test_kernel_decodes_descriptors_exactly_past_2_pow_31():
    # The kernels' own descriptor decoding, run on the work list of a bucket with > 2**31
    # elements: only the metadata exists, no tensor of that size is allocated.
    shapes = [(2**16, 2**15 + 3), (2**15 + 1, 2**16, 3)]
    specs = [SegmentSpec(0), SegmentSpec(1, "cols", [2**16 - 1, 7])]
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=2**14)
    assert layout.total_numel > BIG
    tiles = torch.tensor([0, layout.num_data_tiles - 2, layout.num_data_tiles - 1, layout.num_tiles - 1])
    picked = layout.descriptors[tiles.to(DEVICE)].contiguous()
    got = torch.empty(len(tiles), 10, dtype=torch.int64, device=DEVICE)
    _probe_descriptor[(len(tiles),)](picked, got)
    want = decode(picked)
    assert got.cpu().numpy().tolist() == np.stack([want[n] for n in FIELDS], axis=1).tolist()
    assert int(got[:, 0].max()) > BIG and int(got[:, 1].max()) > BIG


def test_metadata_lives_on_the_layout_device_and_index_views_match_specs():
    layout = BucketLayout([(4, 6), (6, 4)], [SegmentSpec(1, "cols", [3, 1]), SegmentSpec(0, "rows", [0])], device=DEVICE)
    tensors = (layout.descriptors, layout.column_offsets, layout.index_values, layout.inverse_coverage)
    assert all(t.device == DEVICE for t in tensors)
    assert layout.descriptors.shape == (layout.num_tiles, DESC_WIDTH) and layout.column_offsets.dtype == torch.int32
    assert [t.tolist() for t in layout.index_tensors] == [[3, 1], [0]]


def test_pointer_table_is_cached_while_storages_stay_put():
    tensors = [torch.zeros(3, device=DEVICE), torch.zeros(2, 2, device=DEVICE)]
    layout = BucketLayout([t.shape for t in tensors], device=DEVICE)
    table = layout.pointer_table(tensors)
    assert table.tolist() == [t.data_ptr() for t in tensors]
    assert layout.pointer_table(tensors) is table
    moved = [tensors[0], torch.ones(2, 2, device=DEVICE)]
    assert layout.pointer_table(moved).tolist() == [t.data_ptr() for t in moved]


@pytest.mark.parametrize(
    ("shapes", "specs", "message"),
    [
        ([(4, 4)], [SegmentSpec(0, "rows", [1, 2]), SegmentSpec(0, "rows", [2, 3])], r"segments 0 \(rows\) and 1 \(rows\) of tensor 0 overlap in rows \[2\]"),
        ([(4, 4)], [SegmentSpec(0, "cols", [0]), SegmentSpec(0, "cols", [0])], r"overlap in cols \[0\]"),
        ([(4, 4)], [SegmentSpec(0, "rows", [1]), SegmentSpec(0, "cols", [3])], r"segments 0 \(rows\) and 1 \(cols\) of tensor 0 overlap"),
        ([(4, 4)], [SegmentSpec(0), SegmentSpec(0, "rows", [0])], r"segments 0 \(whole\) and 1 \(rows\)"),
        ([(4, 4)], [SegmentSpec(0, "rows", [4])], r"rows \[4\] of tensor 0 out of range \[0, 4\)"),
        ([(4,)], [SegmentSpec(0, "cols", [0])], r"'cols' segment of tensor 0 needs >= 2 dims, shape is \(4,\)"),
        ([(4,)], [SegmentSpec(1)], r"spec 0 names tensor_index 1, but the bucket has 1 tensors"),
        ([(4,)], [(0, "whole")], r"spec 0 is a tuple, expected SegmentSpec"),
    ],
)
def test_layout_rejects_inconsistent_specs_naming_the_values(shapes, specs, message):
    with pytest.raises(LayoutError, match=message):
        BucketLayout(shapes, specs)


def test_empty_segments_overlap_nothing():
    layout = BucketLayout([(4, 4), (0, 3)], [SegmentSpec(0, "rows", []), SegmentSpec(0, "cols", [1, 2]), SegmentSpec(1), SegmentSpec(1, "rows", [])])
    assert [s.numel for s in layout.segments] == [0, 8, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_index=0, kind="diag"), r"segment kind 'diag' is not one of \('whole', 'rows', 'cols'\)"),
        (dict(tensor_index=0, coverage=0), r"coverage=0 must be >= 1"),
        (dict(tensor_index=-1), r"tensor_index=-1 must be >= 0"),
        (dict(tensor_index=0, coverage=1.5), r"coverage=1.5 must be an int"),
        (dict(tensor_index=2, kind="whole", index=(1,)), r"'whole' segment of tensor 2 takes no index, got 1 values"),
        (dict(tensor_index=0, kind="rows", index=(3, 1, 3)), r"segment of tensor 0 repeats rows \[3\]"),
        (dict(tensor_index=0, kind="rows", index=torch.ones(2, 2, dtype=torch.long)), r"1-D integer tensor, got torch.int64 of shape \(2, 2\)"),
    ],
)
def test_segment_spec_rejects_bad_fields_naming_the_values(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        SegmentSpec(**kwargs)


@pytest.mark.parametrize("block_size", [0, 8, 48, 2**15, True])
def test_block_size_must_be_a_power_of_two_in_range(block_size):
    with pytest.raises(LayoutError, match=f"block_size={block_size!r} must be a power of two in \\[16, 16384\\]"):
        BucketLayout([(3,)], block_size=block_size)


def test_more_tiles_than_the_grid_allows_is_a_limit_error_naming_both():
    with pytest.raises(KernelLimitError, match=r"needs 2147483648 tiles of block_size=16, above the grid limit 2147483647"):
        BucketLayout([(2**35,)], block_size=16)
