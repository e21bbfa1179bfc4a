"""The problem constants of docs/theory.md estimated on a training set-up, for ``sdp verify --constants``.

What is measured, and where. From the initial point x0 of an ``sdp train`` set-up (the full model
its seed builds, or a given model, ``at``: `load_point` of a run's ``model.safetensors``) a short
trajectory of the theorems' own algorithm runs (plain-SGD backward-masked SDP, stepwise
averaging, `sdp_train.planning.trajectory.StepwiseSGD`, on the batches rank k of the run trains
on), and at several checkpoints x_t of it worker k's stochastic gradient g_k is the full model's
gradient on its batches t, ..., t + n - 1, restricted per mask column j to the block's coordinates;
the shared parameters (held by every worker) are one more column, of coverage K. At each
checkpoint (`sdp_train.planning.bootstrap` gives the formulas):

- sigma_j^2 (A2, every worker): max_k of the within-worker variance;
- zeta_j^2 (A3, over all K workers): the between-worker dispersion of the means less their noise;
- G_j^2 (A6): max_k of the mean squared norm;
- one-sided percentile-bootstrap upper bounds of each, at a stated level (batches resampled within
  each worker);
- L (A1): ||H v|| after power iteration with Hessian-vector products on the mean loss of every
  worker's first batch there: a lower estimate of the curvature at that point, no confidence bound.

The constants written are, per column, the maximum over checkpoints of the upper bounds (A2-A3
ask for bounds at every iterate), L the maximum over checkpoints, and f(x0) - f* <= the upper bound
of the mean loss at x0 (cross-entropy >= 0). An upper bound of zeta_j^2 below 0 is written as 0 and
the column named (`Estimate.zeta_sq_clipped`). The trajectory's step is ``trajectory_lr``, or 1/L
of the largest L measured so far, the largest step an estimate admits. All of this is an estimate:
`ASSUMPTIONS` says what it rests on. Forward masking does not enter (the constants are those of f,
the full model's). Not here: flags (`sdp_train.cli.estimate`), bounds (``theory``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdp_train.data import build_batches
from sdp_train.errors import ConfigError
from sdp_train.models import BlockMap, SliceSpec, block_map, build_model, model_class
from sdp_train.parallel.blockmap import WHOLE
from sdp_train.planning.bootstrap import bootstrap, gram_matrices, mean_upper_bound
from sdp_train.planning.trajectory import StepwiseSGD
from sdp_train.trainer.prepare import Prepared
from sdp_train.trainer.run import loss_fn

CONSTANTS_FORMAT = "sdp-constants"  # the format theory.constants.load_constants reads (docs/theory.md §7)
CONSTANTS_VERSION = 1
SMOOTHNESS_ESTIMATOR = ("power iteration on Hessian-vector products (double backward) of the mean loss of every "
                        "worker's first batch at each checkpoint: ||H v||, a lower estimate of the curvature there; "
                        "L is the maximum over the checkpoints")
SHARED = "shared"  # the name of the shared parameters' column


def assumptions(e: Estimate) -> list[str]:
    """What the estimate rests on, in words (printed, and written into the constants file)."""
    level = f"{e.confidence_level:.0%}"
    steps = (f"{len(e.checkpoints)} checkpoint(s) (steps {', '.join(str(c['step']) for c in e.checkpoints)}) of a "
             f"{e.trajectory_steps}-step plain-SGD Bb-SDP trajectory from x0")
    return [
        f"A1-A3 and A6 need the constants at every iterate of the bounded run; they were measured only at {steps}, "
        "and a run that goes elsewhere (longer, or with another step) may meet larger ones",
        f"sigma_j^2, zeta_j^2, G_j^2 and f(x0): one-sided {level} percentile-bootstrap upper bounds over {e.batches} "
        f"batches per worker ({e.resamples} resamples within each worker), per checkpoint; written: the maximum over "
        "checkpoints, not a joint confidence level",
        "L: " + SMOOTHNESS_ESTIMATOR + "; no confidence bound",
        "f* >= 0 (cross-entropy), so f(x0) - f* <= f(x0)",
        "the bound is for plain SGD with a constant step (the theorems' algorithm): AdamW, warm-up, cosine decay and "
        "clipping are covered by no theorem",
    ]


Parts = tuple[tuple[str, SliceSpec], ...]


def hessian_norm(loss_of: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], *, iters: int,
                 seed: int) -> tuple[float, float]:
    """Power iteration for the spectral norm of the Hessian of ``loss_of()`` in ``params``.

    Returns (||H v|| for the last unit iterate v, its relative change in the last iteration). For a
    unit v, ||H v|| <= ||H||_2, so the estimate never exceeds the curvature; it converges to it at
    the rate of the ratio of the two largest |eigenvalues|. Attention runs on PyTorch's math
    backend here: the fused kernels have no double backward.

    >>> x = torch.zeros(3, requires_grad=True)
    >>> a = torch.tensor([3.0, 1.0, 0.5])
    >>> value, change = hessian_norm(lambda: 0.5 * (a * x * x).sum(), [x], iters=40, seed=0)
    >>> round(value, 4)
    3.0
    """
    if iters < 1:
        raise ConfigError(f"iters={iters} must be >= 1")
    with sdpa_kernel(SDPBackend.MATH):
        grads = torch.autograd.grad(loss_of(), params, create_graph=True)
        gen = torch.Generator().manual_seed(seed)
        v = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p) for p in params]
        v = _unit(v)
        value = previous = 0.0
        for _ in range(iters):
            hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True, allow_unused=True)
            hv = [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(hv, params)]
            previous, value = value, math.sqrt(sum(float(h.double().pow(2).sum()) for h in hv))
            if value == 0.0:
                return 0.0, 0.0
            v = [h / value for h in hv]
    return value, abs(value - previous) / value


def _unit(v: list[torch.Tensor]) -> list[torch.Tensor]:
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in v))
    return [t / norm for t in v]


def block_parts(bmap: BlockMap, level: str) -> tuple[list[Parts], Parts]:
    """(the parameter parts of every mask column at ``level``, the shared parameters), covering each once."""
    params = bmap.parameter_names
    blocks = [tuple((n, s) for n, s in block.tensors if n in params) for block in bmap.blocks[level]]
    shared = tuple((n, WHOLE) for n in bmap.shared(level) if n in params)
    return blocks, shared


def block_gradients(model: nn.Module, groups: Sequence[Parts], inputs: torch.Tensor,
                    targets: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """(loss, the full model's gradient on one batch as one flat tensor per group of parts)."""
    named = dict(model.named_parameters())
    loss = loss_fn(model(inputs), targets)
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()))))
    return float(loss.detach()), [torch.cat([spec.take(grads[n]).flatten() for n, spec in parts]) for parts in groups]


@dataclass(frozen=True)
class Estimate:
    """What `estimate_constants` measured on one set-up (``to_dict`` for JSON).

    ``sigma_sq``, ``zeta_sq``, ``grad_sq`` (per mask column) and ``shared_*`` (the shared
    parameters' column) are the values written to the constants file: upper confidence bounds, the
    maximum over checkpoints, zeta clipped at 0 (``zeta_sq_clipped`` names where). ``*_estimate`` are
    the point estimates (maximum over checkpoints; zeta unclipped).
    """

    model: str
    level: str
    """The mask's level (``block`` or ``neuron``)."""
    workers: int
    batches: int
    block_names: tuple[str, ...]
    block_parameters: tuple[int, ...]
    sigma_sq: tuple[float, ...]
    zeta_sq: tuple[float, ...]
    grad_sq: tuple[float, ...]
    shared_parameters: int
    shared_sigma_sq: float
    shared_zeta_sq: float
    smoothness: float
    """The maximum over checkpoints of the power-iteration estimate."""
    smoothness_change: float
    """The last relative change of the power iteration at the checkpoint of the largest L."""
    power_iters: int
    initial_loss: float
    """The mean loss of the measured batches at x0 (point estimate of f(x0))."""
    point: str = "initial"
    """``"initial"``: the seed's initial model; ``"given"``: the model passed as ``at`` (``--at``)."""
    shared_grad_sq: float = 0.0
    suboptimality: float = 0.0
    """The upper confidence bound of f(x0), written as f(x0) - f* (f* >= 0)."""
    confidence_level: float = 0.95
    resamples: int = 0
    sigma_sq_estimate: tuple[float, ...] = ()
    zeta_sq_estimate: tuple[float, ...] = ()
    """Unclipped point estimates, the maximum over checkpoints (mask columns, then the shared column if any)."""
    grad_sq_estimate: tuple[float, ...] = ()
    zeta_sq_upper_unclipped: tuple[float, ...] = ()
    zeta_sq_clipped: tuple[str, ...] = ()
    """Columns whose zeta^2 upper bound was below 0 and is written as 0."""
    trajectory_steps: int = 0
    checkpoints: tuple[dict, ...] = ()
    """Per checkpoint: step, mean loss, smoothness, the step size of the segment after it, and the upper bounds."""

    def to_dict(self) -> dict:
        return {**asdict(self), "smoothness_estimator": SMOOTHNESS_ESTIMATOR, "estimated": True,
                "assumptions": assumptions(self)}


def checkpoint_steps(trajectory_steps: int, checkpoints: int) -> list[int]:
    """``checkpoints`` steps spread evenly over [0, trajectory_steps], 0 and the last included.

    >>> checkpoint_steps(20, 3), checkpoint_steps(0, 1), checkpoint_steps(2, 5)
    ([0, 10, 20], [0], [0, 1, 2])
    """
    if trajectory_steps < 0 or checkpoints < 1 or (trajectory_steps > 0 and checkpoints < 2):
        raise ConfigError(f"checkpoints={checkpoints} over a trajectory of {trajectory_steps} steps: need "
                          "steps >= 0, and at least 2 checkpoints (its start and end) when steps > 0")
    return sorted({round(i * trajectory_steps / max(checkpoints - 1, 1)) for i in range(checkpoints)})


def estimate_constants(prep: Prepared, *, batches: int, power_iters: int, device: str = "cpu",
                       at: Mapping[str, torch.Tensor] | None = None, trajectory_steps: int = 0,
                       checkpoints: int = 1, trajectory_lr: float | None = None, confidence_level: float = 0.95,
                       resamples: int = 1000) -> Estimate:
    """Estimate the constants of ``prep``'s model, data and mask along a short trajectory (module docstring)."""
    cfg, mc = prep.config, prep.model_config
    if prep.mask is None or cfg.level is None:
        raise ConfigError(f"mode {cfg.mode!r} has no mask columns to estimate constants for")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if trajectory_lr is not None and not (math.isfinite(trajectory_lr) and trajectory_lr > 0):
        raise ConfigError(f"trajectory_lr={trajectory_lr} must be a finite number > 0")
    steps = checkpoint_steps(trajectory_steps, checkpoints)
    blocks, shared = block_parts(block_map(mc), cfg.level)
    groups = [*blocks, shared] if shared else blocks
    model = build_model(mc, seed=cfg.seed, device=device)
    if at is not None:
        model.load_state_dict(at)  # keys and shapes already checked by load_point
    streams = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=cfg.workers)
               for k in range(cfg.workers)]
    sgd = StepwiseSGD(model, groups, prep.mask, streams, seed=cfg.seed, device=device)
    measured, t = [], 0
    for step in steps:
        if t < step:
            eta = measured[-1]["step_size"]
        while t < step:
            sgd.step(t, eta)
            t += 1
        measured.append(_checkpoint(model, groups, streams, step, batches=batches, power_iters=power_iters,
                                    device=device, seed=cfg.seed, level=confidence_level, resamples=resamples))
        measured[-1]["step_size"] = None if step == steps[-1] else _segment_step(trajectory_lr, measured)
    b = len(blocks)
    upper = {key: np.max([c["upper"][key] for c in measured], axis=0) for key in ("sigma_sq", "zeta_sq", "grad_sq")}
    est = {key: np.max([c["estimate"][key] for c in measured], axis=0) for key in ("sigma_sq", "zeta_sq", "grad_sq")}
    zeta = np.maximum(upper["zeta_sq"], 0.0)
    names = [*prep.mask.block_names, *([SHARED] if shared else [])]
    sizes = [sum(_numel(prep, n, s) for n, s in parts) for parts in groups]
    assert sum(sizes) == sum(p.numel() for p in model.parameters()), "blocks and shared must cover each parameter once"
    largest = max(measured, key=lambda c: c["smoothness"])
    first = measured[0]
    return Estimate(
        model=cfg.model, level=cfg.level, workers=cfg.workers, batches=batches,
        block_names=tuple(prep.mask.block_names), block_parameters=tuple(sizes[:b]),
        sigma_sq=_floats(upper["sigma_sq"][:b]), zeta_sq=_floats(zeta[:b]), grad_sq=_floats(upper["grad_sq"][:b]),
        shared_parameters=sum(sizes[b:]), shared_sigma_sq=float(upper["sigma_sq"][b:].sum()),
        shared_zeta_sq=float(zeta[b:].sum()), shared_grad_sq=float(upper["grad_sq"][b:].sum()),
        smoothness=largest["smoothness"], smoothness_change=largest["smoothness_change"], power_iters=power_iters,
        initial_loss=first["loss"], suboptimality=first["loss_upper"], point="initial" if at is None else "given",
        confidence_level=confidence_level, resamples=resamples, sigma_sq_estimate=_floats(est["sigma_sq"]),
        zeta_sq_estimate=_floats(est["zeta_sq"]), grad_sq_estimate=_floats(est["grad_sq"]),
        zeta_sq_upper_unclipped=_floats(upper["zeta_sq"]),
        zeta_sq_clipped=tuple(n for n, z in zip(names, upper["zeta_sq"]) if z < 0),
        trajectory_steps=trajectory_steps,
        checkpoints=tuple({k: v for k, v in c.items() if k not in ("upper", "estimate")} | {
            f"{key}_upper": _floats(c["upper"][key]) for key in ("sigma_sq", "zeta_sq", "grad_sq")} for c in measured),
    )


def _segment_step(trajectory_lr: float | None, measured: list[dict]) -> float:
    """The trajectory's step after the last checkpoint: ``trajectory_lr``, else 1/L of the largest L so far."""
    if trajectory_lr is not None:
        return trajectory_lr
    largest = max(c["smoothness"] for c in measured)
    if not largest > 0:
        raise ConfigError("the smoothness measured at the trajectory's start is 0: give --trajectory-lr")
    return 1 / largest


def _floats(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _checkpoint(model: nn.Module, groups: Sequence[Parts], streams: Sequence, step: int, *, batches: int,
                power_iters: int, device: str, seed: int, level: float, resamples: int) -> dict:
    """Everything measured at the model's current point with every worker's batches step..step+batches-1."""
    losses = np.zeros((len(streams), batches))

    def worker(k: int) -> Iterable[list[torch.Tensor]]:
        for s in range(batches):
            inputs, targets = streams[k].batch(step + s)
            losses[k, s], grads = block_gradients(model, groups, inputs.to(device), targets.to(device))
            yield grads

    boot = bootstrap(gram_matrices(worker(k) for k in range(len(streams))), level=level, resamples=resamples,
                     seed=seed + step)
    loss, loss_upper = mean_upper_bound(losses, level=level, resamples=resamples, seed=seed + step)
    first = [streams[k].batch(step) for k in range(len(streams))]

    def first_loss() -> torch.Tensor:
        return sum(loss_fn(model(x.to(device)), y.to(device)) for x, y in first) / len(first)

    smoothness, change = hessian_norm(first_loss, list(model.parameters()), iters=power_iters, seed=seed + step)
    return {"step": step, "loss": loss, "loss_upper": loss_upper, "smoothness": smoothness,
            "smoothness_change": change,
            "upper": {"sigma_sq": boot.upper.sigma_sq, "zeta_sq": boot.upper.zeta_sq, "grad_sq": boot.upper.grad_sq},
            "estimate": {"sigma_sq": boot.point.sigma_sq, "zeta_sq": boot.point.zeta_sq,
                         "grad_sq": boot.point.grad_sq}}


def load_point(path: str | os.PathLike[str], prep: Prepared) -> dict[str, torch.Tensor]:
    """The full-model state dict in ``path`` (a ``model.safetensors``, or a run directory holding one),
    checked against ``prep``'s model: every key present, none extra, every shape equal; else ConfigError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from sdp_train.trainer.outputs import MODEL_FILE

    file = Path(path)
    if file.is_dir():
        file = file / MODEL_FILE
    if not file.is_file():
        raise ConfigError(f"--at {path}: no such file" + (f" ({MODEL_FILE} of a run directory)"
                                                           if Path(path).is_dir() else ""))
    try:
        state = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"--at {file}: not a readable safetensors file ({exc})") from None
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in model_class(prep.model_config)(prep.model_config).state_dict().items()}
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected]
    if missing or extra:
        parts = ([f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}"] if missing else []) + \
                ([f"{len(extra)} unexpected, e.g. {', '.join(extra[:3])}"] if extra else [])
        raise ConfigError(f"--at {file}: does not hold a {prep.config.model} model: {'; '.join(parts)}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"--at {file}: tensor {name} has shape {tuple(state[name].shape)}, "
                              f"{prep.config.model} has {shape}")
    return state


def _numel(prep: Prepared, name: str, spec: SliceSpec) -> int:
    shape = block_map(prep.model_config).shapes[name]
    return math.prod(shape) if spec.is_whole else math.prod(shape) // spec.full_size * len(spec.index)


def constants_file(estimate: Estimate) -> dict:
    """The constants file (docs/theory.md §7) of ``estimate``: the upper bounds per mask column, the
    shared parameters as ``shared`` (one more column, held by all K workers), L and D (left out when
    not positive), and ``estimate``: how they were estimated and what that assumes."""
    e = estimate
    data = {"format": CONSTANTS_FORMAT, "version": CONSTANTS_VERSION, "sigma_sq": list(e.sigma_sq),
            "zeta_sq": list(e.zeta_sq), "grad_sq": list(e.grad_sq), "block_names": list(e.block_names)}
    if e.shared_parameters:
        data["shared"] = {"sigma_sq": e.shared_sigma_sq, "zeta_sq": e.shared_zeta_sq, "grad_sq": e.shared_grad_sq,
                          "parameters": e.shared_parameters}
    for name, value in (("smoothness", e.smoothness), ("suboptimality", e.suboptimality)):
        if math.isfinite(value) and value > 0:
            data[name] = value
    data["estimate"] = {"by": "sdp estimate", "confidence_level": e.confidence_level, "resamples": e.resamples,
                        "batches_per_worker": e.batches, "trajectory_steps": e.trajectory_steps,
                        "checkpoints": [c["step"] for c in e.checkpoints], "zeta_sq_clipped": list(e.zeta_sq_clipped),
                        "assumptions": assumptions(e)}
    return data


def summary_lines(estimate: Estimate) -> list[str]:
    """Human-readable lines: labelled an estimate, one row per column (the shared one last), L, D, assumptions."""
    e = estimate
    where = "the initial point" if e.point == "initial" else "the given point (--at)"
    level = f"{e.confidence_level:.0%}"
    lines = [f"sdp estimate (ESTIMATES, not proved bounds): {e.model}, {e.workers} workers x {e.batches} batches at "
             f"each of {len(e.checkpoints)} checkpoint(s) of a {e.trajectory_steps}-step trajectory from {where}, "
             f"{len(e.block_names)} mask columns ({e.level} level) and the shared parameters",
             f"per column: the {level} upper confidence bound (bootstrap), maximum over checkpoints; in brackets the "
             "point estimate",
             f"{'column':<24}{'params':>10}{'sigma_j^2':>22}{'zeta_j^2':>22}{'G_j^2':>22}"]
    names = [*e.block_names, *([SHARED] if e.shared_parameters else [])]
    params = [*e.block_parameters, *([e.shared_parameters] if e.shared_parameters else [])]
    written = [(*e.sigma_sq, e.shared_sigma_sq), (*e.zeta_sq, e.shared_zeta_sq), (*e.grad_sq, e.shared_grad_sq)]
    points = (e.sigma_sq_estimate, e.zeta_sq_estimate, e.grad_sq_estimate)
    for j, name in enumerate(names):
        cells = "".join(f"{f'{w[j]:.4g} [{p[j]:.3g}]':>22}" for w, p in zip(written, points))
        lines.append(f"{name + (' (all K)' if name == SHARED else ''):<24}{params[j]:>10}{cells}")
    if e.zeta_sq_clipped:
        below = ", ".join(f"{n} {z:.3g}" for n, z in zip(names, e.zeta_sq_upper_unclipped) if n in e.zeta_sq_clipped)
        lines.append(f"zeta^2 written as 0 where its upper bound was below 0 ({below}): the workers' means differ by "
                     "less than their noise there")
    lines += [f"smoothness L ~ {e.smoothness:.4g} (at the checkpoints: "
              f"{', '.join('step %d %.3g' % (c['step'], c['smoothness']) for c in e.checkpoints)}; {e.power_iters} power "
              f"iterations, last relative change {e.smoothness_change:.2g})",
              f"suboptimality f(x0) - f* <= {e.suboptimality:.4g} ({level} upper bound of the mean loss "
              f"{e.initial_loss:.4g} at x0, {where}; f* >= 0)",
              "assumptions:", *(f"  - {a}" for a in assumptions(e))]
    if not (e.smoothness > 0):
        lines.append("smoothness measured as 0: not written; give sdp verify --smoothness L")
    return lines
