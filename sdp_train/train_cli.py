"""``sdp train``: parse flags over an optional JSON config, validate, then run or launch ranks.

Outside torchrun, ``--workers N`` starts N local ranks through torch's elastic launcher, which
restarts the group up to ``--max-restarts`` times after a worker fails; under torchrun the
launcher's environment (and its own ``--max-restarts``) decides. The config and mask are
validated in the launching process first, so a bad input fails before any process or process
group starts. A run stopped by a non-finite loss (``--nonfinite stop``) exits 1 with one error
line from rank 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from sdp_train.config import MODES, NONFINITE_POLICIES, TrainConfig, load_config_file

_FLAGS = {  # flag -> (TrainConfig field, type)
    "--model": ("model", str), "--mode": ("mode", str), "--active": ("active", float), "--mask": ("mask", str),
    "--construction": ("construction", str), "--workers": ("workers", int), "--steps": ("steps", int),
    "--batch-size": ("batch_size", int), "--seq-len": ("seq_len", int), "--lr": ("lr", float),
    "--warmup-steps": ("warmup_steps", int), "--weight-decay": ("weight_decay", float),
    "--grad-clip": ("grad_clip", float), "--seed": ("seed", int), "--data": ("data", str),
    "--eval-batches": ("eval_batches", int), "--eval-every": ("eval_every", int), "--out": ("out", str),
    "--max-data-bytes": ("max_data_bytes", int), "--memory-steps": ("memory_steps", int),
    "--checkpoint-every": ("checkpoint_every", int), "--resume": ("resume", str),
    "--keep-checkpoints": ("keep_checkpoints", int), "--max-restarts": ("max_restarts", int),
    "--nonfinite": ("nonfinite", str),
}
_CHOICES = {"mode": MODES, "nonfinite": NONFINITE_POLICIES}
_SWITCHES = {  # flag -> (TrainConfig field, help)
    "--heterogeneous": ("heterogeneous", "give each worker a different part of the data (by file / class)"),
    "--ac": ("activation_checkpointing", "recompute each residual block's activations in backward"),
    "--fsdp": ("fsdp", "with --mode bsdp: shard each held block among its holders (FSDP2)"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train with SDP (or the DDP baseline) on torch.distributed",
                              description="Train a model with DDP, FSDP, B-SDP, N-SDP or Bb-SDP.")
    p.add_argument("--config", metavar="FILE", help="JSON file of TrainConfig fields; flags override it")
    docs = {f.name: f for f in fields(TrainConfig)}
    for flag, (name, typ) in _FLAGS.items():
        kwargs = {"choices": _CHOICES[name]} if name in _CHOICES else {}
        p.add_argument(flag, dest=name, type=typ, default=None, metavar=name.upper(),
                       help=f"(default {docs[name].default!r})", **kwargs)
    for flag, (name, text) in _SWITCHES.items():
        p.add_argument(flag, dest=name, action="store_true", default=None, help=text)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = load_config_file(args.config) if args.config else {}
    names = [name for name, _ in _FLAGS.values()] + [name for name, _ in _SWITCHES.values()]
    values.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if "mask" in values and "active" not in values:
        values["active"] = None
    return TrainConfig.from_dict(values, source=args.config or "command line")


def run(args: argparse.Namespace) -> int:
    from sdp_train.dist import get_dist_info, launch_local, under_torchrun
    from sdp_train.errors import NonFiniteError
    from sdp_train.loop import train
    from sdp_train.train import prepare

    cfg = config_from_args(args)
    if under_torchrun() or cfg.workers == 1:
        try:
            train(cfg)
        except NonFiniteError as exc:  # raised on every rank in the same step; reported once
            if get_dist_info().is_main:
                print(f"sdp train: error: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    prepare(cfg)  # refuse bad configs and masks before starting any process
    return launch_local(["train", *_argv_of(args)], cfg.workers, max_restarts=cfg.max_restarts)


def _argv_of(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config] if args.config else []
    for flag, (name, _) in _FLAGS.items():
        if getattr(args, name) is not None:
            argv += [flag, str(getattr(args, name))]
    argv += [flag for flag, (name, _) in _SWITCHES.items() if getattr(args, name)]
    return argv
