"""Simulators that run SDP exactly as docs/design.md §3-4 describes, on a `theory.problems.Problem`.

`simulate` runs K workers with stepwise averaging (H = 1) or H local steps between averagings; each
worker updates only its held blocks, each block is averaged over its holders (w_j = M[:, j]/c_j)
and the holders' value reaches every worker, so all workers restart each round from one iterate.
Backward masking evaluates gradients at the full model; forward masking at the model with the
worker's non-held blocks zeroed (the worker lacks them; no theorem covers this). `simulate_consensus`
runs overlap averaging, where non-holders keep their own copy (docs/theory.md, Theorem 4).

Seeds are simulated side by side as one (S, K, d) array; the schedule of seed s uses its own draw, so
the seeds are independent replicas. Every gradient is exact plus Gaussian noise of per-block
variance sigma_j^2. This module evaluates no bound (see `theory.bounds`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from masklab.mask import Mask
from theory.bounds import ProblemConstants, _check_rounds_align
from theory.errors import TheoryError
from theory.problems import Problem

MASKINGS = ("backward", "forward")
_SLACK = 1e-9  # relative float round-off allowed when checking a constant against its observed value


@dataclass(frozen=True, eq=False)
class SimulationResult:
    """What `simulate` measured.

    Attributes
    ----------
    per_seed : ndarray of shape (S,)
        (1/R) sum_r ||grad f(x_r)||^2 of each seed over the R averaging rounds.
    curve : ndarray of shape (R,)
        ||grad f(x_r)||^2 averaged over seeds, per round.
    zeta_sq_seen, grad_sq_seen : ndarray of shape (B,)
        Largest heterogeneity (A3) at any visited iterate, and largest worker block-gradient second
        moment ||grad_j f_k(y)||^2 + sigma_j^2 over held blocks at any visited local point (A6).
    """

    per_seed: np.ndarray
    curve: np.ndarray
    zeta_sq_seen: np.ndarray
    grad_sq_seen: np.ndarray
    local_steps: int
    masking: str

    @property
    def measured(self) -> float:
        """The estimate of (1/R) sum_r E||grad f(x_r)||^2: the mean over seeds."""
        return float(self.per_seed.mean())

    @property
    def stderr(self) -> float:
        """Standard error of `measured` (sample standard deviation over sqrt(S))."""
        return float(self.per_seed.std(ddof=1) / np.sqrt(self.per_seed.size))

    @property
    def running_average(self) -> np.ndarray:
        """(1/R) sum_{r<R} E||grad f(x_r)||^2 for R = 1..rounds: what the bound bounds at each horizon."""
        return np.cumsum(self.curve) / np.arange(1, self.curve.size + 1)

    def assumptions_hold(self, constants: ProblemConstants) -> bool:
        """Whether the heterogeneity (and, for local steps, gradient) bounds held at every visited point."""
        ok = bool(np.all(self.zeta_sq_seen <= constants.zeta_sq * (1 + _SLACK) + _SLACK))
        if self.local_steps > 1 and constants.grad_sq is not None:
            ok = ok and bool(np.all(self.grad_sq_seen <= constants.grad_sq * (1 + _SLACK)))
        return ok


def simulate(
    problem: Problem,
    mask: Mask,
    *,
    eta: float,
    steps: int,
    local_steps: int = 1,
    masking: str = "backward",
    seeds: int = 8,
    seed: int | np.random.Generator | None = None,
) -> SimulationResult:
    """Run SDP for `steps` local steps (R = steps / H averaging rounds) on `seeds` replicas.

    Examples
    --------
    >>> from theory.problems import make_quadratic
    >>> q = make_quadratic([4, 4], 2, smoothness=1.0, sigma=0.0, zeta=0.0, suboptimality=1.0, seed=0)
    >>> r = simulate(q, Mask([[1, 1], [1, 1]]), eta=1.0, steps=4, seeds=2, seed=0)
    >>> r.curve.shape, bool(r.curve[-1] < r.curve[0])
    ((4,), True)
    """
    h = _check_run(problem, mask, eta=eta, steps=steps, local_steps=local_steps, masking=masking, seeds=seeds)
    rng = np.random.default_rng(seed)
    schedule_seeds = rng.integers(2**63, size=seeds).tolist()
    sizes = np.asarray(problem.block_sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    k, d = mask.workers, problem.dim
    noise_std = problem.noise_std
    sigma_sq = problem.constants.sigma_sq
    inv_c = np.repeat(1.0 / mask.coverage, sizes)
    x = np.broadcast_to(problem.x0, (seeds, d)).copy()
    rounds = steps // h
    curve = np.empty((rounds, seeds))
    zeta_seen = np.zeros(mask.blocks)
    grad_seen = np.zeros(mask.blocks)
    for r in range(rounds):
        held_blocks = _round_masks(mask, r * h, schedule_seeds)  # (S, K, B)
        held = np.repeat(held_blocks, sizes, axis=2)  # (S, K, d)
        at_x = problem.worker_grads(np.broadcast_to(x[:, None, :], (seeds, k, d)))
        full = at_x.mean(axis=1)
        curve[r] = np.einsum("sd,sd->s", full, full)
        spread = at_x - full[:, None, :]
        het = np.add.reduceat(np.einsum("skd,skd->sd", spread, spread) / k, starts, axis=1)
        zeta_seen = np.maximum(zeta_seen, het.max(axis=0))
        local = np.broadcast_to(x[:, None, :], (seeds, k, d)).copy()
        for step in range(h):
            if step == 0 and masking == "backward":
                grads = at_x
            else:
                grads = problem.worker_grads(local * held if masking == "forward" else local)
            if h > 1:
                sq = np.add.reduceat(grads * grads, starts, axis=2) + sigma_sq
                grad_seen = np.maximum(grad_seen, np.where(held_blocks > 0, sq, 0.0).max(axis=(0, 1)))
            grads = grads + rng.standard_normal((seeds, k, d)) * noise_std
            local -= eta * held * grads
        x = np.einsum("skd,skd->sd", held, local) * inv_c
    return SimulationResult(curve.mean(axis=0), curve.mean(axis=1), zeta_seen, grad_seen, h, masking)


@dataclass(frozen=True, eq=False)
class ConsensusResult:
    """What `simulate_consensus` measured.

    Attributes
    ----------
    deviation : ndarray of shape (S, rounds + 1)
        Xi at the start of every round (and after the last).
    initial : ndarray of shape (S, B)
        Each seed's starting Xi_j.
    grad_sq_seen : ndarray of shape (B,)
        Largest worker block-gradient second moment at a held block at any local point (A6).
    mean_grad_norm_sq : ndarray of shape (S, rounds)
        ||grad f(xbar_r)||^2 at the mean of the copies at the start of each round (Theorem 6).
    zeta_sq_seen : ndarray of shape (B,)
        Largest heterogeneity (A3) at any visited mean xbar_r.
    exported_grad_norm_sq : ndarray of shape (S, rounds)
        ||grad f(z_r)||^2 at the exported model z_r: each block its last holders' mean (Corollary 6.1;
        round 0 uses its own holders).
    round_grad_sq_seen : ndarray of shape (rounds, B)
        Per round, the largest holders' mean of the noise-free block-gradient second moment,
        (1/c_j) sum_{k in S_j} ||grad_j f_k(y)||^2, over seeds and local points (A6r); 0 without local steps.
    bias_cross, weighted_grad_sq : ndarray of shape (S, rounds)
        <a_r, Lambda b_r> and ||a_r||_Lambda^2 with a_r = grad f(xbar_r), Lambda = diag(c_j/K) and b_r the
        masking bias of round r's mask at xbar_r (Lemma 1): the bias cross term of Theorems 6 and 6.3.
    """

    deviation: np.ndarray
    initial: np.ndarray
    grad_sq_seen: np.ndarray
    mean_grad_norm_sq: np.ndarray
    zeta_sq_seen: np.ndarray
    exported_grad_norm_sq: np.ndarray
    round_grad_sq_seen: np.ndarray
    bias_cross: np.ndarray
    weighted_grad_sq: np.ndarray

    @property
    def measured(self) -> float:
        """The estimate of (1/R) sum_r E||grad f(xbar_r)||^2: mean over rounds and seeds."""
        return float(self.mean_grad_norm_sq.mean())

    @property
    def stderr(self) -> float:
        per_seed = self.mean_grad_norm_sq.mean(axis=1)
        return float(per_seed.std(ddof=1) / np.sqrt(per_seed.size))


def simulate_consensus(
    problem: Problem,
    mask: Mask,
    *,
    rounds: int,
    eta: float = 0.0,
    local_steps: int = 1,
    initial_spread: float = 1.0,
    seeds: int = 8,
    seed: int | np.random.Generator | None = None,
) -> ConsensusResult:
    """Overlap averaging: local steps on held blocks, then each block averaged among its holders only.

    Worker copies start at x_0 plus independent N(0, initial_spread^2) offsets per coordinate.
    Backward masking: each worker's gradient is taken at its own full copy.

    >>> from masklab.mask import Schedule
    >>> from theory.problems import make_quadratic
    >>> q = make_quadratic([2], 3, smoothness=1.0, sigma=0.0, zeta=0.0, suboptimality=1.0, seed=0)
    >>> res = simulate_consensus(q, Mask([[1], [1], [1]]), rounds=1, seeds=2, seed=0)
    >>> float(res.deviation[:, 1].max()) < 1e-20  # a block held by everyone is averaged exactly
    True
    """
    h = _check_run(problem, mask, eta=eta, steps=max(rounds, 1) * local_steps, local_steps=local_steps,
                   masking="backward", seeds=seeds, allow_zero_eta=True)
    if not (np.isfinite(initial_spread) and initial_spread >= 0):
        raise TheoryError(f"initial_spread={initial_spread!r} must be a finite number >= 0")
    rng = np.random.default_rng(seed)
    schedule_seeds = rng.integers(2**63, size=seeds).tolist()
    sizes = np.asarray(problem.block_sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    k, d = mask.workers, problem.dim
    inv_c = np.repeat(1.0 / mask.coverage, sizes)
    copies = problem.x0 + initial_spread * rng.standard_normal((seeds, k, d))
    deviation = np.empty((seeds, rounds + 1))
    grad_seen = np.zeros(mask.blocks)

    def per_block_deviation(y: np.ndarray) -> np.ndarray:
        centred = y - y.mean(axis=1, keepdims=True)
        return np.add.reduceat(np.einsum("skd,skd->sd", centred, centred), starts, axis=1)

    initial = per_block_deviation(copies)
    deviation[:, 0] = initial.sum(axis=1)
    mean_grad = np.empty((seeds, rounds))
    exported_grad = np.empty((seeds, rounds))
    zeta_seen = np.zeros(mask.blocks)
    round_seen = np.zeros((rounds, mask.blocks))
    bias_cross = np.empty((seeds, rounds))
    weighted = np.empty((seeds, rounds))
    step_share = np.repeat(mask.coverage / k, sizes)  # Lambda, per coordinate
    last_held = None
    for r in range(rounds):
        held_blocks = _round_masks(mask, r * h, schedule_seeds)
        held = np.repeat(held_blocks, sizes, axis=2)
        exported = np.einsum("skd,skd->sd", held if last_held is None else last_held, copies) * inv_c
        at_export = problem.worker_grads(np.broadcast_to(exported[:, None, :], copies.shape)).mean(axis=1)
        exported_grad[:, r] = np.einsum("sd,sd->s", at_export, at_export)
        at_mean = problem.worker_grads(np.broadcast_to(copies.mean(axis=1, keepdims=True), copies.shape))
        full = at_mean.mean(axis=1)
        mean_grad[:, r] = np.einsum("sd,sd->s", full, full)
        spread = at_mean - full[:, None, :]
        het = np.add.reduceat(np.einsum("skd,skd->sd", spread, spread) / k, starts, axis=1)
        zeta_seen = np.maximum(zeta_seen, het.max(axis=0))
        bias = np.einsum("skd,skd->sd", held * inv_c - 1.0 / k, spread)  # Lemma 1's b at the mean
        bias_cross[:, r] = np.einsum("sd,d,sd->s", full, step_share, bias)
        weighted[:, r] = np.einsum("sd,d,sd->s", full, step_share, full)
        for _ in range(h if eta > 0 else 0):
            grads = problem.worker_grads(copies)
            clean = np.add.reduceat(grads * grads, starts, axis=2)
            holders_mean = np.einsum("skb,skb->sb", held_blocks, clean) / mask.coverage
            round_seen[r] = np.maximum(round_seen[r], holders_mean.max(axis=0))
            sq = clean + problem.constants.sigma_sq
            grad_seen = np.maximum(grad_seen, np.where(held_blocks > 0, sq, 0.0).max(axis=(0, 1)))
            grads = grads + rng.standard_normal((seeds, k, d)) * problem.noise_std
            copies = copies - eta * held * grads
        holder_mean = np.einsum("skd,skd->sd", held, copies) * inv_c
        copies = np.where(held > 0, holder_mean[:, None, :], copies)
        deviation[:, r + 1] = per_block_deviation(copies).sum(axis=1)
        last_held = held
    return ConsensusResult(deviation, initial, grad_seen, mean_grad, zeta_seen, exported_grad, round_seen,
                           bias_cross, weighted)


def _round_masks(mask: Mask, step: int, schedule_seeds: list[int]) -> np.ndarray:
    """The (S, K, B) 0/1 masks in force at `step`, one per seed's schedule draw."""
    if mask.schedule.is_static:
        return np.broadcast_to(mask.matrix.astype(float), (len(schedule_seeds),) + mask.matrix.shape)
    return np.stack([mask.round_matrix(step, seed=s) for s in schedule_seeds]).astype(float)


def _check_run(problem: Problem, mask: Mask, *, eta: float, steps: int, local_steps: int, masking: str,
               seeds: int, allow_zero_eta: bool = False) -> int:
    if masking not in MASKINGS:
        raise TheoryError(f"masking={masking!r} is not one of {MASKINGS}")
    if mask.workers != problem.workers or mask.blocks != len(problem.block_sizes):
        raise TheoryError(
            f"mask is {mask.workers} workers x {mask.blocks} blocks but the problem has "
            f"{problem.workers} workers and {len(problem.block_sizes)} blocks"
        )
    if mask.block_sizes is not None and tuple(mask.block_sizes) != tuple(problem.block_sizes):
        raise TheoryError(f"mask block sizes {mask.block_sizes} differ from the problem's {problem.block_sizes}")
    if not np.isfinite(eta) or eta < 0 or (eta == 0 and not allow_zero_eta):
        raise TheoryError(f"eta={eta!r} must be a finite step size > 0")
    if isinstance(local_steps, bool) or not isinstance(local_steps, (int, np.integer)) or local_steps < 1:
        raise TheoryError(f"local_steps={local_steps!r} must be an integer >= 1")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < local_steps \
            or steps % local_steps:
        raise TheoryError(f"steps={steps!r} must be a positive multiple of local_steps={local_steps}")
    _check_rounds_align(mask, local_steps)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, np.integer)) or seeds < 2:
        raise TheoryError(f"seeds={seeds!r} must be an integer >= 2 (the standard error needs two)")
    return int(local_steps)
