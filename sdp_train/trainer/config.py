"""The training configuration: one keyword-only dataclass, checked on construction.

`TrainConfig` is what ``sdp train`` runs and what every checkpoint and ``summary.json`` records.
A config file is JSON with the same keys (unknown keys are refused); command-line flags override
it. Validation happens here, before any process group exists.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from masklab.costs import parse_budgets
from masklab.design import ACTIVE_TOLERANCE, exact_coverage
from masklab.errors import DesignError
from sdp_train.errors import ConfigError
from sdp_train.trainer.user_model import is_user_model, parse_mlp

MODES = ("ddp", "fsdp", "bsdp", "nsdp", "bbsdp", "overlap")
BASELINES = ("ddp", "fsdp")  # modes that train the full model on every worker, without a mask
LEVEL_OF_MODE = {"bsdp": "block", "bbsdp": "block", "nsdp": "neuron", "overlap": "block"}
LOCAL_STEP_MODES = ("overlap", "bsdp", "nsdp")  # modes that may average every local_steps steps
SCHEDULED_MODES = ("bsdp", "nsdp", "bbsdp", "overlap")  # modes that train a mask schedule
SCHEDULE_KINDS = ("static", "permute", "cyclic")  # masklab.mask.ROW_SCHEDULE_KINDS (a sequence: a mask file)
MAX_WORKERS = 4096  # larger K would not finish designing/certifying a mask (dense K x K matrices)
NONFINITE_POLICIES = ("stop", "skip")  # what a non-finite loss or gradient norm does
COMPUTE_DTYPES = ("float32", "bfloat16")  # TrainConfig.dtype: the forward's, under autocast for bfloat16
WORKER_LOSS_POLICIES = ("stop", "continue")  # what losing a worker does (`sdp_train.trainer.membership`)
# modes whose survivors can continue without rollback (static masks)
SURVIVABLE_MODES = ("bsdp", "nsdp", "bbsdp", "overlap")


@dataclass(kw_only=True)
class TrainConfig:
    """One training run."""

    model: str = "llama-debug"
    """Named model (see ``sdp_train.models``), or ``FILE.py:FACTORY``: a function in that file that
    returns your ``nn.Module`` (`sdp_train.trainer.user_model`; trained through `SubnetworkDataParallel`)."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of the named model config to change, e.g. ``{"width_multiplier": 0.125}``; for
    ``FILE.py:FACTORY``, the factory's keyword arguments."""
    blocks: str | None = None
    """``FILE.py:FACTORY`` models only: the maskable residual blocks, as a pattern whose ``*``
    matches one name component (``"model.layers.*"``) or comma-separated names; found when omitted."""
    mlp: str | None = None
    """``FILE.py:FACTORY`` models in mode ``nsdp`` only: each block's MLP, as the projections into the
    hidden layer and the one out of it, relative to the block: ``IN[,IN...]:OUT``
    (``"mlp.w1,mlp.w3:mlp.w2"``); found among the usual layouts when omitted."""
    mode: str = "bsdp"
    """``ddp`` (torch DDP baseline), ``fsdp`` (FSDP2 ``fully_shard`` baseline), ``bsdp`` (block,
    forward masking), ``nsdp`` (neurons, forward masking), ``bbsdp`` (blocks, backward masking) or
    ``overlap`` (overlap averaging: every worker keeps its own copy of the model, trains the blocks
    it holds for `local_steps` steps, then each block becomes its holders' average;
    `sdp_train.parallel.overlap`)."""
    active: float | None = 0.5
    """Active fraction C for a designed mask; ignored when `mask` is given or mode is ddp/fsdp. Every
    block gets c of the K `workers`, so C must be some c/K within ``masklab.design.ACTIVE_TOLERANCE``
    (0.005): C = 0.69 needs K = 13 or 16 workers, and with 4 it is refused, not trained as 0.75."""
    mask: str | None = None
    """Path of a mask JSON file (``sdp design --out``); overrides `active`."""
    construction: str = "auto"
    """Construction passed to ``masklab.design`` when the mask is designed from `active`."""
    schedule: str | None = None
    """How the mask changes over training: ``static``, ``permute`` (rows reassigned to workers by a
    fresh random permutation every `every` steps) or ``cyclic`` (rows rotate by one worker every
    `every` steps); replaces a mask file's schedule. None: the mask file's (static when designed;
    a file may also hold a ``sequence`` of masks). Schedules other than static train in modes
    ``bsdp``, ``nsdp``, ``bbsdp`` (what a worker stops holding moves to its new holders at a change)
    and ``overlap``, not with `fsdp`."""
    every: int = 1
    """Steps between schedule changes (R), with `schedule`; a multiple of `local_steps`."""
    local_steps: int = 1
    """Optimizer steps between holder averages (H): mode ``overlap`` (every worker keeps a full
    copy), or ``bsdp`` / ``nsdp`` without `fsdp` (forward masking: each worker trains its own
    subnetwork H steps, nothing is sent during backward, then every held tensor becomes its
    holders' average). 1: stepwise averaging (``bsdp`` / ``nsdp``)."""
    workers: int = 2
    """Number of ranks (K). Under torchrun it must equal WORLD_SIZE."""
    steps: int = 50
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences (or images) per worker per step."""
    seq_len: int = 64
    """Tokens per sequence for language models."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` at the end of the cosine decay."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the norm of the whole averaged gradient (each block counted once); 0 disables."""
    seed: int = 0
    """Seed of the model initialization, the data order and the mask design."""
    data: str = "auto"
    """``auto`` (stdlib bytes for LMs, digits for images), ``stdlib``, ``digits``,
    ``bin:DIR`` (uint16 token shards) or ``cifar:DIR`` (CIFAR-10 or CIFAR-100 python batches)."""
    heterogeneous: bool = False
    """Give each worker a different part of the data (by file / by class)."""
    max_data_bytes: int = 2_000_000
    """Cap on stdlib source bytes read (keeps start-up fast)."""
    eval_batches: int = 4
    """Validation batches per rank for the final (and periodic) validation loss."""
    eval_every: int = 0
    """Validate every N steps (0: only at the end)."""
    bn_recalibration: int | None = None
    """Before each validation, recompute the BatchNorm running statistics of the assembled full model
    over this many training batches per rank (forward passes, no update); 0: never. None (auto): the
    ``eval_batches`` for modes bsdp and nsdp, whose workers train subnetworks, so each block's
    statistics come from its holders' subnetworks and not from the full model; 0 for the others.
    Models without BatchNorm are unaffected. The saved model holds the recomputed statistics."""
    activation_checkpointing: bool = False
    """Recompute each residual block's activations in backward (torch.utils.checkpoint), any mode."""
    fsdp: bool = False
    """B-SDP only: shard each held block among its holders with FSDP2 (SDP and FSDP savings multiply)."""
    dtype: str = "float32"
    """``float32``, or ``bfloat16``: forward and loss (training and validation) under ``torch.autocast``
    in bfloat16, while parameters, gradients and AdamW state stay float32 (master weights), as the
    library's ``autocast_dtype`` does; every mode. The GPU presets of ``sdp compare`` train so."""
    compile: str | None = None
    """A ``torch.compile`` backend (``inductor``; ``--compile`` alone) to compile each residual block
    with, one graph per block, so gradients reach the sync as each block's backward ends (docs/api.md,
    "torch.compile"); None: eager. Modes ddp, bsdp, nsdp, bbsdp and overlap, static masks, without
    `fsdp` or `activation_checkpointing`."""
    loss_chunks: int = 8
    """Language models of the built-in families, every mode: compute the head and cross-entropy this many
    chunks of tokens at a time, never holding the whole batch's logits (`sdp_train.models.lm_loss`);
    0: the plain loss over the full logits. Same loss and gradients to float32 rounding."""
    memory_steps: int = 2
    """Steps (the first of this run, or after resuming) whose peak memory is measured and reported in
    summary.json; 0 disables. On CPU the tracker slows these steps ~10x."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps and at the end (0: none), under ``out/checkpoints/step_N``."""
    resume: str | None = None
    """Checkpoint directory to continue from (a ``step_N`` directory, or ``checkpoints`` for the latest)."""
    keep_checkpoints: int = 0
    """Keep only the newest N complete checkpoints, deleting older ``step_N`` after each save (0: keep all)."""
    max_restarts: int = 0
    """Restarts of the whole worker group after a worker fails (``sdp train --workers N`` passes it to
    torch's elastic agent). A restarted group resumes from the latest valid checkpoint under
    ``out/checkpoints`` (from step 0 without one). Under torchrun its own ``--max-restarts`` applies."""
    on_worker_loss: str = "stop"
    """What losing a worker does: ``stop`` (the run fails; with `max_restarts` the elastic agent restarts every rank
    from the last checkpoint) or ``continue`` (``bsdp``, ``nsdp``, ``bbsdp`` and ``overlap`` with a static mask or a
    schedule, ``bsdp`` and ``nsdp`` also with `local_steps`; not with `fsdp`, nor where the ranks would use CUDA's
    NCCL (`sdp train` refuses both): the survivors agree on who is left, train on with the dead rows dropped from
    the mask (a schedule's every later round restricted to the survivors; in ``overlap`` each keeps its own copy and
    AdamW state), rerunning only the interrupted step (Bb-SDP, overlap, local steps, or a loss during a schedule's
    mask change: not rerunning a step every survivor applied, whose new values are sent or averaged again, or whose
    change is made again: in ``overlap`` the round's average among the survivors, then the next round's blocks
    train), without a checkpoint; a loss that leaves a block without holder, now or in a round still to train, stops
    the run; a loss outside a step, while the workers evaluate, write a checkpoint or save the final model, is
    recovered alike and that work done again by the survivors (a checkpoint written after a change records them and
    is refused by `resume`; survivors caught behind the others in the same step's evaluation or checkpoint take the
    evaluation's result from them and go on to their point; survivors at different steps stop); the designed
    coverage may be restored: `restore_coverage`; replacements may rejoin: `max_rejoins`;
    `sdp_train.trainer.membership`, RELIABILITY.md)."""
    restore_coverage: bool = False
    """With ``on_worker_loss='continue'`` (modes ``bsdp``, ``nsdp``, ``bbsdp``, ``overlap``, static mask; modes
    ``bsdp``, ``nsdp``, ``bbsdp`` under a schedule, ``bsdp`` and ``nsdp`` also with `local_steps`): after a loss,
    train on under a mask designed for the survivors with the designed coverage (the start mask's least c_j, at most
    the survivors' number; `masklab.survivors.restored_mask`, which balances the survivors' bytes where a built-in
    family's blocks differ in size), its rows matched to the survivors so the fewest block bytes move, and move each
    block a survivor newly holds, with its optimizer state, from its lowest-ranked surviving holder. Under a
    schedule every later round is trained so, its mask designed from that round's rows of the survivors
    (`Rounds.round_matrix`, `sdp_train.parallel.rounds.restored_round`): the round of the loss moves at once, each
    later change of round between restored masks as the schedule moves blocks. With `local_steps` (``bsdp``,
    ``nsdp``, ``overlap``; under a schedule ``bsdp`` and ``nsdp``) the move comes at a round's boundary, right after
    the holders' average: at once after a loss in the average (overlap averaging with local_steps 1: at once), else
    at the end of the round the loss interrupted, the survivors training it under their own rows. In ``overlap`` a
    survivor's own copy of a block it newly holds is replaced by its holder's, and one it drops stays, untrained and
    unaveraged. The move is all or nothing across the survivors (under a schedule, the one made within the
    recovery, not one that local steps leave to a round's boundary): a worker lost during it leaves each at its
    state from before it, and those still alive agree again and move to the mask restored for them (a loss after
    every survivor received it, while they build their new sync: from the restored rows). False: the lost rows are
    dropped and a block keeps its other holders only (coverage falls). A replacement that rejoins (`max_rejoins`)
    gives the run its designed mask back (under a schedule, the designed round's rows)."""
    restore_budgets: str | None = None
    """With `restore_coverage` at block level (modes ``bsdp``, ``bbsdp``, ``overlap``) and a built-in model: one
    memory budget per worker (``"80GB,80GB,24GB,24GB"``, as ``sdp plan --budgets`` reads them, as many as
    `workers`) that the survivors' restored mask keeps every survivor within (`restored_mask`'s
    ``budgets``): what it holds whatever its blocks (the shared parameters, e.g. the embedding, head and
    norms, with their gradients and AdamW state; in ``bbsdp`` and ``overlap`` also every block's
    parameters and every buffer) plus what each of its blocks adds
    (`sdp_train.trainer.train.coverage_to_restore`; activations and communication buffers are not counted:
    leave headroom). A loss after which no mask with the designed coverage fits the survivors' budgets
    stops the run, in one line naming them. None: no budget."""
    max_rejoins: int = 0
    """With ``on_worker_loss='continue'`` (modes ``bsdp``, ``nsdp``, ``bbsdp`` and ``overlap``, a static mask or a
    schedule, and in ``bsdp`` and ``nsdp`` local steps): start a replacement for a lost worker, up to this
    many times in all, once the survivors have agreed on the loss and while a step is left to run (after the
    last step none starts; one that waits stops with a note; several nodes: per launcher; a lost node's ranks
    restart when ``sdp train`` is started again with its ``--node-rank``). The replacement
    rejoins at the next step boundary (with `local_steps` H, also in ``overlap``, the next multiple of H,
    right after the holders' average; a model of your own, ``FILE.py:FACTORY``, it builds from the
    factory and the library cuts, as at start): it takes the lost worker's row of the mask (the run
    returns to the designed mask; under a schedule, to the designed round's rows at the same step; with
    `restore_coverage` each member whose restored row differs gains the blocks or neuron groups of its
    designed row, with their optimizer state, and drops the others), receives its blocks (N-SDP: neuron
    groups; Bb-SDP: every block's values; ``overlap``: its copy of every block, those it does not hold
    too; under a schedule each from its holders of the round that just ended, and the optimizer state of
    what it holds in the next), the shared parameters, buffers and optimizer state from their lowest-ranked
    holders and reads the lost worker's data from the step it joins at; no checkpoint is loaded
    (`sdp_train.trainer.membership`). A worker lost while others join: the members go on without the joiners
    where their own state is still theirs (the new world not formed yet, or only sending the joiners' parts
    with their rows in force their designed ones, under a schedule too: a change of round a loss left due
    is made first, in the members' world, a member lost there recovered from as any loss), or while members
    whose rows were restored go back to their designed ones, a move all or nothing (undone unless every
    member and joiner received it); a loss after every rank received it stops the run."""
    nonfinite: str = "stop"
    """What a non-finite loss or gradient norm does: ``stop`` (raise NonFiniteError on every rank, no
    summary.json) or ``skip`` (no optimizer update for that step, counted in summary.json). With
    `max_restarts`, a stop is a worker failure like any other and uses up a restart."""
    max_consecutive_skips: int = 10
    """With ``nonfinite='skip'``: this many non-finite steps in a row end the run as ``stop`` would
    (a diverged run does not come back by skipping)."""
    log_every: int = 0
    """Print a plain metrics line to stdout every N steps and at the last step, flushed (for logs
    and pipes; replaces the progress bar). 0: a progress bar on a terminal, else a line every ~10%."""
    tensorboard: bool = False
    """Also write every metric for TensorBoard (torch's ``SummaryWriter``) into ``out/tensorboard``;
    needs the ``tensorboard`` package (``pip install 'sdp-toolkit[tensorboard]'``)."""
    save_model: bool = True
    """Write the final full model to ``out/model.safetensors`` (``--no-save``: don't)."""
    out: str = "runs/latest"
    """Output directory (metrics.jsonl, summary.json, mask.json, certificate.json, model.safetensors,
    checkpoints/, tensorboard/)."""

    def __post_init__(self) -> None:
        for name in ("model", "construction", "data", "out"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a string")
        for name in ("mask", "resume", "blocks", "mlp", "schedule", "restore_budgets"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a string or null")
        for name in ("heterogeneous", "activation_checkpointing", "fsdp", "tensorboard", "save_model",
                     "restore_coverage"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        if not isinstance(self.model_overrides, dict) or not all(isinstance(k, str) for k in self.model_overrides):
            raise ConfigError(f"model_overrides must be a mapping of config fields, got {self.model_overrides!r}")
        if self.blocks is not None and not is_user_model(self.model):
            raise ConfigError(f"blocks={self.blocks!r} (--blocks) names the blocks of your own model "
                              f"(--model FILE.py:FACTORY); the blocks of model {self.model!r} are fixed by its family")
        if self.blocks is not None and not self.blocks.strip(" ,"):
            raise ConfigError(f"blocks={self.blocks!r} (--blocks) names no block")
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {MODES}")
        if self.mlp is not None:
            if not is_user_model(self.model) or self.mode != "nsdp":
                raise ConfigError(f"mlp={self.mlp!r} (--mlp) names the MLP that N-SDP cuts in your own model "
                                  f"(--model FILE.py:FACTORY --mode nsdp), got model {self.model!r}, mode {self.mode!r}")
            parse_mlp(self.mlp)
        _positive_int(self, "workers", "steps", "batch_size", "seq_len", "eval_batches", "max_data_bytes")
        _non_negative_int(self, "warmup_steps", "eval_every", "seed", "memory_steps", "checkpoint_every",
                          "keep_checkpoints", "max_restarts", "max_rejoins", "log_every", "loss_chunks")
        _positive_int(self, "max_consecutive_skips", "every", "local_steps")
        if self.bn_recalibration is not None:
            _non_negative_int(self, "bn_recalibration")
        if self.schedule is not None and self.schedule not in SCHEDULE_KINDS:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {SCHEDULE_KINDS}")
        if self.every != 1 and self.schedule in (None, "static"):
            raise ConfigError(f"every={self.every} (--every) needs schedule (--schedule permute|cyclic), got "
                              f"schedule={self.schedule!r}")
        if self.local_steps != 1 and (self.mode not in LOCAL_STEP_MODES or self.fsdp):
            raise ConfigError(f"local_steps={self.local_steps} (--local-steps) is the averaging period of modes "
                              f"'overlap', 'bsdp' and 'nsdp' (without --fsdp), got mode {self.mode!r}"
                              + (" with fsdp" if self.fsdp else "")
                              + ("; backward masking with local steps is --mode overlap"
                                 if self.mode == "bbsdp" else ""))
        if self.schedule is not None and self.mode in BASELINES:
            raise ConfigError(f"schedule={self.schedule!r} (--schedule) changes a mask; mode {self.mode!r} has none")
        if self.schedule not in (None, "static") and self.mode not in SCHEDULED_MODES:
            raise ConfigError(f"schedule={self.schedule!r} (--schedule): mode {self.mode!r} trains a static mask; "
                              "schedules train with --mode bsdp, nsdp, bbsdp or overlap")
        if self.schedule not in (None, "static") and self.fsdp:
            raise ConfigError(f"schedule={self.schedule!r} (--schedule) with fsdp (--fsdp): FSDP's holder meshes are "
                              "fixed when the run starts; schedules train without --fsdp")
        if self.schedule not in (None, "static") and self.every % self.local_steps:
            raise ConfigError(f"every={self.every} (--every) must be a multiple of local_steps={self.local_steps} "
                              f"(--local-steps): each round of {self.local_steps} steps trains under one mask")
        self._check_compile()
        self._check_worker_loss()
        self._check_restore_budgets()
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite={self.nonfinite!r} is not one of {NONFINITE_POLICIES}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} (--dtype) is not one of {COMPUTE_DTYPES}")
        if self.active is not None and (isinstance(self.active, bool) or not (
                isinstance(self.active, (int, float)) and 0.0 < self.active <= 1.0)):
            raise ConfigError(f"active={self.active!r} must be in (0, 1]")
        for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"):
            value = getattr(self, name)
            # compared, not converted: an integer beyond float range (JSON allows one) is refused, no OverflowError
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= sys.float_info.max:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
        if self.lr == 0:
            raise ConfigError("lr=0 would not train; give a positive learning rate")
        if self.min_lr_ratio > 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must be <= 1")
        if self.fsdp and self.mode != "bsdp":
            raise ConfigError(f"fsdp=True (--fsdp) composes with mode 'bsdp' only, got mode {self.mode!r}: "
                              "nsdp slices tensors differently on every worker, bbsdp keeps full frozen copies, "
                              "and ddp/fsdp are the baselines (use --mode fsdp)")
        if self.mode not in BASELINES and self.mask is None and self.active is None:
            raise ConfigError(f"mode {self.mode!r} needs --active C or --mask FILE")
        if self.max_data_bytes < 10_000:
            raise ConfigError(f"max_data_bytes={self.max_data_bytes} must be >= 10000")
        if self.workers > MAX_WORKERS:
            raise ConfigError(f"workers={self.workers} exceeds the supported maximum of {MAX_WORKERS} "
                              "(mask design and its certificate use dense workers x workers matrices)")
        if self.seed >= 2**63:
            raise ConfigError(f"seed={self.seed} must be < 2**63 (torch seeds are 64-bit integers)")
        if self.mode not in BASELINES and self.mask is None and self.active is not None:
            try:
                exact_coverage(self.workers, self.active, tolerance=ACTIVE_TOLERANCE)
            except DesignError as exc:
                raise ConfigError(f"active={self.active:g} (--active) with workers={self.workers} (--workers): "
                                  f"{exc}") from None

    def _check_compile(self) -> None:
        if self.compile is None:
            return
        if not isinstance(self.compile, str) or not self.compile:
            raise ConfigError(f"compile={self.compile!r} (--compile) must be a torch.compile backend name or null")
        from sdp_train.parallel.compile import compile_backend

        compile_backend(self.compile)  # a known backend
        refused = [what for what, on in (("mode 'fsdp'", self.mode == "fsdp"), ("fsdp (--fsdp)", self.fsdp),
                                         ("activation_checkpointing (--ac)", self.activation_checkpointing),
                                         (f"schedule={self.schedule!r} (--schedule)",
                                          self.schedule not in (None, "static"))) if on]
        if refused:
            raise ConfigError(f"compile={self.compile!r} (--compile) compiles the blocks of a fixed model without "
                              f"FSDP or activation checkpointing; got {', '.join(refused)}")

    def _check_worker_loss(self) -> None:
        if self.on_worker_loss not in WORKER_LOSS_POLICIES:
            raise ConfigError(f"on_worker_loss={self.on_worker_loss!r} is not one of {WORKER_LOSS_POLICIES}")
        if self.on_worker_loss == "stop":
            for flag, on in (("restore_coverage=True (--restore-coverage)", self.restore_coverage),
                             (f"max_rejoins={self.max_rejoins} (--max-rejoins)", self.max_rejoins)):
                if on:
                    raise ConfigError(f"{flag} acts after a worker is lost; it needs on_worker_loss='continue' "
                                      "(--on-worker-loss continue)")
            return
        why = None
        if self.mode not in SURVIVABLE_MODES:
            why = f"mode {self.mode!r}: continuing is built for {', '.join(SURVIVABLE_MODES)}"
        elif self.fsdp:
            why = ("a mask without fsdp (--fsdp): FSDP shards each block's parameters and optimizer state over its "
                   "holders, and the embedding and head over every worker, so a lost worker takes the only copy of "
                   "its shards; with fsdp a loss is survived by a checkpoint restart (--max-restarts)")
        elif self.schedule not in (None, "static") and self.restore_coverage and self.mode == "overlap":
            why = (f"a static mask with restore_coverage (--restore-coverage) in mode 'overlap', got "
                   f"schedule={self.schedule!r} (--schedule)")
        elif self.max_restarts:
            why = f"max_restarts={self.max_restarts}: a loss is survived by the survivors, not by a restart"
        elif self.workers < 2:
            why = f"workers={self.workers}: a single worker has no survivor"
        if why is not None:
            raise ConfigError(f"on_worker_loss='continue' (--on-worker-loss) needs {why}")

    def _check_restore_budgets(self) -> None:
        if self.restore_budgets is None:
            return
        flag = f"restore_budgets={self.restore_budgets!r} (--restore-budgets)"
        if not self.restore_coverage or self.level != "block":
            raise ConfigError(f"{flag} are the memory budgets a block-level restore designs within: they need "
                              "restore_coverage (--restore-coverage) in mode 'bsdp', 'bbsdp' or 'overlap', got "
                              f"restore_coverage={self.restore_coverage}, mode {self.mode!r}")
        if is_user_model(self.model):
            raise ConfigError(f"{flag} weighs a built-in model's blocks; the blocks of your own model "
                              f"{self.model!r} have no sizes to keep within budgets")
        try:
            budgets = parse_budgets(self.restore_budgets)
        except DesignError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
        if len(budgets) != self.workers:
            raise ConfigError(f"{flag} gives {len(budgets)} sizes but workers={self.workers} (--workers): give one "
                              "per worker")

    @property
    def restore_budget_bytes(self) -> list[int] | None:
        """`restore_budgets` in bytes, one per worker (None without budgets)."""
        return None if self.restore_budgets is None else parse_budgets(self.restore_budgets)

    @property
    def level(self) -> str | None:
        """Mask level of the mode (``block``/``neuron``), None for the DDP and FSDP baselines."""
        return LEVEL_OF_MODE.get(self.mode)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON config file into a dict of TrainConfig fields (validated when merged)."""
    path = Path(path)
    try:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist or is not a file")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:  # unreadable, name too long, ...
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # bad JSON, NaN/Infinity, 4300+ digit ints, deep nesting
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name} is not allowed")


def _positive_int(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")


def _non_negative_int(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r} must be an integer >= 0")
