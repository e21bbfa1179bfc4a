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
unless c_j = K. Theorem 4.6 bounds the deviation round by round for deterministic schedules, and Theorems 4.7
(deterministic) and 4.8 (``permute``) tighten it from per-round displacement sizes (`theory.deviation`); Theorem 6.2
bounds the mean at period starts for masks held over rounds. This module evaluates rates and bounds; it does
not simulate (see `theory.simulate.simulate_consensus`).
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
from theory.deviation import gram_deviation, permute_deviation
from theory.errors import AssumptionError, TheoryError
from theory.holder_sets import permute_holder_set_gaps, permute_variance_coefficients


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
    round_grad_sq: np.ndarray | None = None,
    sigma_sq: np.ndarray | None = None,
) -> np.ndarray:
    """Bound on E[Xi_r] for r = 0..rounds (Theorems 4.4 and 4.6 to 4.8), shape (rounds + 1,).

    Parameters
    ----------
    initial : ndarray of shape (B,)
        Xi_j at round 0, per block.
    eta, local_steps :
        Each round, every worker takes `local_steps` steps of size `eta` on its held blocks before
        the averaging. With ``eta = 0``: sum_j (1 - g_j)^floor(r/P) Xi_j(0).
    grad_sq : ndarray of shape (B,), optional
        G_j^2 (Assumption A6). With it alone, d_j^2 = eta^2 H^2 c_j (1 - c_j/K) G_j^2 bounds what one
        round adds, as in Theorem 4.4.
    round_grad_sq, sigma_sq : ndarray of shape (rounds, B) and (B,), optional
        Ghat_{j,r}^2 (A6r: the holders' mean noise-free second moment in round r) and sigma_j^2 (A2); then
        the noise enters as a martingale. One of grad_sq and round_grad_sq is needed when eta > 0.
        `permute` schedules use Theorem 4.8, deterministic ones Theorem 4.7; each round takes the
        smaller of that and Theorem 4.4/4.6.

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
    if eta == 0.0:
        gap = consensus_rates(mask, local_steps=local_steps)
        n = np.arange(rounds + 1)[:, None] // consensus_period(mask, local_steps=local_steps)
        return ((1.0 - gap) ** n * initial).sum(axis=1)
    drift, noise, _ = round_moments(mask, eta=eta, local_steps=local_steps, rounds=rounds, grad_sq=grad_sq,
                                    round_grad_sq=round_grad_sq, sigma_sq=sigma_sq)
    return block_deviation_bound(mask, initial, local_steps=local_steps, drift=drift, noise=noise).sum(axis=1)


def round_moments(mask: Mask, *, eta: float, local_steps: int, rounds: int, grad_sq: np.ndarray | None,
                  round_grad_sq: np.ndarray | None = None,
                  sigma_sq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per round and block, shape (rounds, B) each: (drift, noise, moment) of docs/theory.md Theorem 4.7.

    drift: an L2 bound on the holders' mean displacement, or on its part that is not a martingale
    difference (eta H sqrt(min(Ghat^2, G^2)) with A6r, eta H G without); noise: E||n||^2 of the
    martingale part (eta^2 H sigma^2 / c with A6r, 0 without); moment: the holders' mean second moment
    of the stochastic gradient (min(Ghat^2 + sigma^2, G^2), or G^2), what Theorems 6 and 6.2 charge.
    """
    h, b = local_steps, mask.blocks
    if grad_sq is None and round_grad_sq is None:
        raise AssumptionError("a deviation bound with local steps (eta > 0) needs grad_sq (G_j^2, A6) "
                              "or round_grad_sq (A6r)")
    whole = None
    if grad_sq is not None:
        whole = np.asarray(grad_sq, dtype=float)
        if whole.shape != (b,):
            raise TheoryError(f"grad_sq has shape {whole.shape}, expected ({b},)")
    if round_grad_sq is None:
        moment = np.broadcast_to(whole, (rounds, b))
        return eta * h * np.sqrt(moment), np.zeros((rounds, b)), moment
    per_round = np.asarray(round_grad_sq, dtype=float)
    if per_round.ndim != 2 or per_round.shape[1] != b or per_round.shape[0] < rounds:
        raise TheoryError(f"round_grad_sq has shape {per_round.shape}, expected at least ({rounds}, {b})")
    if sigma_sq is None or np.shape(sigma_sq) != (b,):
        raise TheoryError(f"round_grad_sq needs sigma_sq of shape ({b},) (A2), got {sigma_sq!r}")
    per_round = per_round[:rounds]
    sigma_sq = np.asarray(sigma_sq, dtype=float)
    moment = per_round + sigma_sq
    if whole is not None:
        per_round, moment = np.minimum(per_round, whole), np.minimum(moment, whole)
    noise = np.broadcast_to(eta**2 * h * sigma_sq / mask.coverage, (rounds, b))
    return eta * h * np.sqrt(per_round), noise, moment


def block_deviation_bound(mask: Mask, initial: np.ndarray, *, local_steps: int, drift: np.ndarray,
                          noise: np.ndarray) -> np.ndarray:
    """Bound on E Xi_j(r) per round r = 0..R and block, shape (R + 1, B), R = len(drift).

    Theorem 4.8 (`permute`) or 4.7 (deterministic schedules), and per round the smaller of that and
    Theorem 4.4/4.6 with every round's d_j its largest, sqrt(c_j (1 - c_j/K)) max_s (drift + sqrt(noise)).
    """
    h, k = local_steps, mask.workers
    rounds = drift.shape[0]
    c = mask.coverage.astype(float)
    gap = consensus_rates(mask, local_steps=h)
    period = consensus_period(mask, local_steps=h)
    largest = np.sqrt(c * (1.0 - c / k)) * (drift + np.sqrt(noise)).max(axis=0, initial=0.0)
    start, injected = _deviation_factors(gap, period, rounds, mask=mask, local_steps=h)
    older = (start * np.sqrt(initial) + injected * largest) ** 2
    if mask.schedule.kind == "permute":
        return np.minimum(older, permute_deviation(c, k, period, initial, drift, noise))
    held = np.stack([mask.round_matrix(t * h) > 0 for t in range(period)])
    newer, covered = gram_deviation(held, initial, drift, noise)
    if covered < rounds:  # from a period start the schedule repeats: Theorem 4.4/4.6 from the bound there
        start, injected = _deviation_factors(gap, period, rounds - covered, mask=mask, local_steps=h)
        rest = (start * np.sqrt(newer[-1]) + injected * largest) ** 2
        newer = np.concatenate([newer[:-1], rest])
    return np.minimum(older, newer)


def deviation_increments(mask: Mask, *, eta: float, local_steps: int, grad_sq: np.ndarray | None) -> np.ndarray:
    """d_j^2 = eta^2 H^2 c_j (1 - c_j/K) G_j^2: what one round's local steps can add to Xi_j (Theorem 4.4).

    >>> deviation_increments(Mask([[1, 1], [1, 0]]), eta=0.5, local_steps=2, grad_sq=np.ones(2)).tolist()
    [0.0, 0.5]
    """
    if grad_sq is None:
        raise AssumptionError("a deviation bound with local steps (eta > 0) needs grad_sq (G_j^2, A6)")
    grad_sq = np.asarray(grad_sq, dtype=float)
    if grad_sq.shape != (mask.blocks,):
        raise TheoryError(f"grad_sq has shape {grad_sq.shape}, expected ({mask.blocks},)")
    c = mask.coverage.astype(float)
    return eta**2 * local_steps**2 * c * (1.0 - c / mask.workers) * grad_sq


def _deviation_factors(gap: np.ndarray, period: int, rounds: int, *, mask: Mask | None = None,
                       local_steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(q^n, S(r)) of Theorem 4.4 for r = 0..rounds, each of shape (rounds + 1, B); for a deterministic
    schedule (`mask` given, not ``permute``) the smaller factors of Theorem 4.6 where they are computed."""
    q = np.sqrt(np.clip(1.0 - gap, 0.0, 1.0))
    r = np.arange(rounds + 1)[:, None]
    n = r // period
    start = q**n
    with np.errstate(divide="ignore", invalid="ignore"):
        full = np.where(q < 1.0, period * (1.0 - start) / (1.0 - q), period * n)
    injected = full + (r - n * period)
    if mask is not None and mask.schedule.kind != "permute" and mask.workers > 1:
        exact = min(rounds, max(0, _DIRECTIONAL_WORK // max(1, period * mask.blocks * mask.workers**2)))
        d_start, d_injected = directional_factors(mask, exact, local_steps=local_steps)
        start, injected = start.copy(), injected.copy()
        start[: exact + 1] = np.minimum(start[: exact + 1], d_start)  # both are bounds; 4.6 is never larger
        injected[: exact + 1] = np.minimum(injected[: exact + 1], d_injected)
    return start, injected


_DIRECTIONAL_WORK = 4_000_000  # rounds x period x B x K^2 evaluated exactly by Theorem 4.6; Theorem 4.4 beyond


def directional_factors(mask: Mask, rounds: int, *, local_steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Theorem 4.6 for a deterministic schedule: (a_j(r), s_j(r)) for r = 0..rounds, each (rounds + 1, B).

    a_j(r) is the norm on 1-perp of the product of block j's holder projections over rounds 0..r-1;
    s_j(r) = sum_{s<r} ||Pi_{r<-s+1} u_s|| / ||u_s||, u_s = 1_{S(s)} - (c_j/K) 1 the only direction in
    which round s's local steps move the centred copies. Then sqrt(E Xi_j(r)) <= a_j(r) sqrt(Xi_j(0)) +
    d_j s_j(r), with d_j of Theorem 4.4.

    >>> from masklab.mask import Schedule
    >>> rows = [[1 if (k - j) % 6 < 3 else 0 for j in range(6)] for k in range(6)]
    >>> a, s = directional_factors(Mask(rows, schedule=Schedule("cyclic", 1)), 3)
    >>> [round(float(v), 3) for v in s[:, 0]]  # Theorem 4.4 gives 0, 1, 2, 3: no period has ended
    [0.0, 1.0, 1.745, 2.344]
    """
    if mask.schedule.kind == "permute":
        raise TheoryError("Theorem 4.6 needs a deterministic schedule (static, cyclic or sequence), not permute")
    _check_rounds_align(mask, local_steps)
    k, b = mask.workers, mask.blocks
    period = consensus_period(mask, local_steps=local_steps)
    steps_per_round = local_steps
    sets = [mask.round_matrix(t * steps_per_round) > 0 for t in range(period)]  # (K, B) each, round t mod P
    proj = np.stack([np.stack([_projection(np.flatnonzero(m[:, j]), k) for j in range(b)]) for m in sets])  # P,B,K,K
    centre = np.eye(k) - 1.0 / k
    start = np.empty((rounds + 1, b))
    product = np.broadcast_to(centre, (b, k, k)).copy()
    for r in range(rounds + 1):
        start[r] = np.linalg.norm(product, ord=2, axis=(1, 2))
        product = proj[r % period] @ product
    # a[ph, lag, j] = ||Pi u|| / ||u|| for the direction of round ph (mod P) after `lag` further rounds
    u = np.stack([np.where(m, 1.0, 0.0) - m.sum(axis=0) / k for m in sets])  # P, K, B
    norm_u = np.linalg.norm(u, axis=1)
    w = np.divide(u, norm_u[:, None, :], out=np.zeros_like(u), where=norm_u[:, None, :] > 0)
    w = np.transpose(w, (0, 2, 1))  # P, B, K
    a = np.empty((period, max(rounds, 1), b))
    phases = np.arange(period)
    for lag in range(max(rounds, 1)):
        a[:, lag] = np.linalg.norm(w, axis=2)
        w = np.einsum("pbkl,pbl->pbk", proj[(phases + lag + 1) % period], w)
    lags = np.arange(max(rounds, 1))
    # round r sums lags 0..r-1, round s = r-1-lag having phase (r-1-lag) mod P: a cumulative sum per residue of r-1
    running = np.cumsum(a[(phases[:, None] - lags[None, :]) % period, lags[None, :]], axis=1)  # P, R, B
    injected = np.zeros((rounds + 1, b))
    injected[1:] = running[lags[:rounds] % period, lags[:rounds]]
    return start, injected


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
    every copy starts equal). Needs grad_sq (A6). Proved for 0 < eta < K/(2 L H c_max) (`eta_max`,
    where the bound becomes infinite); the free constants of the proof (alpha, beta) are chosen to
    minimise the total. The consensus term is reported infinite where a block with no positive
    mixing gap drifts: Theorem 4.4 then grows with the horizon and certifies nothing useful.
    """
    _check_mask_constants(mask, constants)
    _check_eta_steps(eta, steps, local_steps)
    if constants.grad_sq is None and constants.round_grad_sq is None:
        raise AssumptionError("overlap averaging needs a bound on the per-worker gradient second moment "
                              "(grad_sq, `--grad-bound`): Theorem 6 bounds the copies' drift with it")
    _, _, moment = _moments(mask, constants, eta=eta, local_steps=local_steps, rounds=steps // local_steps)
    return _overlap_terms(mask, constants, eta=eta, steps=steps, local_steps=local_steps,
                          moment_sum=float((moment * mask.coverage).sum(axis=1).mean()),
                          held_bias=_held_bias(mask, constants, eta=eta, local_steps=local_steps, moment=moment),
                          xi_bar=mean_deviation_bound(mask, constants, eta=eta, steps=steps,
                                                      local_steps=local_steps, initial=initial))


def mean_deviation_bound(mask: Mask, constants: ProblemConstants, *, eta: float, steps: int, local_steps: int = 1,
                         initial: np.ndarray | None = None, per_block_weight: np.ndarray | None = None) -> float:
    """(1/R) sum_{r<R} sum_j w_j E Xi_j(r) by `block_deviation_bound` (w = 1 unless given); inf where a block
    with no mixing gap drifts."""
    rounds = steps // local_steps
    xi0 = np.zeros(mask.blocks) if initial is None else np.asarray(initial, dtype=float)
    weight = np.ones(mask.blocks) if per_block_weight is None else per_block_weight
    drift, noise, _ = _moments(mask, constants, eta=eta, local_steps=local_steps, rounds=rounds)
    gap = consensus_rates(mask, local_steps=local_steps)
    moving = (drift.max(axis=0) + noise.max(axis=0) > 0.0) & (mask.coverage < mask.workers)
    if np.any((gap <= 0.0) & moving):
        return math.inf
    per_round = block_deviation_bound(mask, xi0, local_steps=local_steps, drift=drift[:rounds - 1],
                                      noise=noise[:rounds - 1])
    return float((per_round * weight).sum(axis=1).mean())


def _moments(mask: Mask, constants: ProblemConstants, *, eta: float, local_steps: int,
             rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`round_moments` at the constants' G_j^2, Ghat_{j,r}^2 and sigma_j^2."""
    return round_moments(mask, eta=eta, local_steps=local_steps, rounds=rounds, grad_sq=constants.grad_sq,
                         round_grad_sq=constants.round_grad_sq, sigma_sq=constants.sigma_sq)


def period_overlap_bound(mask: Mask, constants: ProblemConstants, *, eta: float, steps: int,
                         local_steps: int = 1) -> BoundTerms:
    """Theorem 6.2: bound on (1/N) sum_{n<N} E||grad f(xbar_{nP})||^2 at the N = floor(R/P) period starts.

    For schedules that hold a mask over rounds: ``cyclic``, a balanced ``sequence`` (every worker holds
    each block equally often over a period) and ``permute`` kept P > 1 rounds. A period is treated as one
    round of P H local steps, over which the masking bias cancels (cyclic, balanced sequence) or has mean
    zero (permute), so only the drift of the copies and of the mean within a period is paid. Copies start
    equal. Proved for eta L P H c_max / K < 1 (`eta_max`); the free constant beta minimises the total.
    """
    _check_mask_constants(mask, constants)
    _check_eta_steps(eta, steps, local_steps)
    if constants.grad_sq is None and constants.round_grad_sq is None:
        raise AssumptionError("Theorem 6.2 bounds the copies' drift with grad_sq (A6, `--grad-bound`)")
    h, k = local_steps, mask.workers
    period = consensus_period(mask, local_steps=h)
    kind = mask.schedule.kind
    c = mask.coverage.astype(float)
    if kind == "permute":
        if period == 1:
            raise TheoryError("Theorem 6.2 is for masks held over rounds; a permute mask redrawn every round "
                              "is Theorem 6's case")
        bias_var = float(np.sum(c / k * permute_variance_coefficients(mask) * constants.zeta_sq))
    elif kind in ("cyclic", "sequence"):
        held = sum(mask.round_matrix(t * h).astype(float) for t in range(period))  # rounds each worker holds j
        if not np.allclose(held, held[:1]):
            raise TheoryError("Theorem 6.2 needs every worker to hold each block equally often over a period; "
                              f"this {kind} schedule does not")
        bias_var = 0.0
    else:
        raise TheoryError("Theorem 6.2 is for schedules that hold a mask over rounds (cyclic, sequence, permute "
                          "with every > local_steps), not a static mask")
    rounds = steps // h
    periods = rounds // period
    lip, lw = constants.smoothness, constants.local_smoothness
    lam_max = float(c.max()) / k
    eta_max = k / (lip * period * h * float(c.max()))
    room = 1.0 - lip * eta * period * h * lam_max
    if periods == 0:
        raise TheoryError(f"steps={steps} cover no complete period of {period * h} steps: Theorem 6.2 needs one")
    xi_bar = mean_deviation_bound(mask, constants, eta=eta, steps=periods * period * h, local_steps=h)
    if room <= 0.0 or not math.isfinite(xi_bar):
        return BoundTerms(math.inf, math.inf, math.inf, math.inf, eta, eta_max)
    s_h = (h - 1) * h * (2 * h - 1) / 6.0
    s_p = (period - 1) * period * (2 * period - 1) / 6.0
    g = _moments(mask, constants, eta=eta, local_steps=h, rounds=periods * period)[2].max(axis=0)
    psi = (math.sqrt(h * period * xi_bar) + eta * math.sqrt(h**3 * s_p * float(np.sum(c * c / k * g)))
           + eta * math.sqrt(period * s_h * float(np.sum(c * g)))) ** 2
    phi = lw**2 / k * psi
    optimization = constants.suboptimality / (eta * periods * period * h)
    bias = lip * eta * period * h * lam_max * bias_var
    variance = lip * eta * float(np.sum(c * constants.sigma_sq)) / k**2
    consensus_rest = lip * eta * lam_max * phi
    y = phi / (2.0 * period * h)  # the beta-term is y / beta
    a = optimization + bias + variance + consensus_rest
    s = math.sqrt(y)
    if s == 0.0:
        t = 0.0
    elif a == 0.0:
        t = room / s
    else:  # t minimises (a + s/t) / (room - t s/2); beta = sqrt(y) t
        t = (math.sqrt(s * s + 2.0 * a * room) - s) / a
    beta = s * t
    scale = k / (c.min() * (room - beta / 2.0))
    consensus = scale * ((y / beta if y > 0 else 0.0) + consensus_rest)
    return BoundTerms(scale * optimization, scale * bias, scale * variance, consensus, eta, eta_max)


def exported_overlap_bound(mask: Mask, constants: ProblemConstants, *, eta: float, steps: int,
                           local_steps: int = 1, initial: np.ndarray | None = None) -> float:
    """Corollary 6.1: bound on (1/R) sum_r E||grad f(z_r)||^2 for the exported model z_r (each block its
    holders' mean): (sqrt(Theorem 6) + L sqrt((1/R) sum_r sum_j E Xi_j(r) / c_j))^2."""
    total = overlap_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps, initial=initial).total
    spread = mean_deviation_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps, initial=initial,
                                  per_block_weight=1.0 / mask.coverage.astype(float))
    return (math.sqrt(total) + constants.smoothness * math.sqrt(spread)) ** 2


def overlap_max_step_size(mask: Mask, constants: ProblemConstants, *, local_steps: int = 1) -> float:
    """K / (2 L H c_max): Theorem 6 holds for every eta below it (its total is infinite there)."""
    return mask.workers / (2.0 * constants.smoothness * local_steps * float(mask.coverage.max()))


def optimal_overlap_step_size(mask: Mask, constants: ProblemConstants, *, steps: int, local_steps: int = 1) -> float:
    """The eta in (0, K/(2 L H c_max)) that minimises Theorem 6's bound for horizon `steps` (copies start equal)."""
    eta_max = overlap_max_step_size(mask, constants, local_steps=local_steps) * (1.0 - 1e-9)

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

    The consensus term uses the supremum over all horizons of Theorem 4.4's deviation bound,
    (d_j (P/(1 - q_j) + P - 1))^2 per block, so T = optimization * T' / (DDP - floor) suffices
    (T' the probe's horizon); ``inf`` when that floor is at or above DDP's bound. Each local step is a
    backward-masked step: compute fraction (2 + C)/3.
    """
    ddp = ddp_bound(mask, constants, eta=eta, steps=ddp_steps).total
    period = consensus_period(mask, local_steps=local_steps)
    drift = deviation_increments(mask, eta=eta, local_steps=local_steps, grad_sq=constants.grad_sq)
    gap = consensus_rates(mask, local_steps=local_steps)
    with np.errstate(divide="ignore"):
        reach = period / (1.0 - np.sqrt(np.clip(1.0 - gap, 0.0, 1.0))) + period - 1.0
    xi_sup = math.inf if np.any((gap <= 0.0) & (drift > 0.0)) else float(np.sum(np.where(drift > 0, reach**2 * drift, 0.0)))
    probe = _overlap_terms(mask, constants, eta=eta, steps=local_steps, local_steps=local_steps, xi_bar=xi_sup,
                           moment_sum=float(np.sum(mask.coverage * constants.grad_sq)))
    floor = probe.bias + probe.variance + probe.consensus
    gap_to_ddp = ddp - floor
    needed = math.inf if not gap_to_ddp > 0 else probe.optimization * local_steps / gap_to_ddp
    return FlopMatch(ddp_steps, ddp, needed, backward_masking_compute_fraction(mask))


def _overlap_terms(mask: Mask, constants: ProblemConstants, *, eta: float, steps: int, local_steps: int,
                   xi_bar: float, moment_sum: float, held_bias: tuple[float, float] | None = None) -> BoundTerms:
    """Theorem 6's terms at the alpha, beta that minimise the total (docs/theory.md §4); `moment_sum` is
    (1/R) sum_r sum_j c_j G_{j,r}^2. With `held_bias` (Theorem 6.3's alpha-numerator and added bias), the
    smaller of Theorems 6 and 6.3."""
    h, k, lip, lw = local_steps, mask.workers, constants.smoothness, constants.local_smoothness
    c = mask.coverage.astype(float)
    lam, lam_max = c / k, float(c.max()) / k  # the step each block's mean takes, relative to DDP's
    eps_sq, _, kappa = update_statistics(mask, local_steps=h)
    s_h = (h - 1) * h * (2 * h - 1) / 6.0
    zeta, eta_max = constants.zeta_sq, overlap_max_step_size(mask, constants, local_steps=h)
    room = 1.0 - 2.0 * lip * eta * h * lam_max  # 1 - theta before alpha/2 + beta/2
    if room <= 0.0 or not math.isfinite(xi_bar):
        return BoundTerms(math.inf, math.inf, math.inf, math.inf, eta, eta_max)
    bias_sum = float(np.sum(lam * eps_sq * zeta))
    drift = lw**2 / k * (math.sqrt(h * xi_bar) + eta * math.sqrt(s_h * moment_sum)) ** 2
    optimization = constants.suboptimality / (eta * steps)
    bias_rest = 2.0 * lip * eta * h * lam_max * bias_sum
    variance = lip * eta * h * lam_max * float(np.sum(lam * kappa * zeta)) \
        + lip * eta * float(np.sum(c * constants.sigma_sq)) / k**2
    consensus_rest = lip * eta * lam_max * drift
    y = drift / (2.0 * h)  # the beta-term is y / beta

    def terms(x: float, extra: float) -> BoundTerms:  # the alpha-term is x / alpha; `extra` joins the bias
        a = optimization + bias_rest + extra + variance + consensus_rest
        s = math.sqrt(x) + math.sqrt(y)
        if s == 0.0:
            t = 0.0
        elif a == 0.0:
            t = room / s
        else:  # t minimises (a + s/t) / (room - t s/2); alpha = sqrt(x) t, beta = sqrt(y) t
            t = (math.sqrt(s * s + 2.0 * a * room) - s) / a
        alpha, beta = math.sqrt(x) * t, math.sqrt(y) * t
        scale = k / (c.min() * (room - (alpha + beta) / 2.0))
        bias = scale * ((x / alpha if x > 0 else 0.0) + bias_rest + extra)
        consensus = scale * ((y / beta if y > 0 else 0.0) + consensus_rest)
        return BoundTerms(scale * optimization, bias, scale * variance, consensus, eta, eta_max)

    candidates = [terms(bias_sum / 2.0, 0.0)] + ([terms(*held_bias)] if held_bias is not None else [])
    return min(candidates, key=lambda t: t.total)


def bias_cancels_over_period(mask: Mask, *, local_steps: int = 1) -> bool:
    """Whether Theorem 6.3 applies: masks held over rounds whose bias cancels over a period (``cyclic``, a
    ``sequence`` in which every worker holds each block equally often, ``permute`` kept more than one round).

    >>> from masklab.mask import Schedule
    >>> m = Mask([[1, 1], [1, 0], [0, 1]])
    >>> [bias_cancels_over_period(m.replace(schedule=s)) for s in (None, Schedule("cyclic", 1), Schedule("permute", 1))]
    [False, True, False]
    """
    period = consensus_period(mask, local_steps=local_steps)
    if period < 2 or mask.schedule.kind == "static":
        return False
    if mask.schedule.kind == "permute":
        return True
    held = sum(mask.round_matrix(t * local_steps).astype(float) for t in range(period))
    return bool(np.allclose(held, held[:1]))


def _held_bias(mask: Mask, constants: ProblemConstants, *, eta: float, local_steps: int,
               moment: np.ndarray) -> tuple[float, float] | None:
    """Theorem 6.3's (x, extra) for masks held over rounds whose bias cancels over a period, else None.

    The alpha-term is x / alpha with x = kappa'^2 L_w^2 c_2 / 2 + f beta_b / 2, and the bracket gains
    extra = L sqrt(lam_max beta_b) c_1 + L sqrt(lam_max) kappa' L_w c_2, where c_1 = eta H G_m mean(t_r),
    c_2 = (eta H G_m)^2 mean(t_r^2) over the rounds r < R of periods that cancel (t_r = rounds since the
    period began), f the share of the others, G_m^2 = sum_j (c_j/K)^2 max_r G_{j,r}^2, kappa'^2 = max_j c_j eps_j^2 / K.
    """
    if not bias_cancels_over_period(mask, local_steps=local_steps):
        return None
    h, k, rounds = local_steps, mask.workers, moment.shape[0]
    period = consensus_period(mask, local_steps=h)
    kind = mask.schedule.kind
    c = mask.coverage.astype(float)
    lam = c / k
    eps_sq, _, _ = update_statistics(mask, local_steps=h)
    beta_b = float(np.sum(lam * eps_sq * constants.zeta_sq))
    shift, tilt, both = held_bias_coefficients(mask, constants, local_steps=h)
    r = np.arange(rounds)
    begun = r // period * period
    cancels = (begun + period <= rounds) | (kind == "permute")  # a permute period's bias has mean zero at once
    since = (r - begun)[cancels].astype(float)
    step = eta * h * math.sqrt(float(np.sum(lam**2 * moment.max(axis=0))))
    c1, c2 = step * since.sum() / rounds, step**2 * float(np.sum(since**2)) / rounds
    x = tilt**2 * c2 / 2.0 + (1.0 - cancels.mean()) * beta_b / 2.0
    return x, shift * c1 + both * c2


def held_bias_coefficients(mask: Mask, constants: ProblemConstants, *,
                           local_steps: int = 1) -> tuple[float, float, float]:
    """(L sqrt(lam_max beta_b), kappa' L_w, L sqrt(lam_max) kappa' L_w): Theorem 6.3's per-round bound
    <a_{r0}, Lambda b(w_r; xbar_{r0})> - <a_r, Lambda b_r>
        <= C1 ||delta|| + C2 ||a_r||_Lambda ||delta|| + C3 ||delta||^2,
    delta = xbar_r - xbar_{r0}, before Young's inequality and expectations (docs/theory.md, its proof (ii)-(iii)).

    >>> c = ProblemConstants(1.0, np.zeros(2), np.ones(2), 1.0, worker_smoothness=2.0)
    >>> [round(v, 6) for v in held_bias_coefficients(Mask([[1, 0], [1, 0], [0, 1], [0, 1]]), c)]
    [0.707107, 1.414214, 1.0]
    """
    k = mask.workers
    lam = mask.coverage.astype(float) / k
    lam_max = float(lam.max())
    eps_sq, _, _ = update_statistics(mask, local_steps=local_steps)
    beta_b = float(np.sum(lam * eps_sq * constants.zeta_sq))
    kappa = math.sqrt(float(np.max(lam * eps_sq)))
    lip, lw = constants.smoothness, constants.local_smoothness
    return lip * math.sqrt(lam_max * beta_b), kappa * lw, lip * math.sqrt(lam_max) * kappa * lw


def _projection(holders: np.ndarray, k: int) -> np.ndarray:
    """P_S: replace the holders' entries by their mean, leave the others."""
    p = np.eye(k)
    if holders.size:
        p[np.ix_(holders, holders)] = 1.0 / holders.size
    return p

