"""``sdp estimate``: per-block problem constants measured on a training set-up, for ``sdp verify``.

Takes the model, data, batch and mask flags of ``sdp train`` (or its ``--config`` file), estimates
the constants along a short plain-SGD Bb-SDP trajectory from the initial point (or from a saved
model, ``--at``) in one process (`sdp_train.planning.constants`): upper confidence bounds at a stated
level, L the maximum over checkpoints, the shared parameters as one more column held by all K
workers. It writes them, labelled as an estimate with its assumptions, as a constants file that
``sdp verify --constants`` reads (format: docs/theory.md §7). Every input is
checked, and ``--out`` too, before the model is built. This module only parses, calls
`sdp_train.planning.constants` and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import fields
from pathlib import Path

from sdp_train.errors import ConfigError
from sdp_train.trainer.config import BASELINES, TrainConfig, load_config_file

DEFAULT_STEPS = 8
DEFAULT_POWER_ITERS = 10
DEFAULT_TRAJECTORY = 20
DEFAULT_CHECKPOINTS = 3
DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 1000
_FLAGS = {  # flag -> (TrainConfig field, type): what fixes the model, the data and the mask columns
    "--model": ("model", str), "--mode": ("mode", str), "--active": ("active", float), "--mask": ("mask", str),
    "--construction": ("construction", str), "--workers": ("workers", int), "--batch-size": ("batch_size", int),
    "--seq-len": ("seq_len", int), "--seed": ("seed", int), "--data": ("data", str),
    "--max-data-bytes": ("max_data_bytes", int),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate", help="measure per-block constants (sigma_j^2, zeta_j^2, G_j^2, L, D) for sdp verify",
        description="Estimate, at the checkpoints of a short plain-SGD Bb-SDP trajectory from the initial point of an "
        "`sdp train` set-up (or from a model it saved, --at), each mask column's gradient noise sigma_j^2, "
        "heterogeneity zeta_j^2 and second moment G_j^2 (and the shared parameters' as one more column, held by "
        "all K workers) from per-worker gradients of the full model on --steps batches per worker, as bootstrap "
        "upper confidence bounds at --level; the smoothness L by Hessian-vector power iteration, the maximum over "
        "checkpoints; and f(x0) - f* <= f(x0). Writes them, labelled as an estimate with its assumptions, as a "
        "constants file for `sdp verify --constants` (docs/theory.md §7). Runs in one process.")
    p.add_argument("--config", metavar="FILE", help="JSON file of sdp train's config fields; flags override it")
    docs = {f.name: f.default for f in fields(TrainConfig)}
    for flag, (name, typ) in _FLAGS.items():
        p.add_argument(flag, dest=name, type=typ, default=None, metavar=name.upper(),
                       help=f"as in sdp train (default {docs[name]!r})")
    p.add_argument("--heterogeneous", dest="heterogeneous", action="store_true", default=None,
                   help="as in sdp train: give each worker a different part of the data")
    p.add_argument("--steps", dest="batches", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"batches per worker at each checkpoint (>= 2; default {DEFAULT_STEPS})")
    p.add_argument("--trajectory", dest="trajectory_steps", type=int, default=DEFAULT_TRAJECTORY, metavar="N",
                   help="steps of plain-SGD Bb-SDP (the theorems' algorithm) along which to estimate; 0: at the "
                   f"initial point only (default {DEFAULT_TRAJECTORY})")
    p.add_argument("--checkpoints", type=int, default=DEFAULT_CHECKPOINTS, metavar="C",
                   help=f"points of the trajectory, its start and end included, where everything is measured "
                   f"(default {DEFAULT_CHECKPOINTS}; 1 with --trajectory 0)")
    p.add_argument("--trajectory-lr", type=float, default=None, metavar="ETA",
                   help="the trajectory's step size (default: 1/L of the largest L measured so far)")
    p.add_argument("--level", dest="confidence_level", type=float, default=DEFAULT_LEVEL, metavar="P",
                   help=f"one-sided confidence level of the bootstrap upper bounds (default {DEFAULT_LEVEL})")
    p.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, metavar="R",
                   help=f"bootstrap resamples (default {DEFAULT_RESAMPLES})")
    p.add_argument("--power-iters", type=int, default=DEFAULT_POWER_ITERS, metavar="I",
                   help=f"Hessian-vector power iterations for L (>= 1; default {DEFAULT_POWER_ITERS})")
    p.add_argument("--at", metavar="MODEL", default=None,
                   help="measure at this model instead of the initial point: a model.safetensors that sdp train "
                   "saved (or its run directory) for the same --model")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to compute (default cpu)")
    p.add_argument("--out", required=True, metavar="FILE.json", help="constants file to write")
    p.add_argument("--mask-out", metavar="FILE.json", default=None,
                   help="also save the mask whose columns the constants describe (for a mask designed from --active)")
    p.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the flags (over ``--config``) describe; refuses the DDP/FSDP baselines."""
    values = load_config_file(args.config) if args.config else {}
    names = [name for name, _ in _FLAGS.values()] + ["heterogeneous"]
    values.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if "mask" in values and "active" not in values:
        values["active"] = None
    cfg = TrainConfig.from_dict(values, source=args.config or "command line")
    if cfg.mode in BASELINES:
        raise ConfigError(f"mode {cfg.mode!r} has no mask: the constants are per mask column; give an SDP mode "
                          "(--mode bsdp or bbsdp for blocks, nsdp for neurons)")
    return cfg


def check_writable(path: str, flag: str) -> Path:
    """``path`` as a Path if a file can be written there, else ConfigError naming ``flag``."""
    out = Path(path)
    try:
        if out.is_dir():
            raise ConfigError(f"{flag} {path}: is a directory; give a file name such as {out / 'constants.json'}")
        if not out.parent.is_dir():
            raise ConfigError(f"{flag} {path}: directory {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK):
            raise ConfigError(f"{flag} {path}: directory {out.parent} is not writable")
    except OSError as exc:  # name too long, ...
        raise ConfigError(f"{flag} {path}: cannot be written: {exc.strerror or exc}") from None
    return out


def run(args: argparse.Namespace) -> int:
    from masklab.io import atomic_write_text, save_mask
    from sdp_train.planning.constants import constants_file, estimate_constants, load_point, summary_lines
    from sdp_train.trainer.prepare import check_token_ids, prepare

    if args.batches < 2:
        raise ConfigError(f"--steps {args.batches}: needs at least 2 batches per worker to tell noise from "
                          "heterogeneity")
    if args.power_iters < 1:
        raise ConfigError(f"--power-iters {args.power_iters} must be >= 1")
    checkpoints = 1 if args.trajectory_steps == 0 and args.checkpoints == DEFAULT_CHECKPOINTS else args.checkpoints
    if args.trajectory_steps < 0 or checkpoints < 1 or (args.trajectory_steps > 0 and checkpoints < 2):
        raise ConfigError(f"--trajectory {args.trajectory_steps} --checkpoints {checkpoints}: need --trajectory >= 0 "
                          "and, with a trajectory, --checkpoints >= 2 (its start and end)")
    if args.trajectory_lr is not None and not (math.isfinite(args.trajectory_lr) and args.trajectory_lr > 0):
        raise ConfigError(f"--trajectory-lr {args.trajectory_lr} must be a finite number > 0")
    if not 0.5 <= args.confidence_level < 1:
        raise ConfigError(f"--level {args.confidence_level} must lie in [0.5, 1)")
    if args.resamples < 100:
        raise ConfigError(f"--resamples {args.resamples} must be >= 100 for a percentile to mean something")
    out = check_writable(args.out, "--out")
    mask_out = None if args.mask_out is None else check_writable(args.mask_out, "--mask-out")
    prep = prepare(config_from_args(args))
    check_token_ids(prep)
    at = None if args.at is None else load_point(args.at, prep)
    estimate = estimate_constants(prep, batches=args.batches, power_iters=args.power_iters, device=args.device, at=at,
                                  trajectory_steps=args.trajectory_steps, checkpoints=checkpoints,
                                  trajectory_lr=args.trajectory_lr, confidence_level=args.confidence_level,
                                  resamples=args.resamples)
    atomic_write_text(out, json.dumps(constants_file(estimate), indent=2) + "\n")
    if mask_out is not None:
        save_mask(prep.mask, mask_out)
    mask_path = mask_out or prep.config.mask
    if args.json:
        print(json.dumps({**estimate.to_dict(), "out": str(out), "mask": None if mask_path is None else str(mask_path)},
                         indent=2))
        return 0
    print("\n".join(summary_lines(estimate)))
    print(f"sdp estimate: wrote {out}")
    if mask_path is None:
        print("sdp estimate: the mask was designed from --active; rerun with --mask-out FILE to save it for sdp verify")
    else:
        print(f"next: sdp verify {mask_path} --constants {out} --eta E --steps T")
    return 0
