"""How much host time does the package spend preparing one pack / unpack launch of a llama-1b bucket?

The kernels' own host side, per launch: input checks, the cached pointer table, the compile-time
constants, up to the Triton launcher (replaced here by a recorder, so no GPU is needed and Triton's
own launch overhead, which needs a GPU to measure, is not counted). Buckets of llama-1b (d = 2048,
hidden 5632) at K = 8, C = 0.5: one transformer block whole (B-SDP), one block with half the heads
and MLP neurons gathered (N-SDP), and the two RMSNorm weights alone (the smallest bucket). The
tensors are real CPU allocations that are never touched (no memory is committed). Per bucket:

  pack            the sync engine's launch: fp32 gradients -> fp32 buffer, scaled by 1/c_j
  unpack+norm     unpack with the clipping norm fused in (``partials``)
  squared_norm    a single holder's bucket: its norm into ``partials``
  step            pack + unpack+norm, the per-bucket host cost of an averaged, clipped step
  layout build    BucketLayout construction (once per mask), with a new and with a live twin

each the median of `--repeats` timed loops, and its ratio to one eager ``Tensor.add_`` on a tiny
tensor measured in the same run (the unit a per-tensor Python loop pays per tensor). The runtime's
per-step figure is the sum over its buckets (sdp_train's bucket plan; not built here).

    python benchmarks/bench_launch_host.py [--repeats 5] [--loops 500] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled kernels' host path, not the interpreter's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_kernels import llama_block  # noqa: E402
from kernels import BucketLayout, SegmentSpec, triton_ops  # noqa: E402

D_MODEL = 2048  # llama-1b; llama_block derives hidden 5632 from it


def per_call_us(fn: Callable[[], object], loops: int, repeats: int) -> float:
    """Median over `repeats` of the mean host time of `loops` back-to-back calls, in microseconds."""
    for _ in range(min(loops, 50)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - start) / loops * 1e6)
    return statistics.median(times)


def buckets() -> dict[str, tuple[list[tuple[int, ...]], list[SegmentSpec]]]:
    block, neuron = llama_block(D_MODEL, False), llama_block(D_MODEL, True)
    norms = ([(D_MODEL,), (D_MODEL,)], [SegmentSpec(0, coverage=4), SegmentSpec(1, coverage=4)])
    return {"B-SDP block": block, "N-SDP block": neuron, "two RMSNorm weights": norms}


def run_bucket(name: str, shapes, specs, loops: int, repeats: int, eager_us: float) -> dict:
    start = time.perf_counter()
    layout = BucketLayout(shapes, specs)
    build_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    twin = BucketLayout(shapes, specs)  # an engine rebuilt while the old one lives: metadata shared
    twin_ms = (time.perf_counter() - start) * 1e3
    grads = [torch.empty(s) for s in shapes]
    buffer = torch.empty(layout.total_numel)
    partials = torch.zeros(layout.num_norm_partials)
    scale = layout.inverse_coverage

    def pack():
        triton_ops.pack(grads, layout, buffer, scale=scale)

    def unpack_norm():
        triton_ops.unpack(buffer, grads, layout, partials=partials)

    def step():
        pack()
        unpack_norm()

    timings = {
        "pack": per_call_us(pack, loops, repeats),
        "unpack+norm": per_call_us(unpack_norm, loops, repeats),
        "squared_norm": per_call_us(lambda: triton_ops.squared_norm(grads, layout, partials=partials), loops, repeats),
        "step": per_call_us(step, loops, repeats),
    }
    del twin
    print(f"\n{name}: {len(shapes)} tensors, {len(specs)} segments, {layout.num_tiles} tiles; "
          f"layout build {build_ms:.1f} ms new, {twin_ms:.1f} ms with a live twin")
    print(f"  {'launch':<14} {'host us':>9} {'x eager op':>11}")
    for what, us in timings.items():
        print(f"  {what:<14} {us:>9.1f} {us / eager_us:>11.1f}")
    return dict(bucket=name, tensors=len(shapes), segments=len(specs), tiles=layout.num_tiles, build_ms=build_ms,
                build_live_twin_ms=twin_ms, host_us=timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loops", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if triton_ops.INTERPRETED:
        sys.exit("TRITON_INTERPRET=1 is set: this measures the compiled kernels' host path; unset it")
    kind = type(triton_ops._pack_kernel)  # the launcher, replaced by a recorder: no GPU needed
    kind.run = lambda self, *a, grid, warmup, **k: None
    torch.set_num_threads(1)
    tiny = torch.zeros(4)
    eager_us = per_call_us(lambda: tiny.add_(1), args.loops, args.repeats)
    print(f"host time per launch, {platform.processor() or platform.machine()}, torch {torch.__version__}; "
          f"baseline: one eager add_ on 4 elements = {eager_us:.2f} us")
    rows = [run_bucket(name, shapes, specs, args.loops, args.repeats, eager_us) for name, (shapes, specs) in buckets().items()]
    if args.json:
        args.json.write_text(json.dumps(dict(eager_add_us=eager_us, machine=platform.machine(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
