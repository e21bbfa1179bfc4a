"""How much host time does the sync engine spend per step on llama-1b, against torch DDP's reducer?

SDP: rank 0 of llama-1b at K = 8, C = 0.5 (the designed mask of `sdp train --active 0.5`), B-SDP
and N-SDP: `plan_buckets` builds the bucket plan, `SyncEngine` is built on that rank's
parameters, and one step is what backward and the loop ask of it: the gradient hook for every
parameter in backward order (packing the buckets each gradient completes with one launch and
starting their all-reduces), then `finish` (unpacking every bucket with one launch, its norm fused
in, one sum). The collectives are replaced by a
recorder on every device. On CPU the tensors are real allocations that are never touched and
Triton's launcher is replaced by a recorder too, so what is timed is the package's host side up
to the launcher (checks, pointer tables, constants; Triton's own launch cost is not counted).
With ``--device cuda`` the kernels really launch (Triton's launch cost included) and each step is
timed on the host alone, the GPU synchronised between steps outside the timed region.

DDP: torch's reducer over the same parameters (the same count, in the same order, each tensor
1/``--shrink`` of its size, with ``bucket_cap_mb`` shrunk alike, so that the buckets hold the same
tensors while the copies into them cost next to nothing), one-rank gloo (nccl on CUDA), with a comm
hook that returns the bucket at once (the collective not counted, as on the SDP side). Its host
time per step is one forward + backward of a model that sums its parameters, with DDP minus
without it, measured in turn in this run. On CPU every figure is the thread's CPU time, on CUDA wall
time; "step ms" is the median over the steps, "best ms" the fastest.

    python benchmarks/bench_step_host.py [--device cpu] [--steps 30] [--bucket-cap-mb 25,65] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled kernels' host path, not the interpreter's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from kernels import dispatch, triton_ops  # noqa: E402
from sdp_train.models import block_map, get_model_config, model_class, subnet_kwargs  # noqa: E402
from sdp_train.models.subnet import check_held, held_tensors  # noqa: E402
from sdp_train.parallel import sync  # noqa: E402
from sdp_train.parallel.blockmap import on_meta  # noqa: E402
from sdp_train.trainer.config import TrainConfig  # noqa: E402
from sdp_train.trainer.prepare import design_for_model  # noqa: E402

TARGET_MS = 3.0  # issue 29: host time per step of B-SDP and N-SDP


class _Done:
    def wait(self) -> None:
        pass


def clock(device: torch.device) -> Callable[[], float]:
    """Seconds of this thread's CPU time on CPU (the machine is shared: wall time would count other
    jobs' time slices; nothing here waits), wall time on CUDA (where a launch may wait on the driver)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def timed_steps(step: Callable[[], object], steps: int, device: torch.device) -> list[float]:
    """Host seconds of each of `steps` calls after 3 warm-up calls; the device drained between calls, untimed."""
    now = clock(device)
    times = []
    for i in range(steps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = now()
        step()
        elapsed = now() - start
        if i >= 3:
            times.append(elapsed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return times


def sdp_engine(model_name: str, mode: str, workers: int, active: float, device: torch.device,
               bucket_cap_mb: float = sync.DEFAULT_BUCKET_CAP_MB):
    """(engine, rank 0's parameters in backward order, plans) for the designed mask of `mode`."""
    config = get_model_config(model_name)
    level = "neuron" if mode == "nsdp" else "block"
    mask = design_for_model(TrainConfig(model=model_name, mode=mode, workers=workers, active=active), config).matrix
    held = [held_tensors(config, mask[k], level) for k in range(workers)]
    bmap = block_map(config)
    names = [n for n in bmap.shapes if n in bmap.parameter_names]
    plans = sync.plan_buckets(held, names, shapes=bmap.shapes, bucket_cap_mb=bucket_cap_mb)
    with on_meta():
        model = model_class(config)(config, **subnet_kwargs(config, check_held(config, mask[0], level), level))
    model.to_empty(device=device)  # never initialised: only addresses and shapes matter here
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    groups = {p.holders: (object() if len(p.holders) > 1 else None) for p in plans}
    engine = sync.SyncEngine(model, plans, model.full_index(), groups, 0, backend="triton")
    return engine, list(reversed(list(model.parameters()))), plans


def sdp_row(model_name: str, mode: str, workers: int, active: float, device: torch.device, steps: int,
            launches: list[str], bucket_cap_mb: float = sync.DEFAULT_BUCKET_CAP_MB) -> dict:
    engine, backward_order, plans = sdp_engine(model_name, mode, workers, active, device, bucket_cap_mb)
    hook = sync.weak_grad_hook(engine)  # the hook autograd calls, as registered by the engine
    phases = {"backward": [], "finish": []}
    now = clock(device)

    def step() -> None:
        start = now()
        for p in backward_order:
            hook(p)
        middle = now()
        engine.finish()
        phases["backward"].append(middle - start)
        phases["finish"].append(now() - middle)

    launches.clear()
    times = timed_steps(step, steps, device)
    engine.remove_hooks()
    communicating = sum(b.communicates for b in engine.buckets)
    cap = "" if bucket_cap_mb == sync.DEFAULT_BUCKET_CAP_MB else f" cap {bucket_cap_mb:g}M"
    return dict(
        what=f"{mode} K={workers} C={active}{cap}", buckets=len(engine.buckets), communicating=communicating,
        plan_buckets=len(plans), launches_per_step=len(launches) / (steps + 3),
        step_ms=statistics.median(times) * 1e3, best_step_ms=min(times) * 1e3,
        backward_ms=statistics.median(phases["backward"][3:]) * 1e3,
        finish_ms=statistics.median(phases["finish"][3:]) * 1e3,
        per_bucket_us=statistics.median(times) / len(engine.buckets) * 1e6,
    )


class _SumModel(nn.Module):
    def __init__(self, shapes: list[int], device: torch.device) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n, device=device)) for n in shapes)

    def forward(self) -> torch.Tensor:
        return torch.stack([w.sum() for w in self.weights]).sum()


def _ready_bucket(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def ddp_row(model_name: str, shrink: int, device: torch.device, steps: int) -> dict:
    config = get_model_config(model_name)
    bmap = block_map(config)
    sizes = [max(1, torch.Size(bmap.shapes[n]).numel() // shrink) for n in bmap.shapes if n in bmap.parameter_names]
    plain = _SumModel(sizes, device)
    ddp = nn.parallel.DistributedDataParallel(_SumModel(sizes, device), bucket_cap_mb=25.0 / shrink,
                                              device_ids=[device.index or 0] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, _ready_bucket)

    def step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            model().backward()
            for p in model.parameters():
                p.grad = None
        return run

    with_ddp, without = [], []
    for _ in range(steps):  # interleaved, so that both see the same machine
        with_ddp += timed_steps(step(ddp), 1, device)
        without += timed_steps(step(plain), 1, device)
    buckets = ddp._get_ddp_logging_data().get("num_buckets_reduced")
    return dict(what="torch DDP reducer", tensors=len(sizes), buckets=buckets,
                best_step_ms=(min(with_ddp) - min(without)) * 1e3,
                with_ddp_ms=statistics.median(with_ddp) * 1e3, without_ms=statistics.median(without) * 1e3,
                step_ms=(statistics.median(with_ddp) - statistics.median(without)) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--active", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shrink", type=int, default=1024, help="DDP's tensors and bucket cap, divided by this")
    parser.add_argument("--modes", default="bsdp,nsdp")
    parser.add_argument("--bucket-cap-mb", default=str(sync.DEFAULT_BUCKET_CAP_MB),
                        help="comma-separated bucket caps (MiB) of the SDP plans, one row per mode and cap")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if triton_ops.INTERPRETED:
        sys.exit("TRITON_INTERPRET=1 is set: this measures the compiled kernels' host path; unset it")
    torch.set_num_threads(1)
    launches: list[str] = []
    if device.type == "cpu":  # no GPU: the package's host side up to the launcher, which records
        type(triton_ops._pack_kernel).run = lambda self, *a, grid, warmup, **k: launches.append(self.fn.__name__)
        dispatch._triton_unavailable_reason = lambda device: None
    else:
        original = type(triton_ops._pack_kernel).run

        def counted(self, *a, **k):
            launches.append(self.fn.__name__)
            return original(self, *a, **k)

        type(triton_ops._pack_kernel).run = counted
    sync.dist.all_reduce = lambda buffer, group=None, async_op=False: _Done()  # collectives not counted
    print(f"host time per step, {args.model}, {platform.machine()} {args.device}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; target <= {TARGET_MS} ms per step (issue 29)")
    rows = [sdp_row(args.model, mode, args.workers, args.active, device, args.steps, launches, float(cap))
            for mode in args.modes.split(",") for cap in args.bucket_cap_mb.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            ddp = ddp_row(args.model, args.shrink, device, args.steps)
        finally:
            dist.destroy_process_group()
    print(f"\n{'engine':<24} {'buckets':>8} {'comm':>5} {'launches':>9} {'step ms':>8} {'bwd ms':>7} {'finish ms':>9} "
          f"{'us/bucket':>9} {'x DDP':>6} {'best ms':>8}")
    for r in rows:
        print(f"{r['what']:<24} {r['buckets']:>8} {r['communicating']:>5} {r['launches_per_step']:>9.0f} "
              f"{r['step_ms']:>8.2f} {r['backward_ms']:>7.2f} {r['finish_ms']:>9.2f} {r['per_bucket_us']:>9.1f} "
              f"{r['step_ms'] / ddp['step_ms']:>6.2f} {r['best_step_ms']:>8.2f}")
    print(f"{ddp['what']:<24} {ddp['buckets']!s:>8} {'':>5} {'':>9} {ddp['step_ms']:>8.2f} {'':>7} {'':>9} {'':>9} "
          f"{1:>6.2f} {ddp['best_step_ms']:>8.2f}\n  (DDP: {ddp['tensors']} tensors; fwd+bwd "
          f"{ddp['with_ddp_ms']:.2f} ms with DDP, {ddp['without_ms']:.2f} without)")
    if args.json:
        args.json.write_text(json.dumps(dict(device=args.device, model=args.model, machine=platform.machine(), sdp=rows,
                                              ddp=ddp), indent=1))


if __name__ == "__main__":
    main()
