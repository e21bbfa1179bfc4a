"""A steady-state step of pack / unpack / squared_norm makes no host synchronisation and uploads nothing.

The sync engine calls the kernels inside gradient hooks, every step. On a GPU a host
synchronisation there (``.item()``, a Python branch on a device tensor, a blocking host-to-device
copy) stalls the host behind the device and loses the overlap with backward. Here, on CPU, a
detector fails on every operation that would synchronise or build a tensor from host data, while
the gradients' addresses alternate among a few sets, as torch's default ``zero_grad()``
(set_to_none) with the caching allocator gives. The Triton launches are recorded, not run: what is
checked is the host side of every launch (the interpreter itself reads tensors on the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import DEVICE, make_tensors

from kernels import BucketLayout, SegmentSpec, clip_coefficient, pack, squared_norm, triton_ops, unpack
from tests.host_sync import HostSyncDetector

SHAPES = [(40, 24), (24, 40), (40,), (17, 3)]
SPECS = [SegmentSpec(0, "rows", tuple(range(0, 40, 3)), 2), SegmentSpec(1, "cols", tuple(range(8, 32)), 2),
         SegmentSpec(2, coverage=2), SegmentSpec(3, "rows", (16, 0, 5), 3)]


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Triton launches recorded, not run: the host side of a launch is what is checked."""
    launches: list = []
    kind = type(triton_ops._pack_kernel)  # JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    original = kind.run

    def recorder(self, *args, grid, warmup, **kwargs):
        launches.append(self.fn.__name__)

    kind.run = recorder
    try:
        yield launches
    finally:
        kind.run = original


def _step(grads: list[torch.Tensor], alone: list[torch.Tensor], layout: BucketLayout, buffer: torch.Tensor,
          partials: torch.Tensor, backend: str) -> None:
    """The sync engine's step with clipping: a bucket averaged (pack, all-reduce, unpack with its norm
    fused), a single holder's bucket (its norm only), one sum, the clipping factor applied on the device."""
    shared, own = partials.split(layout.num_norm_partials)
    pack(grads, layout, buffer, scale=layout.inverse_coverage, backend=backend)
    unpack(buffer, grads, layout, partials=shared, backend=backend)
    squared_norm(alone, layout, partials=own, backend=backend)
    torch._foreach_mul_(grads + alone, clip_coefficient(partials.sum(), 1.0))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_steady_state_steps_with_alternating_gradient_addresses_never_sync_or_upload(backend):
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE)
    buffer = torch.empty(layout.total_numel, device=DEVICE)
    partials = torch.zeros(2 * layout.num_norm_partials, device=DEVICE)
    # zero_grad(set_to_none=True) frees the gradients; backward allocates new ones, which the
    # caching allocator places at one of a few addresses: three sets, in turn.
    sets = [make_tensors(SHAPES, torch.float32, seed) for seed in range(6)]
    with recorded_launches() if backend == "triton" else contextlib.nullcontext() as launches:
        for step in range(3):
            _step(sets[step % 3], sets[3 + step % 3], layout, buffer, partials, backend)
        with HostSyncDetector() as detector:
            for step in range(3, 6):
                _step(sets[step % 3], sets[3 + step % 3], layout, buffer, partials, backend)
    assert detector.copies == 0
    if backend == "triton":  # per step and bucket one pack and one unpack launch, the norm fused in
        assert launches == ["_pack_kernel", "_unpack_kernel", "_squared_norm_kernel"] * 6


def test_steady_state_launches_check_aliasing_once_per_address_set(monkeypatch):
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE)
    buffer = torch.empty(layout.total_numel, device=DEVICE)
    partials = torch.zeros(2 * layout.num_norm_partials, device=DEVICE)
    sets = [make_tensors(SHAPES, torch.float32, seed) for seed in range(6)]
    checked = []
    original = triton_ops.check_no_aliasing
    monkeypatch.setattr(triton_ops, "check_no_aliasing", lambda *a, **k: checked.append(1) or original(*a, **k))
    with recorded_launches() as launches:
        for step in range(6):
            _step(sets[step % 3], sets[3 + step % 3], layout, buffer, partials, "triton")
    # pack, unpack and squared_norm on each of the three address sets: checked in the first three steps only
    assert len(checked) == 9 and len(launches) == 18


def test_a_layout_uploads_its_metadata_in_one_copy_and_an_identical_live_one_in_none():
    with HostSyncDetector(forbid=False) as detector:
        first = BucketLayout(SHAPES, SPECS, device=DEVICE)
    assert detector.copies <= 1
    with HostSyncDetector(forbid=False) as detector:
        again = BucketLayout(SHAPES, SPECS, device=DEVICE)  # an engine rebuilt while the old one lives
    assert detector.copies == 0
    assert again.descriptors.data_ptr() == first.descriptors.data_ptr()
    assert torch.equal(again.inverse_coverage, first.inverse_coverage)


@settings(max_examples=25, deadline=None, database=None)
@given(order=st.lists(st.integers(0, 11), max_size=40))
def test_pointer_table_always_holds_the_addresses_of_the_tensors_passed(order):
    # Twelve address sets against a cache of eight: hits, misses and evictions in any order.
    layout = BucketLayout([(3,), (2, 2)], device=DEVICE)
    pool = [[torch.zeros(3, device=DEVICE), torch.zeros(2, 2, device=DEVICE)] for _ in range(12)]
    for i in order:
        table = layout.pointer_table(pool[i])
        assert table.device == layout.device and table.dtype == torch.int64
        assert table.tolist() == [t.data_ptr() for t in pool[i]]
        assert layout.pointer_table(pool[i]) is table  # the set just used is cached


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steady_state_steps_on_the_gpu_pass_torch_sync_debug_mode_error():
    layout = BucketLayout(SHAPES, SPECS, device=DEVICE)
    buffer = torch.empty(layout.total_numel, device=DEVICE)
    partials = torch.zeros(2 * layout.num_norm_partials, device=DEVICE)
    sets = [make_tensors(SHAPES, torch.float32, seed) for seed in range(6)]
    for step in range(3):
        _step(sets[step % 3], sets[3 + step % 3], layout, buffer, partials, "triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3, 6):
            _step(sets[step % 3], sets[3 + step % 3], layout, buffer, partials, "triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
