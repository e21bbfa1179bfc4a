"""Per-block noise, heterogeneity and second moment from Gram matrices, with bootstrap upper bounds.

Every estimator of docs/theory.md §7 is a function of inner products of gradients only: with
worker k's n batch gradients g_{k,s,j} of block j and their Gram matrix G_j (K n x K n),

- s_{k,j}^2 = (sum_s ||g_{k,s,j}||^2 - n ||gbar_{k,j}||^2) / (n - 1), sigma_j^2 = max_k s_{k,j}^2;
- zeta_j^2 = (1/K) [sum_k ||gbar_{k,j} - gbar_j||^2 - (1 - 1/K) sum_k s_{k,j}^2 / n] (unclipped);
- G_j^2 = max_k (1/n) sum_s ||g_{k,s,j}||^2,

and a resample of each worker's batches (counts w_{k,s}, summing to n per worker) changes only
the weights of those inner products. So `bootstrap` draws R resamples (batches with replacement
within each worker; the K workers are fixed, as A2-A3 are about them) and returns the point
estimates and the one-sided percentile upper bounds at a stated level, from the Gram matrices in
O(R B (K n)^2). `gram_matrices` builds the Gram matrices from gradients, `gradient_constants` gives the
plain estimates. Not here: computing gradients (`sdp_train.planning.constants`).
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from sdp_train.errors import ConfigError


@dataclass(frozen=True)
class BlockStatistics:
    """sigma_j^2, zeta_j^2 (unclipped) and G_j^2 per block; arrays of shape (..., B)."""

    sigma_sq: np.ndarray
    zeta_sq: np.ndarray
    """Unclipped: negative where the workers' means differ by less than their noise."""
    grad_sq: np.ndarray
    worker_sigma_sq: np.ndarray
    """(..., K, B) each worker's within-worker variance."""


@dataclass(frozen=True)
class Bootstrap:
    """Point estimates and one-sided upper confidence bounds at `level` (percentile bootstrap)."""

    point: BlockStatistics
    upper: BlockStatistics
    level: float
    resamples: int


def gram_statistics(gram: np.ndarray, weights: np.ndarray) -> BlockStatistics:
    """The estimators of the module docstring from ``gram`` (B, K, n, K, n) under batch ``weights`` (R, K, n).

    ``weights`` are resampling counts (all ones: the plain estimates); each worker's must sum to n.

    >>> g = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.0, 3.0]])  # worker 0: rows 0-1, worker 1: rows 2-3
    >>> s = gram_statistics((g @ g.T).reshape(1, 2, 2, 2, 2), np.ones((1, 2, 2)))
    >>> s.sigma_sq.tolist(), s.zeta_sq.tolist(), s.grad_sq.tolist()
    ([[2.0]], [[1.5]], [[5.0]])
    """
    blocks, workers, n = gram.shape[:3]
    if n < 2:
        raise ValueError(f"{n} batch(es) per worker: at least 2 are needed to tell noise from heterogeneity")
    diag = np.einsum("bksks->bks", gram)  # ||g_{k,s}||^2
    sq = np.einsum("rks,bks->rkb", weights, diag)  # sum_s w_s ||g_s||^2
    mean_dot = np.einsum("rks,bkslt,rlt->rklb", weights, gram, weights, optimize=True) / n**2
    own = np.einsum("rkkb->rkb", mean_dot)  # ||gbar_k||^2
    worker_var = (sq - n * own) / (n - 1)
    between = own.sum(axis=1) - mean_dot.sum(axis=(1, 2)) / workers  # sum_k ||gbar_k - gbar||^2
    zeta = (between - (1 - 1 / workers) * worker_var.sum(axis=1) / n) / workers
    return BlockStatistics(sigma_sq=worker_var.max(axis=1), zeta_sq=zeta, grad_sq=(sq / n).max(axis=1),
                           worker_sigma_sq=worker_var)


def bootstrap(gram: np.ndarray, *, level: float, resamples: int, seed: int) -> Bootstrap:
    """Point estimates and ``level`` upper bounds of every statistic, from ``resamples`` resamples.

    The upper bound of each statistic (per block) is the ``level`` quantile of its bootstrap
    distribution: a percentile bootstrap, approximate for few batches per worker (it cannot see
    noise the n batches did not show).
    """
    if not 0.5 <= level < 1:
        raise ValueError(f"level={level} must lie in [0.5, 1)")
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    _, workers, n = gram.shape[:3]
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1 / n), size=(resamples, workers)).astype(float)
    point = gram_statistics(gram, np.ones((1, workers, n)))
    drawn = gram_statistics(gram, counts)

    def upper(values: np.ndarray) -> np.ndarray:
        return np.quantile(values, level, axis=0)

    return Bootstrap(
        point=BlockStatistics(*(v[0] for v in (point.sigma_sq, point.zeta_sq, point.grad_sq, point.worker_sigma_sq))),
        upper=BlockStatistics(upper(drawn.sigma_sq), upper(drawn.zeta_sq), upper(drawn.grad_sq),
                              upper(drawn.worker_sigma_sq)),
        level=level, resamples=resamples)


def mean_upper_bound(values: np.ndarray, *, level: float, resamples: int, seed: int) -> tuple[float, float]:
    """(mean, ``level`` percentile-bootstrap upper bound of the mean) of ``values`` (K, n), batches
    resampled within each row."""
    workers, n = values.shape
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(resamples, workers, n))
    means = np.take_along_axis(np.broadcast_to(values, (resamples, workers, n)), picks, axis=2).mean(axis=(1, 2))
    return float(values.mean()), float(np.quantile(means, level))


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
    """Point estimates of sigma_j^2, zeta_j^2 and G_j^2 from ``gradients[k][s][j]``, worker k's batch s, block j.

    Every worker must give the same number n >= 2 of batches, each a sequence of B tensors of fixed
    sizes. The estimators are `sdp_train.planning.bootstrap.gram_statistics` of the gradients' Gram
    matrices (memory: every gradient once, in float64 only block by block).

    >>> g = [[[torch.tensor([1.0, 0.0])], [torch.tensor([3.0, 0.0])]],
    ...      [[torch.tensor([0.0, 1.0])], [torch.tensor([0.0, 3.0])]]]
    >>> c = gradient_constants(g)
    >>> c.sigma_sq.tolist(), c.zeta_sq.tolist(), c.grad_sq.tolist()
    ([2.0], [1.5], [5.0])
    """
    gram = gram_matrices(gradients)
    s = gram_statistics(gram, np.ones((1, *gram.shape[1:3])))
    return GradientConstants(sigma_sq=s.sigma_sq[0], zeta_sq=np.maximum(s.zeta_sq[0], 0.0), grad_sq=s.grad_sq[0],
                             worker_sigma_sq=s.worker_sigma_sq[0], zeta_sq_unclipped=s.zeta_sq[0],
                             batches=gram.shape[2])


def gram_matrices(gradients: Iterable[Iterable[Sequence[torch.Tensor]]]) -> np.ndarray:
    """(B, K, n, K, n) inner products of ``gradients[k][s][j]`` block by block, in float64; ConfigError
    unless every worker gives the same n >= 2 batches of equally sized blocks."""
    stacked: list[list[torch.Tensor]] = []  # per worker: one (n, total) float32 matrix of its batches
    sizes = batches = None
    for k, worker in enumerate(gradients):
        rows = []
        for s, batch in enumerate(worker):
            vecs = [g.detach().flatten() for g in batch]
            got = [v.numel() for v in vecs]
            if sizes is None:
                sizes = got
            elif got != sizes:
                raise ConfigError(f"worker {k}, batch {s}: block sizes {got} differ from worker 0's batch 0 {sizes}")
            rows.append(torch.cat(vecs).to(torch.float64))
        if len(rows) < 2:
            raise ConfigError(f"worker {k} gave {len(rows)} batch(es): at least 2 are needed to tell noise from "
                              "heterogeneity")
        if batches is not None and len(rows) != batches:
            raise ConfigError(f"worker {k} gave {len(rows)} batches, worker 0 gave {batches}: every worker needs the same")
        batches = len(rows)
        stacked.append(torch.stack(rows))
    if batches is None:
        raise ConfigError("no workers: need the gradients of at least one")
    every = torch.cat(stacked)  # (K n, total)
    edges = np.cumsum([0, *sizes])
    grams = [(every[:, a:b] @ every[:, a:b].T).numpy() for a, b in zip(edges[:-1], edges[1:])]
    workers = len(stacked)
    return np.stack(grams).reshape(len(sizes), workers, batches, workers, batches)
