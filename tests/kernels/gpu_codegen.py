"""Compile the package's real kernel launches for sm_90 and sm_80 on a CPU-only machine; report what they execute.

Run as a script WITHOUT TRITON_INTERPRET (the kernels must be JIT-compilable, not interpreted):

    TRITON_INTERPRET=0 python tests/kernels/gpu_codegen.py [--ptxas-demo]

It records the launches `kernels.triton_ops.pack` / `unpack` make (JITFunction.run is replaced by a
recorder, so no GPU is needed) for every path the runtime (`sdp_train.parallel.sync`) and the kernel
benchmark (`benchmarks/bench_kernels.py`) take, on the benchmark's own buckets. Each distinct
launch is specialised exactly as Triton's JIT would (its binder, for the target) and compiled with
the ptxas shipped in the triton wheel; cuobjdump reads registers, stack and local memory (where
spills go) from the cubin, the PTX gives the width of every global load/store, integer divisions,
FMAs and bf16 conversions. Prints one JSON object: {"skip": reason} or {"results": [...]}.
``--ptxas-demo`` instead compiles `ptxas_rejects_this`, a kernel the interpreter runs but ptxas
refuses, through the same path, and prints the error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ARCHS = (90, 80)


@triton.jit
def ptxas_rejects_this(x, y, BLOCK: tl.constexpr):
    """Streams x to y. The interpreter accepts the cache hints; ptxas refuses .cg with evict_first."""
    offsets = tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, cache_modifier=".cg", eviction_policy="evict_first"))


def unavailable() -> str | None:
    """Why this machine cannot compile for the GPU, or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels are interpreted, not compiled"
    missing = [name for name in ("ptxas", "cuobjdump") if not (BIN / name).exists()]
    if missing:
        return f"the triton wheel ships no {', '.join(missing)} in {BIN}"
    return None


def record_launches() -> list[dict]:
    """Every launch the package makes on the benchmark's buckets, as (label, kernel, args, kwargs)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_kernels import llama_block, resnet50_stage3
    from kernels import BucketLayout, concat_layouts, triton_ops
    from kernels.layout import MAX_BLOCK_SIZE

    launches: list[dict] = []
    label = [""]

    def recorder(self, *args, grid, warmup, **kwargs):
        launches.append(dict(label=label[0], kernel=self, args=args, kwargs=kwargs))

    original = triton.runtime.jit.JITFunction.run
    triton.runtime.jit.JITFunction.run = recorder
    try:
        buckets = [("llama-2048-block", llama_block(2048, False)), ("llama-2048-neuron", llama_block(2048, True)),
                   ("resnet50-stage3-block", resnet50_stage3(False)), ("resnet50-stage3-neuron", resnet50_stage3(True))]
        for name, (shapes, specs) in buckets:
            layout = BucketLayout(shapes, specs)
            grads = [torch.empty(s) for s in shapes]
            scale = layout.inverse_coverage
            partials = torch.empty(layout.num_norm_partials)
            paths = {
                "pack fp32->fp32 scaled (sync engine, benchmark)": lambda b: triton_ops.pack(grads, layout, b(torch.float32), scale=scale),
                "pack fp32->bf16 scaled (benchmark)": lambda b: triton_ops.pack(grads, layout, b(torch.bfloat16), scale=scale),
                "pack fp32->fp32 unscaled (Bb-SDP broadcast)": lambda b: triton_ops.pack(grads, layout, b(torch.float32)),
                "unpack fp32->fp32 copy (sync engine, broadcast, benchmark)": lambda b: triton_ops.unpack(b(torch.float32), grads, layout),
                "unpack bf16->fp32 copy (benchmark)": lambda b: triton_ops.unpack(b(torch.bfloat16), grads, layout),
                "unpack fp32->fp32 scaled (overlap_average divide='after')": lambda b: triton_ops.unpack(b(torch.float32), grads, layout, scale=scale),
                "unpack bf16->fp32 accumulate scaled": lambda b: triton_ops.unpack(b(torch.bfloat16), grads, layout, mode="accumulate", scale=scale),
                "squared_norm fp32 (clipping norm of held slices)": lambda b: triton_ops.squared_norm(grads, layout),
                "pack fp32->fp32 scaled, norm partials (clipping norm of the local gradient)":
                    lambda b: triton_ops.pack(grads, layout, b(torch.float32), scale=scale, partials=partials),
                "unpack fp32->fp32 copy, norm partials (sync engine with clipping)":
                    lambda b: triton_ops.unpack(b(torch.float32), grads, layout, partials=partials),
                "unpack bf16->fp32 copy, norm partials (bf16 buffer with clipping)":
                    lambda b: triton_ops.unpack(b(torch.bfloat16), grads, layout, partials=partials),
            }
            for path, call in paths.items():
                label[0] = f"{name} | {path}"
                call(lambda dtype: torch.empty(layout.total_numel, dtype=dtype))
        # The sync engine's runs (kernels.concat_layouts): several buckets as one layout, one of them out of
        # the norm, packed by one launch and unpacked by one with the norm partials.
        (block_shapes, block_specs), (neuron_shapes, neuron_specs) = llama_block(2048, False), llama_block(2048, True)
        n = len(block_shapes)
        run, _ = concat_layouts([BucketLayout(block_shapes, block_specs), BucketLayout(neuron_shapes, neuron_specs)],
                                [list(range(n)), list(range(n, n + len(neuron_shapes)))], in_norm=[True, False])
        grads = [torch.empty(s) for s in run.shapes]
        label[0] = "sync engine run of buckets | pack fp32->fp32 scaled (the buckets one gradient completes)"
        triton_ops.pack(grads, run, torch.empty(run.total_numel), scale=run.inverse_coverage)
        label[0] = "sync engine run of buckets | unpack fp32->fp32 copy, norm partials (finish)"
        triton_ops.unpack(torch.empty(run.total_numel), grads, run, partials=torch.empty(run.num_norm_partials))
        # Larger tiles than the default, up to the layout's limit: num_warps must follow, or they spill.
        shapes, specs = llama_block(2048, True)
        grads = [torch.empty(s) for s in shapes]
        for block in (4096, MAX_BLOCK_SIZE):
            layout = BucketLayout(shapes, specs, block_size=block)
            label[0] = f"llama-2048-neuron, block_size={block} | pack fp32->bf16 scaled"
            triton_ops.pack(grads, layout, torch.empty(layout.total_numel, dtype=torch.bfloat16), scale=layout.inverse_coverage)
        # Gradients that are views at a 4-byte offset (e.g. into one flat allocation): the checked fallback.
        storage = torch.empty(4097)
        views = [storage[1:2049].view(32, 64), storage[2049:4097].view(64, 32)]
        layout = BucketLayout([v.shape for v in views])
        label[0] = "unaligned tensors | pack fp32->bf16 scaled"
        triton_ops.pack(views, layout, torch.empty(layout.total_numel, dtype=torch.bfloat16), scale=layout.inverse_coverage)
    finally:
        triton.runtime.jit.JITFunction.run = original
    return launches


def specialise(kernel, args, kwargs, arch: int):
    """(signature, constexprs, attrs, options) exactly as Triton's JIT derives them for `arch`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return target, signature, constexprs, attrs, options


def compile_for(kernel, signature, constexprs, attrs, target, options: dict):
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)


_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)+)")


def global_access_widths(ptx: str) -> dict[str, int]:
    """Count of global loads/stores per width in bits, e.g. {"ld.128": 2, "st.16": 24}, from the PTX."""
    widths: dict[str, int] = {}
    for op, suffix in _ACCESS.findall(ptx):
        parts = suffix.strip(".").split(".")
        lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)), 0)
        key = f"{op}.{lanes * bits}"
        widths[key] = widths.get(key, 0) + 1
    return widths


def analyse(compiled) -> dict:
    """Registers, stack/local memory (spills land there) and the PTX facts the contract is about."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    return dict(
        registers=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)), local=int(fields.get("LOCAL", -1)),
        shared=int(fields.get("SHARED", -1)), local_accesses=len(re.findall(r"\b(ld|st)\.local\b", ptx)),
        global_accesses=global_access_widths(ptx), int64_divisions=len(re.findall(r"\b(div|rem)\.[su]64\b", ptx)),
        int32_divisions=len(re.findall(r"\b(div|rem)\.[su]32\b", ptx)), fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        hardware_bf16=len(re.findall(r"\bcvt\.rn\.bf16(x2)?\.f32\b", ptx)),
    )


def _describe(constexprs: dict, kernel) -> dict:
    names = {(kernel.arg_names.index(k) if isinstance(k, str) else k[0]): v for k, v in constexprs.items()}
    return {kernel.arg_names[i]: str(v) for i, v in sorted(names.items())}


def run_all() -> list[dict]:
    results, seen = [], {}
    for launch in record_launches():
        kernel, args, kwargs = launch["kernel"], launch["args"], launch["kwargs"]
        for arch in ARCHS:
            target, signature, constexprs, attrs, options = specialise(kernel, args, kwargs, arch)
            key = (kernel.fn.__name__, arch, str(signature), str(sorted(constexprs.items())), str(attrs), str(options))
            if key not in seen:
                entry = dict(kernel=kernel.fn.__name__, arch=f"sm_{arch}", signature=signature, constexprs=_describe(constexprs, kernel),
                             num_warps=options.num_warps, enable_fp_fusion=options.enable_fp_fusion, labels=[])
                try:
                    entry.update(compiled=True, **analyse(compile_for(kernel, signature, constexprs, attrs, target, options.__dict__)))
                except Exception as exc:  # a ptxas / lowering failure is a finding, reported per launch
                    entry.update(compiled=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
                seen[key] = entry
                results.append(entry)
            seen[key]["labels"].append(launch["label"])
    return results


def ptxas_demo() -> dict:
    x = torch.empty(128)
    kwargs = dict(BLOCK=128, num_warps=4)
    out = {}
    for arch in ARCHS:
        target, signature, constexprs, attrs, options = specialise(ptxas_rejects_this, (x, torch.empty(128)), kwargs, arch)
        try:
            compile_for(ptxas_rejects_this, signature, constexprs, attrs, target, options.__dict__)
            out[f"sm_{arch}"] = "compiled"
        except Exception as exc:
            out[f"sm_{arch}"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return out


def main() -> None:
    reason = unavailable()
    if reason:
        print(json.dumps({"skip": reason}))
        return
    print(json.dumps({"ptxas_demo": ptxas_demo()} if "--ptxas-demo" in sys.argv else {"results": run_all()}))


if __name__ == "__main__":
    main()
