"""Triton (interpreted on CPU, compiled on GPU) against the reference, and the round-trip invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, DTYPES, buckets, held_masks, make_tensors

from kernels import BucketLayout, SegmentSpec, pack, select_backend, squared_norm, triton_ops, unpack
from kernels.worklist import DESC_KIND, KIND_GATHER, KIND_RUN, KIND_RUN_ALIGNED, KIND_ZERO

FAST = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 2**16)
dtypes = st.sampled_from(DTYPES)


def test_auto_backend_runs_the_triton_kernels_in_these_tests():
    assert select_backend("auto", DEVICE) is triton_ops
    assert triton_ops.INTERPRETED == (DEVICE.type == "cpu")


@FAST
@given(bucket=buckets(), dtype=dtypes, seed=seeds)
def test_triton_pack_copy_is_bit_exact_with_reference(bucket, dtype, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    tensors = make_tensors(shapes, dtype, seed)
    got = pack(tensors, layout, backend="triton")
    want = pack(tensors, layout, backend="reference")
    assert got.dtype == (dtype if tensors else torch.float32) and got.shape == (layout.total_numel,)
    assert torch.equal(got, want)


@FAST
@given(bucket=buckets(), dtype=dtypes, out_dtype=dtypes, seed=seeds)
def test_triton_pack_scaled_and_cast_is_bit_exact_with_reference(bucket, dtype, out_dtype, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    tensors = make_tensors(shapes, dtype, seed)
    got = pack(tensors, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, backend="triton")
    want = pack(tensors, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, backend="reference")
    assert got.dtype == out_dtype
    assert torch.equal(got, want)


@FAST
@given(bucket=buckets(), dtype=dtypes, buffer_dtype=dtypes, mode=st.sampled_from(["copy", "accumulate"]), seed=seeds)
def test_triton_unpack_is_bit_exact_with_reference_and_leaves_unheld_entries_untouched(bucket, dtype, buffer_dtype, mode, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    buffer = make_tensors([(layout.total_numel,)], buffer_dtype, seed)[0]
    before = make_tensors(shapes, dtype, seed + 1)
    got, want = [t.clone() for t in before], [t.clone() for t in before]
    unpack(buffer, got, layout, mode=mode, scale=layout.inverse_coverage, backend="triton")
    unpack(buffer, want, layout, mode=mode, scale=layout.inverse_coverage, backend="reference")
    for g, w, b, held in zip(got, want, before, held_masks(layout)):
        assert torch.equal(g, w)
        assert torch.equal(g[~held], b[~held])


@FAST
@given(bucket=buckets(), dtype=dtypes, backend=st.sampled_from(["triton", "reference"]), seed=seeds)
def test_pack_then_unpack_is_identity_on_held_slices_and_untouched_elsewhere(bucket, dtype, backend, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    source = make_tensors(shapes, dtype, seed)
    target = make_tensors(shapes, dtype, seed + 1)
    original = [t.clone() for t in target]
    unpack(pack(source, layout, backend=backend), target, layout, backend=backend)
    for s, t, o, held in zip(source, target, original, held_masks(layout)):
        assert torch.equal(t[held], s[held])
        assert torch.equal(t[~held], o[~held])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_reference_semantics_rows_cols_whole_match_explicit_indexing(backend):
    up = torch.arange(35.0, device=DEVICE).reshape(7, 5)  # (d_ff, d): rows are neurons
    down = torch.arange(35.0, device=DEVICE).reshape(5, 7) + 100  # (d, d_ff): cols are neurons
    conv = torch.arange(3 * 5 * 2 * 2.0, device=DEVICE).reshape(3, 5, 2, 2) + 1000
    bias = torch.arange(3.0, device=DEVICE) - 10
    neurons = [6, 1, 3]
    specs = [SegmentSpec(0, "rows", neurons, 3), SegmentSpec(1, "cols", neurons, 3), SegmentSpec(2, "cols", [4, 0]), SegmentSpec(3)]
    layout = BucketLayout([up.shape, down.shape, conv.shape, bias.shape], specs, device=DEVICE, block_size=16)
    scale = torch.tensor([0.5, 2.0, 1.0, -1.0], device=DEVICE)
    got = pack([up, down, conv, bias], layout, scale=scale, backend=backend)
    parts = [up[neurons].flatten() * 0.5, down[:, neurons].flatten() * 2, conv[:, [4, 0]].flatten(), -bias]
    # Each segment starts at a multiple of 8 elements; the padding between them is zero.
    assert [s.offset for s in layout.segments] == [0, 16, 32, 56] and layout.gaps == ((15, 1), (31, 1))
    want = torch.zeros(layout.total_numel, device=DEVICE)
    for seg, part in zip(layout.segments, parts):
        want[seg.offset : seg.offset + seg.numel] = part
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_pack_into_larger_out_writes_only_the_layout_prefix(backend):
    tensors = make_tensors([(3, 3), (5,)], torch.float32, 0)
    layout = BucketLayout([t.shape for t in tensors], device=DEVICE)
    out = torch.full((30,), 7.0, device=DEVICE)
    assert pack(tensors, layout, out, backend=backend) is out
    assert layout.total_numel == 21 and layout.gaps == ((9, 7),)
    assert torch.equal(out[:9], tensors[0].flatten()) and torch.equal(out[16:21], tensors[1])
    assert torch.equal(out[9:16], torch.zeros(7, device=DEVICE))  # the padding is cleared
    assert torch.equal(out[21:], torch.full((9,), 7.0, device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_bucket_and_zero_length_segments_pack_to_an_empty_buffer(backend):
    assert pack([], BucketLayout([], device=DEVICE), backend=backend).numel() == 0
    tensors = make_tensors([(0, 4), (3, 0), (4, 2)], torch.bfloat16, 0)
    specs = [SegmentSpec(0), SegmentSpec(1, "rows", [2, 0]), SegmentSpec(2, "cols", [])]
    layout = BucketLayout([t.shape for t in tensors], specs, device=DEVICE)
    assert layout.total_numel == 0 and layout.num_tiles == 0
    assert pack(tensors, layout, backend=backend).numel() == 0
    unpack(torch.empty(0, device=DEVICE), tensors, layout, backend=backend)


def test_bfloat16_cast_rounds_to_nearest_even_like_torch():
    # 1 + 2**-8 is a tie between bf16 neighbours 1 and 1 + 2**-7: even mantissa wins (1.0);
    # 1 + 3 * 2**-8 ties to 1 + 2**-6; just above a tie rounds up; truncation would give 1 + 2**-7.
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-7 + 2**-9), 3.4e38], device=DEVICE)
    layout = BucketLayout([values.shape], device=DEVICE)
    got = pack([values], layout, out_dtype=torch.bfloat16, backend="triton")
    assert torch.equal(got, values.to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_unpack_accumulate_adds_the_scaled_buffer_to_held_entries_only(backend):
    grad = torch.arange(20.0, device=DEVICE).reshape(5, 4)
    layout = BucketLayout([grad.shape], [SegmentSpec(0, "rows", [4, 1], 2), SegmentSpec(0, "rows", [2], 4)], device=DEVICE, block_size=16)
    buffer = torch.arange(12.0, device=DEVICE) + 100
    unpack(buffer, [grad], layout, mode="accumulate", scale=layout.inverse_coverage, backend=backend)
    want = torch.arange(20.0, device=DEVICE).reshape(5, 4)
    want[4] += buffer[0:4] / 2
    want[1] += buffer[4:8] / 2
    want[2] += buffer[8:12] / 4
    assert torch.equal(grad, want)


def _every_tile_kind() -> tuple[list[tuple[int, ...]], list[SegmentSpec]]:
    shapes = [(4096,), (37,), (64, 24), (24, 64), (24, 70), (10, 33), (50,)]
    specs = [
        SegmentSpec(0, coverage=2),  # whole: aligned run
        SegmentSpec(1, coverage=3),  # whole of odd size: aligned body, unaligned tail, then padding
        SegmentSpec(2, "rows", range(8, 40), 2),  # consecutive rows merged into one run
        SegmentSpec(3, "cols", range(40), 4),  # a column run per row, aligned strides
        SegmentSpec(4, "cols", range(3, 70), 4),  # a column run per row, unaligned
        SegmentSpec(5, "cols", (0, 5, 9, 17, 30), 2),  # scattered columns: a gather over 10 rows
        SegmentSpec(6, "rows", (1, 4, 7, 20, 44), 3),  # scattered entries of a vector: one-row gather
    ]
    return shapes, specs


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_runtime_fp32_pack_and_unpack_are_bit_exact_on_every_tile_kind(buffer_dtype):
    # The sync engine's path (fp32 gradients, fp32 buffer, scaled by 1/c_j) and the bf16 one.
    shapes, specs = _every_tile_kind()
    layout = BucketLayout(shapes, specs, device=DEVICE)
    assert set(layout.descriptors[:, DESC_KIND].tolist()) == {KIND_RUN_ALIGNED, KIND_RUN, KIND_GATHER, KIND_ZERO}
    grads = make_tensors(shapes, torch.float32, seed=5)
    got = pack(grads, layout, scale=layout.inverse_coverage, out_dtype=buffer_dtype, backend="triton")
    assert torch.equal(got, pack(grads, layout, scale=layout.inverse_coverage, out_dtype=buffer_dtype, backend="reference"))
    for mode in ("copy", "accumulate"):
        back = {b: make_tensors(shapes, torch.float32, seed=6) for b in ("triton", "reference")}
        for backend, tensors in back.items():
            unpack(got, tensors, layout, mode=mode, scale=layout.inverse_coverage, backend=backend)
        assert all(torch.equal(t, r) for t, r in zip(back["triton"], back["reference"]))


def test_unaligned_tensors_take_the_checked_fallback_and_stay_bit_exact():
    # Gradients as views into one flat allocation at a 4-byte offset: not 16-byte aligned.
    shapes, specs = _every_tile_kind()
    storage = torch.randn(1 + sum(math.prod(s) for s in shapes), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    views, start = [], 1
    for s in shapes:
        views.append(storage[start : start + math.prod(s)].view(s))
        start += math.prod(s)
    layout = BucketLayout(shapes, specs, device=DEVICE)
    out = torch.empty(layout.total_numel, device=DEVICE)
    assert not triton_ops.kernel_constexprs(views, layout, out)["ALIGNED"]
    assert triton_ops.kernel_constexprs(make_tensors(shapes, torch.float32, 0), layout, out)["ALIGNED"]
    got = pack(views, layout, out, scale=layout.inverse_coverage, backend="triton")
    assert torch.equal(got, pack(views, layout, scale=layout.inverse_coverage, backend="reference"))
    copies = [v.clone() for v in views]
    unpack(got * 3, views, layout, backend="triton")
    unpack(got * 3, copies, layout, backend="reference")
    assert all(torch.equal(v, c) for v, c in zip(views, copies))


@FAST
@given(bucket=buckets(), dtype=dtypes, seed=seeds)
def test_squared_norm_of_held_slices_matches_the_packed_buffer_within_float32_summation(bucket, dtype, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    tensors = make_tensors(shapes, dtype, seed)
    exact = float(pack(tensors, layout, backend="reference").double().pow(2).sum())  # padding is zero
    # Float32 sums of n non-negative terms: relative error below n * 2**-24 whatever the order.
    bound = max(1, layout.total_numel) * 2**-24 * exact
    for backend in ("triton", "reference"):
        got = squared_norm(tensors, layout, backend=backend)
        assert got.dtype == torch.float32 and got.shape == ()
        assert abs(float(got) - exact) <= bound, (backend, float(got), exact)


def test_squared_norm_reads_every_tile_kind_and_ignores_unheld_entries():
    shapes, specs = _every_tile_kind()
    layout = BucketLayout(shapes, specs, device=DEVICE)
    tensors = make_tensors(shapes, torch.float32, seed=2)
    want = float(pack(tensors, layout, backend="reference").double().pow(2).sum())
    got = squared_norm(tensors, layout, backend="triton")
    assert abs(float(got) - want) <= 1e-5 * want
    masks = held_masks(layout)
    for t, held in zip(tensors, masks):
        t[~held] = float("nan")  # never read
    assert float(squared_norm(tensors, layout, backend="triton")) == float(got)
