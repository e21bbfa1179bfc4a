"""``sdp design`` and ``sdp inspect``: build or read a mask and print its certificate.

The certificate names, for every number, the theorem that uses it (`masklab.report.USED_BY`);
below it, the number of process groups the mask needs (`masklab.analysis.process_group_holder_sets`)
and, for ``sdp design --costs``, each worker's bytes against its budget (`masklab.balance`).

Registered into the ``sdp`` command by `sdp_train.cli`. Bad arguments raise masklab's
ValueError subclasses; the dispatcher prints them as one line and exits non-zero. A file is
written only after the mask has been built and analysed, so a failing run writes nothing.
"""

from __future__ import annotations

import argparse
import json

from masklab.analysis import optimality_ratio, process_group_holder_sets, spectral_gap
from masklab.costs import BlockCosts
from masklab.errors import DesignError
from masklab.failures import check_tolerates, checked_tolerate
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
    p.add_argument("--workers", "-K", type=int, metavar="K",
                   help="number of workers (with --budgets, defaults to the number of budgets)")
    p.add_argument("--blocks", "-B", type=int, metavar="B",
                   help="number of maskable blocks (with --costs, defaults to the file's)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--active", type=float, metavar="C", help="active fraction C in (0, 1]")
    budget.add_argument("--coverage", type=int, metavar="c", help="holders per block, 1 <= c <= K")
    budget.add_argument("--costs", metavar="FILE",
                        help="costs file (bytes per block, docs/design.md section 2): design the mask that "
                             "balances bytes instead of block counts")
    p.add_argument("--budgets", metavar="SIZES",
                   help="with --costs: one memory budget per worker, e.g. 80GB,80GB,24GB,24GB (bytes, or "
                        "KB/MB/GB/TB, KiB/MiB/GiB/TiB)")
    p.add_argument("--min-coverage", type=int, metavar="c",
                   help="with --costs: holders per block (default 2)")
    p.add_argument("--max-groups", type=int, metavar="G",
                   help="at most G process groups (distinct holder sets of 2 to K-1 workers, each an NCCL "
                        "communicator); prints the spectral gap of the masks tried against their groups")
    p.add_argument("--tolerate", type=int, metavar="F",
                   help="survive F simultaneous worker losses: every block on at least F + 1 workers (alone: "
                        "coverage F + 1; with --costs: --min-coverage F + 1), or refuse")
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
    costs = budgets = None
    lines, extra = [], {}
    if args.costs is not None:
        mask, costs, budgets = _design_for_costs(args)
    else:
        mask, lines, extra = _design_for_counts(args)
    if args.schedule != "static" or args.every != 1:
        mask = mask.replace(schedule=Schedule(args.schedule, args.every))
    if costs is not None:
        lines, extra = _bytes_report(mask, args, costs, budgets)
    from masklab.io import check_destination, save_mask

    if args.out:
        check_destination(args.out)  # a bad --out fails before the plot is written
    _emit(mask, args, lines=lines, extra=extra)
    if args.out:
        save_mask(mask, args.out)
    return 0


def _design_for_counts(args: argparse.Namespace) -> tuple[Mask, list[str], dict[str, object]]:
    """The mask of ``-K -B --active|--coverage``: block counts balanced, the best spectral gap found
    (within ``--max-groups``, with the trade-off as text lines and JSON keys)."""
    from masklab.design import design, group_tradeoff, pick_within_groups

    for flag, value in (("--budgets", args.budgets), ("--min-coverage", args.min_coverage)):
        if value is not None:
            raise DesignError(f"{flag} belongs to --costs FILE (a byte-balanced design); for block counts "
                              "give --active or --coverage")
    if args.workers is None or args.blocks is None or (args.active is None and args.coverage is None
                                                       and args.tolerate is None):
        raise DesignError("give -K WORKERS -B BLOCKS and one of --active C, --coverage c, --tolerate F "
                          "(or --costs FILE)")
    if args.active is not None and not 0.0 < args.active <= 1.0:
        raise DesignError(f"--active {args.active} must be in (0, 1]")
    _check_size(args.workers, args.blocks)
    if args.max_groups is None:
        return design(args.workers, args.blocks, active=args.active, coverage=args.coverage,
                      construction=args.construction, tolerate=args.tolerate, seed=args.seed), [], {}
    if args.construction != "auto":
        raise DesignError(f"--max-groups applies to --construction auto, not {args.construction}")
    masks = group_tradeoff(args.workers, args.blocks, active=args.active, coverage=args.coverage,
                           max_groups=args.max_groups, tolerate=args.tolerate, seed=args.seed)
    mask = pick_within_groups(masks, args.max_groups)
    rows = [{"process_groups": len(process_group_holder_sets(m)), "spectral_gap": spectral_gap(m),
             "optimality_ratio": optimality_ratio(m), "construction": m.construction, "chosen": m is mask}
            for m in masks]
    lines = [f"--max-groups {args.max_groups}: the masks tried (the first without the limit)",
             "  groups  spectral gap  optimality ratio  construction"]
    lines += [f"  {r['process_groups']:>6}  {r['spectral_gap']:>12.6g}  {r['optimality_ratio']:>16.6f}  "
              f"{r['construction']}{'  <- chosen' if r['chosen'] else ''}" for r in rows]
    return mask, lines, {"max_groups": args.max_groups, "group_tradeoff": rows}


def _check_size(workers: int, blocks: int) -> None:
    if workers > MAX_WORKERS or max(workers, 0) * max(blocks, 0) > MAX_ENTRIES:
        raise DesignError(f"-K {workers} -B {blocks}: sdp design supports at most {MAX_WORKERS} workers "
                          f"and {MAX_ENTRIES} mask entries (K x B)")


def _design_for_costs(args: argparse.Namespace) -> tuple[Mask, BlockCosts, list[int] | None]:
    """The byte-balanced mask of ``--costs`` (with its costs and budgets, for the report)."""
    from masklab.balance import design_for_costs
    from masklab.costs import parse_budgets
    from masklab.io import load_costs

    if args.construction != "auto":
        raise DesignError(f"--construction {args.construction} does not apply to --costs: the byte-balanced "
                          "design is its own construction")
    budgets = None if args.budgets is None else parse_budgets(args.budgets)
    costs = load_costs(args.costs)
    workers = args.workers if args.workers is not None else None if budgets is None else len(budgets)
    if workers is None:
        raise DesignError("--costs needs -K WORKERS or --budgets (one size per worker)")
    if budgets is not None and len(budgets) != workers:
        raise DesignError(f"--budgets gives {len(budgets)} sizes but -K is {workers}: give one per worker")
    if args.blocks is not None and args.blocks != costs.blocks:
        raise DesignError(f"-B {args.blocks} but {args.costs} gives the bytes of {costs.blocks} blocks")
    _check_size(workers, costs.blocks)
    min_coverage = _min_coverage(args.min_coverage, args.tolerate, workers)
    mask = design_for_costs(costs, workers, min_coverage=min_coverage, budgets=budgets, max_groups=args.max_groups,
                            seed=args.seed)
    return (mask if args.tolerate is None else check_tolerates(mask, args.tolerate)), costs, budgets


def _min_coverage(min_coverage: int | None, tolerate: int | None, workers: int) -> int:
    """``--min-coverage`` (default 2, or F + 1 with ``--tolerate F``), refused below F + 1."""
    if tolerate is None:
        return 2 if min_coverage is None else min_coverage
    tolerate = checked_tolerate(tolerate, workers)
    if min_coverage is not None and min_coverage < tolerate + 1:
        raise DesignError(f"--tolerate {tolerate} needs every block on at least {tolerate + 1} workers, but "
                          f"--min-coverage is {min_coverage}: drop it or give at least {tolerate + 1}")
    return tolerate + 1 if min_coverage is None else min_coverage


def _bytes_report(mask: Mask, args: argparse.Namespace, costs: BlockCosts,
                  budgets: list[int] | None) -> tuple[list[str], dict[str, object]]:
    """Text lines and JSON keys: each worker's bytes (of the mask in force in any round) and budget."""
    from masklab.costs import bytes_lower_bound, worker_bytes

    held = worker_bytes(mask, costs)
    over = [k for k, b in enumerate(held) if budgets is not None and b > budgets[k]]
    if over:  # only a schedule, which hands every row to every worker, can push one over
        k = over[0]
        raise DesignError(f"--schedule {args.schedule}: worker {k} would hold {held[k]} bytes in some round but its "
                          f"budget is {budgets[k]}; a schedule hands every row to every worker")
    bound = bytes_lower_bound(costs, mask.workers, min_coverage=int(mask.coverage.min()))
    lines = [f"bytes per worker (costs: {args.costs}; fixed {_size(costs.fixed_bytes)} each): largest "
             f"{_size(max(held))}; no mask with coverage {int(mask.coverage.min())} puts less than {_size(bound)} "
             "on its largest worker"]
    width = len(str(mask.workers - 1))
    for k, b in enumerate(held):
        budget = "" if budgets is None else f"  budget {_size(budgets[k]):>10}  ({100 * b / budgets[k]:.0f}% used)"
        lines.append(f"  worker {k:>{width}}  {_size(b):>10}  {len(mask.held_blocks(k))} blocks{budget}")
    extra = {"worker_bytes": held, "largest_worker_bytes": max(held), "bytes_lower_bound": bound,
             "fixed_bytes": costs.fixed_bytes, "budgets": budgets}
    return lines, extra


def _size(n: int) -> str:
    """Bytes in decimal units with three significant digits, as budgets are usually written."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def run_inspect(args: argparse.Namespace) -> int:
    from masklab.io import load_mask

    _emit(load_mask(args.file), args)
    return 0


def _emit(mask: Mask, args: argparse.Namespace, *, lines: list[str] = (), extra: dict | None = None) -> None:
    report = analyze(mask)
    if args.plot:
        from masklab.plot import plot_mask

        plot_mask(mask, args.plot, seed=getattr(args, "seed", 0))
    groups = len(process_group_holder_sets(mask))
    fsdp_groups = len(process_group_holder_sets(mask, singletons=True))
    if args.json:
        print(json.dumps(report.to_dict() | {"process_groups": groups, "process_groups_fsdp": fsdp_groups}
                         | (extra or {}), indent=2))
    else:
        print(report.to_text())
        print(f"process groups: {groups} (B-SDP+FSDP: {fsdp_groups}), one per distinct holder set of 2 to K-1 "
              "workers (with FSDP, single holders too); on NCCL each is a communicator on its members' devices")
        for line in lines:
            print(line)
