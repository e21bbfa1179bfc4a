"""``sdp plan``: predicted peak memory per rank (training and validation) and bytes per step of DDP,
FSDP and SDP at several C, and which fit.

Nothing is trained or allocated: the numbers come from `sdp_train.plan` (see docs/plan.md).
"""

from __future__ import annotations

import argparse
import json

from sdp_train.config import TrainConfig

_DEFAULTS = TrainConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    from sdp_train.plan import COMMUNICATOR_BYTES_ENV, DEFAULT_ACTIVE, DEVICES, DTYPE_BYTES

    p = subparsers.add_parser(
        "plan", help="predict peak memory per rank of DDP, FSDP and SDP, and which fit a device",
        description="Predict the peak memory per rank of DDP, FSDP, B-SDP, N-SDP and Bb-SDP (at every active "
                    "fraction C the worker count realises) from the model's parameters, gradients, optimizer "
                    "state and activations, and list which fit --memory-per-device. Nothing is trained.")
    p.add_argument("--model", required=True,
                   help="named model (llama-debug, llama-134m, llama-500m, llama-1b, resnet18-cifar, vit-tiny, swin-tiny)")
    p.add_argument("--workers", type=int, required=True, metavar="K", help="number of ranks")
    p.add_argument("--memory-per-device", required=True, metavar="SIZE",
                   help="device memory, e.g. 24GiB, 80GB or plain bytes")
    p.add_argument("--ac", action="store_true", help="activation checkpointing in every system")
    p.add_argument("--fsdp", action="store_true", help="also B-SDP composed with FSDP2 among each block's holders")
    p.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size,
                   help=f"sequences (images) per worker (default {_DEFAULTS.batch_size}, as sdp train)")
    p.add_argument("--seq-len", type=int, default=_DEFAULTS.seq_len,
                   help=f"tokens per sequence (default {_DEFAULTS.seq_len}, as sdp train)")
    p.add_argument("--active", type=float, nargs="+", default=list(DEFAULT_ACTIVE), metavar="C",
                   help=f"candidate active fractions (default {' '.join(map(str, DEFAULT_ACTIVE))})")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                   help="element type of parameters, state and activations (default float32, what sdp train runs)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where the ranks run (default cpu): cuda adds each rank's NCCL communicators, an "
                        f"estimate per communicator that {COMMUNICATOR_BYTES_ENV} overrides")
    p.add_argument("--image-size", type=int, default=8,
                   help="vision models: image side (default 8, the digits sdp train uses; 32 for CIFAR)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sdp_train.errors import ConfigError
    from sdp_train.memory import format_bytes
    from sdp_train.plan import COMMUNICATOR_BYTES_ENV, parse_bytes, plan_systems

    budget = parse_bytes(args.memory_per_device)
    for c in args.active:
        if not 0 < c <= 1:
            raise ConfigError(f"--active {c} must lie in (0, 1]")
    rows = plan_systems(args.model, workers=args.workers, memory_per_device=budget, ac=args.ac, fsdp=args.fsdp,
                        actives=tuple(args.active), batch_size=args.batch_size, seq_len=args.seq_len,
                        dtype=args.dtype, image_size=args.image_size, device=args.device)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}, {args.workers} workers, batch {args.batch_size}"
          f"{f' x {args.seq_len} tokens' if args.model.startswith('llama') else ''}, {args.dtype}, {args.device}; "
          f"peak per rank (largest rank) vs {args.memory_per_device} = {format_bytes(budget)} per device")
    header = ("system", "C", "groups", "params", "grads", "optimizer", "activations", "comms", "total", "no mask",
              "eval peak", "buffer/step", "wire/step", "fits")
    print(f"{header[0]:<16}{header[1]:>6}{header[2]:>7}" + "".join(f"{h:>12}" for h in header[3:9])
          + f"{header[9]:>18}" + "".join(f"{h:>12}" for h in header[10:13]) + f"{header[13]:>6}")
    notes = []
    for row in rows:
        if row["total"] is None:
            notes.append(f"{row['system']} at C={row['active']:g}: {row['error']}")
            continue
        fixed = f"{format_bytes(row['unmaskable'])} ({row['unmaskable'] / row['total']:.0%})"
        cells = "".join(f"{format_bytes(round(row[k])):>12}" for k in (
            "parameters", "gradients", "optimizer", "activations", "communicators", "total"))
        cells += f"{fixed:>18}" + "".join(f"{format_bytes(round(row[k])):>12}" for k in (
            "eval_peak", "comm_bytes_per_step", "wire_bytes_per_step"))
        print(f"{row['system']:<16}{row['active']:>6.3g}{row['process_groups']:>7}{cells}"
              f"{'yes' if row['fits'] else 'no':>6}")
    for note in notes:
        print(f"not designable: {note}")
    print("no mask: the part of total that no mask removes (its share): the parameters outside the blocks "
          "(embedding, final norm, head) with their gradients, optimizer state and buckets, sharded over all "
          "ranks under FSDP (and --fsdp), and at backward start the root unsharded (FSDP), the stem's and head's "
          "activations (logits) and the loss gradients")
    print("eval peak: rank 0 during validation (it alone assembles the full model); buffer/step and "
          "wire/step: bytes per step of the rank that sends most, wire under the ring model "
          "(all-reduce 2(c-1)/c of the buffer, all-gather / reduce-scatter / broadcast (c-1)/c)")
    per = next((r["communicator_bytes"] for r in rows if r["total"] is not None), 0)
    print("groups: process groups besides the world's, one per distinct holder set; comms: the largest rank's "
          + (f"NCCL communicators (the world's and its groups') at {format_bytes(per)} each, an estimate "
             f"({COMMUNICATOR_BYTES_ENV} overrides it)" if args.device == "cuda"
             else "communicator memory, 0 on cpu (gloo; --device cuda counts NCCL's)"))
    print("not counted: the CUDA context, cuBLAS workspaces, allocator fragmentation (leave headroom; docs/plan.md)")
    fitting = [f"{r['system']} (C={r['active']:g})" for r in rows if r["fits"]]
    print(f"fit: {', '.join(fitting) if fitting else 'none'}")
    return 0
