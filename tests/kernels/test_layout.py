"""BucketLayout: offsets, work-list, int64 addressing past 2**31, validation of segment specs."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from kernel_cases import DEVICE, buckets

from kernels import BucketLayout, KernelLimitError, LayoutError, SegmentSpec
from kernels.layout import TABLE_INDEX_START, TABLE_OFFSET, TABLE_WIDTH
from kernels.triton_ops import _segment_offsets

BIG = 2**31  # past int32


@settings(max_examples=40, deadline=None, database=None)
@given(bucket=buckets(max_tensors=6))
def test_segments_tile_the_buffer_contiguously_in_spec_order(bucket):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, block_size=block)
    offset = 0
    for spec, seg in zip(specs, layout.segments, strict=True):
        assert seg.offset == offset and seg.tensor_index == spec.tensor_index and seg.coverage == spec.coverage
        offset += seg.numel
    assert layout.total_numel == offset


@settings(max_examples=40, deadline=None, database=None)
@given(bucket=buckets(max_tensors=6))
def test_work_list_covers_every_segment_element_exactly_once(bucket):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, block_size=block)
    covered = [0] * len(layout.segments)
    for seg_id, start in zip(layout.tile_segment.tolist(), layout.tile_start.tolist()):
        assert start == covered[seg_id]  # tiles of a segment are consecutive, in order
        covered[seg_id] = min(start + block, layout.segments[seg_id].numel)
    assert covered == [s.numel for s in layout.segments]


def test_offsets_past_2_pow_31_are_exact_int64_without_allocating_tensors():
    shapes = [(2**20, 2**11), (3, 5), (2**21, 2**10 + 1)]
    specs = [SegmentSpec(0), SegmentSpec(1, "rows", [2]), SegmentSpec(2, "cols", [1024, 0])]
    layout = BucketLayout(shapes, specs, block_size=2**16)
    assert [s.offset for s in layout.segments] == [0, BIG, BIG + 5]
    assert layout.total_numel == BIG + 5 + 2 * 2**21
    assert layout.segment_table.dtype == torch.int64 and layout.tile_start.dtype == torch.int64
    assert layout.segment_table[:, TABLE_OFFSET].tolist() == [0, BIG, BIG + 5]
    assert int(layout.tile_start[layout.tile_segment == 0].max()) == BIG - 2**16


@triton.jit
def _probe_offsets(segment_table, index_values, tile_segment, tile_start, src_out, dst_out, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    _, _, src, dst, in_range = _segment_offsets(segment_table, index_values, tile_segment, tile_start, tile, BLOCK)
    lanes = tile * BLOCK + tl.arange(0, BLOCK)
    tl.store(src_out + lanes, tl.where(in_range, src, -1))
    tl.store(dst_out + lanes, tl.where(in_range, dst, -1))


def test_kernel_offset_arithmetic_is_int64_past_2_pow_31():
    # The kernels' own address computation, run on the metadata of a bucket with > 2**31
    # elements: only the metadata exists, no tensor of that size is allocated.
    shapes = [(2**16, 2**15 + 3), (2**15 + 1, 2**16, 3)]
    specs = [SegmentSpec(0), SegmentSpec(1, "cols", [2**16 - 1, 7])]
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=2**16)
    block = layout.block_size
    last = [int(torch.nonzero(layout.tile_segment == j).max()) for j in range(2)]  # last tile of each segment
    tiles = torch.tensor(last, device=DEVICE)
    src = torch.empty(len(last) * block, dtype=torch.int64, device=DEVICE)
    dst = torch.empty_like(src)
    _probe_offsets[(len(last),)](
        layout.segment_table, layout.index_values, layout.tile_segment[tiles], layout.tile_start[tiles], src, dst, BLOCK=block
    )
    for k, seg in enumerate(layout.segments):
        e = int(layout.tile_start[last[k]]) + torch.arange(block, dtype=torch.int64)
        e = e[e < seg.numel]
        a, rest = e // (len(seg.index) * seg.inner), e % (len(seg.index) * seg.inner)
        picked = torch.tensor(seg.index)[rest // seg.inner]
        want_src = (a * seg.extent + picked) * seg.inner + rest % seg.inner
        assert int(want_src.max()) > BIG and int(seg.offset + e.max()) > BIG
        lanes = slice(k * block, k * block + e.numel())
        assert torch.equal(src[lanes].cpu(), want_src)
        assert torch.equal(dst[lanes].cpu(), seg.offset + e)
        assert bool((src[k * block + e.numel() : (k + 1) * block] == -1).all())


def test_metadata_lives_on_the_layout_device_and_index_views_match_specs():
    layout = BucketLayout([(4, 6), (6, 4)], [SegmentSpec(1, "cols", [3, 1]), SegmentSpec(0, "rows", [0])], device=DEVICE)
    tensors = (layout.segment_table, layout.index_values, layout.tile_segment, layout.tile_start, layout.inverse_coverage)
    assert all(t.device == DEVICE for t in tensors)
    assert layout.segment_table.shape == (2, TABLE_WIDTH)
    assert layout.segment_table[:, TABLE_INDEX_START].tolist() == [0, 2]
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


@pytest.mark.parametrize("block_size", [0, 8, 48, 2**17, True])
def test_block_size_must_be_a_power_of_two_in_range(block_size):
    with pytest.raises(LayoutError, match=f"block_size={block_size!r} must be a power of two in \\[16, 65536\\]"):
        BucketLayout([(3,)], block_size=block_size)


def test_more_tiles_than_the_grid_allows_is_a_limit_error_naming_both():
    with pytest.raises(KernelLimitError, match=r"needs 2147483648 tiles of block_size=16, above the grid limit 2147483647"):
        BucketLayout([(2**35,)], block_size=16)
