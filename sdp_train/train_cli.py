"""``sdp train``: parse flags over an optional JSON config, validate, then run or launch ranks.

Outside torchrun, ``--workers N`` starts N local ranks through torch's elastic launcher; under
torchrun the launcher's environment decides. The config and mask are validated in the launching
process first, so a bad input fails before any process or process group starts.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from sdp_train.config import MODES, TrainConfig, load_config_file

_FLAGS = {  # flag -> (TrainConfig field, type)
    "--model": ("model", str), "--mode": ("mode", str), "--active": ("active", float), "--mask": ("mask", str),
    "--construction": ("construction", str), "--workers": ("workers", int), "--steps": ("steps", int),
    "--batch-size": ("batch_size", int), "--seq-len": ("seq_len", int), "--lr": ("lr", float),
    "--warmup-steps": ("warmup_steps", int), "--weight-decay": ("weight_decay", float),
    "--grad-clip": ("grad_clip", float), "--seed": ("seed", int), "--data": ("data", str),
    "--eval-batches": ("eval_batches", int), "--eval-every": ("eval_every", int), "--out": ("out", str),
    "--max-data-bytes": ("max_data_bytes", int), "--memory-steps": ("memory_steps", int),
    "--checkpoint-every": ("checkpoint_every", int), "--resume": ("resume", str),
}
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
        kwargs = {"choices": MODES} if name == "mode" else {}
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
    from sdp_train.dist import launch_local, under_torchrun
    from sdp_train.loop import train
    from sdp_train.train import prepare

    cfg = config_from_args(args)
    if under_torchrun() or cfg.workers == 1:
        train(cfg)
        return 0
    prepare(cfg)  # refuse bad configs and masks before starting any process
    return launch_local(["train", *_argv_of(args)], cfg.workers)


def _argv_of(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config] if args.config else []
    for flag, (name, _) in _FLAGS.items():
        if getattr(args, name) is not None:
            argv += [flag, str(getattr(args, name))]
    argv += [flag for flag, (name, _) in _SWITCHES.items() if getattr(args, name)]
    return argv
