"""How close do pack / unpack come to a plain copy of the same bytes, against what users write today?

For realistic SDP buckets (the parameter list of a LLaMA-style block at d = 2048 and 4096, and of a
ResNet-50 stage; block level and neuron level with C = 0.5, K = 8 so coverage c = 4), times:

  pack   fp32 gradients -> flat buffer (default bfloat16), scaled by 1/c_j
  unpack flat buffer -> fp32 gradients (copy mode, the path after a pre-divided all-reduce)

for the fused Triton kernel (CUDA only: the CPU interpreter is a correctness tool, not timed), the
package's PyTorch reference, and the baselines a user would otherwise write: a loop of slice
copies; torch.cat of index_selects; _flatten_dense_tensors; torch._foreach_copy_ into split views
of one preallocated buffer followed by torch._foreach_mul_ with a per-tensor scalar list (FSDP2's
copy-in); torch.split_with_sizes_copy(..., out=...) for unpack; torch.compile of the reference.
Each row prints GB/s (bytes read + written), the fraction of a plain device copy of the same bytes
and dtypes measured in the same run (the physical limit), and the speed-up over the best baseline.

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--quick] [--buffer-dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch._utils import _flatten_dense_tensors

import kernels
from kernels import BucketLayout, SegmentSpec, reference

K, C = 8, 0.5
COVERAGE = int(K * C)


def llama_block(d: int, neuron_level: bool, seed: int = 0) -> tuple[list[tuple[int, ...]], list[SegmentSpec]]:
    """wq wk wv wo (d, d), w_gate w_up (ff, d), w_down (d, ff), two RMSNorm weights (d,)."""
    ff, head_dim = 256 * ((8 * d // 3 + 255) // 256), 128
    shapes = [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff), (d,), (d,)]
    if not neuron_level:
        return shapes, [SegmentSpec(i, coverage=COVERAGE) for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(seed)
    heads = torch.randperm(d // head_dim, generator=gen)[: int(C * d // head_dim)].sort().values
    head_rows = (heads[:, None] * head_dim + torch.arange(head_dim)).flatten().tolist()
    neurons = torch.randperm(ff, generator=gen)[: int(C * ff)].sort().values.tolist()
    specs = [SegmentSpec(i, "rows", head_rows, COVERAGE) for i in range(3)] + [SegmentSpec(3, "cols", head_rows, COVERAGE)]
    specs += [SegmentSpec(4, "rows", neurons, COVERAGE), SegmentSpec(5, "rows", neurons, COVERAGE), SegmentSpec(6, "cols", neurons, COVERAGE)]
    return shapes, specs + [SegmentSpec(7, coverage=K), SegmentSpec(8, coverage=K)]


def resnet50_stage3(neuron_level: bool, seed: int = 0) -> tuple[list[tuple[int, ...]], list[SegmentSpec]]:
    """Six bottlenecks 1024 -> 256 -> 1024 (the first from 512, with a downsample conv), with BN.

    Block level: 3 of the 6 bottlenecks, whole. Neuron level: in every bottleneck half the 256
    mid channels, i.e. rows of conv1 and bn1, and the matching input channels (cols) of conv2.
    """
    shapes, specs, gen = [], [], torch.Generator().manual_seed(seed)
    for b in range(6):
        cin, first = (512 if b == 0 else 1024), len(shapes)
        block = [(256, cin, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,)]
        block += [(1024, 512, 1, 1), (1024,), (1024,)] if b == 0 else []
        shapes += block
        if not neuron_level and b % 2 == 1:
            specs += [SegmentSpec(first + i, coverage=COVERAGE) for i in range(len(block))]
        elif neuron_level:
            mid = torch.randperm(256, generator=gen)[: int(C * 256)].sort().values.tolist()
            specs += [SegmentSpec(first + i, "rows", mid, COVERAGE) for i in range(3)] + [SegmentSpec(first + 3, "cols", mid, COVERAGE)]
    return shapes, specs


def _held(t: torch.Tensor, seg, index: torch.Tensor | None) -> torch.Tensor:
    return t if seg.kind == "whole" else t.index_select(0 if seg.kind == "rows" else 1, index)


def pack_baselines(layout: BucketLayout, grads, out: torch.Tensor) -> dict[str, Callable[[], object] | None]:
    """The pack a user would write without the kernels, each filling `out` like kernels.pack."""
    segs, idx = layout.segments, layout.index_tensors
    sizes = [s.numel for s in segs]
    scales = [s.scale for s in segs]
    views = list(out[: layout.total_numel].split(sizes))

    def loop():
        for seg, i, view in zip(segs, idx, views):
            held = _held(grads[seg.tensor_index], seg, i)
            view.view(held.shape).copy_(held)
            view.mul_(seg.scale)

    def cat():
        out[: layout.total_numel].copy_(torch.cat([_held(grads[s.tensor_index], s, i).flatten() * s.scale for s, i in zip(segs, idx)]))

    def flatten():
        out[: layout.total_numel].copy_(_flatten_dense_tensors([_held(grads[s.tensor_index], s, i) * s.scale for s, i in zip(segs, idx)]))

    def foreach():
        held = [_held(grads[s.tensor_index], s, i).reshape(-1) for s, i in zip(segs, idx)]
        torch._foreach_copy_(views, held)
        torch._foreach_mul_(views, scales)

    return {"loop of slice copies + mul_": loop, "torch.cat(index_select * s)": cat,
            "_flatten_dense_tensors": flatten, "_foreach_copy_ + _foreach_mul_": foreach}


def unpack_baselines(layout: BucketLayout, buffer: torch.Tensor, grads) -> dict[str, Callable[[], object] | None]:
    """The unpack (copy mode) a user would write, each writing the held slices of `grads`."""
    segs, idx = layout.segments, layout.index_tensors
    sizes = [s.numel for s in segs]
    whole = all(s.kind == "whole" for s in segs) and len({s.tensor_index for s in segs}) == len(segs)

    def loop():
        for seg, i, part in zip(segs, idx, buffer[: layout.total_numel].split(sizes)):
            t = grads[seg.tensor_index]
            if seg.kind == "whole":
                t.view(-1).copy_(part)
            else:
                dim = 0 if seg.kind == "rows" else 1
                t.index_copy_(dim, i, part.to(t.dtype).view(_held(t, seg, i).shape))

    def split_copy():
        outs = [grads[s.tensor_index].view(-1) for s in segs]
        torch.split_with_sizes_copy(buffer[: layout.total_numel].to(outs[0].dtype), sizes, out=outs)

    def foreach():
        torch._foreach_copy_([grads[s.tensor_index].view(-1) for s in segs], list(buffer[: layout.total_numel].split(sizes)))

    # split_with_sizes_copy and _foreach_copy_ cannot scatter rows/cols: only for whole tensors.
    return {"loop of slice/index copies": loop,
            "split_with_sizes_copy(out=)": split_copy if whole else None,
            "_foreach_copy_ into views": foreach if whole else None}


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    def measure(fn: Callable[[], object]) -> float:
        fn()  # warm-up (and compilation)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        # CPU: best of N, since other processes share the cores; CUDA: median of events.
        return statistics.median(times) if device.type == "cuda" else min(times)

    return measure


def report(title: str, nbytes: int, t_copy: float, ours: dict[str, float], baselines: dict[str, float | None]) -> None:
    measured = {k: v for k, v in baselines.items() if v is not None}
    best = min(measured.values())
    print(f"\n{title}: {nbytes / 1e6:.1f} MB moved (read + write)")
    print(f"  {'method':<34} {'ms':>9} {'GB/s':>8} {'x copy':>7} {'vs best baseline':>17}")
    for name, t in [("plain copy (same bytes)", t_copy), *ours.items(), *baselines.items()]:
        if t is None:
            print(f"  {name:<34} {'n/a (cannot scatter rows/cols)':>43}")
            continue
        print(f"  {name:<34} {t * 1e3:9.2f} {nbytes / t / 1e9:8.2f} {t_copy / t:7.2f} {best / t:16.2f}x")


def run_case(name: str, shapes, specs, device: torch.device, buffer_dtype: torch.dtype, measure, compile_ref: bool) -> None:
    layout = BucketLayout(shapes, specs, device=device)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    out = torch.empty(layout.total_numel, dtype=buffer_dtype, device=device)
    n = layout.total_numel
    nbytes = n * (4 + out.element_size())
    src_flat, dst_flat = torch.empty(n, device=device), torch.empty(n, dtype=buffer_dtype, device=device)
    fused = device.type == "cuda"
    scale = layout.inverse_coverage

    want = reference.pack(grads, layout, scale=scale, out_dtype=buffer_dtype)
    ours = {}
    if fused:
        ours["kernels.pack (fused Triton)"] = measure(lambda: kernels.pack(grads, layout, out, scale=scale, backend="triton"))
        torch.testing.assert_close(out, want)
    ours["kernels reference"] = measure(lambda: reference.pack(grads, layout, out, scale=scale))
    baselines = {}
    for label, fn in pack_baselines(layout, grads, out).items():
        baselines[label] = measure(fn)
        torch.testing.assert_close(out, want, rtol=2**-7, atol=0.0)  # the baseline really packs
    if compile_ref:
        packed = torch.compile(reference.pack)
        baselines["torch.compile(reference.pack)"] = measure(lambda: packed(grads, layout, out, scale=scale))
    report(f"{name} | pack fp32 -> {str(buffer_dtype)[6:]} scaled 1/c ({len(layout.segments)} segments)",
           nbytes, measure(lambda: dst_flat.copy_(src_flat)), ours, baselines)

    ours = {}
    if fused:
        ours["kernels.unpack (fused Triton)"] = measure(lambda: kernels.unpack(want, grads, layout, backend="triton"))
    ours["kernels reference"] = measure(lambda: reference.unpack(want, grads, layout))
    baselines = {label: fn and measure(fn) for label, fn in unpack_baselines(layout, want, grads).items()}
    if compile_ref:
        unpacked = torch.compile(reference.unpack)
        baselines["torch.compile(reference.unpack)"] = measure(lambda: unpacked(want, grads, layout))
    report(f"{name} | unpack {str(buffer_dtype)[6:]} -> fp32 copy", nbytes, measure(lambda: src_flat.copy_(dst_flat)), ours, baselines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="d = 2048 and the ResNet stage only, fewer repeats")
    parser.add_argument("--buffer-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (slow to compile on CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = (5 if args.quick else 20) if device.type == "cuda" else (2 if args.quick else 5)
    measure = timer(device, repeats)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (fused Triton kernel not timed on CPU)"
    print(f"{datetime.date.today()} | {platform.machine()} {torch.get_num_threads()} threads | torch {torch.__version__} | "
          f"device {device} | GPU: {gpu} | K={K} C={C} | {'median' if device.type == 'cuda' else 'best'} of {repeats}")
    cases = [(f"LLaMA block d={d}", lambda nl, d=d: llama_block(d, nl)) for d in ((2048,) if args.quick else (2048, 4096))]
    cases.append(("ResNet-50 stage 3", resnet50_stage3))
    for name, build in cases:
        for neuron_level in (False, True):
            shapes, specs = build(neuron_level)
            level = "neuron level (N-SDP)" if neuron_level else "block level (B-SDP)"
            run_case(f"{name}, {level}", shapes, specs, device, getattr(torch, args.buffer_dtype), measure, not args.no_compile)


if __name__ == "__main__":
    main()
