"""Overlap averaging with schedules (docs/theory.md §4, Theorems 4 and 6).

Overlap averaging, as the runtime runs it: every worker keeps its own copy of the model, takes H
local steps on the blocks it holds, then each block is replaced by its holders' mean on the holders
only; non-holders keep their copy. With a schedule the holder sets change between rounds and the
copies mix. The consensus deviation is Xi = sum_j Xi_j, Xi_j = sum_k ||x_{k,j} - xbar_j||^2.

The contraction is that of one *period* of the schedule: the rounds after which its law repeats
(1 round for a mask redrawn every round, R for a permutation kept R rounds, K R for a cyclic
rotation that moves every R rounds, N R for a sequence of N masks; a static mask is its own period). Over a period block j's copies
are multiplied by the product Pi_j of the holder-set projections P_S = I - L_S, and the expected
mixing operator Q_j = E[Pi_j^T Pi_j] contracts the deviation by lambda_max(Q_j on 1-perp) = 1 - g_j
(Theorem 4). g_j is the spectral gap of that operator. For ``permute`` it is the holder-set gap
(c_j - 1)/(K - 1), equal to gamma(M) for a balanced mask; for ``cyclic`` it is positive whenever
the rotations reach every worker, although no single round contracts; for a static mask it is 0
unless c_j = K. This module evaluates rates and bounds; it does not simulate (see
`theory.simulate.simulate_consensus`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize_scalar

from masklab.mask import Mask
from theory.bounds import (
    BoundTerms,
    FlopMatch,
    ProblemConstants,
    backward_masking_compute_fraction,
    ddp_bound,
    _check_eta_steps,
    _check_mask_constants,
    _check_rounds_align,
    update_statistics,
)
from theory.errors import AssumptionError, TheoryError
from theory.holder_sets import permute_holder_set_gaps


_GAP_ROUND_OFF = 1e-12


def consensus_period(mask: Mask, *, local_steps: int = 1) -> int:
    """Rounds per period of the schedule: 1 (static), every/H (permute), K every/H (cyclic), P every/H
    (a sequence of P masks).

    >>> from masklab.mask import Schedule
    >>> consensus_period(Mask([[1, 1], [1, 0], [0, 1]], schedule=Schedule("cyclic", 2)), local_steps=2)
    3
    """
    _check_rounds_align(mask, local_steps)
    kind = mask.schedule.kind
    if kind == "static":
        return 1
    rounds = mask.schedule.every // local_steps
    if kind == "sequence":
        return rounds * len(mask.matrices)
    return rounds * mask.workers if kind == "cyclic" else rounds


def mixing_operator(mask: Mask, block: int, *, local_steps: int = 1) -> np.ndarray:
    """Q_j = E[Pi_j^T Pi_j] of one period for `block`, shape (K, K), symmetric PSD, Q 1 = 1.

    >>> q = mixing_operator(Mask([[1, 0], [0, 1]]), 0)
    >>> q.tolist()  # a static holder set of one worker: nothing moves
    [[1.0, 0.0], [0.0, 1.0]]
    """
    if not 0 <= block < mask.blocks:
        raise TheoryError(f"block={block!r} is out of range [0, {mask.blocks})")
    _check_rounds_align(mask, local_steps)
    k = mask.workers
    holders = np.flatnonzero(mask.matrix[:, block])
    kind = mask.schedule.kind
    if kind == "permute":
        c = holders.size
        rho = 1.0 if k == 1 else (c - 1.0) / (k - 1.0)  # E L_S = rho (I - 11^T/K), and P_S^T P_S = P_S
        return np.eye(k) - rho * (np.eye(k) - 1.0 / k)
    if kind == "sequence":
        sets = [np.flatnonzero(m[:, block]) for m in mask.matrices]
    else:
        sets = [(holders - r) % k for r in range(k if kind == "cyclic" else 1)]
    product = np.eye(k)
    for s in sets:  # repeating one holder set within an epoch changes nothing: P_S is idempotent
        product = _projection(s, k) @ product
    return product.T @ product


def consensus_rates(mask: Mask, *, local_steps: int = 1) -> np.ndarray:
    """Per-block gaps g_j = 1 - lambda_max(Q_j on 1-perp) of one period, shape (B,), in [0, 1].

    >>> from masklab.mask import Schedule
    >>> consensus_rates(Mask([[1, 1], [1, 0], [0, 1]], schedule=Schedule("permute", 1))).tolist()
    [0.5, 0.5]
    >>> consensus_rates(Mask([[1, 1], [1, 0], [0, 1]])).tolist()
    [0.0, 0.0]
    """
    k = mask.workers
    if k == 1:
        return np.ones(mask.blocks)
    if mask.schedule.kind == "permute":
        _check_rounds_align(mask, local_steps)
        return permute_holder_set_gaps(mask)
    centre = np.eye(k) - 1.0 / k
    gaps = [1.0 - np.linalg.eigvalsh(centre @ mixing_operator(mask, j, local_steps=local_steps) @ centre)[-1]
            for j in range(mask.blocks)]
    gaps = np.asarray(gaps)
    # a product of projections that fixes some centred vector has gap exactly 0; eigh returns ~1e-16
    return np.where(gaps < _GAP_ROUND_OFF, 0.0, np.minimum(gaps, 1.0))


def consensus_rate(mask: Mask, *, local_steps: int = 1) -> float:
    """min_j g_j: the per-period gap that bounds the total deviation (gamma(M) for a balanced permute mask)."""
    return float(consensus_rates(mask, local_steps=local_steps).min())


def per_round_factor(mask: Mask, *, local_steps: int = 1) -> np.ndarray:
    """(1 - g_j)^(1/P) per block: the guaranteed contraction of E Xi_j per round, averaged over a period.

    >>> from masklab.mask import Schedule
    >>> rows = [[1 if (k - j) % 6 < 3 else 0 for j in range(6)] for k in range(6)]
    >>> m = Mask(rows, schedule=Schedule("cyclic", 1))
    >>> round(float(per_round_factor(m)[0]), 3)  # K = 6, c = 3, rotated every round
    0.649
    """
    return (1.0 - consensus_rates(mask, local_steps=local_steps)) ** (1.0 / consensus_period(mask, local_steps=local_steps))


def size_weighted_gap(mask: Mask) -> float:
    """lambda_2 of sum_j (d_j / d) L_{S_j} for the mask in force (d_j = block size; equal sizes: gamma(M)).

    Theorem 4.3: one round contracts a block-uniform deviation by at least 1 - this gap.

    >>> round(size_weighted_gap(Mask([[1, 1], [0, 1]], block_sizes=[100, 1])), 6)  # not gamma(M) = 0.5
    0.009901
    """
    k = mask.workers
    if k == 1:
        return 1.0
    sizes = np.ones(mask.blocks) if mask.block_sizes is None else np.asarray(mask.block_sizes, float)
    lap = np.zeros((k, k))
    for j in range(mask.blocks):
        lap += sizes[j] / sizes.sum() * (np.eye(k) - _projection(np.flatnonzero(mask.matrix[:, j]), k))
    return float(max(np.linalg.eigvalsh(lap)[1], 0.0))


def consensus_deviation_bound(
    mask: Mask,
    initial: np.ndarray,
    *,
    rounds: int,
    eta: float = 0.0,
    local_steps: int = 1,
    grad_sq: np.ndarray | None = None,
) -> np.ndarray:
    """Bound on E[Xi_r] for r = 0..rounds (Theorem 4), shape (rounds + 1,).

    Parameters
    ----------
    initial : ndarray of shape (B,)
        Xi_j at round 0, per block.
    eta, local_steps :
        Each round, every worker takes `local_steps` steps of size `eta` on its held blocks before
        the averaging. With ``eta = 0``: sum_j (1 - g_j)^floor(r/P) Xi_j(0).
    grad_sq : ndarray of shape (B,), optional
        G_j^2 (Assumption A6), required when eta > 0. Then at r = nP + s, with
        delta_j^2 = eta^2 H^2 c_j G_j^2 and X_j = (1 - g_j/2)^n Xi_j(0) + 6 P^2 delta_j^2 / g_j^2,
        E Xi_j(r) <= (sqrt(X_j) + s delta_j)^2 (inf where g_j = 0 and delta_j > 0).

    >>> from masklab.mask import Schedule
    >>> m = Mask([[1, 0], [1, 1], [0, 1]], schedule=Schedule("permute", 1))
    >>> consensus_deviation_bound(m, np.array([8.0, 0.0]), rounds=2).tolist()
    [8.0, 4.0, 2.0]
    """
    initial = np.asarray(initial, dtype=float)
    if initial.shape != (mask.blocks,) or np.any(initial < 0) or not np.all(np.isfinite(initial)):
        raise TheoryError(
            f"initial deviation must be {mask.blocks} finite numbers >= 0 (one per block), got {initial!r}"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise TheoryError(f"rounds={rounds!r} must be an integer >= 0")
    if not (math.isfinite(eta) and eta >= 0):
        raise TheoryError(f"eta={eta!r} must be a finite number >= 0")
    gap = consensus_rates(mask, local_steps=local_steps)
    period = consensus_period(mask, local_steps=local_steps)
    r = np.arange(rounds + 1)[:, None]
    n, s = r // period, r % period
    if eta == 0.0:
        return ((1.0 - gap) ** n * initial).sum(axis=1)
    if grad_sq is None:
        raise AssumptionError("a deviation bound with local steps (eta > 0) needs grad_sq (G_j^2, A6)")
    grad_sq = np.asarray(grad_sq, dtype=float)
    if grad_sq.shape != (mask.blocks,):
        raise TheoryError(f"grad_sq has shape {grad_sq.shape}, expected ({mask.blocks},)")
    delta_sq = eta**2 * local_steps**2 * mask.coverage * grad_sq
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.where(delta_sq == 0.0, 0.0, 6.0 * period**2 * delta_sq / gap**2)
    at_period = (1.0 - gap / 2.0) ** n * initial + floor
    return ((np.sqrt(at_period) + s * np.sqrt(delta_sq)) ** 2).sum(axis=1)


def overlap_bound(
    mask: Mask,
    constants: ProblemConstants,
    *,
    eta: float,
    steps: int,
    local_steps: int = 1,
    initial: np.ndarray | None = None,
) -> BoundTerms:
    """Theorem 6: bound on (1/R) sum_r E||grad f(xbar_r)||^2 for overlap averaging, term by term.

    xbar_r is the mean of the K copies at the start of round r; `initial` is Xi_j(0) (default 0:
    every copy starts equal). Needs grad_sq (A6). Proved only for 0 < eta <= 1/(12 L H); the
    consensus term is infinite where the schedule has no positive gap and copies drift.
    """
    _check_mask_constants(mask, constants)
    _check_eta_steps(eta, steps, local_steps)
    if constants.grad_sq is None:
        raise AssumptionError("overlap averaging needs a bound on the per-worker gradient second moment "
                              "(grad_sq, `--grad-bound`): Theorem 6 bounds the copies' drift with it")
    rounds = steps // local_steps
    xi0 = np.zeros(mask.blocks) if initial is None else np.asarray(initial, dtype=float)
    xi_bar = float(consensus_deviation_bound(mask, xi0, rounds=rounds - 1, eta=eta, local_steps=local_steps,
                                             grad_sq=constants.grad_sq).mean())
    return _overlap_terms(mask, constants, eta=eta, steps=steps, local_steps=local_steps, xi_bar=xi_bar)


def optimal_overlap_step_size(mask: Mask, constants: ProblemConstants, *, steps: int, local_steps: int = 1) -> float:
    """The eta in (0, 1/(12 L H)] that minimises Theorem 6's bound for horizon `steps` (copies start equal)."""
    eta_max = 1.0 / (12.0 * constants.smoothness * local_steps)

    def total(eta: float) -> float:
        value = overlap_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps).total
        return value if math.isfinite(value) else 1e300

    res = minimize_scalar(total, bounds=(eta_max * 1e-6, eta_max), method="bounded")
    return float(res.x) if total(float(res.x)) < total(eta_max) else eta_max


def overlap_flop_matched_steps(
    mask: Mask,
    constants: ProblemConstants,
    *,
    eta: float,
    ddp_steps: int,
    local_steps: int = 1,
) -> FlopMatch:
    """Local steps T that make Theorem 6's bound (copies start equal) reach stepwise DDP's after `ddp_steps`.

    The consensus term uses the largest deviation bound over a period, which holds at every horizon,
    so T = (K/c_min) 4 D / (eta (DDP - floor)) suffices; ``inf`` when that floor is at or above
    DDP's bound. Each local step is a backward-masked step: compute fraction (2 + C)/3.
    """
    ddp = ddp_bound(mask, constants, eta=eta, steps=ddp_steps).total
    period = consensus_period(mask, local_steps=local_steps)
    xi_sup = float(consensus_deviation_bound(mask, np.zeros(mask.blocks), rounds=period, eta=eta,
                                             local_steps=local_steps, grad_sq=constants.grad_sq).max())
    probe = _overlap_terms(mask, constants, eta=eta, steps=local_steps, local_steps=local_steps, xi_bar=xi_sup)
    floor = probe.bias + probe.variance + probe.consensus
    gap = ddp - floor
    needed = math.inf if not gap > 0 else probe.optimization * local_steps / gap
    return FlopMatch(ddp_steps, ddp, needed, backward_masking_compute_fraction(mask))


def _overlap_terms(mask: Mask, constants: ProblemConstants, *, eta: float, steps: int, local_steps: int,
                   xi_bar: float) -> BoundTerms:
    h, k, lip, lw = local_steps, mask.workers, constants.smoothness, constants.local_smoothness
    c = mask.coverage.astype(float)
    lam = c / k  # the step each block's mean takes, relative to DDP's
    eps_sq, _, kappa = update_statistics(mask, local_steps=h)
    s_h = (h - 1) * h * (2 * h - 1) / 6.0
    scale = k / c.min()  # ||a||^2 <= (K / c_min) ||a||^2_Lambda
    zeta = constants.zeta_sq
    bias = scale * 4.0 * float(np.sum(lam * eps_sq * zeta))
    variance = scale * (12.0 * lip * eta * h * lam.max() * float(np.sum(lam * (eps_sq + kappa) * zeta))
                        + 6.0 * lip * eta * float(np.sum(c * constants.sigma_sq)) / k**2)
    drift = (2.0 * h * c.max() * lw**2 / k**2) * (h * xi_bar + eta**2 * s_h * float(np.sum(c * constants.grad_sq)))
    consensus = scale * (4.0 * k / (h**2 * c.min()) + 6.0 * lip * eta / h) * drift if math.isfinite(xi_bar) \
        else math.inf
    return BoundTerms(scale * 4.0 * constants.suboptimality / (eta * steps), bias, variance, consensus, eta,
                      1.0 / (12.0 * lip * h))


def _projection(holders: np.ndarray, k: int) -> np.ndarray:
    """P_S: replace the holders' entries by their mean, leave the others."""
    p = np.eye(k)
    if holders.size:
        p[np.ix_(holders, holders)] = 1.0 / holders.size
    return p

