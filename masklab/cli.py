"""``sdp design`` and ``sdp inspect``: build or read a mask and print its certificate.

The certificate names, for every number, the theorem that uses it (`masklab.report.USED_BY`);
below it, the number of process groups the mask needs (`masklab.analysis.process_group_holder_sets`).

Registered into the ``sdp`` command by `sdp_train.cli`. Bad arguments raise masklab's
ValueError subclasses; the dispatcher prints them as one line and exits non-zero. A file is
written only after the mask has been built and analysed, so a failing run writes nothing.
"""

from __future__ import annotations

import argparse
import json

from masklab.analysis import process_group_holder_sets
from masklab.errors import DesignError
from masklab.mask import ROW_SCHEDULE_KINDS, Mask, Schedule
from masklab.report import analyze

MAX_WORKERS = 4096  # the certificate needs dense K x K matrices; beyond this `sdp design` would not finish
MAX_ENTRIES = 2**22  # K * B: a 1024 x 4096 mask


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "design",
        help="design a mask and print its certificate",
        description="Design a K x B mask (exact 2-design where one exists, else a search) and print its "
        "certificate. Each number says which theorem of docs/theory.md uses it: coverage and masking error "
        "bound stepwise training; the spectral gap matters only for overlap averaging.",
    )
    p.add_argument("--workers", "-K", type=int, required=True, metavar="K", help="number of workers")
    p.add_argument("--blocks", "-B", type=int, required=True, metavar="B", help="number of maskable blocks")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--active", type=float, metavar="C", help="active fraction C in (0, 1]")
    budget.add_argument("--coverage", type=int, metavar="c", help="holders per block, 1 <= c <= K")
    p.add_argument("--construction", default="auto", metavar="NAME",
                   help="auto (default), complete, cyclic, random, projective-plane, affine-plane, difference-set, search")
    p.add_argument("--schedule", default="static", choices=ROW_SCHEDULE_KINDS,
                   help="how the mask changes over training (a sequence of masks comes from a mask file)")
    p.add_argument("--every", type=int, default=1, metavar="R", help="steps between schedule redraws (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for random and searched designs (default 0)")
    _add_output_args(p)
    p.add_argument("--out", metavar="FILE", help="save the mask as JSON to FILE")
    p.set_defaults(func=run_design)

    q = subparsers.add_parser("inspect", help="print the certificate of a saved mask",
                              description="Analyse a mask JSON file and print its certificate.")
    q.add_argument("file", metavar="FILE", help="mask JSON written by `sdp design --out`")
    _add_output_args(q)
    q.set_defaults(func=run_inspect)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the certificate as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw matrix, spectrum and mixing graph into a PNG")


def run_design(args: argparse.Namespace) -> int:
    from masklab.design import design

    if args.active is not None and not 0.0 < args.active <= 1.0:
        raise DesignError(f"--active {args.active} must be in (0, 1]")
    if args.workers > MAX_WORKERS or max(args.workers, 0) * max(args.blocks, 0) > MAX_ENTRIES:
        raise DesignError(f"-K {args.workers} -B {args.blocks}: sdp design supports at most {MAX_WORKERS} workers "
                          f"and {MAX_ENTRIES} mask entries (K x B)")
    mask = design(args.workers, args.blocks, active=args.active, coverage=args.coverage,
                  construction=args.construction, seed=args.seed)
    if args.schedule != "static" or args.every != 1:
        mask = mask.replace(schedule=Schedule(args.schedule, args.every))
    from masklab.io import check_destination, save_mask

    if args.out:
        check_destination(args.out)  # a bad --out fails before the plot is written
    _emit(mask, args)
    if args.out:
        save_mask(mask, args.out)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from masklab.io import load_mask

    _emit(load_mask(args.file), args)
    return 0


def _emit(mask: Mask, args: argparse.Namespace) -> None:
    report = analyze(mask)
    if args.plot:
        from masklab.plot import plot_mask

        plot_mask(mask, args.plot, seed=getattr(args, "seed", 0))
    groups = len(process_group_holder_sets(mask))
    fsdp_groups = len(process_group_holder_sets(mask, singletons=True))
    if args.json:
        print(json.dumps(report.to_dict() | {"process_groups": groups, "process_groups_fsdp": fsdp_groups},
                         indent=2))
    else:
        print(report.to_text())
        print(f"process groups: {groups} (B-SDP+FSDP: {fsdp_groups}), one per distinct holder set of 2 to K-1 "
              "workers (with FSDP, single holders too); on NCCL each is a communicator on its members' devices")
