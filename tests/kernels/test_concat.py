"""Several buckets as one layout (`concat_layouts`) and segments left out of the norm (`SegmentSpec.in_norm`).

One launch over the concatenated layout must leave every element where a launch per bucket
leaves it, bit for bit, on both backends: the buffers (gaps included), the unpacked tensors, and
the squared norm of the buckets that count in it (to float32 summation order).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, DTYPES, buckets, make_tensors

from kernels import BucketLayout, LayoutError, SegmentSpec, concat_layouts, pack, squared_norm, unpack

FAST = settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
backends = st.sampled_from(["triton", "reference"])


@st.composite
def split_buckets(draw):
    """(shapes, per-bucket specs, block, in_norm): one random bucket's segments dealt into 1-3 buckets
    over the same tensors, so that one tensor's disjoint rows or columns fall in different buckets."""
    shapes, specs, block = draw(buckets(max_tensors=3, max_extent=7))
    n = draw(st.integers(1, 3))
    owner = [draw(st.integers(0, n - 1)) for _ in specs]
    dealt = [[s for s, o in zip(specs, owner) if o == i] for i in range(n)]
    return shapes, dealt, block, [draw(st.booleans()) for _ in range(n)]


@FAST
@given(case=split_buckets(), dtype=st.sampled_from(DTYPES), backend=backends, seed=st.integers(0, 2**16))
def test_one_launch_over_concatenated_buckets_equals_a_launch_per_bucket_bit_for_bit(case, dtype, backend, seed):
    shapes, dealt, block, in_norm = case
    layouts = [BucketLayout(shapes, specs, device=DEVICE, block_size=block) for specs in dealt]
    ids = [list(range(len(shapes)))] * len(layouts)
    both, starts = concat_layouts(layouts, ids, in_norm=in_norm)
    tensors = make_tensors(shapes, dtype, seed)
    flat = torch.full((starts[-1] + layouts[-1].total_numel,), float("nan"), dtype=dtype, device=DEVICE)
    pack(tensors, both, flat, scale=both.inverse_coverage, backend=backend)
    for layout, start in zip(layouts, starts):
        own = pack(tensors, layout, scale=layout.inverse_coverage, backend="reference")  # today's launch per bucket
        assert torch.equal(flat.narrow(0, start, layout.total_numel), own)
    partials = torch.full((both.num_norm_partials,), float("nan"), device=DEVICE)
    got = [t.clone() for t in tensors]
    unpack(flat, got, both, partials=partials, backend=backend)
    want = [t.clone() for t in tensors]
    for layout, start in zip(layouts, starts):
        unpack(flat.narrow(0, start, layout.total_numel), want, layout, backend="reference")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    counted = sum(float(squared_norm(want, layout, backend="reference")) for layout, keep in zip(layouts, in_norm) if keep)
    assert float(partials.sum()) == pytest.approx(counted, rel=1e-5, abs=1e-30)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_segment_out_of_the_norm_adds_nothing_to_partials_even_when_not_finite(backend):
    layout = BucketLayout([(4, 3), (5,)], [SegmentSpec(0, "rows", (1, 3)), SegmentSpec(1, in_norm=False)],
                          device=DEVICE, block_size=16)
    tensors = [torch.full((4, 3), 2.0, device=DEVICE), torch.full((5,), float("nan"), device=DEVICE)]
    partials = torch.full((layout.num_norm_partials,), float("nan"), device=DEVICE)
    assert float(squared_norm(tensors, layout, partials=partials, backend=backend).sum()) == 24.0
    assert float(squared_norm(tensors, layout, backend=backend)) == 24.0
    pack(tensors, layout, partials=partials, backend=backend)
    assert float(partials.sum()) == 24.0
    assert layout.norm_flags.tolist() == [1, 0]


def test_concat_places_each_bucket_at_an_aligned_start_and_keeps_a_shared_tensor_once():
    a = BucketLayout([(6, 2)], [SegmentSpec(0, "rows", (0, 5), coverage=2)])
    b = BucketLayout([(6, 2), (3,)], [SegmentSpec(0, "rows", (1, 2)), SegmentSpec(1)])
    both, starts = concat_layouts([a, b], [[0], [0, 1]])
    assert starts == (0, 8) and both.shapes == (torch.Size([6, 2]), torch.Size([3]))
    assert [(s.tensor_index, s.offset, s.coverage) for s in both.segments] == [(0, 0, 2), (0, 8, 1), (1, 16, 1)]


def test_concat_rejects_inconsistent_inputs_naming_the_values():
    a, b = BucketLayout([(3,)]), BucketLayout([(4,)])
    with pytest.raises(LayoutError, match=r"tensor 0 has shape \(3,\) in one layout, \(4,\) in layout 1"):
        concat_layouts([a, b], [[0], [0]])
    with pytest.raises(LayoutError, match=r"every position from 0 to 1, got \[0, 2\]"):
        concat_layouts([a, b], [[0], [2]])
    with pytest.raises(LayoutError, match="block_size=16"):
        concat_layouts([a, BucketLayout([(3,)], block_size=16)], [[0], [1]])
    with pytest.raises(LayoutError, match="overlap"):  # the same rows of one tensor in two buckets
        concat_layouts([a, BucketLayout([(3,)])], [[0], [0]])
    with pytest.raises(LayoutError, match="in_norm=1 must be a bool"):
        SegmentSpec(0, in_norm=1)
