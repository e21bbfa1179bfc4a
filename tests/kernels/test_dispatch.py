"""Backend choice, doctests of the public API, and the compiled kernels on a real GPU."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from kernel_cases import DEVICE, make_tensors

import kernels.layout
import kernels.ops
from kernels import BackendUnavailableError, BucketLayout, SegmentSpec, pack, reference, select_backend, triton_ops, unpack

CPU = torch.device("cpu")


def test_cpu_without_interpreter_auto_uses_reference_and_triton_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend("auto", CPU) is reference
    with pytest.raises(BackendUnavailableError, match=r"backend='triton' cannot run tensors on cpu: Triton runs CPU tensors only under TRITON_INTERPRET=1"):
        select_backend("triton", CPU)


def test_kernels_compiled_for_gpu_are_refused_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    assert select_backend("auto", CPU) is reference
    with pytest.raises(BackendUnavailableError, match=r"imported before TRITON_INTERPRET=1 was set"):
        select_backend("triton", CPU)


def test_interpreted_kernels_are_refused_for_cuda_tensors(monkeypatch):
    # Interpreted kernels on CUDA tensors would run every program on the host: never chosen.
    monkeypatch.setattr(triton_ops, "INTERPRETED", True)
    cuda = torch.device("cuda", 0)
    assert select_backend("auto", cuda) is reference
    with pytest.raises(BackendUnavailableError, match=r"cannot run tensors on cuda:0: .*imported under TRITON_INTERPRET=1, so its kernels are interpreted"):
        select_backend("triton", cuda)
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    assert select_backend("auto", cuda) is triton_ops


def test_other_devices_fall_back_to_reference_and_refuse_triton():
    meta = torch.device("meta")
    assert select_backend("auto", meta) is reference and select_backend("reference", DEVICE) is reference
    with pytest.raises(BackendUnavailableError, match=r"support cuda and cpu \(interpreted\) tensors, not meta"):
        select_backend("triton", meta)


@pytest.mark.parametrize("module", [kernels.layout, kernels.ops])
def test_docstring_examples_run(module):
    assert doctest.testmod(module, raise_on_error=False).failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_compiled_kernels_bit_exact_on_a_llama_sized_bucket():
    assert select_backend("auto", DEVICE) is triton_ops and not triton_ops.INTERPRETED
    d, d_ff = 2048, 5632
    shapes = [(d_ff, d), (d_ff, d), (d, d_ff), (d,)]
    held = torch.randperm(d_ff, generator=torch.Generator().manual_seed(0))[: d_ff // 2].tolist()
    specs = [SegmentSpec(0, "rows", held, 2), SegmentSpec(1, "rows", held, 2), SegmentSpec(2, "cols", held, 2), SegmentSpec(3)]
    layout = BucketLayout(shapes, specs, device=DEVICE)
    grads = make_tensors(shapes, torch.float32, seed=0)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = pack(grads, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, backend="triton")
        assert torch.equal(got, pack(grads, layout, scale=layout.inverse_coverage, out_dtype=out_dtype, backend="reference"))
    back = [torch.zeros_like(g) for g in grads]
    unpack(pack(grads, layout), back, layout, backend="triton")
    assert torch.equal(back[0][held], grads[0][held]) and torch.equal(back[2][:, held], grads[2][:, held])


@given(value=st.one_of(st.sampled_from(["1", "0", "true", "TRUE", "on", "ON", "yes", "Y", "y", "2", " 1", "", "off",
                                        "no", "false"]), st.text(max_size=4)))
@settings(max_examples=60, deadline=None)
def test_the_interpreter_knob_is_read_from_the_environment_as_triton_reads_it(value):
    """Before triton is imported, dispatch reads TRITON_INTERPRET itself (a CPU process then never
    imports triton); it must agree with Triton's own knob on every value."""
    import os
    import sys

    import triton

    from kernels import dispatch

    if "\x00" in value:
        return
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", value)
        m.delitem(sys.modules, "triton")
        without_triton = dispatch._interpret_requested()
        assert "triton" not in sys.modules
        m.setitem(sys.modules, "triton", triton)
        assert without_triton == bool(triton.knobs.runtime.interpret), (value, os.environ["TRITON_INTERPRET"])


def test_the_sync_engines_tile_is_the_gpus_except_under_the_interpreter(monkeypatch):
    """Interpreted, each program costs tens of milliseconds of Python: the engine takes the largest
    tile there (in-process tests ran ten times longer with the GPU's), the GPU's everywhere else."""
    from kernels import block_size_for
    from kernels.layout import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE

    interpreted = triton_ops.INTERPRETED
    assert block_size_for(CPU) == (MAX_BLOCK_SIZE if interpreted else DEFAULT_BLOCK_SIZE)
    assert block_size_for(torch.device("meta")) == DEFAULT_BLOCK_SIZE
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert block_size_for(CPU) == DEFAULT_BLOCK_SIZE  # the reference runs CPU tensors: no tiles to save
    monkeypatch.undo()
    import numpy as np

    from masklab import Mask
    from sdp_train import SubnetworkDataParallel

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Linear(3, 3)),
                              torch.nn.Sequential(torch.nn.Linear(3, 3)))
    sdp = SubnetworkDataParallel(net, mask=Mask(np.ones((1, 2), dtype=np.int8)), blocks=["1", "2"])
    assert {b.layout.block_size for b in sdp.sync.engine.buckets} == {block_size_for(CPU)}
    sdp.close()
