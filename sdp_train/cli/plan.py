"""``sdp plan``: predicted peak memory per rank (training and validation) and bytes per step of DDP,
FSDP and SDP at several C, and which fit; with ``--budgets``, a B-SDP mask that fits each device.

Nothing is trained or allocated: the numbers come from `sdp_train.planning.memory` (see docs/plan.md).
"""

from __future__ import annotations

import argparse
import json

from sdp_train.trainer.config import TrainConfig

_DEFAULTS = TrainConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    from masklab.design import list_constructions
    from sdp_train.planning.memory import COMMUNICATOR_BYTES_ENV, DEFAULT_ACTIVE, DEVICES, DTYPE_BYTES

    p = subparsers.add_parser(
        "plan", help="predict peak memory per rank of DDP, FSDP and SDP, and which fit a device",
        description="Predict the peak memory per rank of DDP, FSDP, B-SDP, N-SDP and Bb-SDP (at every active "
                    "fraction C the worker count realises) from the model's parameters, gradients, optimizer "
                    "state and activations, and list which fit --memory-per-device. With --budgets (one size per "
                    "worker), design a B-SDP mask whose predicted peak fits each worker's device instead. Nothing "
                    "is trained.")
    p.add_argument("--model", required=True,
                   help="named model (llama-debug, llama-134m, llama-500m, llama-1b, resnet18-cifar, "
                        "wideresnet18-cifar, vit-tiny, swin-debug, swin-tiny)")
    p.add_argument("--workers", type=int, required=True, metavar="K", help="number of ranks")
    memory = p.add_mutually_exclusive_group(required=True)
    memory.add_argument("--memory-per-device", metavar="SIZE", help="device memory, e.g. 24GiB, 80GB or plain bytes")
    memory.add_argument("--budgets", metavar="SIZES",
                        help="one device memory per worker, e.g. 80GB,80GB,24GB,24GB (as many as --workers): design "
                             "a B-SDP mask for these costs (masklab.design_for_costs) and print each worker's "
                             "predicted peak and whether it fits")
    p.add_argument("--min-coverage", type=int, default=2, metavar="c",
                   help="with --budgets: holders per block (default 2)")
    p.add_argument("--seed", type=int, default=0, help="with --budgets: seed of the mask design (default 0)")
    p.add_argument("--mask-out", metavar="FILE", help="with --budgets: write the mask (sdp train --mask FILE)")
    p.add_argument("--costs-out", metavar="FILE",
                   help="with --budgets: write each block's bytes (a costs file for sdp design --costs)")
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
                   help="where the ranks run (default cpu): cuda adds each rank's NCCL communicators, estimates "
                        f"that {COMMUNICATOR_BYTES_ENV} and SDP_NCCL_PEER_BYTES override; split communicators share "
                        "the world's resources unless NCCL_COMM_SPLIT_SHARE_RESOURCES=0 (docs/plan.md)")
    p.add_argument("--image-size", type=int, default=8,
                   help="vision models: image side (default 8, the digits sdp train uses; 32 for CIFAR)")
    p.add_argument("--loss-chunks", type=int, default=_DEFAULTS.loss_chunks, metavar="N",
                   help="language models: the head and loss computed N chunks of tokens at a time, never the full "
                        f"logits; 0: the plain loss (default {_DEFAULTS.loss_chunks}, as sdp train)")
    p.add_argument("--construction", default="auto", choices=list_constructions(),
                   help="the SDP rows' mask design, as sdp train --construction (default auto); cyclic: holder "
                        "sets of consecutive ranks, which add the fewest ring neighbours to the world's NCCL "
                        "communicator (--device cuda), at a lower spectral gap (which only overlap averaging uses)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sdp_train.errors import ConfigError
    from sdp_train.parallel.dist import NCCL_SPLIT_SHARE_ENV
    from sdp_train.planning.communicators import PEER_BYTES_ENV
    from sdp_train.planning.memory import COMMUNICATOR_BYTES_ENV, parse_bytes, peer_bytes, plan_systems
    from sdp_train.trainer.memory import format_bytes

    if args.budgets is not None:
        if args.construction != "auto":
            raise ConfigError(f"--construction {args.construction} designs the plain plan's masks; --budgets designs "
                              "its own mask for the devices (masklab.design_for_costs)")
        return _run_budgets(args)
    for flag in ("mask_out", "costs_out"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} belongs to --budgets (the mask designed for the devices)")
    budget = parse_bytes(args.memory_per_device)
    for c in args.active:
        if not 0 < c <= 1:
            raise ConfigError(f"--active {c} must lie in (0, 1]")
    rows = plan_systems(args.model, workers=args.workers, memory_per_device=budget, ac=args.ac, fsdp=args.fsdp,
                        actives=tuple(args.active), batch_size=args.batch_size, seq_len=args.seq_len,
                        dtype=args.dtype, image_size=args.image_size, device=args.device,
                        loss_chunks=args.loss_chunks, construction=args.construction)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}, {args.workers} workers, batch {args.batch_size}"
          f"{f' x {args.seq_len} tokens' if args.model.startswith('llama') else ''}, {args.dtype}, {args.device}; "
          f"peak per rank (largest rank) vs {args.memory_per_device} = {format_bytes(budget)} per device")
    header = ("system", "C", "groups", "params", "grads", "optimizer", "activations", "comms", "total", "no mask",
              "eval peak", "buffer/step", "wire/step", "saved vs DDP", "comms of it", "fits")
    print(f"{header[0]:<16}{header[1]:>6}{header[2]:>7}" + "".join(f"{h:>12}" for h in header[3:9])
          + f"{header[9]:>18}" + "".join(f"{h:>12}" for h in header[10:13]) + f"{header[13]:>14}{header[14]:>13}"
          + f"{header[15]:>6}")
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
        print(f"{row['system']:<16}{row['active']:>6.3g}{row['process_groups']:>7}{cells}{_saving(row)}"
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
    shared = next((r["communicators_shared"] for r in rows if r["total"] is not None), False)
    if args.device != "cuda":
        comms = "communicator memory, 0 on cpu (gloo; --device cuda counts NCCL's)"
    elif shared:
        comms = (f"NCCL communicators, split ones sharing the world's resources ({NCCL_SPLIT_SHARE_ENV} unset or 1, "
                 f"the runtime's default): the world's at {format_bytes(per)} and {format_bytes(peer_bytes('cuda'))} "
                 f"per ring neighbour its groups add, estimates ({COMMUNICATOR_BYTES_ENV}, {PEER_BYTES_ENV} override "
                 "them; docs/plan.md)")
    else:
        comms = (f"NCCL communicators (the world's and its groups', {NCCL_SPLIT_SHARE_ENV}=0) at {format_bytes(per)} "
                 f"each, an estimate ({COMMUNICATOR_BYTES_ENV} overrides it)")
    print("groups: process groups besides the world's, one per distinct holder set; comms: the largest rank's "
          + comms)
    print("saved vs DDP: DDP's total less the row's, communicators left out of both; comms of it: the row's "
          "communicators beyond DDP's as a share of that saving")
    print("not counted: the CUDA context, cuBLAS workspaces, allocator fragmentation (leave headroom; docs/plan.md)")
    fitting = [f"{r['system']} (C={r['active']:g})" for r in rows if r["fits"]]
    print(f"fit: {', '.join(fitting) if fitting else 'none'}")
    return 0


def _saving(row: dict) -> str:
    """The ``saved vs DDP`` and ``comms of it`` cells of an SDP row (`communicator_share`), blank for the baselines."""
    from sdp_train.trainer.memory import format_bytes

    if "saved_vs_ddp" not in row:
        return " " * 27
    share = row["communicator_share"]
    return f"{format_bytes(row['saved_vs_ddp']):>14}{'-' if share is None else f'{share:.0%}':>13}"


def _run_budgets(args: argparse.Namespace) -> int:
    """``--budgets``: the B-SDP mask for one device per worker, each rank's predicted peak against it."""
    from masklab import save_costs, save_mask
    from masklab.costs import parse_budgets
    from sdp_train.errors import ConfigError
    from sdp_train.planning.costs import plan_for_budgets
    from sdp_train.trainer.memory import format_bytes

    budgets = parse_budgets(args.budgets)
    if len(budgets) != args.workers:
        raise ConfigError(f"--budgets gives {len(budgets)} sizes but --workers is {args.workers}: give one per worker")
    if args.fsdp:
        raise ConfigError("--budgets designs a B-SDP mask without FSDP: leave out --fsdp")
    plan = plan_for_budgets(args.model, budgets=budgets, min_coverage=args.min_coverage, seed=args.seed, ac=args.ac,
                            batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                            image_size=args.image_size, device=args.device, loss_chunks=args.loss_chunks)
    if args.mask_out is not None:
        save_mask(plan.mask, args.mask_out)
    if args.costs_out is not None:
        save_costs(plan.costs, args.costs_out)
    eval_peak = plan.prediction["eval_peak"]
    if args.json:
        print(json.dumps({"system": "B-SDP" + ("+AC" if args.ac else ""), "workers": plan.rows,
                          "coverage": plan.mask.coverage.tolist(), "mask": plan.mask.matrix.tolist(),
                          "block_names": list(plan.costs.block_names), "eval_peak": eval_peak,
                          "eval_fits": eval_peak <= budgets[0], "fixed_bytes": plan.costs.fixed_bytes,
                          "block_bytes": list(plan.costs.block_bytes)}, indent=1))
        return 0
    print(f"{args.model}, {args.workers} workers, batch {args.batch_size}"
          f"{f' x {args.seq_len} tokens' if args.model.startswith('llama') else ''}, {args.dtype}, {args.device}; "
          f"B-SDP{'+AC' if args.ac else ''} mask designed for each worker's device, every block held "
          f">= {args.min_coverage} times")
    print(f"{'worker':<8}{'budget':>12}{'peak':>12}{'blocks':>8}  {'holds':<40}{'fits':>5}")
    for row, held in zip(plan.rows, plan.mask.matrix):
        holds = "".join(str(int(h)) for h in held)
        print(f"{row['worker']:<8}{format_bytes(row['budget']):>12}{format_bytes(row['peak']):>12}"
              f"{row['blocks']:>8}  {holds:<40}{'yes' if row['fits'] else 'no':>5}")
    print(f"blocks: {', '.join(plan.costs.block_names)}; coverage {plan.mask.coverage.tolist()}")
    print(f"eval peak: rank 0 during validation assembles the full model: {format_bytes(eval_peak)} "
          f"({'fits' if eval_peak <= budgets[0] else 'does not fit'} worker 0's {format_bytes(budgets[0])})")
    print("not counted: the CUDA context, cuBLAS workspaces, allocator fragmentation (leave headroom; docs/plan.md)")
    for flag, path in (("mask", args.mask_out), ("costs", args.costs_out)):
        if path is not None:
            print(f"{flag} -> {path}" + (f" (sdp train --mode bsdp --workers {args.workers} --mask {path})"
                                        if flag == "mask" else ""))
    return 0
