"""``sdp verify``: check the convergence conditions of a mask file for a training set-up.

Prints whether the step size is admissible, every term of the bound (docs/theory.md), the DDP bound
for the same set-up and the ratio, and the admissible step-size range; with ``--simulate`` it also
runs the simulator on a generated problem with the same constants and exits 1 if the measured value
is significantly above the bound. This module only parses, calls `theory` and prints.
"""

from __future__ import annotations

import argparse
import json
import math

from masklab.io import load_mask
from masklab.mask import Mask
from theory.bounds import (
    ProblemConstants,
    constants_from_totals,
    ddp_bound,
    optimal_step_size,
    sdp_bound,
)
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
        "--sigma, --zeta and --grad-bound are totals over all parameters, spread over blocks in "
        "proportion to the mask's block sizes (evenly when it records none).",
    )
    p.add_argument("mask", metavar="MASK.json", help="mask file written by `sdp design`")
    p.add_argument("--smoothness", type=float, required=True, metavar="L", help="smoothness L of f")
    p.add_argument("--sigma", type=float, required=True, metavar="S", help="gradient noise sigma (total)")
    p.add_argument("--zeta", type=float, required=True, metavar="Z", help="heterogeneity zeta (total)")
    p.add_argument("--eta", type=float, required=True, metavar="E", help="step size")
    p.add_argument("--steps", type=int, required=True, metavar="T", help="number of (local) steps")
    p.add_argument("--suboptimality", type=float, required=True, metavar="D", help="f(x0) - f*")
    p.add_argument("--local-steps", type=int, default=1, metavar="H", help="local steps per averaging (1)")
    p.add_argument("--grad-bound", type=float, default=None, metavar="G",
                   help="bound G on a worker's stochastic gradient norm (total, RMS); needed when H > 1")
    p.add_argument("--simulate", choices=("quadratic", "logistic"), default=None,
                   help="also simulate SDP on a generated problem and compare with the bound")
    p.add_argument("--seeds", type=int, default=16, help="simulation replicas (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated problem and noise")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mask = load_mask(args.mask)
    constants = constants_from_totals(mask, smoothness=args.smoothness, sigma=args.sigma, zeta=args.zeta,
                                      suboptimality=args.suboptimality, grad_bound=args.grad_bound)
    h = args.local_steps
    terms = sdp_bound(mask, constants, eta=args.eta, steps=args.steps, local_steps=h)
    ddp = ddp_bound(mask, constants, eta=args.eta, steps=args.steps, local_steps=h)
    report = {
        "step_size_ok": terms.step_size_ok,
        "eta": args.eta,
        "eta_max": terms.eta_max,
        "eta_best": optimal_step_size(mask, constants, steps=args.steps, local_steps=h),
        "terms": {"optimization": terms.optimization, "bias": terms.bias,
                  "variance": terms.variance, "consensus": terms.consensus},
        "bound": terms.total,
        "ddp_bound": ddp.total,
        "ratio_to_ddp": terms.total / ddp.total if ddp.total > 0 else math.inf,
    }
    if args.simulate is not None:
        report.update(_simulate(mask, constants, args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_text(mask, report))
    return EXIT_VIOLATED if report.get("violated") else 0


def _simulate(mask: Mask, constants: ProblemConstants, args: argparse.Namespace) -> dict:
    sizes = mask.block_sizes or (_DEFAULT_BLOCK_SIZE,) * mask.blocks
    sized = mask if mask.block_sizes is not None else mask.replace(block_sizes=sizes)
    if args.simulate == "quadratic":
        problem = make_quadratic(sizes, mask.workers, smoothness=args.smoothness, sigma=args.sigma,
                                 zeta=args.zeta, suboptimality=args.suboptimality, seed=args.seed)
    else:
        problem = make_logistic(sizes, mask.workers, smoothness=args.smoothness, sigma=args.sigma,
                                suboptimality=args.suboptimality, seed=args.seed)
    sim_constants = ProblemConstants(
        smoothness=args.smoothness,
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


def _text(mask: Mask, r: dict) -> str:
    t = r["terms"]
    lines = [
        f"mask: {mask!r}",
        f"step size: eta = {r['eta']:.6g} {'satisfies' if r['step_size_ok'] else 'VIOLATES'} "
        f"0 < eta <= {r['eta_max']:.6g}; best eta for this T: {r['eta_best']:.6g}",
        "bound on (1/R) sum_r E||grad f(x_r)||^2:",
        f"  optimization  {t['optimization']:.6g}",
        f"  bias          {t['bias']:.6g}",
        f"  variance      {t['variance']:.6g}",
        f"  consensus     {t['consensus']:.6g}",
        f"  total         {r['bound']:.6g}",
        f"DDP bound       {r['ddp_bound']:.6g}   (SDP / DDP = {r['ratio_to_ddp']:.4g})",
    ]
    if not r["step_size_ok"]:
        lines.append("the step-size condition fails: the total above is not a proved bound")
    if "measured" in r:
        lines.append(
            f"simulated ({r['simulated_problem']}): measured {r['measured']:.6g} "
            f"+- {r['measured_stderr']:.2g} vs bound {r['simulated_bound']:.6g} for the simulated problem: "
            + ("VIOLATED" if r["violated"] else "holds" if r["assumptions_held"] else
               "assumptions did not hold along the run (no verdict)")
        )
    return "\n".join(lines)
