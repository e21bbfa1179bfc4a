"""``sdp verify``: a proved bound for a mask file and a training set-up.

The bound is evaluated either at per-block constants read from a constants file (``--constants``,
format in `theory.constants`; a file's ``shared`` column is appended to the mask, and a file that
``sdp estimate`` wrote is labelled estimated: every number is then printed as an estimate of the
theorem's bound, not as a guarantee) or, from totals (``--sigma``, ``--zeta``, ``--grad-bound``), at the
worst way of splitting them across blocks, so the printed number bounds every problem with those
totals (docs/theory.md, Proposition 1). It prints which, the terms at the given step size, the
bound at the best step size, the DDP bound, and the FLOP-matched step count. With ``--simulate``
it also runs the simulator on a generated problem with the same constants and exits 1 if the
measured value is significantly above the bound. This module only parses, calls `theory` and
prints.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from masklab.io import load_mask
from masklab.mask import Mask
from theory.bounds import (
    ProblemConstants,
    ddp_bound,
    flop_matched_steps,
    optimal_step_size,
    redraws_every_update,
    sdp_bound,
)
from theory.consensus import (
    bias_cancels_over_period,
    exported_overlap_bound,
    optimal_overlap_step_size,
    overlap_bound,
    overlap_flop_matched_steps,
    period_overlap_bound,
)
from theory.constants import load_constants_file, worst_case_blocks, worst_case_constants, worst_case_split
from theory.errors import TheoryError
from theory.problems import make_logistic, make_quadratic
from theory.simulate import simulate

EXIT_VIOLATED = 1
Z_MARGIN = 3.0  # a violation is declared when measured - 3 standard errors exceeds the bound
_DEFAULT_BLOCK_SIZE = 16  # coordinates per block in the simulated problem when the mask records no sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check convergence conditions and bounds of a mask",
        description="Evaluate the backward-masked SDP bound of docs/theory.md for MASK.json. "
        "Either give per-block constants in a JSON file (--constants) or totals over all "
        "parameters (--sigma, --zeta, --grad-bound): the bound is then the worst case over every "
        "way of splitting the totals across blocks.",
    )
    p.add_argument("mask", metavar="MASK.json", help="mask file written by `sdp design`")
    p.add_argument("--constants", metavar="FILE.json", default=None,
                   help="per-block constants sigma_sq, zeta_sq[, grad_sq] (format: docs/theory.md §7)")
    p.add_argument("--smoothness", type=float, default=None, metavar="L",
                   help="smoothness L of f (required unless the constants file has it)")
    p.add_argument("--sigma", type=float, default=None, metavar="S", help="gradient noise sigma (total)")
    p.add_argument("--zeta", type=float, default=None, metavar="Z", help="heterogeneity zeta (total)")
    p.add_argument("--eta", type=float, required=True, metavar="E", help="step size")
    p.add_argument("--steps", type=int, required=True, metavar="T", help="number of (local) steps")
    p.add_argument("--suboptimality", type=float, default=None, metavar="D",
                   help="f(x0) - f* (required unless the constants file has it)")
    p.add_argument("--local-steps", type=int, default=1, metavar="H", help="local steps per averaging (1)")
    p.add_argument("--grad-bound", type=float, default=None, metavar="G",
                   help="bound G on a worker's stochastic gradient norm (total, RMS); needed when H > 1")
    p.add_argument("--overlap", action="store_true",
                   help="bound the mean of the copies under overlap averaging (Theorem 6: copies kept, holders "
                   "average every H local steps, copies start equal); needs G")
    p.add_argument("--simulate", choices=("quadratic", "logistic"), default=None,
                   help="also simulate SDP on a generated problem and compare with the bound")
    p.add_argument("--seeds", type=int, default=16, help="simulation replicas (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated problem and noise")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mask, constants, source = constants_from_args(load_mask(args.mask), args)
    h = args.local_steps
    if args.overlap:
        if args.simulate is not None:
            raise TheoryError("--simulate runs stepwise averaging; it cannot check the --overlap bound")
        terms = overlap_bound(mask, constants, eta=args.eta, steps=args.steps, local_steps=h)
        eta_best = optimal_overlap_step_size(mask, constants, steps=args.steps, local_steps=h)
        best = overlap_bound(mask, constants, eta=eta_best, steps=args.steps, local_steps=h)
        match = overlap_flop_matched_steps(mask, constants, eta=eta_best, ddp_steps=args.steps, local_steps=h)
    else:
        terms = sdp_bound(mask, constants, eta=args.eta, steps=args.steps, local_steps=h)
        eta_best = optimal_step_size(mask, constants, steps=args.steps, local_steps=h)
        best = sdp_bound(mask, constants, eta=eta_best, steps=args.steps, local_steps=h)
        match = flop_matched_steps(mask, constants, eta=eta_best, ddp_steps=args.steps, local_steps=h)
    ddp = ddp_bound(mask, constants, eta=args.eta, steps=args.steps, local_steps=h)
    report = {
        "step_size_ok": terms.step_size_ok,
        "eta": args.eta,
        "eta_max": terms.eta_max,
        "eta_best": eta_best,
        "terms": {"optimization": terms.optimization, "bias": terms.bias,
                  "variance": terms.variance, "consensus": terms.consensus},
        "bound": terms.total,
        "ddp_bound": ddp.total,
        "ratio_to_ddp": terms.total / ddp.total if ddp.total > 0 else math.inf,
        "constants": source,
        "estimated": source.get("estimated", False),
        "guarantee": terms.step_size_ok and not source.get("estimated", False),
        "theorem": _overlap_theorem(mask, h) if args.overlap else _stepwise_theorem(mask, h),
        "bound_at_eta_best": best.total,
        "flop_matched": {
            "eta": eta_best, "ddp_steps": match.ddp_steps, "ddp_bound": match.ddp_bound,
            "sdp_steps": match.sdp_steps, "reachable": math.isfinite(match.sdp_steps),
            "compute_fraction": match.compute_fraction, "compute_ratio": match.compute_ratio,
        },
    }
    if args.overlap:
        report["exported_bound"] = _exported_bound(mask, constants, source, args)
        period = _period_bound(mask, constants, source, args)
        if period is not None:
            report["period_bound"] = {"theorem": "Theorem 6.2 (mean of the copies at period starts)", "bound": period}
    if args.simulate is not None:
        report.update(_simulate(mask, constants, args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_text(mask, report))
    return EXIT_VIOLATED if report.get("violated") else 0


def _exported_bound(mask: Mask, constants: ProblemConstants, source: dict, args: argparse.Namespace) -> float:
    """Corollary 6.1 (the model the runtime exports, each block its holders' mean), at its own worst split."""
    def exported(c: ProblemConstants) -> float:
        return exported_overlap_bound(mask, c, eta=args.eta, steps=args.steps, local_steps=args.local_steps)

    if source["source"] == "file":
        return exported(constants)
    return exported(worst_case_split(mask, exported, smoothness=args.smoothness, sigma=args.sigma, zeta=args.zeta,
                                     suboptimality=args.suboptimality, grad_bound=args.grad_bound))


def _period_bound(mask: Mask, constants: ProblemConstants, source: dict, args: argparse.Namespace) -> float | None:
    """Theorem 6.2 for a mask held over rounds, at its own worst split; None where it does not apply."""
    def at_starts(c: ProblemConstants) -> float:
        return period_overlap_bound(mask, c, eta=args.eta, steps=args.steps, local_steps=args.local_steps).total

    try:
        value = at_starts(constants)
    except TheoryError:  # static, permute redrawn every round, unbalanced sequence, no complete period
        return None
    if source["source"] == "file":
        return value
    return at_starts(worst_case_split(mask, at_starts, smoothness=args.smoothness, sigma=args.sigma, zeta=args.zeta,
                                      suboptimality=args.suboptimality, grad_bound=args.grad_bound))


def _overlap_theorem(mask: Mask, local_steps: int) -> str:
    """Theorem 6 and the theorem that bounds its consensus deviation (docs/theory.md §4)."""
    deviation = "Theorems 4.8 and 4.4" if mask.schedule.kind == "permute" else "Theorems 4.7 and 4.6"
    held = " or 6.3, the smaller" if bias_cancels_over_period(mask, local_steps=local_steps) else ""
    return f"Theorem 6{held} (overlap averaging; consensus deviation by {deviation})"


def _stepwise_theorem(mask: Mask, local_steps: int) -> str:
    if local_steps > 1:
        return "Theorem 3 (local steps, stepwise averaging)"
    return "Theorem 2' (mask redrawn every update)" if redraws_every_update(mask) else "Theorem 1 (mask in force)"


def constants_from_args(mask: Mask, args: argparse.Namespace) -> tuple[Mask, ProblemConstants, dict]:
    """``sdp verify``'s mask (with a constants file's ``shared`` column appended), problem constants
    (totals or a ``--constants`` file) and a description of their source."""
    totals = {"--sigma": args.sigma, "--zeta": args.zeta, "--grad-bound": args.grad_bound}
    if args.constants is not None:
        given = [flag for flag, value in totals.items() if value is not None]
        if given:
            raise TheoryError(f"{given[0]} is a total; with --constants {args.constants} every constant "
                              "comes from the file")
        loaded = load_constants_file(args.constants, mask, smoothness=args.smoothness,
                                     suboptimality=args.suboptimality)
        return loaded.mask, loaded.constants, {
            "source": "file", "file": args.constants, "estimated": loaded.estimated,
            "shared_column": loaded.mask.blocks > mask.blocks, "estimate": loaded.estimate}
    for flag, value in (("--sigma", args.sigma), ("--zeta", args.zeta), ("--smoothness", args.smoothness),
                        ("--suboptimality", args.suboptimality)):
        if value is None:
            raise TheoryError(f"{flag} is required without --constants")
    totals = {"smoothness": args.smoothness, "sigma": args.sigma, "zeta": args.zeta,
              "suboptimality": args.suboptimality, "grad_bound": args.grad_bound}
    if args.overlap:
        if args.grad_bound is None:
            raise TheoryError("--overlap needs --grad-bound: Theorem 6 bounds the copies' drift with it")

        def overlap_total(c: ProblemConstants) -> float:
            return overlap_bound(mask, c, eta=args.eta, steps=args.steps, local_steps=args.local_steps).total

        constants = worst_case_split(mask, overlap_total, **totals)
        at = {"sigma": int(np.argmax(constants.sigma_sq)), "zeta": int(np.argmax(constants.zeta_sq)),
              "grad": int(np.argmax(constants.grad_sq))}
    else:
        constants = worst_case_constants(mask, **totals)
        at = worst_case_blocks(mask)
    return mask, constants, {"source": "worst-case split of totals",
                       "worst_case_blocks": {k: mask.block_names[j] for k, j in at.items()}}


def _simulate(mask: Mask, constants: ProblemConstants, args: argparse.Namespace) -> dict:
    sizes = mask.block_sizes or (_DEFAULT_BLOCK_SIZE,) * mask.blocks
    sized = mask if mask.block_sizes is not None else mask.replace(block_sizes=sizes)
    sigma_total = math.sqrt(float(constants.sigma_sq.sum()))
    if args.simulate == "quadratic":
        zeta_total = math.sqrt(float(constants.zeta_sq.sum()))
        problem = make_quadratic(sizes, mask.workers, smoothness=constants.smoothness, sigma=sigma_total,
                                 zeta=zeta_total, suboptimality=constants.suboptimality, seed=args.seed,
                                 sigma_split=_split(constants.sigma_sq), zeta_split=_split(constants.zeta_sq),
                                 worker_pattern=mask.matrix / mask.coverage)
    else:
        problem = make_logistic(sizes, mask.workers, smoothness=constants.smoothness, sigma=sigma_total,
                                suboptimality=constants.suboptimality, seed=args.seed,
                                sigma_split=_split(constants.sigma_sq))
    sim_constants = ProblemConstants(
        smoothness=constants.smoothness,
        sigma_sq=problem.constants.sigma_sq,
        zeta_sq=problem.constants.zeta_sq,
        suboptimality=problem.constants.suboptimality,
        worker_smoothness=problem.constants.worker_smoothness,
        grad_sq=constants.grad_sq,
    )
    bound = sdp_bound(sized, sim_constants, eta=args.eta, steps=args.steps, local_steps=args.local_steps)
    result = simulate(problem, sized, eta=args.eta, steps=args.steps, local_steps=args.local_steps,
                      seeds=args.seeds, seed=args.seed)
    held = result.assumptions_hold(sim_constants)
    applies = bound.step_size_ok and held
    return {
        "simulated_problem": args.simulate,
        "simulated_bound": bound.total,
        "measured": result.measured,
        "measured_stderr": result.stderr,
        "assumptions_held": held,
        "violated": bool(applies and result.measured - Z_MARGIN * result.stderr > bound.total),
    }


def _split(per_block) -> list[float] | None:
    total = float(per_block.sum())
    return None if total == 0 else (per_block / total).tolist()


def _estimate_words(estimate: dict) -> str:
    """How a constants file's estimate was made, from its ``estimate`` object (whatever it records)."""
    by = estimate.get("by", "an estimator")
    if "confidence_level" not in estimate:
        return f"by {by}"
    checkpoints = estimate.get("checkpoints", [0])
    return (f"by {by}, {estimate['confidence_level']:.0%} upper confidence bounds over "
            f"{estimate.get('batches_per_worker', '?')} batches per worker, maximum over checkpoints "
            f"{', '.join(map(str, checkpoints))} of a {estimate.get('trajectory_steps', 0)}-step trajectory")


def _text(mask: Mask, r: dict) -> str:
    t = r["terms"]
    src = r["constants"]
    estimated = r["estimated"]
    if src["source"] == "file":
        said = f"constants: per block, from {src['file']}"
        if src["shared_column"]:
            said += " (the shared parameters as column 'shared', held by all K workers)"
        if estimated:
            said += "; ESTIMATED, not known bounds: " + _estimate_words(src["estimate"])
    else:
        at = src["worst_case_blocks"]
        said = (f"constants: the worst case over every split of the totals across blocks "
                f"(sigma^2 on block {at['sigma']!r}, zeta^2 on block {at['zeta']!r}, G^2 on block {at['grad']!r})")
    fm = r["flop_matched"]
    if fm["reachable"]:
        matched = (f"FLOP-matched at eta = {fm['eta']:.6g}: SDP needs {fm['sdp_steps']:.6g} steps to reach stepwise "
                   f"DDP's bound after {fm['ddp_steps']} ({fm['compute_ratio']:.4g} x DDP's compute at "
                   f"{fm['compute_fraction']:.4g} per step, backward masking)")
    else:
        matched = (f"FLOP-matched at eta = {fm['eta']:.6g}: never (infinite steps): SDP's floor lies at or above "
                   f"stepwise DDP's bound {fm['ddp_bound']:.6g} after {fm['ddp_steps']} steps")
    lines = [
        f"mask: {mask!r}",
        f"theorem: {r['theorem']}",
        said,
        f"step size: eta = {r['eta']:.6g} {'satisfies' if r['step_size_ok'] else 'VIOLATES'} "
        f"0 < eta <= {r['eta_max']:.6g}{' at the estimated L' if estimated else ''}; best eta for this T: "
        f"{r['eta_best']:.6g}",
        ("estimated " if estimated else "") +
        ("bound on (1/R) sum_r E||grad f(xbar_r)||^2, xbar_r the mean of all K copies:"
         if "exported_bound" in r else "bound on (1/R) sum_r E||grad f(x_r)||^2:"),
        f"  optimization  {t['optimization']:.6g}",
        f"  bias          {t['bias']:.6g}",
        f"  variance      {t['variance']:.6g}",
        f"  consensus     {t['consensus']:.6g}",
        f"  total         {r['bound']:.6g}",
        *([f"exported model (each block its holders' mean, Corollary 6.1): {r['exported_bound']:.6g}"]
          if "exported_bound" in r else []),
        *([f"{r['period_bound']['theorem']}: {r['period_bound']['bound']:.6g}"]
          if "period_bound" in r else []),
        f"DDP bound       {r['ddp_bound']:.6g}   (SDP / DDP = {r['ratio_to_ddp']:.4g})",
        f"bound at the best step size eta = {r['eta_best']:.6g}: {r['bound_at_eta_best']:.6g}",
        matched,
    ]
    if not r["step_size_ok"]:
        lines.append("the step-size condition fails: the total above is not a proved bound")
    if estimated:
        lines.append(f"estimated: {r['theorem']} evaluated at estimated constants; every number above is an estimate "
                     "of its bound for this run, not a guarantee. Assumptions:")
        lines += [f"  - {a}" for a in (src["estimate"] or {}).get("assumptions", [])]
    if "measured" in r:
        lines.append(
            f"simulated ({r['simulated_problem']}): measured {r['measured']:.6g} "
            f"+- {r['measured_stderr']:.2g} vs bound {r['simulated_bound']:.6g} for the simulated problem: "
            + ("VIOLATED" if r["violated"] else "holds" if r["assumptions_held"] else
               "assumptions did not hold along the run (no verdict)")
        )
    return "\n".join(lines)
