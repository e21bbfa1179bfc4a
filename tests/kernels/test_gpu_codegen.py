"""The kernels' GPU code, compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100) on a CPU machine.

`gpu_codegen.py` records the launches the package makes on every path the runtime and the kernel
benchmark take, compiles each exactly as Triton's JIT would (with the ptxas in the triton wheel,
in a subprocess without TRITON_INTERPRET) and reads the cubin back. The performance contract:

- every launch compiles for both targets;
- no spills, no stack, no local memory, at most REGISTER_BUDGET registers per thread;
- aligned buckets move their contiguous runs with 128-bit global loads and stores;
- no integer division or remainder (the old kernels ran two int64 divisions per element);
- FP fusion off (the scaled accumulate rounds like kernels.reference), hardware bf16 conversion.

Skipped, with the reason, where the wheel has no ptxas/cuobjdump.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_codegen
from tests.child_env import child_env

HARNESS = Path(gpu_codegen.__file__)
# 64 registers x 128 threads leaves room for 8 resident programs per SM (half the threads an
# sm_80/sm_90 SM holds), each with 8 elements a thread in flight: enough to cover HBM latency.
# The kernels before this contract used 92 (5 programs per SM); today's use 30-40.
REGISTER_BUDGET = 64
PATHS = 11  # per benchmark bucket, see gpu_codegen.record_launches


def _harness(*flags: str) -> dict:
    env = child_env(drop=("TRITON_INTERPRET",))
    done = subprocess.run([sys.executable, str(HARNESS), *flags], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    return report


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return _harness()["results"]


def _show(entry: dict) -> str:
    return f"{entry['kernel']} {entry['arch']} {entry['constexprs']} (used by {entry['labels'][0]!r})"


@pytest.mark.slow
def test_every_launch_of_the_runtime_and_benchmark_compiles_for_sm90_and_sm80(compiled):
    failed = [f"{_show(e)}: {e['error'][-600:]}" for e in compiled if not e["compiled"]]
    assert not failed, "\n".join(failed)
    labels = {label for e in compiled for label in e["labels"]}
    # four benchmark buckets, the sync engine's runs of buckets, two larger block sizes, the unaligned fallback
    assert len(labels) == 4 * PATHS + 2 + 3
    assert {e["arch"] for e in compiled} == {"sm_90", "sm_80"}
    assert {e["kernel"] for e in compiled} == {"_pack_kernel", "_unpack_kernel", "_squared_norm_kernel"}


@pytest.mark.slow
def test_no_spills_no_local_memory_and_registers_within_budget(compiled):
    for e in compiled:
        assert (e["stack"], e["local"], e["local_accesses"]) == (0, 0, 0), _show(e)
        assert 0 < e["registers"] <= REGISTER_BUDGET, f"{e['registers']} registers: {_show(e)}"


@pytest.mark.slow
def test_aligned_buckets_copy_runs_with_128_bit_global_accesses(compiled):
    aligned = [e for e in compiled if e["constexprs"]["ALIGNED"] == "True"]
    assert aligned
    for e in aligned:
        accesses = e["global_accesses"]
        stores = e["kernel"] != "_squared_norm_kernel"  # it only reads the tensors
        assert accesses.get("ld.128", 0) >= 1 and (accesses.get("st.128", 0) >= 1 or not stores), f"{accesses}: {_show(e)}"
    for e in compiled:
        if e["constexprs"]["ALIGNED"] == "False":  # the fallback must not assume alignment
            assert "ld.128" not in e["global_accesses"] and "st.128" not in e["global_accesses"], _show(e)


@pytest.mark.slow
def test_no_integer_division_or_remainder(compiled):
    for e in compiled:
        assert (e["int64_divisions"], e["int32_divisions"]) == (0, 0), _show(e)


@pytest.mark.slow
def test_fp_fusion_is_off_and_bf16_uses_the_hardware_conversion(compiled):
    for e in compiled:
        assert e["enable_fp_fusion"] is False and e["fma"] == 0, _show(e)
    bf16_out = [e for e in compiled if e["signature"].get("out") == "*bf16"]
    assert bf16_out and all(e["hardware_bf16"] > 0 for e in bf16_out)


@pytest.mark.slow
def test_codegen_catches_a_ptxas_error_that_the_interpreter_accepts():
    from kernels import triton_ops

    if triton_ops.INTERPRETED:  # under TRITON_INTERPRET=1 (CPU CI) the kernel runs, hints and all
        x = torch.arange(128.0)
        y = torch.empty(128)
        gpu_codegen.ptxas_rejects_this[(1,)](x, y, BLOCK=128)
        assert torch.equal(x, y)
    demo = _harness("--ptxas-demo")["ptxas_demo"]
    for arch in ("sm_90", "sm_80"):
        assert "PTXASError" in demo[arch] and "cannot be combined with modifier '.cg'" in demo[arch], demo[arch][-600:]
