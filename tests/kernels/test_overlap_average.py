"""overlap_average over simulated workers: every held slice becomes the average over its holders."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, make_tensors

from kernels import BucketLayout, SegmentSpec, overlap_average, pack

K = 4
# One MLP whose neurons are split between two holder sets with different coverage, the matching
# down-projection columns, and a bias every worker holds: three coverages inside one bucket and
# two inside one tensor. Neurons 3, 4, 6 are held by no segment of this bucket.
SHAPES = [(8, 6), (6, 8), (8,)]
HOLDERS = [{0, 1}, {0, 2, 3}, {0, 1}, {0, 2, 3}, {0, 1, 2, 3}]
SPECS = [
    SegmentSpec(0, "rows", (0, 1, 2), coverage=2),
    SegmentSpec(0, "rows", (7, 5), coverage=3),
    SegmentSpec(1, "cols", (0, 1, 2), coverage=2),
    SegmentSpec(1, "cols", (7, 5), coverage=3),
    SegmentSpec(2, "whole", coverage=4),
]


def _simulated_all_reduce(layout, worker_grads, buffer_dtype, divide):
    """The sum over holders as worker 0 sees it: its own packed buffer plus the other holders'."""
    scale = layout.inverse_coverage if divide == "before" else None
    others = torch.zeros(layout.total_numel, dtype=torch.float32, device=DEVICE)
    for k in range(1, K):
        packed = pack(worker_grads[k], layout, scale=scale, out_dtype=buffer_dtype, backend="reference")
        for seg, holders in zip(layout.segments, HOLDERS):
            if k in holders:
                others[seg.offset : seg.offset + seg.numel] += packed[seg.offset : seg.offset + seg.numel].float()

    def all_reduce(buffer):
        buffer.copy_(buffer.float() + others)

    return all_reduce


@pytest.mark.parametrize("divide", ["before", "after"])
@pytest.mark.parametrize(("dtype", "buffer_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
def test_overlap_average_gives_each_slice_the_mean_over_its_own_holders(divide, dtype, buffer_dtype):
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE, block_size=16)
    worker_grads = [make_tensors(SHAPES, dtype, seed=k) for k in range(K)]
    results = {}
    for backend in ("triton", "reference"):
        grads = [g.clone() for g in worker_grads[0]]
        all_reduce = _simulated_all_reduce(layout, worker_grads, buffer_dtype, divide)
        buffer = overlap_average(grads, layout, all_reduce, buffer_dtype=buffer_dtype, divide=divide, backend=backend)
        assert buffer.dtype == buffer_dtype and buffer.numel() == layout.total_numel
        results[backend] = grads
    for got, want in zip(results["triton"], results["reference"]):
        assert torch.equal(got, want)

    # Against the exact mean: the pack/sum/unpack path rounds at most K + 2 times in the
    # coarser of the two dtypes, each rounding off by half an ulp of a value <= max |g|.
    eps = max(torch.finfo(dtype).eps, torch.finfo(buffer_dtype).eps)
    for seg, holders in zip(layout.segments, HOLDERS):
        pick = _selector(seg)
        mean = sum(pick(worker_grads[k][seg.tensor_index]).double() for k in holders) / len(holders)
        bound = (K + 2) * eps * max(float(pick(worker_grads[k][seg.tensor_index]).abs().max()) for k in range(K))
        torch.testing.assert_close(pick(results["reference"][seg.tensor_index]).double(), mean, rtol=0.0, atol=bound)
    unheld = [3, 4, 6]
    for grads in results.values():
        assert torch.equal(grads[0][unheld], worker_grads[0][0][unheld])
        assert torch.equal(grads[1][:, unheld], worker_grads[0][1][:, unheld])


def _selector(seg):
    if seg.kind == "whole":
        return lambda t: t
    index = list(seg.index)
    return (lambda t: t[index]) if seg.kind == "rows" else (lambda t: t[:, index])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_overlap_average_reuses_a_preallocated_buffer_and_passes_the_used_prefix(backend):
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE)
    grads = make_tensors(SHAPES, torch.float32, seed=0)
    buffer = torch.full((layout.total_numel + 5,), -1.0, device=DEVICE)
    seen = []
    assert overlap_average(grads, layout, seen.append, buffer=buffer, backend=backend) is buffer
    (reduced,) = seen
    assert reduced.numel() == layout.total_numel and reduced.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[layout.total_numel :], torch.full((5,), -1.0, device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_overlap_average_with_identity_collective_scales_each_slice_by_its_inverse_coverage(backend):
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE)
    original = make_tensors(SHAPES, torch.float32, seed=3)
    grads = [g.clone() for g in original]
    overlap_average(grads, layout, lambda b: None, backend=backend)
    for seg in layout.segments:
        pick = _selector(seg)
        assert torch.equal(pick(grads[seg.tensor_index]), pick(original[seg.tensor_index]) * torch.tensor(seg.scale, dtype=torch.float32))
