"""Consensus deviation under overlap averaging (docs/theory.md, Theorem 4).

Overlap averaging: every worker keeps a full copy of the model; in each averaging round block j is
replaced by its holders' mean on the holders only, and non-holders keep their own copy. The
consensus deviation is Xi = sum_j sum_k ||x_{k,j} - xbar_j||^2. This module evaluates the per-block
contraction rates and the deviation bound; it does not simulate (see `theory.simulate`).

The rate of block j is rho_j = lambda_2(E[L_{S_j}]), the gap of its expected holder-set Laplacian.
A holder set drawn uniformly afresh each round (``permute`` redrawn every round) gives
rho_j = (c_j - 1)/(K - 1), whose block mean is the mixing-graph gap gamma(M); a balanced mask
therefore contracts at exactly 1 - gamma per round. A fixed holder set (static, cyclic, or a
permutation kept for several rounds) gives rho_j = 0 unless c_j = K: its non-holders never see the
average, so no positive rate can be proved.
"""

from __future__ import annotations

import math

import numpy as np

from masklab.mask import Mask
from theory.bounds import redraws_every_update
from theory.errors import AssumptionError, TheoryError


def consensus_rates(mask: Mask, *, local_steps: int = 1) -> np.ndarray:
    """Per-block contraction rates rho_j in [0, 1], shape (B,).

    >>> from masklab.mask import Schedule
    >>> consensus_rates(Mask([[1, 1], [1, 0], [0, 1]], schedule=Schedule("permute", 1))).tolist()
    [0.5, 0.5]
    >>> consensus_rates(Mask([[1, 1], [1, 0], [0, 1]])).tolist()
    [0.0, 0.0]
    """
    k = mask.workers
    c = mask.coverage.astype(float)
    if k == 1:
        return np.ones(mask.blocks)
    if redraws_every_update(mask, local_steps=local_steps):
        return (c - 1.0) / (k - 1.0)
    return np.where(c == k, 1.0, 0.0)


def consensus_rate(mask: Mask, *, local_steps: int = 1) -> float:
    """The rate that bounds the total deviation, min_j rho_j (= gamma(M) for a balanced permute mask)."""
    return float(consensus_rates(mask, local_steps=local_steps).min())


def consensus_deviation_bound(
    mask: Mask,
    initial: np.ndarray,
    *,
    rounds: int,
    eta: float = 0.0,
    local_steps: int = 1,
    grad_sq: np.ndarray | None = None,
) -> np.ndarray:
    """Bound on E[Xi_r] for r = 0..rounds, shape (rounds + 1,).

    Parameters
    ----------
    initial : ndarray of shape (B,)
        Xi_j at round 0, per block.
    eta, local_steps :
        Each round, every worker takes `local_steps` steps of size `eta` on its held blocks before
        the averaging. With ``eta = 0`` the bound is sum_j (1 - rho_j)^r Xi_j(0).
    grad_sq : ndarray of shape (B,), optional
        G_j^2 (Assumption A6), required when eta > 0. Then
        E Xi_j(r) <= (1 - rho_j/2)^r Xi_j(0) + 6 eta^2 H^2 c_j G_j^2 / rho_j^2 (inf where rho_j = 0).

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
    rho = consensus_rates(mask, local_steps=local_steps)
    r = np.arange(rounds + 1)[:, None]
    if eta == 0.0:
        return ((1.0 - rho) ** r * initial).sum(axis=1)
    if grad_sq is None:
        raise AssumptionError("a deviation bound with local steps (eta > 0) needs grad_sq (G_j^2, A6)")
    grad_sq = np.asarray(grad_sq, dtype=float)
    if grad_sq.shape != (mask.blocks,):
        raise TheoryError(f"grad_sq has shape {grad_sq.shape}, expected ({mask.blocks},)")
    drift = eta**2 * local_steps**2 * mask.coverage * grad_sq
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.where(drift == 0.0, 0.0, 6.0 * drift / rho**2)
    return ((1.0 - rho / 2.0) ** r * initial + floor).sum(axis=1)
