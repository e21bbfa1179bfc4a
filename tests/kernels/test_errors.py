"""Both backends reject the same bad inputs with a KernelInputError that names the values."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE

from kernels import BucketLayout, KernelInputError, SegmentSpec, overlap_average, pack, unpack

BACKENDS = ["triton", "reference"]


@pytest.fixture
def bucket():
    tensors = [torch.randn(4, 3, device=DEVICE), torch.randn(5, device=DEVICE)]
    layout = BucketLayout([t.shape for t in tensors], [SegmentSpec(0, "rows", [1, 3]), SegmentSpec(1)], device=DEVICE)
    return tensors, layout


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_dtypes_within_a_bucket_are_rejected(bucket, backend):
    tensors, layout = bucket
    with pytest.raises(KernelInputError, match=r"tensor 1 has dtype torch.float16, tensor 0 has torch.float32"):
        pack([tensors[0], tensors[1].half()], layout, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_dtype_is_rejected(backend):
    layout = BucketLayout([(3,)], device=DEVICE)
    with pytest.raises(KernelInputError, match=r"tensor 0 has dtype torch.float64, supported"):
        pack([torch.zeros(3, dtype=torch.float64, device=DEVICE)], layout, backend=backend)
    with pytest.raises(KernelInputError, match=r"out_dtype=torch.int32 is not supported"):
        pack([torch.zeros(3, device=DEVICE)], layout, out_dtype=torch.int32, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_on_another_device_than_the_layout_is_rejected(bucket, backend):
    tensors, _ = bucket
    layout = BucketLayout([t.shape for t in tensors], device="meta")
    with pytest.raises(KernelInputError, match=r"tensor 0 is on (cpu|cuda:0), the layout is on meta"):
        pack(tensors, layout, backend="reference")
    layout = BucketLayout([t.shape for t in tensors], device=DEVICE)
    meta_out = torch.empty(layout.total_numel, device="meta")
    with pytest.raises(KernelInputError, match=r"out is on meta, the layout is on (cpu|cuda:0)"):
        pack(tensors, layout, meta_out, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_tensor_is_rejected_with_its_strides(bucket, backend):
    tensors, layout = bucket
    transposed = torch.randn(3, 4, device=DEVICE).t()
    with pytest.raises(KernelInputError, match=r"tensor 0 of shape \(4, 3\) has strides \(1, 4\), not contiguous"):
        pack([transposed, tensors[1]], layout, backend=backend)
    with pytest.raises(KernelInputError, match=r"tensor 0 of shape \(4, 3\) has strides \(1, 4\), not contiguous"):
        unpack(torch.zeros(13, device=DEVICE), [transposed, tensors[1]], layout, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_count_or_shape_of_tensors_is_rejected(bucket, backend):
    tensors, layout = bucket
    with pytest.raises(KernelInputError, match=r"got 1 tensors, the layout was built for 2"):
        pack(tensors[:1], layout, backend=backend)
    with pytest.raises(KernelInputError, match=r"tensor 1 has shape \(6,\), the layout expects \(5,\)"):
        pack([tensors[0], torch.zeros(6, device=DEVICE)], layout, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_too_small_or_not_flat_is_rejected(bucket, backend):
    tensors, layout = bucket
    # 6 held elements, 2 of padding that align the second segment, then 5: 13.
    with pytest.raises(KernelInputError, match=r"out holds 12 elements, the layout needs 13"):
        pack(tensors, layout, torch.zeros(12, device=DEVICE), backend=backend)
    with pytest.raises(KernelInputError, match=r"buffer holds 12 elements, the layout needs 13"):
        unpack(torch.zeros(12, device=DEVICE), tensors, layout, backend=backend)
    with pytest.raises(KernelInputError, match=r"out must be a contiguous 1-D tensor, got shape \(13, 2\)"):
        pack(tensors, layout, torch.zeros(13, 2, device=DEVICE), backend=backend)
    with pytest.raises(KernelInputError, match=r"out has dtype torch.float32 but out_dtype=torch.bfloat16"):
        pack(tensors, layout, torch.zeros(13, device=DEVICE), out_dtype=torch.bfloat16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_overlapping_a_tensor_in_memory_is_rejected(backend):
    storage = torch.zeros(64, device=DEVICE)
    weight, out = storage[:12].view(4, 3), storage[8:20]
    layout = BucketLayout([(4, 3)], device=DEVICE)
    with pytest.raises(KernelInputError, match=r"tensor 0 \(bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\)\) and out \(bytes .*overlap in memory"):
        pack([weight], layout, out, backend=backend)
    with pytest.raises(KernelInputError, match=r"tensor 0 .* and tensor 1 .* overlap in memory"):
        unpack(storage[22:50], [weight, storage[10:22].view(4, 3)], BucketLayout([(4, 3), (4, 3)], device=DEVICE), backend=backend)


def test_a_cached_launch_plan_never_lets_an_overlapping_buffer_or_partials_through():
    # Triton checks aliasing once per operand key (addresses, dtypes, buffer length): the same
    # addresses with a longer buffer, or partials elsewhere, are new keys and are checked again.
    storage = torch.zeros(64, device=DEVICE)
    weight = storage[20:32].view(4, 3)
    layout = BucketLayout([(4, 3)], device=DEVICE)
    partials = storage[40:40 + layout.num_norm_partials]
    for _ in range(2):
        pack([weight], layout, storage[8:20], partials=partials, backend="triton")
        unpack(storage[8:20], [weight], layout, partials=partials, backend="triton")
    with pytest.raises(KernelInputError, match=r"out \(bytes .* and tensor 0 .*overlap in memory"):
        pack([weight], layout, storage[8:28], partials=partials, backend="triton")
    with pytest.raises(KernelInputError, match=r"buffer \(bytes .* and tensor 0 .*overlap in memory"):
        unpack(storage[8:28], [weight], layout, partials=partials, backend="triton")
    with pytest.raises(KernelInputError, match=r"tensor 0 .* and partials .*overlap in memory"):
        unpack(storage[8:20], [weight], layout, partials=storage[30:30 + layout.num_norm_partials], backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mode_divide_or_scale_is_rejected(bucket, backend):
    tensors, layout = bucket
    buffer = pack(tensors, layout, backend=backend)
    with pytest.raises(KernelInputError, match=r"mode='add' is not one of \('copy', 'accumulate'\)"):
        unpack(buffer, tensors, layout, mode="add", backend=backend)
    with pytest.raises(KernelInputError, match=r"divide='never' is not one of \('before', 'after'\)"):
        overlap_average(tensors, layout, lambda b: None, divide="never", backend=backend)
    with pytest.raises(KernelInputError, match=r"scale must be a float32 tensor of shape \(2,\).*got torch.float32 of shape \(3,\)"):
        pack(tensors, layout, scale=torch.ones(3, device=DEVICE), backend=backend)
    with pytest.raises(KernelInputError, match=r"scale must be a float32 tensor of shape \(2,\).*got list"):
        pack(tensors, layout, scale=[1.0, 1.0], backend=backend)


def test_unknown_backend_is_rejected(bucket):
    tensors, layout = bucket
    with pytest.raises(KernelInputError, match=r"backend='cuda' is not one of \('auto', 'triton', 'reference'\)"):
        pack(tensors, layout, backend="cuda")
