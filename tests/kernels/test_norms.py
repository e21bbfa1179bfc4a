"""Squared norms fused into pack / unpack (``partials``), squared_norm into partials, and clip_coefficient.

Within one backend, a fused norm is the same computation as `squared_norm` (Triton: the same tiles,
values and reduction, so the partials agree bit for bit; reference: the same function). Across
backends only the order of the float32 summation differs, bounded as in test_pack_unpack.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, DTYPES, buckets, held_masks, make_tensors

from kernels import BucketLayout, KernelInputError, SegmentSpec, clip_coefficient, pack, squared_norm, unpack

FAST = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 2**16)
dtypes = st.sampled_from(DTYPES)
backends = st.sampled_from(["triton", "reference"])


def _partials(layout: BucketLayout, fill: float = float("nan")) -> torch.Tensor:
    # NaN first: every entry must be overwritten.
    return torch.full((layout.num_norm_partials,), fill, device=DEVICE)


def _exact_sq(tensors, layout: BucketLayout) -> float:
    return float(pack(tensors, layout, out_dtype=torch.float32, backend="reference").double().pow(2).sum())


@FAST
@given(bucket=buckets(), dtype=dtypes, out_dtype=dtypes, backend=backends, seed=seeds)
def test_pack_with_partials_packs_the_same_buffer_and_its_partials_are_squared_norm_of_the_source(
        bucket, dtype, out_dtype, backend, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    tensors = make_tensors(shapes, dtype, seed)
    partials = _partials(layout)
    got = pack(tensors, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, partials=partials, backend=backend)
    assert torch.equal(got, pack(tensors, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, backend=backend))
    alone = squared_norm(tensors, layout, partials=_partials(layout), backend=backend)
    assert torch.equal(partials, alone)  # the same tiles, values and reduction as squared_norm's
    exact = _exact_sq(tensors, layout)
    assert abs(float(partials.sum()) - exact) <= max(1, layout.total_numel) * 2**-24 * exact


@FAST
@given(bucket=buckets(), dtype=dtypes, buffer_dtype=dtypes, mode=st.sampled_from(["copy", "accumulate"]), backend=backends,
       seed=seeds)
def test_unpack_with_partials_writes_the_same_tensors_and_its_partials_are_squared_norm_of_the_result(
        bucket, dtype, buffer_dtype, mode, backend, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    buffer = make_tensors([(layout.total_numel,)], buffer_dtype, seed)[0]
    before = make_tensors(shapes, dtype, seed + 1)
    fused, plain = [t.clone() for t in before], [t.clone() for t in before]
    partials = _partials(layout)
    unpack(buffer, fused, layout, mode=mode, scale=layout.inverse_coverage, partials=partials, backend=backend)
    unpack(buffer, plain, layout, mode=mode, scale=layout.inverse_coverage, backend=backend)
    assert all(torch.equal(f, p) for f, p in zip(fused, plain))
    assert torch.equal(partials, squared_norm(fused, layout, partials=_partials(layout), backend=backend))


@FAST
@given(bucket=buckets(), dtype=dtypes, seed=seeds)
def test_squared_norm_partials_sum_to_squared_norm_on_both_backends(bucket, dtype, seed):
    shapes, specs, block = bucket
    layout = BucketLayout(shapes, specs, device=DEVICE, block_size=block)
    tensors = make_tensors(shapes, dtype, seed)
    exact = _exact_sq(tensors, layout)
    bound = max(1, layout.total_numel) * 2**-24 * exact
    for backend in ("triton", "reference"):
        partials = _partials(layout)
        assert squared_norm(tensors, layout, partials=partials, backend=backend) is partials
        assert abs(float(partials.sum()) - exact) <= bound, backend
        assert torch.equal(partials.sum(), squared_norm(tensors, layout, backend=backend))


def test_norm_partials_ignore_unheld_entries_and_fit_a_slice_of_one_step_buffer():
    shapes = [(24, 70), (10, 33), (50,)]
    specs = [SegmentSpec(0, "cols", range(3, 70), 4), SegmentSpec(1, "cols", (0, 5, 9, 17, 30), 2), SegmentSpec(2)]
    layouts = [BucketLayout(shapes, specs, device=DEVICE, block_size=64), BucketLayout(shapes[:1], specs[:1], device=DEVICE)]
    grads = [make_tensors(layout.shapes, torch.float32, seed) for seed, layout in enumerate(layouts)]
    for tensors, layout in zip(grads, layouts):
        for t, held in zip(tensors, held_masks(layout)):
            t[~held] = float("nan")  # never read
    step = torch.zeros(sum(layout.num_norm_partials for layout in layouts), device=DEVICE)
    shares = step.split([layout.num_norm_partials for layout in layouts])
    for tensors, layout, share in zip(grads, layouts, shares):
        buffer = pack(tensors, layout, partials=share, backend="triton")
        unpack(buffer, tensors, layout, partials=share, backend="triton")
    want = sum(_exact_sq(tensors, layout) for tensors, layout in zip(grads, layouts))
    assert abs(float(step.sum()) - want) <= 1e-5 * want


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_partials_of_the_wrong_length_dtype_or_memory_are_refused(backend):
    tensors = make_tensors([(4, 6), (6,)], torch.float32, 0)
    layout = BucketLayout([t.shape for t in tensors], device=DEVICE)
    n = layout.num_norm_partials
    with pytest.raises(KernelInputError, match=rf"partials must be a float32 tensor of shape \({n},\).*got torch.float32 of shape \({n + 1},\)"):
        pack(tensors, layout, partials=torch.zeros(n + 1, device=DEVICE), backend=backend)
    with pytest.raises(KernelInputError, match=r"partials must be a float32 tensor.*got torch.bfloat16"):
        unpack(torch.zeros(layout.total_numel, device=DEVICE), tensors, layout,
               partials=torch.zeros(n, dtype=torch.bfloat16, device=DEVICE), backend=backend)
    with pytest.raises(KernelInputError, match=r"(?=.*tensor 0)(?=.*partials).*overlap in memory"):
        squared_norm(tensors, layout, partials=tensors[0].view(-1)[:n], backend=backend)


def test_clip_coefficient_clips_only_norms_above_the_limit():
    sq = torch.tensor([0.0, 3.0, 4.0, 100.0, float("inf"), float("nan")], device=DEVICE)
    got = torch.stack([clip_coefficient(s, 2.0, eps=0.0) for s in sq])
    assert got.dtype == torch.float32 and got.device == sq.device
    # norms 0, 1.73, 2 (not above the limit), 10, inf, nan; 2 / 10 is one correctly rounded float32 division
    assert torch.equal(got, torch.tensor([1.0, 1.0, 1.0, 0.2, 0.0, 1.0], device=DEVICE))
    assert float(clip_coefficient(torch.tensor(100.0, device=DEVICE), 2.0)) == pytest.approx(2 / (10 + 1e-6), rel=1e-6)


@pytest.mark.parametrize(("args", "message"), [
    ((torch.ones(2), 1.0), r"squared_norm must be a 0-d floating tensor, got torch.float32 of shape \(2,\)"),
    ((torch.tensor(1), 1.0), r"squared_norm must be a 0-d floating tensor, got torch.int64"),
    ((torch.tensor(1.0), 0.0), r"max_norm=0.0 must be a finite number > 0"),
    ((torch.tensor(1.0), float("nan")), r"max_norm=nan must be"),
])
def test_clip_coefficient_refuses_bad_input_naming_the_value(args, message):
    with pytest.raises(KernelInputError, match=message):
        clip_coefficient(*args)
