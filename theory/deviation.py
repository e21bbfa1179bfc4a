"""Consensus-deviation bounds round by round, from per-round displacement sizes (docs/theory.md §4).

Overlap averaging moves block j's centred copies, round s, by u_s m_s^T: u_s = 1_S - (c_j/K) 1 in
worker space (S the round's holder set) times m_s, the holders' mean displacement. What the bounds
take per round s and block j:

* ``drift[s, j]``: an L2 bound on the part of m_s that is not a martingale difference (all of m_s
  when no split is known), eta H G_{j,s};
* ``noise[s, j]``: E||n_s||^2 of its martingale-difference part (zero without a split).

Theorem 4.7 (`gram_deviation`) is for deterministic schedules: it keeps the angles between the
directions the rounds' displacements take, where Theorem 4.6 adds their lengths. Theorem 4.8
(`permute_deviation`) is for ``permute`` schedules: a second-moment recursion over the fresh holder
set of each period, where Theorem 4.4 adds lengths. Both return a bound on E Xi_j(r) per round and
block. This module takes arrays, knows no `Mask` and evaluates no convergence bound
(`theory.consensus` wires it to masks and to Theorem 6).
"""

from __future__ import annotations

import numpy as np

_GRAM_WORK = 20_000_000  # B K W^3 per window of W rounds; Theorems 4.6/4.4 take over beyond this budget
_WINDOW = 48  # rounds per window of Theorem 4.7 (rounded up to whole periods)


def permute_deviation(coverage: np.ndarray, workers: int, period: int, initial: np.ndarray,
                      drift: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Theorem 4.8: bound on E Xi_j(r), r = 0..R, shape (R + 1, B), for a fresh uniform holder set per period.

    Within a period of `period` rounds the holder set S (|S| = c_j) is fixed; with X the bound at the
    period start, M_t the summed drift and V_t the summed noise of its first t rounds,
    E Xi_j(start + t) <= (1 - rho) X + 2 sqrt(mu c X) M_t + c (1 - c/K) (M_t + sqrt(V_t))^2,
    rho = (c - 1)/(K - 1), mu = (K - c)/(K (K - 1)).

    >>> permute_deviation(np.array([1]), 2, 1, np.array([0.0]), np.ones((2, 1)), np.zeros((2, 1))).ravel().tolist()
    [0.0, 0.5, 2.0]
    """
    c = np.asarray(coverage, dtype=float)
    rounds = drift.shape[0]
    out = np.zeros((rounds + 1, c.size))
    out[0] = initial
    if workers == 1:
        return out
    rho = (c - 1.0) / (workers - 1.0)
    mu_c = c * (workers - c) / (workers * (workers - 1.0))
    spread = c * (1.0 - c / workers)
    x = np.asarray(initial, dtype=float)
    steady = _steady_state(rho, mu_c, spread, drift, noise, period)
    for start in range(0, rounds, period):
        steps = min(period, rounds - start)
        moved = np.cumsum(drift[start:start + steps], axis=0)
        shaken = np.sqrt(np.cumsum(noise[start:start + steps], axis=0))
        within = (1.0 - rho) * x + 2.0 * np.sqrt(mu_c * x) * moved + spread * (moved + shaken) ** 2
        out[start + 1:start + steps + 1] = within
        if steps == period and steady is not None and np.allclose(within[-1], x, rtol=1e-13, atol=0.0):
            # the period map is increasing, so the X_n are monotone: from here on every X_n lies between the
            # current one and the fixed point, and the larger of the two bounds every later round
            x = np.maximum(within[-1], steady)
            tail = (1.0 - rho) * x + 2.0 * np.sqrt(mu_c * x) * moved + spread * (moved + shaken) ** 2
            rest = out[start + steps + 1:]
            rest[:] = np.resize(tail, (-(-rest.shape[0] // period) * period, x.size))[:rest.shape[0]]
            return out
        x = within[-1]
    return out


def _steady_state(rho, mu_c, spread, drift, noise, period) -> np.ndarray | None:
    """The fixed point X* of Theorem 4.8's period map when every round has the same drift and noise, else None."""
    if drift.shape[0] < period or np.ptp(drift, axis=0).any() or np.ptp(noise, axis=0).any() or np.any(rho <= 0):
        return None
    moved, shaken = period * drift[0], np.sqrt(period * noise[0])
    root = (np.sqrt(mu_c) * moved + np.sqrt(mu_c * moved**2 + rho * spread * (moved + shaken) ** 2)) / rho
    return root**2


def gram_deviation(held: np.ndarray, initial: np.ndarray, drift: np.ndarray, noise: np.ndarray,
                   *, work: int = _GRAM_WORK) -> tuple[np.ndarray, int]:
    """Theorem 4.7 for a deterministic schedule whose holder sets repeat with period P.

    Parameters
    ----------
    held : ndarray of shape (P, K, B), bool
        Round t's holders of each block, for t = 0..P-1 (round s uses ``held[s % P]``).
    initial : ndarray of shape (B,)
        Xi_j(0).
    drift, noise : ndarray of shape (R, B)
        Per round, as in the module docstring.

    Returns
    -------
    bound : ndarray of shape (R' + 1, B)
        Bound on E Xi_j(r) for r = 0..R', R' <= R the rounds the work budget covered.
    covered : int
        R'. Windows of whole periods restart from the bound at their first round (a period start).
    """
    period, k, b = held.shape
    rounds = drift.shape[0]
    window = period * max(1, -(-_WINDOW // period))
    proj = _projections(held)  # (P, B, K, K)
    u = held - held.sum(axis=1, keepdims=True) / k  # (P, K, B)
    size = np.sqrt(np.sum(u * u, axis=1))  # ||u_s||, (P, B)
    unit = np.divide(u, size[:, None, :], out=np.zeros_like(u), where=size[:, None, :] > 0).transpose(0, 2, 1)
    centre = np.eye(k) - 1.0 / k
    out = [np.asarray(initial, dtype=float)]
    budget = work
    start = 0
    while start < rounds and budget >= b * k * window**3:
        budget -= b * k * window**3
        steps = min(window, rounds - start)
        x0 = out[-1]
        directions = np.zeros((b, k, steps))  # column i: Pi_{t <- start+i+1} u_{start+i} / ||u||
        product = np.broadcast_to(centre, (b, k, k)).copy()
        for t in range(steps):
            phase = t % period
            directions[:, :, t] = unit[phase]
            directions[:, :, :t + 1] = proj[phase] @ directions[:, :, :t + 1]
            product = proj[phase] @ product
            lengths = size[np.arange(t + 1) % period].T * drift[start:start + t + 1].T  # (B, t+1): ||u_s|| D_s
            shakes = size[np.arange(t + 1) % period].T ** 2 * noise[start:start + t + 1].T
            gram = np.abs(np.einsum("bks,bkq->bsq", directions[:, :, :t + 1], directions[:, :, :t + 1]))
            coherent = np.einsum("bs,bsq,bq->b", lengths, gram, lengths)
            martingale = np.einsum("bss,bs->b", gram, shakes)
            top = np.linalg.norm(product, ord=2, axis=(1, 2))
            out.append((top * np.sqrt(x0) + np.sqrt(coherent) + np.sqrt(martingale)) ** 2)
        start += steps
    return np.stack(out), start


def _projections(held: np.ndarray) -> np.ndarray:
    """P_S for every round and block, shape (P, B, K, K): the holders' entries replaced by their mean."""
    period, k, b = held.shape
    h = held.transpose(0, 2, 1).astype(float)  # (P, B, K)
    c = h.sum(axis=2, keepdims=True)
    mean = np.divide(h[..., :, None] * h[..., None, :], c[..., None], out=np.zeros((period, b, k, k)),
                     where=c[..., None] > 0)
    return mean + np.eye(k) * (1.0 - h)[..., :, None]
