"""How close do pack / unpack come to a plain copy of the same bytes, against what users write today?

For realistic SDP buckets (the parameter list of a LLaMA-style block at d = 2048 and 4096, and of a
ResNet-50 stage; block level and neuron level with C = 0.5, K = 8 so coverage c = 4), with fp32
gradients and a bfloat16 or float32 buffer, times:

  pack   fp32 gradients -> flat buffer, scaled by 1/c_j (the sync engine's launch)
  unpack flat buffer -> fp32 gradients (copy mode, the path after a pre-divided all-reduce)

for the fused Triton kernel (CUDA: `triton.testing.do_bench`, median), the package's PyTorch
reference, the eager baselines a user would otherwise write (a loop of slice copies; torch.cat
of index_selects; _flatten_dense_tensors; torch._foreach_copy_ + torch._foreach_mul_ into split
views of one buffer, FSDP2's copy-in; split_with_sizes_copy for unpack) and torch.compile of the
reference and of the loop (where compiling works). Each row prints:

  GB/s useful   bytes of the held elements read + written, over the time
  GB/s sectors  bytes of the 32-byte sectors those accesses touch (a scattered column costs a
                whole sector), over the time: at the memory-system ceiling this is ~copy GB/s
  x copy        time of a plain device copy of the useful bytes (same dtypes), over the time
  vs eager / vs compiled   best eager (compiled) baseline time over the time

On CPU (no GPU) the fused kernel is not timed: the Triton interpreter is a correctness tool. It is
checked bit-exact against the reference on a d = 128 bucket when TRITON_INTERPRET=1 is set (on
CUDA, on the first LLaMA bucket, before timing).
`--quick` on CPU uses a d = 512 LLaMA block and one ResNet bottleneck so the run takes a few
minutes; CPU times are the best of 5 back-to-back calls on one thread (`--threads`).

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--quick | --smoke] [--buffer-dtype bfloat16 float32]
                                       [--no-compile] [--json PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

import kernels
from kernels import BucketLayout, SegmentSpec, reference
from kernels.worklist import KIND_GATHER, KIND_ZERO

K, C = 8, 0.5
COVERAGE = int(K * C)
SECTOR = 32


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


def resnet50_stage3(neuron_level: bool, seed: int = 0, blocks: int = 6) -> tuple[list[tuple[int, ...]], list[SegmentSpec]]:
    """`blocks` bottlenecks 1024 -> 256 -> 1024 (the first from 512, with a downsample conv), with BN.

    Block level: every other bottleneck, whole. Neuron level: in every bottleneck half the 256
    mid channels, i.e. rows of conv1 and bn1, and the matching input channels (cols) of conv2.
    """
    shapes, specs, gen = [], [], torch.Generator().manual_seed(seed)
    for b in range(blocks):
        cin, first = (512 if b == 0 else 1024), len(shapes)
        block = [(256, cin, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1), (1024,), (1024,)]
        block += [(1024, 512, 1, 1), (1024,), (1024,)] if b == 0 else []
        shapes += block
        if not neuron_level and b % 2 == (1 if blocks > 1 else 0):
            specs += [SegmentSpec(first + i, coverage=COVERAGE) for i in range(len(block))]
        elif neuron_level:
            mid = torch.randperm(256, generator=gen)[: int(C * 256)].sort().values.tolist()
            specs += [SegmentSpec(first + i, "rows", mid, COVERAGE) for i in range(3)] + [SegmentSpec(first + 3, "cols", mid, COVERAGE)]
    return shapes, specs


def sectors_touched(layout: BucketLayout, tensor_bytes: int, buffer_bytes: int) -> int:
    """32-byte sectors the held elements occupy: tensor side (per tensor, 32-byte aligned bases) plus buffer side.

    Read from the layout's work list: every run row is an interval of elements, every gather
    element its own address; overlapping sectors of neighbouring rows count once.
    """
    d = layout.descriptors.cpu().numpy()
    data = d[: layout.num_data_tiles]
    t_start, b_start, strides, shape, ids, kind, col_start = (data[:, i] for i in range(7))
    nrows, ncols, tensor = shape & 0xFFFFFFFF, shape >> 32, ids & 0xFFFFFFFF
    t_stride, b_stride = strides & 0xFFFFFFFF, strides >> 32
    tile = np.repeat(np.arange(len(data)), nrows)
    row = np.arange(len(tile)) - np.repeat(np.cumsum(nrows) - nrows, nrows)
    t_row, b_row = t_start[tile] + row * t_stride[tile], b_start[tile] + row * b_stride[tile]
    width = ncols[tile]
    total = _union_sectors(np.zeros_like(b_row), b_row, b_row + width, buffer_bytes)
    run = kind[tile] != KIND_GATHER
    total += _union_sectors(tensor[tile][run], t_row[run], t_row[run] + width[run], tensor_bytes)
    columns = layout.column_offsets.cpu().numpy().astype(np.int64)
    gathered = [np.stack([np.full(w, tensor[i]), start + columns[c : c + w]]) for i, start, c, w in
                zip(tile[~run], t_row[~run], col_start[tile][~run], width[~run])]
    if gathered:
        who, element = np.concatenate(gathered, axis=1)
        total += len(np.unique(who * 2**40 + element * tensor_bytes // SECTOR))
    return int(total)


def _union_sectors(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray, element_bytes: int) -> int:
    """Distinct sectors covered by element intervals [lo, hi) of each owner."""
    if not len(lo):
        return 0
    first, last = lo * element_bytes // SECTOR, (hi * element_bytes - 1) // SECTOR
    order = np.lexsort((first, owner))
    owner, first, last = owner[order], first[order], last[order]
    count, prev_owner, reach = 0, None, -1
    for o, f, l in zip(owner.tolist(), first.tolist(), last.tolist()):
        if o != prev_owner:
            prev_owner, reach = o, -1
        if l > reach:
            count += l - max(f, reach + 1) + 1
            reach = l
    return count


def _held(t: torch.Tensor, seg, index: torch.Tensor | None) -> torch.Tensor:
    return t if seg.kind == "whole" else t.index_select(0 if seg.kind == "rows" else 1, index)


def pack_baselines(layout: BucketLayout, grads, out: torch.Tensor) -> dict[str, Callable[[], object] | None]:
    """The pack a user would write without the kernels, each filling `out`'s segments like kernels.pack."""
    segs, idx = layout.segments, layout.index_tensors
    scales = [s.scale for s in segs]
    views = [out.narrow(0, s.offset, s.numel) for s in segs]
    dense = out.narrow(0, 0, sum(s.numel for s in segs))  # cat/flatten produce the unpadded concatenation

    def loop():
        for seg, i, view in zip(segs, idx, views):
            held = _held(grads[seg.tensor_index], seg, i)
            view.view(held.shape).copy_(held)
            view.mul_(seg.scale)

    def cat():
        dense.copy_(torch.cat([_held(grads[s.tensor_index], s, i).flatten() * s.scale for s, i in zip(segs, idx)]))

    def flatten():
        dense.copy_(_flatten_dense_tensors([_held(grads[s.tensor_index], s, i) * s.scale for s, i in zip(segs, idx)]))

    def foreach():
        held = [_held(grads[s.tensor_index], s, i).reshape(-1) for s, i in zip(segs, idx)]
        torch._foreach_copy_(views, held)
        torch._foreach_mul_(views, scales)

    return {"loop of slice copies + mul_": loop, "torch.cat(index_select * s)": cat,
            "_flatten_dense_tensors": flatten, "_foreach_copy_ + _foreach_mul_": foreach}


def unpack_baselines(layout: BucketLayout, buffer: torch.Tensor, grads) -> dict[str, Callable[[], object] | None]:
    """The unpack (copy mode) a user would write, each writing the held slices of `grads`."""
    segs, idx = layout.segments, layout.index_tensors
    parts = [buffer.narrow(0, s.offset, s.numel) for s in segs]
    whole = all(s.kind == "whole" for s in segs) and len({s.tensor_index for s in segs}) == len(segs)

    def loop():
        for seg, i, part in zip(segs, idx, parts):
            t = grads[seg.tensor_index]
            if seg.kind == "whole":
                t.view(-1).copy_(part)
            else:
                t.index_copy_(0 if seg.kind == "rows" else 1, i, part.to(t.dtype).view(_held(t, seg, i).shape))

    def foreach():
        torch._foreach_copy_([grads[s.tensor_index].view(-1) for s in segs], parts)

    # _foreach_copy_ into views cannot scatter rows/cols: only for whole tensors.
    return {"loop of slice/index copies": loop, "_foreach_copy_ into views": foreach if whole else None}


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: CUDA, triton.testing.do_bench's median; CPU, the best of `repeats` calls."""

    def measure(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
        fn()  # warm-up (and compilation)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return measure


def _compiled(fn: Callable[[], object], measure) -> float | str:
    try:
        return measure(torch.compile(fn))
    except Exception as exc:  # torch.compile of data-dependent index loops may not work: say so
        return f"compile failed: {type(exc).__name__}"


def report(title: str, useful: int, sectors: int, t_copy: float, rows: dict[str, float | str | None], table: list) -> None:
    eager = [t for n, t in rows.items() if isinstance(t, float) and n.startswith("eager")]
    compiled = [t for n, t in rows.items() if isinstance(t, float) and n.startswith("compiled")]
    print(f"\n{title}: {useful / 1e6:.1f} MB useful, {sectors * SECTOR / 1e6:.1f} MB of 32-byte sectors (read + write)")
    print(f"  {'method':<44} {'ms':>8} {'GB/s useful':>12} {'GB/s sectors':>13} {'x copy':>7} {'vs eager':>9} {'vs compiled':>12}")
    for name, t in [("plain copy (same useful bytes)", t_copy), *rows.items()]:
        if not isinstance(t, float):
            print(f"  {name:<44} {t or 'n/a (cannot scatter rows/cols)':>40}")
            continue
        vs_eager = f"{min(eager) / t:8.2f}x" if eager else f"{'-':>9}"
        vs_compiled = f"{min(compiled) / t:11.2f}x" if compiled else f"{'-':>12}"
        print(f"  {name:<44} {t * 1e3:8.3f} {useful / t / 1e9:12.2f} {sectors * SECTOR / t / 1e9:13.2f} {t_copy / t:7.2f} "
              f"{vs_eager} {vs_compiled}")
        table.append(dict(case=title, method=name, seconds=t, useful_bytes=useful, sector_bytes=sectors * SECTOR, copy_seconds=t_copy))


def run_case(name: str, shapes, specs, device: torch.device, buffer_dtype: torch.dtype, measure, compile_baselines: bool,
             table: list) -> None:
    layout = BucketLayout(shapes, specs, device=device)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    out = torch.empty(layout.total_numel, dtype=buffer_dtype, device=device)
    n = sum(s.numel for s in layout.segments)
    useful = n * (4 + out.element_size())
    sectors = sectors_touched(layout, 4, out.element_size())
    src_flat, dst_flat = torch.empty(n, device=device), torch.empty(n, dtype=buffer_dtype, device=device)
    scale = layout.inverse_coverage
    short = str(buffer_dtype).removeprefix("torch.")

    want = reference.pack(grads, layout, scale=scale, out_dtype=buffer_dtype)
    rows: dict[str, float | str | None] = {}
    if device.type == "cuda":
        rows["kernels.pack (fused Triton)"] = measure(lambda: kernels.pack(grads, layout, out, scale=scale, backend="triton"))
        assert torch.equal(out, want)
    rows["kernels reference"] = measure(lambda: reference.pack(grads, layout, out, scale=scale))
    for label, fn in pack_baselines(layout, grads, out).items():
        rows[f"eager: {label}"] = measure(fn)
        if "flatten" not in label and "cat" not in label:  # the loop and foreach fill the padded layout
            torch.testing.assert_close(out, want, rtol=2**-7, atol=0.0)
    if compile_baselines:
        rows["compiled: torch.compile(reference.pack)"] = _compiled(lambda: reference.pack(grads, layout, out, scale=scale), measure)
        rows["compiled: torch.compile(loop + mul_)"] = _compiled(pack_baselines(layout, grads, out)["loop of slice copies + mul_"], measure)
    report(f"{name} | pack fp32 -> {short} scaled 1/c ({len(layout.segments)} segments)", useful, sectors,
           measure(lambda: dst_flat.copy_(src_flat)), rows, table)

    rows = {}
    if device.type == "cuda":
        rows["kernels.unpack (fused Triton)"] = measure(lambda: kernels.unpack(want, grads, layout, backend="triton"))
    rows["kernels reference"] = measure(lambda: reference.unpack(want, grads, layout))
    rows.update({f"eager: {label}": fn and measure(fn) for label, fn in unpack_baselines(layout, want, grads).items()})
    if compile_baselines:
        rows["compiled: torch.compile(reference.unpack)"] = _compiled(lambda: reference.unpack(want, grads, layout), measure)
    report(f"{name} | unpack {short} -> fp32 copy", useful, sectors, measure(lambda: src_flat.copy_(dst_flat)), rows, table)


def check_fused(device: torch.device, d: int) -> str:
    """Bit-exact check of the fused kernels against the reference where they run (interpreter or GPU)."""
    from kernels.dispatch import select_backend

    if select_backend("auto", device) is reference:
        return "fused kernels not run here (CPU without TRITON_INTERPRET=1)"
    shapes, specs = llama_block(d, True)
    layout = BucketLayout(shapes, specs, device=device)
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(1)).to(device) for s in shapes]
    for dtype in (torch.float32, torch.bfloat16):
        got = kernels.pack(grads, layout, scale=layout.inverse_coverage, out_dtype=dtype, backend="triton")
        assert torch.equal(got, reference.pack(grads, layout, scale=layout.inverse_coverage, out_dtype=dtype))
    return f"fused kernels bit-exact with the reference on a d={d} neuron-level bucket (fp32 and bf16 buffers)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one LLaMA block (d=2048 on CUDA, 512 on CPU), a one-bottleneck ResNet stage on CPU")
    parser.add_argument("--smoke", action="store_true", help="a d=128 LLaMA block, one repeat: checks the script runs (scripts/gpu_check.sh --dry-run)")
    parser.add_argument("--buffer-dtype", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines (slow to compile on CPU)")
    parser.add_argument("--json", help="also write every timed row to this file")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine, multi-threaded copies stall and the ratios drift)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)
    measure = timer(device, 1 if args.smoke else 5)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (fused Triton kernel not timed on CPU)"
    print(f"{datetime.date.today()} | {platform.machine()} {torch.get_num_threads()} threads | torch {torch.__version__} | "
          f"device {device} | GPU: {gpu} | K={K} C={C} | {'do_bench median' if not cpu else 'best of N'}")
    dims = (128,) if args.smoke else ((512,) if cpu else (2048,)) if args.quick else (2048, 4096)
    print(check_fused(device, 128 if cpu else dims[0]))
    cases = [(f"LLaMA block d={d}", lambda nl, d=d: llama_block(d, nl)) for d in dims]
    stage = 1 if cpu and args.quick else 6
    if not args.smoke:
        cases.append((f"ResNet-50 stage 3 ({stage} bottleneck{'s' if stage > 1 else ''})", lambda nl: resnet50_stage3(nl, blocks=stage)))
    table: list = []
    for dtype in args.buffer_dtype:
        for name, build in cases:
            for neuron_level in (False, True):
                shapes, specs = build(neuron_level)
                level = "neuron level (N-SDP)" if neuron_level else "block level (B-SDP)"
                run_case(f"{name}, {level}", shapes, specs, device, getattr(torch, dtype), measure, not args.no_compile, table)
                if args.json:  # after every case, so a run cut short by a time limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
