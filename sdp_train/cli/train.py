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
import json
import os
import sys
from dataclasses import fields

from sdp_train.errors import ConfigError
from sdp_train.trainer.config import (
    BASELINES,
    MODES,
    NONFINITE_POLICIES,
    SCHEDULE_KINDS,
    WORKER_LOSS_POLICIES,
    TrainConfig,
    load_config_file,
)
from sdp_train.trainer.config import COMPUTE_DTYPES
from sdp_train.trainer.rundir import LOCKED_ENV, OutLock, check_out_dir, clear_previous_run, die_with_parent

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
    "--nonfinite": ("nonfinite", str), "--max-consecutive-skips": ("max_consecutive_skips", int),
    "--on-worker-loss": ("on_worker_loss", str), "--max-rejoins": ("max_rejoins", int),
    "--log-every": ("log_every", int), "--blocks": ("blocks", str), "--mlp": ("mlp", str), "--schedule": ("schedule", str),
    "--every": ("every", int), "--local-steps": ("local_steps", int), "--loss-chunks": ("loss_chunks", int),
    "--dtype": ("dtype", str), "--bn-recalibration": ("bn_recalibration", int),
    "--restore-budgets": ("restore_budgets", str),
}
_CHOICES = {"mode": MODES, "dtype": COMPUTE_DTYPES, "nonfinite": NONFINITE_POLICIES, "schedule": SCHEDULE_KINDS,
            "on_worker_loss": WORKER_LOSS_POLICIES}
_SWITCHES = {  # flag -> (TrainConfig field, help)
    "--heterogeneous": ("heterogeneous", "give each worker a different part of the data (by file / class)"),
    "--ac": ("activation_checkpointing", "recompute each residual block's activations in backward"),
    "--fsdp": ("fsdp", "with --mode bsdp: shard each held block among its holders (FSDP2)"),
    "--restore-coverage": ("restore_coverage", "with --on-worker-loss continue (bsdp, nsdp, bbsdp): after a loss "
                                               "move to a mask for the survivors with the designed coverage, "
                                               "moving the blocks they gain from surviving holders (under "
                                               "a schedule: every later round's); "
                                               "a replacement that rejoins (--max-rejoins) brings back "
                                               "the designed mask"),
    "--tensorboard": ("tensorboard", "also write the metrics for TensorBoard into --out/tensorboard "
                                     "(needs the tensorboard package)"),
}
_OFF_SWITCHES = {  # flag -> (TrainConfig field that it sets to False, help)
    "--no-save": ("save_model", "do not write the final full model (--out/model.safetensors)"),
}
_OPTIONAL_VALUES = {  # flag -> (TrainConfig field, its value when the flag is given alone)
    "--compile": ("compile", "inductor"),
}
_OVERWRITE_HELP = ("replace the results of an earlier run in --out (summary, metrics, checkpoints, model, mask, "
                   "certificate, tensorboard)")


_MODES_HELP = """modes (--mode):
  ddp      torch DDP: every worker trains the full model (baseline)
  fsdp     FSDP2 fully_shard of each block and the root (baseline)
  bsdp     B-SDP: each worker trains the blocks of its mask row, forward masking
  nsdp     N-SDP: each worker trains some neuron groups of every MLP, forward masking
  bbsdp    Bb-SDP: every worker runs the full model, trains its blocks (backward masking)
  overlap  overlap averaging: own copies, --local-steps H, then holder averages"""

_EXAMPLES = """your own model: --model FILE.py:FACTORY imports FILE.py and trains FACTORY(**model_overrides),
an nn.Module (token ids -> logits for text data, images -> class logits), through
SubnetworkDataParallel; --blocks and --mlp name its blocks and MLP when discovery cannot.

examples:
  sdp train --model llama-debug --mode bsdp --active 0.5 --workers 2
  sdp train --model examples/sdp_train_models.py:byte_lm --mode nsdp --workers 2
  sdp train --model my_model.py:build --mode nsdp --mlp "mlp.w1,mlp.w3:mlp.w2" --workers 4

Every flag but --overwrite and the node flags is a TrainConfig field; --config FILE (JSON) sets any
of them, flags override it.
docs/api.md ("sdp train with your own model") and README.md ("The sdp command") say more."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from sdp_train.models import model_names

    p = subparsers.add_parser(
        "train", help="train with SDP (or the DDP baseline) on torch.distributed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model with DDP, FSDP, B-SDP, N-SDP, Bb-SDP or overlap averaging.\n\n"
                    f"built-in models (--model): {', '.join(model_names())}\n\n{_MODES_HELP}",
        epilog=_EXAMPLES)
    p.add_argument("--config", metavar="FILE", help="JSON file of TrainConfig fields; flags override it")
    docs = {f.name: f for f in fields(TrainConfig)}
    texts = field_help(TrainConfig)
    metavars = {"model": "NAME|FILE.py:FACTORY", "mlp": "IN[,IN...]:OUT", "restore_budgets": "SIZES"}
    for flag, (name, typ) in _FLAGS.items():
        kwargs = {"choices": _CHOICES[name]} if name in _CHOICES else {}
        p.add_argument(flag, dest=name, type=typ, default=None, metavar=metavars.get(name, name.upper()),
                       help=f"{texts.get(name, '')} (default {docs[name].default!r})".lstrip(), **kwargs)
    for flag, (name, text) in _SWITCHES.items():
        p.add_argument(flag, dest=name, action="store_true", default=None, help=text)
    for flag, (name, text) in _OFF_SWITCHES.items():
        p.add_argument(flag, dest=name, action="store_const", const=False, default=None, help=text)
    for flag, (name, alone) in _OPTIONAL_VALUES.items():
        p.add_argument(flag, dest=name, nargs="?", const=alone, default=None, metavar="BACKEND",
                       help=f"{texts.get(name, '')} (alone: {alone})")
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    nodes = p.add_argument_group(
        "several nodes, keeping survivors (with --on-worker-loss continue; otherwise run under torchrun)",
        "start `sdp train` with the same flags on every node, each with its --node-rank; node 0's launcher hosts "
        "the ranks' store at --master-addr:--master-port, and a lost node other than node 0 is a lost worker set; "
        "with --store HOST:PORT the store is an `sdp store` process on a host that trains nothing, and any lost "
        "node, node 0 included, is a lost worker set")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="M",
                       help="nodes, each starting --workers / M ranks (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node, in [0, M) (default 0)")
    nodes.add_argument("--master-addr", default=None, metavar="HOST",
                       help="node 0's address, which every node reaches (default 127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=None, metavar="PORT",
                       help="the port of node 0's store (default 29500, as torchrun's)")
    nodes.add_argument("--store", default=None, metavar="HOST:PORT",
                       help="the address of an `sdp store --nnodes M` process that hosts the ranks' store instead "
                            "of node 0 (not with --master-addr or --master-port)")
    p.set_defaults(func=run)


def field_help(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body) as plain one-line text, for
    ``--help``: one place says what a setting does, the config class."""
    import ast
    import inspect
    import re

    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body
    except (OSError, TypeError):  # no source (a frozen build): flags keep their defaults only
        return {}
    texts = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            text = " ".join(after.value.value.split()).replace("``", "")
            texts[node.target.id] = re.sub(r"`([^`]*)`", r"\1", text).replace("%", "%%")
    return texts


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = load_config_file(args.config) if args.config else {}
    names = [name for name, _ in (*_FLAGS.values(), *_SWITCHES.values(), *_OFF_SWITCHES.values(),
                                  *_OPTIONAL_VALUES.values())]
    values.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if values.get("mode") in BASELINES and any(values.get(k) is not None for k in ("active", "mask")):
        given = ", ".join(f"{k}={values[k]!r}" for k in ("active", "mask") if values.get(k) is not None)
        raise ConfigError(f"mode={values['mode']!r} trains the full model on every worker: {given} would be "
                          f"ignored; drop it, or choose an SDP mode (bsdp, nsdp, bbsdp)")
    if "mask" in values and "active" not in values:
        values["active"] = None
    return TrainConfig.from_dict(values, source=args.config or "command line")


def run(args: argparse.Namespace) -> int:
    from sdp_train.errors import NonFiniteError
    from sdp_train.parallel.dist import get_dist_info, under_torchrun
    from sdp_train.trainer.checkpoint import MANIFEST
    from sdp_train.trainer.launch import launch_local, restart_attempt
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.survivor_launcher import replaces_node_0

    cfg = config_from_args(args)
    refuse_survival_on_cuda(cfg)
    node = node_of(args, cfg)
    if under_torchrun():
        die_with_parent()  # a SIGKILLed launcher takes its ranks with it
    owner = not (under_torchrun() and (os.environ.get(LOCKED_ENV) or not get_dist_info().is_main))
    lock = None
    if owner and (node.rank or replaces_node_0(node)):  # another node's launcher: node 0's holds --out
        check_data(prepare(cfg))
    elif owner:  # the launcher, a single process, or rank 0 of a group that torchrun started
        prep = prepare(cfg)  # refuse bad configs and masks before starting any process
        check_data(prep)
        check_outputs(cfg)
        if prep.resume_from is not None:  # its history must be readable before anything is replaced
            from sdp_train.trainer.train import metrics_history

            manifest = json.loads((prep.resume_from / MANIFEST).read_text(encoding="utf-8"))
            metrics_history(cfg.out, manifest["step"], report=False)
        lock = _claim_out_dir(cfg, args.overwrite, first_attempt=restart_attempt() == 0,
                              keep=(args.config,) if args.config else ())
        if restart_attempt() == 0:
            report_mask(prep)
    try:
        if under_torchrun() or cfg.workers == 1:
            from sdp_train.trainer.train import train  # a launcher never loads the training loop

            from sdp_train.trainer.agreement import WorkerLossError

            try:
                train(cfg)
            except (NonFiniteError, WorkerLossError):  # `train` reported it once, on one rank
                return 1
            return 0
        os.environ[LOCKED_ENV] = str(os.getpid())  # the ranks' launcher (this process) holds --out
        try:
            if cfg.on_worker_loss == "continue":
                from sdp_train.trainer.survivor_launcher import launch_keeping_survivors

                return launch_keeping_survivors(["train", *argv_of(args)], cfg.workers, max_rejoins=cfg.max_rejoins,
                                                node=node)
            return launch_local(["train", *argv_of(args)], cfg.workers, max_restarts=cfg.max_restarts)
        finally:
            del os.environ[LOCKED_ENV]
    finally:
        if lock is not None:
            lock.release()


def refuse_survival_on_cuda(cfg: TrainConfig) -> None:
    """Refuse ``--on-worker-loss continue`` where the ranks would train on CUDA: their collectives would be NCCL's,
    whose path through a loss is not built (docs/design.md §7, "NCCL"), so that a loss would end every
    survivor after the collective timeout instead of the run going on."""
    import torch

    if cfg.on_worker_loss == "continue" and torch.cuda.is_available():
        raise ConfigError("on_worker_loss='continue' (--on-worker-loss) is built for gloo, on CPU: on this machine's "
                          "CUDA devices the ranks would use NCCL, whose path through a lost worker (its watchdog, "
                          "shrink_group) is not built, so a loss would end every survivor after the collective "
                          "timeout; on GPUs survive a loss with checkpoints and restarts (--checkpoint-every N "
                          "--max-restarts M)")


def node_of(args: argparse.Namespace, cfg: TrainConfig):
    """This launcher's `Node` (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``,
    ``--store``), checked against `cfg`: several nodes, or an external store, keep survivors only
    (``--on-worker-loss continue``; torchrun launches the others), each node starting an equal share of
    ``--workers``."""
    from sdp_train.trainer.survivor_launcher import Node

    nodes, rank = args.nnodes, args.node_rank
    if nodes < 1:
        raise ConfigError(f"--nnodes {nodes} must be >= 1")
    if not 0 <= rank < nodes:
        raise ConfigError(f"--node-rank {rank} must lie in [0, --nnodes) = [0, {nodes})")
    addr = "127.0.0.1" if args.master_addr is None else args.master_addr
    port = 29500 if args.master_port is None else args.master_port  # torchrun's
    if not 0 < port < 65536:
        raise ConfigError(f"--master-port {port} must be a port number in [1, 65535]")
    store = None
    if args.store is not None:
        store = store_address(args.store, "--store")
        given = [flag for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port))
                 if value is not None]
        if given:
            raise ConfigError(f"--store {args.store} is the store's address: {' and '.join(given)} name node 0's "
                              "store, which an `sdp store` replaces; give one or the other")
    if nodes == 1 and store is None:
        return Node()
    if cfg.on_worker_loss != "continue":
        flag = f"--nnodes {nodes}" if store is None else f"--store {args.store}"
        raise ConfigError(f"{flag} starts the launchers that keep survivors (--on-worker-loss continue); "
                          f"other runs on several nodes go through torchrun: torchrun --nnodes {nodes} "
                          "--nproc-per-node N ... -m sdp_train.cli train ...")
    if cfg.workers % nodes:
        raise ConfigError(f"--workers {cfg.workers} must be a multiple of --nnodes {nodes}: each node starts "
                          "an equal share")
    from sdp_train.trainer.survivor_launcher import node_timeout

    try:
        node_timeout()  # read by node 0's launcher while the run goes: refused now, before any rank starts
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if store is not None:
        return Node(nodes, rank, *store, external=True)
    return Node(nodes, rank, addr, port)


def store_address(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port), refused in one line naming `flag` when it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} {text!r} must be HOST:PORT with a port in [1, 65535]")
    return host.strip("[]"), int(port)


def _claim_out_dir(cfg: TrainConfig, overwrite: bool, *, first_attempt: bool, keep: tuple[str, ...] = ()) -> OutLock:
    """Check ``--out``, lock it for this run, and (with --overwrite) clear an earlier run's results
    except the files in `keep` (this run's ``--config``).

    A restarted attempt of a torchrun group (rank 0 died, so its lock went with it) takes the lock
    again without the checks: the results there are its own run's.
    """
    check_out_dir(cfg.out, resume=cfg.resume is not None or not first_attempt, overwrite=True)
    lock = OutLock(cfg.out)
    stale = lock.acquire()
    try:
        if first_attempt:
            check_out_dir(cfg.out, resume=cfg.resume is not None, overwrite=overwrite)
            if overwrite and cfg.resume is None:
                removed = clear_previous_run(cfg.out, keep=keep)
                if removed:
                    print(f"sdp train: --overwrite: removed {', '.join(removed)} of an earlier run in {cfg.out}",
                          file=sys.stderr, flush=True)
    except BaseException:
        lock.release()
        raise
    if stale and first_attempt:
        print(f"sdp train: {cfg.out}: took over the lock of a run that no longer runs ({stale})",
              file=sys.stderr, flush=True)
    return lock


def check_data(prep) -> None:
    """Open the data as the first and the last rank will, both splits, so a shard too small or
    unreadable for some rank is refused here in one line instead of by every rank after launch.

    The last rank gets the fewest items (items are dealt out in rank order). Token shards are
    scanned for ids beyond the model's vocabulary here, once, not by every rank, and image labels
    (CIFAR-100's 100 classes) for classes beyond a built-in model's ``num_classes``.
    """
    from sdp_train.data import build_batches
    from sdp_train.trainer.prepare import check_token_ids

    check_token_ids(prep)

    workers = prep.config.workers
    classes = getattr(prep.model_config, "num_classes", None)  # a built-in image model's
    for split in ("train", "val"):
        for rank in sorted({0, workers - 1}):
            batches = build_batches(prep.data, split=split, seed=prep.config.seed, rank=rank, world_size=workers)
        labels = getattr(batches, "labels", None)  # every example of the split, not this rank's shard
        if classes is not None and labels is not None and len(labels) and int(labels.max()) >= classes:
            raise ConfigError(
                f"data {prep.config.data!r} ({split} split) holds class label {int(labels.max())} but model "
                f"{prep.config.model!r} has num_classes={classes}; give the model {int(labels.max()) + 1} or more "
                f'classes (--config with "model_overrides": {{"num_classes": {int(labels.max()) + 1}}})')


def report_mask(prep) -> None:
    """Print the mask a run trains with and its certificate, save both in --out (`sdp_train.trainer.outputs`),
    and warn where the mask is not what was asked for or certifies nothing."""
    mask, cfg = prep.mask, prep.config
    if mask is None:
        return
    from sdp_train.trainer.outputs import mask_lines, save_mask_and_certificate

    mask_path, cert_path, report = save_mask_and_certificate(cfg.out, mask)
    source = cfg.mask or f"designed for --active {cfg.active}"
    print(f"sdp train: mask {mask.workers} workers x {mask.blocks} blocks ({source}): C = {mask.active_fraction:.4g}, "
          f"coverage {report.coverage_min}..{report.coverage_max}, spectral gap {report.spectral_gap:.4g}"
          f"{'' if report.connected else ', mixing graph disconnected'}", flush=True)
    print("\n".join(mask_lines(mask, report)), flush=True)
    line = unmaskable_line(prep)
    if line is not None:
        print(line, flush=True)
    print(f"sdp train: saved the mask to {mask_path} (--mask reuses it) and its certificate to {cert_path}",
          flush=True)
    if cfg.mask is None and cfg.active is not None and abs(mask.active_fraction - cfg.active) > 1e-9:
        print(f"sdp train: warning: --active {cfg.active} became C = {mask.active_fraction:.4g}: with "
              f"{mask.workers} workers every block has a whole number of holders", file=sys.stderr, flush=True)
    if not report.connected:
        print("sdp train: warning: the mask's mixing graph is disconnected (spectral gap 0): some groups of "
              "workers share no block", file=sys.stderr, flush=True)


def unmaskable_line(prep) -> str | None:
    """The share of the largest rank's predicted peak that no mask removes, as ``sdp plan`` prints it
    (`sdp_train.planning.memory.predict`'s ``unmaskable``); None where nothing is planned (overlap
    averaging, a model of your own)."""
    from sdp_train.planning.memory import PLANNED_MODES, predict
    from sdp_train.trainer.memory import format_bytes
    from sdp_train.trainer.prepare import image_side
    from sdp_train.trainer.user_model import UserModel

    cfg = prep.config
    if cfg.mode not in PLANNED_MODES or isinstance(prep.model_config, UserModel):
        return None
    plan = predict(prep.model_config, mode=cfg.mode, workers=cfg.workers, mask=prep.mask, ac=cfg.activation_checkpointing,
                   fsdp=cfg.fsdp, batch_size=cfg.batch_size, seq_len=cfg.seq_len, image_size=image_side(prep.data),
                   seed=cfg.seed, loss_chunks=cfg.loss_chunks)
    return (f"  no mask removes {format_bytes(plan['unmaskable'])} of the largest rank's predicted peak "
            f"{format_bytes(plan['total'])} ({plan['unmaskable'] / plan['total']:.0%}): the parameters outside the "
            f"blocks (embedding, final norm, head) with their gradients, optimizer state and buffers"
            f"{', sharded over all ranks' if cfg.fsdp else ''}, the stem's and head's activations and the loss's "
            f"(sdp plan's \"no mask\", docs/plan.md)")


def check_outputs(cfg: TrainConfig) -> None:
    """Refuse, before launching, a run whose final model or TensorBoard log could not be written."""
    import importlib.util

    if cfg.save_model:
        from sdp_train.trainer.outputs import check_can_save_model

        check_can_save_model()
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'sdp-toolkit[tensorboard]' "
                          "(or pip install tensorboard), or drop --tensorboard")


def argv_of(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (what the launcher passes its ranks)."""
    argv = ["--config", args.config] if args.config else []
    for flag, (name, _) in _FLAGS.items():
        if getattr(args, name) is not None:
            argv += [flag, str(getattr(args, name))]
    argv += [flag for flag, (name, _) in _SWITCHES.items() if getattr(args, name)]
    argv += [flag for flag, (name, _) in _OFF_SWITCHES.items() if getattr(args, name) is False]
    return argv  # not --nnodes and the other launch flags: a rank's place comes with its environment
