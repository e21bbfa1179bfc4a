"""``sdp compare``: design → verify → train every system on the same data, seeds and budget → report.

1. Design: every SDP run's mask is designed here (``sdp train``'s own `design_for_model`), saved to
   ``DIR/masks/NAME.json`` and certified (`masklab.analyze`: coverage, connectivity, spectral gap)
   and checked against what the theorems of docs/theory.md need (every block held; where a theorem
   covers constant-step SGD with the mask, a finite bound ratio to DDP under unit constants). No
   theorem covers the runs themselves (AdamW, warm-up, cosine decay, clipping): they print no bound,
   only that ratio as a labelled design figure. A mask that fails is reported
   and its run is not started.
2. Train: each system is one real ``sdp train --config DIR/runs/NAME/config.json`` (its own
   torchrun-launched ranks) writing into ``DIR/runs/NAME``. A run whose ``summary.json`` records
   exactly that config and mask is skipped, so an interrupted comparison resumes where it stopped.
   Every run gets the preset's model, data, seed, learning rate, schedule, batch, steps and dtype;
   nothing is tuned per system. The one exception is the FLOP-matched B-SDP run, which trains
   ``ceil(steps * F_ddp / F_bsdp)`` steps, F being the training FLOPs per step per rank.
   ``--seeds N`` trains every system with seeds 0..N-1, seed by seed, seed S > 0 in
   ``DIR/runs/NAME/seed_S`` (`run_dir`), each run skipped when finished. The seed sets model init
   and data order (training and validation batches) of every system alike; the mask is *not*
   redesigned: each system keeps its one certified mask (seed 0's), so the spread is that of init
   and data order, and a difference to DDP beyond it belongs to this system with this mask.
   Redesigning per seed would add mask luck and give each system N certificates and bounds; mask
   luck is a question for masklab's designs.
   A GPU preset is refused before any run on a machine without a CUDA device per worker, or where
   ``sdp plan``'s predicted peak of a run exceeds the smallest device (`check_devices`).
3. Report: `build_report` makes it (seed 0's rows, and with several seeds every seed's rows and
   `sdp_train.compare.stats.seed_statistics`), `sdp_train.compare.report` writes ``DIR/compare.json``,
   ``DIR/compare.md`` and PNG plots.

FLOPs are the usual dense estimate, per token: 2N forward, 2N backward through the activations and
2N for the weight gradients, N being the parameters the worker runs (embeddings and attention
scores are treated like any other parameter; activation checkpointing adds one forward). B-SDP
and N-SDP workers run only their subnetwork; a Bb-SDP worker runs the full model forward and
through the activations, and computes weight gradients for its held blocks only.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from masklab.design import exact_coverage
from masklab.errors import DesignError
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named comparison: model, workers and the training budget every system shares."""

    model: str
    workers: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    active: float = 0.5
    """C of the SDP runs: some c/K of the `workers` (`masklab.design.exact_coverage`), else refused."""
    sweep: tuple[float, ...] = ()
    """Further B-SDP runs at these C, each some c/K (the paper's 0.375 = 3/8 and 0.69 ~ 11/16 need 8
    and 16 workers), labelled ``bsdp-C`` and the C realised."""
    heterogeneous: bool = False
    """Also run DDP and B-SDP with each worker on its own part of the data (by file)."""
    eval_every: int = 50
    eval_batches: int = 4
    max_data_bytes: int = 2_000_000
    notes: tuple[str, ...] = ()
    """Printed under the report's table: what this preset leaves out and why."""
    memory_steps: int = 2
    """Measured steps: the second is the first with AdamW's state allocated."""
    data: str = "auto"
    model_overrides: tuple[tuple[str, Any], ...] = ()
    """Fields of the model config every run replaces (``sdp train``'s ``model_overrides``)."""
    overlap: bool = False
    """Only the overlap-averaging comparison (`overlap_specs`) instead of the systems of `run_specs`."""
    local_steps: int = 2
    """H of the overlap-averaging runs (their schedules change the mask every H steps)."""
    dtype: str = "float32"
    """``sdp train --dtype`` of every run (``bfloat16``: autocast, float32 master weights)."""
    gpus: bool = False
    """One CUDA device per worker: `check_devices` refuses the preset before any run where there are
    fewer, or where ``sdp plan``'s predicted peak of a run exceeds the smallest device's memory."""
    grid: tuple[str, ...] = ()
    """The image presets' systems: DDP and each of these SDP modes at `active` and at every C of
    `sweep` (``bsdp-C0.375``, ...), instead of the LLaMA presets' systems (`run_specs`)."""
    needs_data: str | None = None
    """The ``--data`` kind the preset trains on (``"cifar"``): refused without it, nothing downloaded."""


_PAPER_C = ("The paper's C = 3/8 and 0.69 are no c/K of 4 workers (every block has c of the K workers as "
            "holders): C = 3/8 needs K = 8 (c = 3), C = 0.69 needs K = 16 (c = 11, C = 0.6875). Asked of 4 "
            "workers they are refused, not rounded, so this preset sweeps the C that 4 workers realise.")

_IMAGE_NOTES = ("The paper's C = 3/8 needs 8 workers (c = 3), so the image presets run 8, one per GPU, at C = 3/8, "
                "1/2 and 3/4. 64 images per worker per step (512 in all), about 41 epochs of the 50,000 training "
                "images; the validation batches score 19 x 64 test images per worker (9,728 of the 10,000). "
                "No data augmentation (random crops, flips): absolute accuracies sit below the paper's, which "
                "trained with it; what the preset measures is each system against DDP on the same data.",)
_SMOKE = ("A smoke test of the image comparison, not a result: 40 steps of a ResNet-18 of 1/16 width (stages of "
          "4-8-16-32 channels) on 2 CPU ranks. The image presets (cifar10-resnet18, ...) train the paper's models "
          "on 8 GPUs.")


def _image_preset(model: str, classes: int) -> Preset:
    """The paper's CIFAR comparison for `model` with `classes` classes (``--data cifar:DIR``): 8 GPUs,
    DDP against B-, N- and Bb-SDP at C = 3/8, 1/2 and 3/4 (`_IMAGE_NOTES`)."""
    return Preset(model=model, workers=8, steps=4000, batch_size=64, seq_len=1, lr=1e-3, warmup_steps=200,
                  sweep=(0.375, 0.75), eval_every=500, eval_batches=19, grid=("bsdp", "nsdp", "bbsdp"),
                  needs_data="cifar", dtype="bfloat16", gpus=True, notes=_IMAGE_NOTES,
                  model_overrides=(("num_classes", classes),) if classes != 10 else ())


PRESETS: dict[str, Preset] = {
    # 4 CPU ranks of the byte-level stdlib LM: the whole comparison in under 10 min on 2 cores.
    "cpu-small": Preset(model="llama-debug", workers=4, steps=120, batch_size=4, seq_len=64, lr=3e-3,
                        warmup_steps=10, sweep=(0.75,), heterogeneous=True, eval_every=30,
                        eval_batches=8, max_data_bytes=1_000_000,
                        notes=("C = 1.0 is left out of this preset to fit its time budget: B-SDP with a complete "
                               "mask follows DDP's trajectory to float32 rounding (tests/distributed/test_sdp_training.py), "
                               "so "
                               "its loss is DDP's; the GPU presets train it.", _PAPER_C)),
    # GPU presets: the paper's LLaMA shapes on 4 GPUs (one per rank). The stdlib default data is
    # small; for real pre-training data pass uint16 token shards: sdp compare --data bin:DIR.
    # Overlap averaging, where the mask graph's spectral gap is said to matter: 7 CPU ranks of a
    # 7-block byte-level LM, so that a Fano plane (gamma 1/3) and a random balanced mask of the same
    # coverage 3 (gamma 0.096) can be compared; about 12 min on 2 cores (BENCHMARKS.md).
    "cpu-overlap": Preset(model="llama-debug", workers=7, steps=120, batch_size=4, seq_len=64, lr=3e-3,
                          warmup_steps=10, active=3 / 7, heterogeneous=True, eval_every=10, eval_batches=4,
                          max_data_bytes=1_000_000, model_overrides=(("n_layers", 7),), overlap=True),
    "gpu-134m": Preset(model="llama-134m", workers=4, steps=2000, batch_size=16, seq_len=1024, lr=6e-4,
                       warmup_steps=100, sweep=(0.25, 0.75, 1.0), heterogeneous=True, eval_every=200,
                       eval_batches=16, max_data_bytes=200_000_000, notes=(_PAPER_C,), dtype="bfloat16", gpus=True),
    "gpu-1b": Preset(model="llama-1b", workers=4, steps=2000, batch_size=8, seq_len=1024, lr=3e-4,
                     warmup_steps=100, sweep=(0.25, 0.75, 1.0), eval_every=200, eval_batches=16,
                     max_data_bytes=200_000_000, notes=(_PAPER_C,), dtype="bfloat16", gpus=True),
    # The image smoke comparison: DDP, B-, N- and Bb-SDP on CIFAR-format batches (--data cifar:DIR),
    # a ResNet-18 of 1/16 width on 2 CPU ranks; the suite runs it on generated files.
    "cpu-cifar": Preset(model="resnet18-cifar", workers=2, steps=40, batch_size=16, seq_len=1, lr=3e-3,
                        warmup_steps=4, eval_every=20, eval_batches=4, grid=("bsdp", "nsdp", "bbsdp"),
                        needs_data="cifar", memory_steps=1, model_overrides=(("width_multiplier", 0.0625),),
                        notes=(_SMOKE,)),
    **{f"{name}-{short}": _image_preset(model, classes)
       for name, classes in (("cifar10", 10), ("cifar100", 100))
       for short, model in (("resnet18", "resnet18-cifar"), ("wrn18", "wideresnet18-cifar"), ("swin-tiny", "swin-tiny"))},
}


@dataclass(frozen=True)
class RunSpec:
    """One system of the comparison."""

    name: str
    mode: str
    active: float | None = None
    ac: bool = False
    fsdp: bool = False
    heterogeneous: bool = False
    flop_matched: bool = False
    schedule: str | None = None
    """``sdp train --schedule`` (modes bsdp, bbsdp and overlap): the mask changes every ``local_steps`` steps."""
    construction: str = "auto"
    """The mask design (``sdp train --construction``)."""
    design_seed: int = 0
    """Seed of the mask design (of a ``random`` construction), apart from the runs' seeds."""
    local: bool = False
    """Modes bsdp/nsdp: average the held values every ``local_steps`` steps (``sdp train
    --local-steps``: overlap averaging of forward-masked subnetworks) instead of every gradient."""


def run_specs(preset: Preset) -> list[RunSpec]:
    """The systems of a preset, baselines first."""
    if preset.overlap:
        return overlap_specs(preset)
    c = realised_active(preset, preset.active)
    if preset.grid:
        fractions = sorted({c, *(realised_active(preset, a) for a in preset.sweep)})
        specs = [RunSpec("ddp", "ddp")]
        specs += [RunSpec(f"{mode}-C{a:.4g}", mode, a) for a in fractions for mode in preset.grid]
        if preset.heterogeneous:
            specs += [RunSpec("ddp-hetero", "ddp", heterogeneous=True),
                      RunSpec(f"bsdp-C{c:.4g}-hetero", "bsdp", c, heterogeneous=True)]
        return specs
    specs = [
        RunSpec("ddp", "ddp"),
        RunSpec("fsdp", "fsdp"),
        RunSpec("fsdp+ac", "fsdp", ac=True),
        RunSpec("bsdp", "bsdp", c),
        RunSpec("nsdp", "nsdp", c),
        RunSpec("bbsdp", "bbsdp", c),
        RunSpec("bsdp+fsdp+ac", "bsdp", c, ac=True, fsdp=True),
        RunSpec("bsdp-flop-matched", "bsdp", c, flop_matched=True),
    ]
    sweep = dict.fromkeys(realised_active(preset, a) for a in preset.sweep)
    specs += [RunSpec(f"bsdp-C{a:.4g}", "bsdp", a) for a in sweep if a != c]
    if preset.heterogeneous:
        specs += [RunSpec("ddp-hetero", "ddp", heterogeneous=True),
                  RunSpec("bsdp-hetero", "bsdp", c, heterogeneous=True)]
    return specs


def realised_active(preset: Preset, active: float) -> float:
    """The C = c/K that `active` is on the preset's workers, which its runs train and its labels carry;
    a C that no c/K realises (`masklab.design.exact_coverage`) is refused naming what would."""
    try:
        return exact_coverage(preset.workers, active) / preset.workers
    except DesignError as exc:
        raise ConfigError(f"preset {preset.model} on {preset.workers} workers: {exc}") from None


def overlap_specs(preset: Preset) -> list[RunSpec]:
    """Stepwise B-SDP and Bb-SDP (static and under ``permute``) against overlap averaging with a
    static and a ``permute`` mask, with backward masking (``overlap``) and forward masking (B-SDP
    with local steps, ``bsdp-local``), on iid
    and heterogeneous data, and two masks of equal coverage but different spectral gap under
    ``permute`` (the designed one, a projective plane where one exists, and a random balanced one)."""
    c = realised_active(preset, preset.active)
    return [
        RunSpec("ddp", "ddp"),
        RunSpec("bsdp", "bsdp", c),
        RunSpec("bsdp-permute", "bsdp", c, schedule="permute"),
        RunSpec("bbsdp", "bbsdp", c),
        RunSpec("bbsdp-permute", "bbsdp", c, schedule="permute"),
        RunSpec("bsdp-local", "bsdp", c, local=True),
        RunSpec("bsdp-local-permute", "bsdp", c, schedule="permute", local=True),
        RunSpec("overlap-static", "overlap", c),
        RunSpec("overlap-permute", "overlap", c, schedule="permute"),
        RunSpec("overlap-permute-random", "overlap", c, schedule="permute", construction="random", design_seed=3),
        RunSpec("ddp-hetero", "ddp", heterogeneous=True),
        RunSpec("bsdp-hetero", "bsdp", c, heterogeneous=True),
        RunSpec("overlap-permute-hetero", "overlap", c, schedule="permute", heterogeneous=True),
    ]


def run_dir(out: Path, name: str, seed: int) -> Path:
    """Where the run of system `name` at `seed` writes: ``runs/NAME`` for seed 0 (the one-seed layout),
    ``runs/NAME/seed_S`` for the further seeds of ``--seeds N``."""
    return out / "runs" / name if seed == 0 else out / "runs" / name / f"seed_{seed}"


def base_config(preset: Preset, spec: RunSpec, out: Path) -> TrainConfig:
    """The TrainConfig of one system (mask still to be designed; steps before FLOP matching)."""
    return TrainConfig(
        model=preset.model, mode=spec.mode, active=spec.active, workers=preset.workers, steps=preset.steps,
        batch_size=preset.batch_size, seq_len=preset.seq_len, lr=preset.lr, warmup_steps=preset.warmup_steps,
        seed=0, data=preset.data, heterogeneous=spec.heterogeneous, max_data_bytes=preset.max_data_bytes,
        eval_batches=preset.eval_batches, eval_every=preset.eval_every, activation_checkpointing=spec.ac,
        fsdp=spec.fsdp, memory_steps=preset.memory_steps, out=str(run_dir(out, spec.name, 0)),
        save_model=False,  # a comparison reports metrics; a gpu-1b run's model would be GBs per system
        model_overrides=dict(preset.model_overrides), construction=spec.construction,
        schedule=spec.schedule, every=preset.local_steps if spec.schedule else 1,
        local_steps=preset.local_steps if spec.mode == "overlap" or spec.local else 1, dtype=preset.dtype,
    )


# -- design and verification ---------------------------------------------------------------------
def training_rule(cfg: TrainConfig) -> dict[str, Any]:
    """``sdp train``'s optimizer, step-size schedule and clipping, in `theory.coverage.covering_theorem`'s terms."""
    warmup, cosine = cfg.warmup_steps > 0, cfg.min_lr_ratio < 1
    schedule = "warmup+cosine" if warmup and cosine else "warmup" if warmup else "cosine" if cosine else "constant"
    return {"optimizer": "adamw", "lr_schedule": schedule, "clipping": cfg.grad_clip > 0}


def certify(mask, steps: int, mode: str, *, local_steps: int = 1,
            training: dict[str, Any] | None = None) -> dict[str, Any]:
    """masklab's certificate of `mask`, the conditions a theorem needs of it, and the covering bound ratio.

    The one condition every theorem of docs/theory.md needs is that every block is held. The
    mixing graph's connectivity (spectral gap > 0) is reported but is no condition: it governs
    only overlap averaging (mode ``overlap``, backward masking with its copies kept: Theorems 4
    and 6), whose ``consensus_gap`` is Theorem 4's per-period gap g = min_j g_j of the schedule's
    expected mixing operator (``consensus_period`` rounds of ``local_steps`` steps; 0 for a static
    mask, whose non-holders never mix) and whose bound is infinite without one.

    `training` is the run's rule (`training_rule`; None: plain constant-step SGD). ``bound_vs_ddp``
    and ``theorem`` are the covering theorem's bound over DDP's (`theory.coverage.covered_bound_ratio`)
    and its name, None where no theorem covers the run (``not_covered`` says why: forward masking, or
    AdamW, warm-up, cosine decay, clipping, which every ``sdp train`` run uses) or, with
    ``bound_infinite``, where it gives no finite bound. ``sgd_bound_vs_ddp``, ``sgd_theorem`` and
    ``sgd_bound_infinite`` are the same for plain constant-step SGD with this mask: a design figure
    that ranks masks, not a guarantee for the run (for overlap averaging, Theorem 6's, which bounds
    the mean of all K copies).
    """
    from masklab import Schedule, analyze
    from theory.consensus import consensus_period, consensus_rate
    from theory.coverage import covered_bound_ratio, covering_theorem

    cert = analyze(mask).to_dict()
    overlap = mode == "overlap"
    theory_mode = "bbsdp" if overlap else mode  # overlap averaging is backward masking, copies kept
    sgd_ratio = covered_bound_ratio(theory_mode, mask, steps=steps, local_steps=local_steps, overlap=overlap)
    conditions = {"every block held (coverage >= 1)": cert["coverage_min"] >= 1}
    if sgd_ratio is not None and not overlap:  # a static overlap mask has no finite bound, and is compared for that
        conditions["finite bound (unit constants)"] = math.isfinite(sgd_ratio)
    sgd = covering_theorem(theory_mode, mask.schedule, local_steps=local_steps, overlap=overlap)
    coverage = covering_theorem(theory_mode, mask.schedule, local_steps=local_steps, overlap=overlap,
                                **(training or {}))
    infinite = sgd_ratio is not None and not math.isfinite(sgd_ratio)  # kept out of the JSON report as null
    verification = {"certificate": cert, "conditions": conditions, "verified": all(conditions.values()),
                    "bound_vs_ddp": None if infinite or not coverage.covered else sgd_ratio,
                    "bound_infinite": infinite and coverage.covered, "theorem": coverage.theorem,
                    "not_covered": None if coverage.covered else coverage.regime,
                    "sgd_bound_vs_ddp": None if infinite else sgd_ratio, "sgd_bound_infinite": infinite,
                    "sgd_theorem": sgd.theorem}
    if overlap:  # the certificate's gap is the schedule's expectation (the same for every mask under permute)
        verification["matrix_spectral_gap"] = analyze(mask.replace(schedule=Schedule())).spectral_gap
        verification["consensus_gap"] = consensus_rate(mask, local_steps=local_steps)
        verification["consensus_period"] = consensus_period(mask, local_steps=local_steps)
    return verification


def _bound_text(verification: dict[str, Any]) -> str:
    consensus = (f", gamma of the matrix {verification['matrix_spectral_gap']:.3f}, Theorem 4 consensus gap "
                 f"{verification['consensus_gap']:.3f} per "
                 f"{verification['consensus_period']} round(s)" if "consensus_gap" in verification else "")
    copies = " for the mean of all K copies" if consensus else ""
    if verification["theorem"] is not None:
        if verification["bound_infinite"]:
            return f"no finite bound ({verification['theorem']}: the copies never reach consensus){consensus}"
        return f"bound x DDP {verification['bound_vs_ddp']:.2f} ({verification['theorem']}{copies}){consensus}"
    said = f"no bound: {verification['not_covered']}"
    if verification["sgd_theorem"] is None:
        return said + consensus
    figure = "inf" if verification["sgd_bound_infinite"] else f"{verification['sgd_bound_vs_ddp']:.2f}"
    return (f"{said}; design figure (heuristic, not a guarantee for this run): x DDP {figure} by "
            f"{verification['sgd_theorem']} for constant-step SGD{copies}{consensus}")


def flops_per_step(cfg: TrainConfig, mask) -> float:
    """Training FLOPs per step per rank (mean over ranks), by the dense estimate of the module doc."""
    from sdp_train.models import data_kind, get_model_config, model_class, num_params, subnet_kwargs

    model_config = get_model_config(cfg.model, **cfg.model_overrides)
    tokens = cfg.batch_size * (cfg.seq_len if data_kind(model_config) == "text" else 1)
    full = num_params(model_config)
    forwards = 2 if cfg.activation_checkpointing else 1
    if mask is None:
        return tokens * full * (2 * forwards + 4)
    import torch

    held = []
    for row in mask.matrix.astype(bool):
        with torch.device("meta"):
            model = model_class(model_config)(model_config, **subnet_kwargs(model_config, row, cfg.level))
        held.append(sum(p.numel() for p in model.parameters()))
    mean_held = float(np.mean(held))
    if cfg.mode in ("bbsdp", "overlap"):  # the full model forward and backward, weight gradients of held blocks
        return tokens * (2 * forwards * full + 2 * full + 2 * mean_held)
    return tokens * mean_held * (2 * forwards + 4)


@dataclass
class Planned:
    spec: RunSpec
    config: TrainConfig
    mask: Any
    flops_per_step: float
    verification: dict[str, Any] | None


def plan_runs(preset: Preset, out: Path) -> list[Planned]:
    """Design, certify and save every mask; fix every run's config (FLOP-matched steps included)."""
    from masklab.io import save_mask
    from sdp_train.trainer.prepare import prepare

    planned: list[Planned] = []
    (out / "masks").mkdir(parents=True, exist_ok=True)
    for spec in run_specs(preset):
        cfg = base_config(preset, spec, out)
        # the mask `sdp train` would design, with every check it makes
        mask = prepare(replace(cfg, seed=spec.design_seed)).mask
        verification = None
        if mask is not None:
            mask_path = out / "masks" / f"{spec.name}.json"
            if not mask_path.is_file() or mask_path.read_bytes() != _mask_bytes(mask):
                save_mask(mask, mask_path)
            cfg = replace(cfg, mask=str(mask_path), active=None)
            verification = certify(mask, cfg.steps, cfg.mode, local_steps=cfg.local_steps,
                                   training=training_rule(cfg))
        planned.append(Planned(spec, cfg, mask, flops_per_step(cfg, mask), verification))
    by_name = {p.spec.name: p for p in planned}
    for p in planned:
        if p.spec.flop_matched:
            ratio = by_name["ddp"].flops_per_step / p.flops_per_step
            p.config = replace(p.config, steps=math.ceil(preset.steps * ratio))
    return planned


def seed_runs(planned: list[Planned], out: Path, seed: int) -> list[Planned]:
    """The runs of `planned` at `seed`: the same masks and steps, that seed and its `run_dir`."""
    return [replace(p, config=replace(p.config, seed=seed, out=str(run_dir(out, p.spec.name, seed))))
            for p in planned]


def _mask_bytes(mask) -> bytes:
    import tempfile

    from masklab.io import save_mask

    with tempfile.TemporaryDirectory() as tmp:
        return save_mask(mask, Path(tmp) / "m.json").read_bytes()


# -- report --------------------------------------------------------------------------------------
def build_report(preset_name: str, preset: Preset, planned: list[Planned],
                 summaries: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The comparison as one JSON-ready dict (`sdp_train.compare.report` writes it): settings, masks
    with certificates, one row per run (``runs``: seed 0's).

    `summaries` maps each seed to its runs' summaries. With more than one seed the report also has
    ``seeds``, ``seed_runs`` (every seed's rows, keyed by the seed as a string) and ``seed_stats``
    (`sdp_train.compare.stats.seed_statistics`).
    """
    from sdp_train.compare.stats import seed_statistics

    rows = {seed: _rows(planned, by_name) for seed, by_name in sorted(summaries.items())}
    runs, skipped = rows[0]
    masks = {p.spec.name: p.verification for p in planned if p.verification is not None}
    command = f"sdp compare --preset {preset_name}" + (f" --data {preset.data}" if preset.data != "auto" else "")
    report = {"preset": preset_name, "settings": preset_dict(preset), "date": today(), "machine": machine(),
              "command": command + (f" --seeds {len(rows)}" if len(rows) > 1 else ""),
              "masks": masks, "runs": runs, "not_run": skipped, "notes": list(preset.notes)}
    if len(rows) > 1:
        report["seeds"] = list(rows)
        report["seed_runs"] = {str(seed): seed_rows for seed, (seed_rows, _) in rows.items()}
        report["seed_stats"] = seed_statistics({seed: seed_rows for seed, (seed_rows, _) in rows.items()})
    return report


def _rows(planned: list[Planned],
          summaries: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """One seed's report rows, ratios to that seed's DDP run, and the runs not run with why."""
    ddp = summaries.get("ddp")
    runs: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for p in planned:
        name = p.spec.name
        if name not in summaries:
            skipped[name] = "its mask failed verification"
            continue
        s = summaries[name]
        peak = max(s["peak_memory_bytes"], key=lambda q: q.get("total", 0))
        row = {
            "mode": p.spec.mode, "active": None if p.mask is None else float(p.mask.matrix.mean()),
            "ac": p.spec.ac, "fsdp": p.spec.fsdp, "heterogeneous": p.spec.heterogeneous,
            "flop_matched": p.spec.flop_matched, "steps": s["config"]["steps"],
            "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
            "final_val_accuracy": s.get("final_val_accuracy"),
            "peak_memory_bytes": peak, "comm_bytes_per_step": s["comm_bytes_per_step"],
            "wire_bytes_per_step": s.get("wire_bytes_per_step"),
            "step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"],
            "flops_per_step": p.flops_per_step, "training_flops": p.flops_per_step * s["config"]["steps"],
            "val_history": [*s.get("val_history", []), {
                "step": s["config"]["steps"] - 1, "val_loss": s["final_val_loss"],
                **({} if s.get("final_val_accuracy") is None else {"val_accuracy": s["final_val_accuracy"]})}],
            "bound_vs_ddp": None if p.verification is None else p.verification["bound_vs_ddp"],
            "bound_infinite": p.verification is not None and p.verification["bound_infinite"],
            "sgd_bound_vs_ddp": None if p.verification is None else p.verification["sgd_bound_vs_ddp"],
            "sgd_bound_infinite": p.verification is not None and p.verification["sgd_bound_infinite"],
            "mask_file": s["config"].get("mask"),
        }
        if p.spec.mode == "overlap":
            row |= {"schedule": p.mask.schedule.kind, "local_steps": s["config"]["local_steps"],
                    "spectral_gap": p.verification["matrix_spectral_gap"],
                    "consensus_gap": p.verification["consensus_gap"],
                    "consensus_period": p.verification["consensus_period"],
                    "consensus_history": [
                        *({"step": v["step"], **v["consensus_distance"]} for v in s.get("val_history", [])
                          if "consensus_distance" in v),
                        {"step": s["config"]["steps"] - 1, **s["final_consensus_distance"]}]}
        if ddp is not None:
            ref = {"peak_memory": max(q.get("total", 0) for q in ddp["peak_memory_bytes"]),
                   "comm_bytes_per_step": ddp["comm_bytes_per_step"],
                   "wire_bytes_per_step": ddp.get("wire_bytes_per_step"), "step_time_s": ddp["step_time_s"],
                   "final_val_loss": ddp["final_val_loss"],
                   "training_flops": _ddp_flops(planned, ddp)}
            values = {"peak_memory": peak.get("total", 0), **{k: row[k] for k in ref if k != "peak_memory"}}
            for key, base in ref.items():
                row[f"{key}_vs_ddp"] = values[key] / base if base and values[key] is not None else None
            if row["final_val_accuracy"] is not None and ddp.get("final_val_accuracy") is not None:
                row["final_val_accuracy_minus_ddp"] = row["final_val_accuracy"] - ddp["final_val_accuracy"]
        runs[name] = row
    return runs, skipped


def _ddp_flops(planned: list[Planned], ddp_summary: dict[str, Any]) -> float:
    ddp = next(p for p in planned if p.spec.name == "ddp")
    return ddp.flops_per_step * ddp_summary["config"]["steps"]


# -- training ------------------------------------------------------------------------------------
def finished_summary(p: Planned) -> dict[str, Any] | None:
    """The run's summary.json if it finished with exactly this config and mask, else None."""
    from masklab.io import mask_to_dict

    path = Path(p.config.out) / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    want_mask = None if p.mask is None else json.loads(json.dumps(mask_to_dict(p.mask)))
    if summary.get("config") != json.loads(json.dumps(p.config.to_dict())) or summary.get("mask") != want_mask:
        return None
    return summary


def compare(preset_name: str, out: Path, *, data: str | None = None, seeds: int = 1, log=print) -> dict[str, Any]:
    """Run (or resume) the comparison and write its report; returns the compare.json content.

    `data` replaces the preset's data source (``sdp train --data`` syntax) for every run; every
    system is trained with each of the `seeds` seeds 0, 1, ..., seeds-1 (module doc, step 2).
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"--seeds {seeds!r} must be a positive integer")
    if preset_name not in PRESETS:
        raise ConfigError(f"unknown preset {preset_name!r}; known presets: {sorted(PRESETS)}")
    preset = PRESETS[preset_name] if data is None else replace(PRESETS[preset_name], data=data)
    if preset.needs_data is not None and preset.data.partition(":")[0] != preset.needs_data:
        raise ConfigError(f"preset {preset_name} trains on {preset.needs_data} data, which is not downloaded: pass "
                          f"--data {preset.needs_data}:DIR (CIFAR-10's python batches data_batch_1..5 and "
                          f"test_batch, or CIFAR-100's train and test), got --data {preset.data}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    started = time.monotonic()
    if preset.gpus:
        check_devices(preset_name, preset, None, cuda_memory())
    planned = plan_runs(preset, out)
    if preset.gpus:
        check_devices(preset_name, preset, planned, cuda_memory())
    log(f"sdp compare --preset {preset_name}: {len(planned)} runs of {preset.model} on {preset.workers} workers, "
        f"{preset.steps} steps each" + (f", each with {seeds} seeds" if seeds > 1 else "") + f" -> {out}")
    for p in planned:
        if p.verification is not None:
            cert = p.verification["certificate"]
            status = "verified" if p.verification["verified"] else "FAILED: " + ", ".join(
                k for k, ok in p.verification["conditions"].items() if not ok)
            log(f"  mask {p.spec.name}: C={cert['active_fraction']:.3f}, coverage {cert['coverage_min']}-"
                f"{cert['coverage_max']}, spectral gap {cert['spectral_gap']:.3f} (overlap averaging only), "
                f"{_bound_text(p.verification)}: {status}")
    summaries: dict[int, dict[str, dict[str, Any]]] = {seed: {} for seed in range(seeds)}
    todo = [p for p in planned if p.verification is None or p.verification["verified"]]
    todo = [(seed, p) for seed in range(seeds) for p in seed_runs(todo, out, seed)]  # seed by seed
    for i, (seed, p) in enumerate(todo, 1):
        label = f"[{i}/{len(todo)}] {p.spec.name}" + (f" (seed {seed})" if seeds > 1 else "")
        summary = finished_summary(p)
        if summary is not None:
            log(f"{label}: finished earlier, skipped")
        else:
            summary = _train(p, label, log)
        summaries[seed][p.spec.name] = summary
    from sdp_train.compare.report import write_report  # imports torch (the memory categories)

    report = build_report(preset_name, preset, planned, summaries)
    report["wall_time_s"] = time.monotonic() - started
    write_report(report, out)
    return report


def cuda_memory() -> list[int]:
    """Total memory of each CUDA device this process sees, in bytes ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def predicted_peak(preset: Preset, p: Planned) -> int:
    """``sdp plan``'s peak per device of run `p` on CUDA: the larger of the training peak of its busiest
    rank and rank 0's validation peak. For ``dtype='bfloat16'`` it predicts float32 activations, an
    upper estimate wherever the activations outweigh the bfloat16 weight copies autocast adds (every
    GPU preset: their batches' activations are several times the parameters)."""
    from sdp_train.planning.memory import predict

    cfg = p.config
    result = predict(preset.model, mode=cfg.mode, workers=cfg.workers, mask=p.mask, ac=cfg.activation_checkpointing,
                     fsdp=cfg.fsdp, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                     model_overrides=dict(preset.model_overrides), device="cuda", loss_chunks=cfg.loss_chunks,
                     image_size=32 if preset.data.startswith("cifar:") else 8)  # CIFAR's sides, else the digits
    return max(result["total"], result["eval_peak"])


def check_devices(preset_name: str, preset: Preset, planned: list[Planned] | None, memory: list[int]) -> None:
    """Refuse a GPU preset, in one line, on a machine with fewer CUDA devices than workers (`memory`:
    each device's bytes) or, given the `planned` runs, where a run's `predicted_peak` exceeds the
    smallest of the devices its ranks use."""
    from sdp_train.trainer.memory import format_bytes

    if len(memory) < preset.workers:
        have = f"{len(memory)}" if memory else "none (torch.cuda.is_available() is False)"
        raise ConfigError(f"preset {preset_name} runs one rank per CUDA device and needs {preset.workers}; this "
                          f"machine has {have}. The {'cpu-cifar' if preset.needs_data else 'cpu-small'} preset "
                          "runs on CPUs")
    if planned is None:
        return
    smallest = min(memory[:preset.workers])
    beyond = [(p.spec.name, peak) for p in planned if p.config.mode != "overlap"
              for peak in [predicted_peak(preset, p)] if peak > smallest]
    if beyond:
        runs = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in beyond)
        raise ConfigError(f"preset {preset_name} does not fit: sdp plan predicts per-device peaks beyond the "
                          f"{format_bytes(smallest)} of the smallest of its {preset.workers} CUDA devices for "
                          f"{len(beyond)} of {len(planned)} runs ({runs}); use devices with more memory")


def _train(p: Planned, label: str, log) -> dict[str, Any]:
    run_dir = Path(p.config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps(p.config.to_dict(), indent=1), encoding="utf-8")
    # --overwrite: a run whose summary did not match this comparison is trained again from scratch
    argv = [sys.executable, "-m", "sdp_train.cli", "train", "--config", str(config_path), "--overwrite"]
    log(f"{label}: training {p.config.steps} steps (log: {run_dir / 'log.txt'})")
    t0 = time.monotonic()
    with open(run_dir / "log.txt", "w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _watch(proc, run_dir / "metrics.jsonl", p.config.steps, label)
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
    if proc.returncode != 0:
        tail = log_tail((run_dir / "log.txt").read_text(encoding="utf-8", errors="replace"))
        raise RuntimeError(f"run {p.spec.name} failed (exit {proc.returncode}); the end of {run_dir / 'log.txt'}:\n"
                           + tail)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    accuracy = summary.get("final_val_accuracy")
    log(f"{label}: done in {time.monotonic() - t0:.0f} s, val loss {summary['final_val_loss']:.4f}"
        + ("" if accuracy is None else f", val accuracy {accuracy:.2%}"))
    return summary


_LAUNCHER_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")  # torch.distributed.elastic's own log lines


def log_tail(text: str, lines: int = 4) -> str:
    """The end of a failed run's log without the launcher's lines about stopping the other ranks,
    so that the rank's own error (a traceback's last line, a one-line config error) is shown."""
    own = [line for line in text.strip().splitlines() if not _LAUNCHER_LINE.match(line)]
    return "\n".join(own[-lines:])


def _watch(proc: subprocess.Popen, metrics: Path, steps: int, label: str) -> None:
    """Wait for `proc`, showing the step it reached (from metrics.jsonl) on a terminal."""
    tty = sys.stdout.isatty()
    while proc.poll() is None:
        time.sleep(1.0)
        if tty and metrics.is_file():
            with open(metrics, "rb") as f:
                done = sum(1 for _ in f)
            print(f"\r{label}: step {done}/{steps}", end="", flush=True)
    if tty:
        print("\r", end="", flush=True)


def machine() -> str:
    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, python {platform.python_version()}"


def today() -> str:
    return date.today().isoformat()


def preset_dict(preset: Preset) -> dict[str, Any]:
    return asdict(preset)
