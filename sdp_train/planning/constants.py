"""The problem constants of docs/theory.md measured on a training set-up, for ``sdp verify --constants``.

At the initial point x0 of an ``sdp train`` set-up (the full model its seed builds), worker k's
stochastic gradient g_k is the full model's gradient on a batch that rank k of the run would train
on (`build_batches` with ``rank=k``), restricted per mask column j to the block's coordinates. All
K workers are simulated in this one process, each on its first n batches, all at x0 (or at a given
model, ``at``: `load_point` of a run's ``model.safetensors``). With
gbar_{k,j} the mean of worker k's n block-j gradients:

- sigma_j^2 (A2, a bound for every worker): max_k s_{k,j}^2, with
  s_{k,j}^2 = (1/(n-1)) sum_s ||g_{k,s,j} - gbar_{k,j}||^2 the unbiased within-worker variance;
- zeta_j^2 (A3, averaged over all K workers, not over holders):
  (1/K) [sum_k ||gbar_{k,j} - gbar_j||^2 - (1 - 1/K) sum_k s_{k,j}^2 / n], clipped at 0 — the
  between-worker dispersion of the means less the noise they carry, unbiased before clipping;
- G_j^2 (A6): max_k (1/n) sum_s ||g_{k,s,j}||^2;
- L (A1): ||H v|| after power iteration with Hessian-vector products (double backward) on f at x0,
  f estimated by the mean loss of every worker's first batch; never above ||H(x0)||_2 <= L;
- f(x0) - f^*: at most the mean measured loss, since cross-entropy is >= 0.

Forward masking does not enter: the theory's constants are those of f and its gradient, the
full model's. Parameters no block owns (shared, held by every worker) are not mask columns; their
constants are reported apart. Not here: flags (`sdp_train.cli.estimate`), bounds (``theory``),
training steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
from sdp_train.trainer.prepare import Prepared
from sdp_train.trainer.run import loss_fn

CONSTANTS_FORMAT = "sdp-constants"  # the format theory.constants.load_constants reads (docs/theory.md §7)
CONSTANTS_VERSION = 1
SMOOTHNESS_ESTIMATOR = ("power iteration on Hessian-vector products (double backward) of the mean loss of every "
                        "worker's first batch at x0: ||H v||, a lower estimate of L")

Parts = tuple[tuple[str, SliceSpec], ...]


@dataclass(frozen=True)
class GradientConstants:
    """Per-block noise, heterogeneity and second moment measured from per-worker gradients."""

    sigma_sq: np.ndarray
    """(B,) max over workers of the within-worker variance of the block's gradient."""
    zeta_sq: np.ndarray
    """(B,) between-worker dispersion of the workers' mean gradients less their noise, clipped at 0."""
    grad_sq: np.ndarray
    """(B,) max over workers of the mean squared norm of the block's gradient."""
    worker_sigma_sq: np.ndarray
    """(K, B) each worker's within-worker variance (sigma_sq is its column maximum)."""
    zeta_sq_unclipped: np.ndarray
    """(B,) zeta_sq before clipping at 0 (negative: no heterogeneity above the noise)."""
    batches: int
    """Batches per worker, n."""


def gradient_constants(gradients: Iterable[Iterable[Sequence[torch.Tensor]]]) -> GradientConstants:
    """Estimate sigma_j^2, zeta_j^2 and G_j^2 from ``gradients[k][s][j]``, worker k's batch s, block j.

    Every worker must give the same number n >= 2 of batches, each a sequence of B tensors of fixed
    sizes. Workers and batches are consumed one at a time (memory: a few copies of one gradient);
    sums are in float64 (Welford's updates).

    >>> g = [[[torch.tensor([1.0, 0.0])], [torch.tensor([3.0, 0.0])]],
    ...      [[torch.tensor([0.0, 1.0])], [torch.tensor([0.0, 3.0])]]]
    >>> c = gradient_constants(g)
    >>> c.sigma_sq.tolist(), c.zeta_sq.tolist(), c.grad_sq.tolist()
    ([2.0], [1.5], [5.0])
    """
    worker_var, worker_sq, means_mean, means_m2 = [], [], None, None
    batches = None
    for k, worker in enumerate(gradients):
        mean, m2, sq, n = _moments(worker, k)
        if batches is None:
            batches = n
        elif n != batches:
            raise ConfigError(f"worker {k} gave {n} batches, worker 0 gave {batches}: every worker needs the same")
        if means_mean is None:
            means_mean, means_m2 = [v.clone() for v in mean], np.zeros(len(mean))
        else:
            if [v.numel() for v in mean] != [v.numel() for v in means_mean]:
                raise ConfigError(f"worker {k}'s blocks have other sizes than worker 0's")
            _welford(means_mean, means_m2, mean, k + 1)
        worker_var.append(m2 / (n - 1))
        worker_sq.append(sq / n)
    if batches is None:
        raise ConfigError("no workers: need the gradients of at least one")
    workers = len(worker_var)
    var = np.array(worker_var)
    zeta_raw = (means_m2 - (1 - 1 / workers) * var.sum(axis=0) / batches) / workers
    return GradientConstants(sigma_sq=var.max(axis=0), zeta_sq=np.maximum(zeta_raw, 0.0),
                             grad_sq=np.max(worker_sq, axis=0), worker_sigma_sq=var, zeta_sq_unclipped=zeta_raw,
                             batches=batches)


def _moments(worker: Iterable[Sequence[torch.Tensor]], k: int) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray, int]:
    """(mean per block, sum of squared deviations per block, sum of squared norms per block, n)."""
    mean: list[torch.Tensor] = []
    m2 = sq = np.zeros(0)
    n = 0
    for batch in worker:
        vecs = [g.detach().to(torch.float64).flatten() for g in batch]
        n += 1
        if n == 1:
            mean, m2, sq = [v.clone() for v in vecs], np.zeros(len(vecs)), np.zeros(len(vecs))
        else:
            if [v.numel() for v in vecs] != [v.numel() for v in mean]:
                raise ConfigError(f"worker {k}, batch {n - 1}: block sizes differ from its batch 0")
            _welford(mean, m2, vecs, n)
        sq += [float(v.dot(v)) for v in vecs]
    if n < 2:
        raise ConfigError(f"worker {k} gave {n} batch(es): at least 2 are needed to tell noise from heterogeneity")
    return mean, m2, sq, n


def _welford(mean: list[torch.Tensor], m2: np.ndarray, vecs: Sequence[torch.Tensor], n: int) -> None:
    """Add the n-th sample ``vecs`` to the running per-block ``mean`` and sum of squared deviations."""
    for j, v in enumerate(vecs):
        delta = v - mean[j]
        mean[j] += delta / n
        m2[j] += float(delta.dot(v - mean[j]))


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
    """What `estimate_constants` measured on one set-up (``to_dict`` for JSON)."""

    model: str
    level: str
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
    smoothness_change: float
    power_iters: int
    initial_loss: float
    point: str = "initial"
    """``"initial"``: the seed's initial model; ``"given"``: the model passed as ``at`` (``--at``)."""

    def to_dict(self) -> dict:
        return {**asdict(self), "smoothness_estimator": SMOOTHNESS_ESTIMATOR}


def estimate_constants(prep: Prepared, *, batches: int, power_iters: int, device: str = "cpu",
                       at: Mapping[str, torch.Tensor] | None = None) -> Estimate:
    """Measure the constants of ``prep``'s model, data and mask columns at its initial point (module docstring).

    With ``at`` (a full-model state dict, e.g. `load_point` of a run's ``model.safetensors``) the
    point is that model instead of the seed's initial one.
    """
    cfg, mc = prep.config, prep.model_config
    if prep.mask is None or cfg.level is None:
        raise ConfigError(f"mode {cfg.mode!r} has no mask columns to estimate constants for")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    blocks, shared = block_parts(block_map(mc), cfg.level)
    groups = [*blocks, shared] if shared else blocks
    model = build_model(mc, seed=cfg.seed, device=device)
    if at is not None:
        model.load_state_dict(at)  # keys and shapes already checked by load_point
    streams = [build_batches(prep.data, split="train", seed=cfg.seed, rank=k, world_size=cfg.workers)
               for k in range(cfg.workers)]
    losses: list[float] = []

    def worker(k: int) -> Iterator[list[torch.Tensor]]:
        for s in range(batches):
            inputs, targets = streams[k].batch(s)
            loss, grads = block_gradients(model, groups, inputs.to(device), targets.to(device))
            losses.append(loss)
            yield grads

    measured = gradient_constants(worker(k) for k in range(cfg.workers))
    first = [streams[k].batch(0) for k in range(cfg.workers)]

    def first_loss() -> torch.Tensor:
        return sum(loss_fn(model(x.to(device)), y.to(device)) for x, y in first) / len(first)

    smoothness, change = hessian_norm(first_loss, list(model.parameters()), iters=power_iters, seed=cfg.seed)
    b = len(blocks)
    sizes = [sum(_numel(prep, n, s) for n, s in parts) for parts in groups]
    assert sum(sizes) == sum(p.numel() for p in model.parameters()), "blocks and shared must cover each parameter once"
    return Estimate(
        model=cfg.model, level=cfg.level, workers=cfg.workers, batches=batches,
        block_names=tuple(prep.mask.block_names), block_parameters=tuple(sizes[:b]),
        sigma_sq=tuple(measured.sigma_sq[:b].tolist()), zeta_sq=tuple(measured.zeta_sq[:b].tolist()),
        grad_sq=tuple(measured.grad_sq[:b].tolist()), shared_parameters=sum(sizes[b:]),
        shared_sigma_sq=float(measured.sigma_sq[b:].sum()), shared_zeta_sq=float(measured.zeta_sq[b:].sum()),
        smoothness=smoothness, smoothness_change=change, power_iters=power_iters,
        initial_loss=float(np.mean(losses)), point="initial" if at is None else "given",
    )


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
    """The constants file (docs/theory.md §7) of ``estimate``: L and D are left out when not positive."""
    data = {"format": CONSTANTS_FORMAT, "version": CONSTANTS_VERSION, "sigma_sq": list(estimate.sigma_sq),
            "zeta_sq": list(estimate.zeta_sq), "grad_sq": list(estimate.grad_sq),
            "block_names": list(estimate.block_names)}
    for name, value in (("smoothness", estimate.smoothness), ("suboptimality", estimate.initial_loss)):
        if math.isfinite(value) and value > 0:
            data[name] = value
    return data


def summary_lines(estimate: Estimate) -> list[str]:
    """Human-readable lines: one row per mask column, the shared parameters, L and D with their estimators."""
    e = estimate
    where = "the initial point" if e.point == "initial" else "the given point (--at)"
    lines = [f"sdp estimate: {e.model}, {e.workers} workers x {e.batches} batches at {where}, "
             f"{len(e.block_names)} mask columns ({e.level} level)",
             f"{'block':<24}{'params':>10}{'sigma_j^2':>12}{'zeta_j^2':>12}{'G_j^2':>12}"]
    for row in zip(e.block_names, e.block_parameters, e.sigma_sq, e.zeta_sq, e.grad_sq):
        lines.append(f"{row[0]:<24}{row[1]:>10}{row[2]:>12.4g}{row[3]:>12.4g}{row[4]:>12.4g}")
    lines.append(f"{'total':<24}{sum(e.block_parameters):>10}{sum(e.sigma_sq):>12.4g}{sum(e.zeta_sq):>12.4g}"
                 f"{sum(e.grad_sq):>12.4g}")
    lines += [
        f"shared parameters (every worker holds them; no mask column, not in the file): {e.shared_parameters}, "
        f"sigma^2 {e.shared_sigma_sq:.4g}, zeta^2 {e.shared_zeta_sq:.4g}",
        f"smoothness L ~ {e.smoothness:.4g}: {SMOOTHNESS_ESTIMATOR}; {e.power_iters} iterations, last relative "
        f"change {e.smoothness_change:.2g}",
        f"suboptimality f(x0) - f* <= {e.initial_loss:.4g} (x0: {where}): the mean loss of the measured batches (cross-entropy "
        "is >= 0, so f* >= 0)",
        "sigma_j^2: max over workers of the within-worker variance; zeta_j^2: (1/K) sum_k ||mean_k - mean||^2 less "
        "the noise in the means, clipped at 0; G_j^2: max over workers of E||g_j||^2 (docs/theory.md §7)",
        "estimates at x0 from a few batches, not certified bounds: the theory needs them at every iterate",
    ]
    if not (e.smoothness > 0):
        lines.append("smoothness measured as 0: not written; give sdp verify --smoothness L")
    return lines
