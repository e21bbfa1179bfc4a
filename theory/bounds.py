"""Convergence bounds for backward-masked SDP with a given `Mask` (docs/theory.md, Theorems 1-3, 2').

Every function evaluates a proved bound: the optimization, bias, variance and consensus terms of
the average squared gradient norm, the step-size condition, the step size that minimises the bound
for a horizon T, and the FLOP-matched comparison with DDP. This module does not simulate (see
`theory.simulate`) and does not prove anything itself: the constants here are the ones proved in
docs/theory.md, and a change to one must change the proof.

Which mask statistics enter depends on whether the update uses a mask drawn independently of the
iterate (docs/theory.md §2.3): only a ``permute`` schedule redrawn at every update (``every`` equal
to the local steps H) is; a static mask, a ``cyclic`` rotation or a permutation held for several
updates is bounded through the mask in force, eps_j^2 = K/c_j - 1, with no weight-variance term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from masklab.mask import Mask
from theory.errors import AssumptionError, TheoryError
from theory.holder_sets import permute_variance_coefficients


@dataclass(frozen=True, eq=False)
class ProblemConstants:
    """The constants of Assumptions A1-A5 (docs/theory.md §1), per block where they are per block.

    Parameters
    ----------
    smoothness : float
        L: f is L-smooth.
    sigma_sq : ndarray of shape (B,)
        sigma_j^2: bound on each worker's stochastic-gradient variance on block j.
    zeta_sq : ndarray of shape (B,)
        zeta_j^2: bound on (1/K) sum_k ||grad_j f_k - grad_j f||^2 at every iterate.
    suboptimality : float
        f(x_0) - f^* (an upper bound on it).
    worker_smoothness : float, optional
        Each f_k is this smooth (A5, local steps only). Defaults to `smoothness`.
    grad_sq : ndarray of shape (B,), optional
        G_j^2: bound on each worker's second moment E||g_{k,j}||^2 (A6, local steps only).
    round_grad_sq : ndarray of shape (R, B), optional
        Ghat_{j,r}^2: per round r, bound on the holders' mean of the noise-free block gradient second
        moment (A6r, overlap averaging only; docs/theory.md Theorem 4.7). Row r is round r.
    """

    smoothness: float
    sigma_sq: np.ndarray
    zeta_sq: np.ndarray
    suboptimality: float
    worker_smoothness: float | None = None
    grad_sq: np.ndarray | None = None
    round_grad_sq: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("smoothness", "suboptimality"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value)) or value < 0:
                raise TheoryError(f"{name}={value!r} must be a finite number >= 0")
        if self.smoothness <= 0:
            raise TheoryError(f"smoothness={self.smoothness!r} must be > 0")
        if self.worker_smoothness is not None and not self.worker_smoothness >= self.smoothness:
            raise TheoryError(
                f"worker_smoothness={self.worker_smoothness!r} must be >= smoothness={self.smoothness!r} "
                "(f is the average of the f_k, so it is at least as smooth)"
            )
        for name in ("sigma_sq", "zeta_sq", "grad_sq"):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.asarray(value, dtype=float)
            if arr.ndim != 1 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise TheoryError(f"{name}={value!r} must be a 1-D array of finite numbers >= 0")
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if self.round_grad_sq is not None:
            arr = np.array(self.round_grad_sq, dtype=float)
            if arr.ndim != 2 or arr.shape[1] != np.size(self.sigma_sq) or not np.all(np.isfinite(arr)) \
                    or np.any(arr < 0):
                raise TheoryError(f"round_grad_sq must be an (R, {np.size(self.sigma_sq)}) array of finite numbers "
                                  f">= 0 (one row per round), got shape {arr.shape}")
            arr.setflags(write=False)
            object.__setattr__(self, "round_grad_sq", arr)
        if self.sigma_sq.shape != self.zeta_sq.shape:
            raise TheoryError(
                f"sigma_sq has {self.sigma_sq.size} blocks but zeta_sq has {self.zeta_sq.size}"
            )

    @property
    def local_smoothness(self) -> float:
        """The smoothness of every f_k (A5), `smoothness` unless set."""
        return self.smoothness if self.worker_smoothness is None else float(self.worker_smoothness)


@dataclass(frozen=True)
class BoundTerms:
    """The bound on (1/R) sum_r E||grad f(x_r)||^2 over the R averaging rounds, term by term."""

    optimization: float
    bias: float
    variance: float
    consensus: float
    eta: float
    eta_max: float

    @property
    def total(self) -> float:
        return self.optimization + self.bias + self.variance + self.consensus

    @property
    def step_size_ok(self) -> bool:
        """Whether eta satisfies the theorem's condition 0 < eta <= eta_max (else the total proves nothing)."""
        return 0.0 < self.eta <= self.eta_max


@dataclass(frozen=True)
class FlopMatch:
    """SDP steps needed to reach DDP's bound, and what they cost relative to DDP's steps."""

    ddp_steps: int
    ddp_bound: float
    sdp_steps: float
    compute_fraction: float

    @property
    def compute_ratio(self) -> float:
        """SDP compute / DDP compute = sdp_steps * compute_fraction / ddp_steps (inf if unreachable)."""
        return self.sdp_steps * self.compute_fraction / self.ddp_steps


def constants_from_totals(
    mask: Mask,
    *,
    smoothness: float,
    sigma: float,
    zeta: float,
    suboptimality: float,
    grad_bound: float | None = None,
) -> ProblemConstants:
    """Spread totals sigma^2 = sum_j sigma_j^2 (likewise zeta^2, G^2) over the mask's blocks.

    Blocks get shares proportional to `mask.block_sizes` when the mask records sizes, equal shares
    otherwise.

    >>> c = constants_from_totals(Mask([[1, 1]], block_sizes=[3, 1]), smoothness=1.0, sigma=2.0,
    ...                           zeta=0.0, suboptimality=1.0)
    >>> c.sigma_sq.tolist()
    [3.0, 1.0]
    """
    for name, value in (("sigma", sigma), ("zeta", zeta), ("grad_bound", grad_bound)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise TheoryError(f"{name}={value!r} must be a finite number >= 0")
    sizes = np.ones(mask.blocks) if mask.block_sizes is None else np.asarray(mask.block_sizes, float)
    share = sizes / sizes.sum()
    return ProblemConstants(
        smoothness=smoothness,
        sigma_sq=sigma**2 * share,
        zeta_sq=zeta**2 * share,
        suboptimality=suboptimality,
        grad_sq=None if grad_bound is None else grad_bound**2 * share,
    )


def max_step_size(smoothness: float, *, local_steps: int = 1) -> float:
    """The largest step size the theorems admit: 1/L for stepwise averaging, 1/(2 L H) for H local steps.

    >>> max_step_size(4.0), max_step_size(4.0, local_steps=2)
    (0.25, 0.0625)
    """
    _check_local_steps(local_steps)
    if not smoothness > 0:
        raise TheoryError(f"smoothness={smoothness!r} must be > 0")
    return 1.0 / smoothness if local_steps == 1 else 1.0 / (2.0 * smoothness * local_steps)


def redraws_every_update(mask: Mask, *, local_steps: int = 1) -> bool:
    """Whether the mask of each update is drawn afresh, independently of the iterate (Theorem 2)."""
    return mask.schedule.kind == "permute" and mask.schedule.every == local_steps


def update_statistics(mask: Mask, *, local_steps: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(eps_j^2, E[1/c_j], kappa_j) as they enter the bound, each of shape (B,).

    For a mask redrawn at every update eps_j = 0 and kappa_j = 1 - K rho_j / c_j, the
    heterogeneity-variance coefficient of Theorem 2' (rho_j the holder-set gap,
    `theory.holder_sets`); otherwise the bound holds for the mask in force at each update,
    eps_j^2 = K/c_j - 1 and kappa_j = 0.
    """
    _check_rounds_align(mask, local_steps)
    k = mask.workers
    inv_c = 1.0 / mask.coverage.astype(float)
    if redraws_every_update(mask, local_steps=local_steps):
        return np.zeros(mask.blocks), inv_c, permute_variance_coefficients(mask)
    return np.maximum(k * inv_c - 1.0, 0.0), inv_c, np.zeros(mask.blocks)


def sdp_bound(
    mask: Mask, constants: ProblemConstants, *, eta: float, steps: int, local_steps: int = 1
) -> BoundTerms:
    """Evaluate the bound of Theorem 2 (H = 1) or Theorem 3 (H local steps) term by term.

    The bound is on (1/R) sum_r E||grad f(x_r)||^2 over the R = steps / H averaging rounds. It is
    proved only when ``terms.step_size_ok``; the terms are returned either way so a caller can
    report them.

    Examples
    --------
    >>> m = Mask([[1, 1], [1, 0]])
    >>> c = constants_from_totals(m, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    >>> t = sdp_bound(m, c, eta=0.5, steps=100)
    >>> round(t.optimization, 6), round(t.bias, 6), round(t.variance, 6), t.consensus
    (0.04, 0.5, 0.375, 0.0)
    """
    _check_mask_constants(mask, constants)
    _check_eta_steps(eta, steps, local_steps)
    h = local_steps
    eps_sq, inv_c, kappa = update_statistics(mask, local_steps=h)
    lip = constants.smoothness
    sigma_term = float(np.sum(inv_c * constants.sigma_sq))
    weight_term = float(np.sum(kappa * constants.zeta_sq))
    bias = float(np.sum(eps_sq * constants.zeta_sq))
    eta_max = max_step_size(lip, local_steps=h)
    d0 = constants.suboptimality
    if h == 1:
        return BoundTerms(2.0 * d0 / (eta * steps), bias, lip * eta * (sigma_term + weight_term), 0.0,
                          eta, eta_max)
    if constants.grad_sq is None:
        raise AssumptionError(
            f"local_steps={h} needs a bound on the per-worker gradient second moment "
            "(grad_sq, `--grad-bound`): Theorem 3 bounds the local drift with it"
        )
    drift = _drift_second_moment(mask, constants, eta=eta, local_steps=h)
    consensus = (4.0 * lip * eta / h + 4.0 / h**2) * drift
    return BoundTerms(4.0 * d0 / (eta * steps), 2.0 * bias,
                      4.0 * lip * eta * (sigma_term + h * weight_term), consensus, eta, eta_max)


def ddp_bound(
    mask: Mask, constants: ProblemConstants, *, eta: float, steps: int, local_steps: int = 1
) -> BoundTerms:
    """The same bound for DDP on the same workers and blocks (every c_j = K, eps = 0).

    >>> m = Mask([[1, 0], [0, 1]])
    >>> c = constants_from_totals(m, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    >>> round(ddp_bound(m, c, eta=0.5, steps=100).total, 6)  # 2/(0.5*100) + 0.5 * 1/2
    0.29
    """
    full = Mask(np.ones((mask.workers, mask.blocks), dtype=np.uint8), block_sizes=mask.block_sizes)
    return sdp_bound(full, constants, eta=eta, steps=steps, local_steps=local_steps)


def optimal_step_size(mask: Mask, constants: ProblemConstants, *, steps: int, local_steps: int = 1) -> float:
    """The admissible eta in (0, eta_max] that minimises the bound for horizon `steps`.

    For H = 1 the bound is a/eta + b + c*eta, minimised at sqrt(a/c) clipped to 1/L.

    >>> m = Mask([[1, 1]] * 4)
    >>> c = constants_from_totals(m, smoothness=1.0, sigma=2.0, zeta=0.0, suboptimality=1.0)
    >>> optimal_step_size(m, c, steps=50)  # sqrt(2*1 / (50 * 1 * 4/4)) = 0.2
    0.2
    """
    eta_max = max_step_size(constants.smoothness, local_steps=local_steps)
    probe = sdp_bound(mask, constants, eta=eta_max, steps=steps, local_steps=local_steps)
    if local_steps == 1:
        a = probe.optimization * eta_max
        c = probe.variance / eta_max
        return eta_max if c == 0.0 else float(min(eta_max, math.sqrt(a / c)))
    from scipy.optimize import minimize_scalar

    def total(eta: float) -> float:
        return sdp_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps).total

    res = minimize_scalar(total, bounds=(eta_max * 1e-9, eta_max), method="bounded",
                          options={"xatol": eta_max * 1e-10})
    return float(res.x) if total(float(res.x)) < total(eta_max) else eta_max


def flop_matched_steps(
    mask: Mask,
    constants: ProblemConstants,
    *,
    eta: float,
    ddp_steps: int,
    local_steps: int = 1,
    compute_fraction: float | None = None,
) -> FlopMatch:
    """SDP steps needed to make its bound equal stepwise DDP's after `ddp_steps`, at the same eta.

    SDP's bound is a D/(eta T) + floor (a = 2, or 4 with local steps); it reaches DDP's total when
    T = a D / (eta (ddp - floor)), and never (``inf``) when its floor (bias + variance + consensus)
    is already at or above DDP's total. `compute_fraction` is an SDP step's compute relative to a
    DDP step. By default it is that of backward masking, the regime the theorems cover:
    (2 + C) / 3 with C the parameter-weighted active fraction (the forward pass and the activation
    gradients run on the full model, the weight gradients only on held blocks; 2 + 2 + 2 FLOPs per
    parameter and token). Forward masking would cost C, but no theorem covers it.

    >>> m = Mask([[1, 1]] * 2)
    >>> c = constants_from_totals(m, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0)
    >>> round(flop_matched_steps(m, c, eta=0.5, ddp_steps=100).sdp_steps, 9)  # DDP itself
    100.0
    """
    ddp = ddp_bound(mask, constants, eta=eta, steps=ddp_steps).total
    probe_steps = ddp_steps * local_steps
    sdp = sdp_bound(mask, constants, eta=eta, steps=probe_steps, local_steps=local_steps)
    floor = sdp.bias + sdp.variance + sdp.consensus
    if compute_fraction is None:
        compute_fraction = backward_masking_compute_fraction(mask)
    if not 0.0 < compute_fraction <= 1.0:
        raise TheoryError(f"compute_fraction={compute_fraction!r} must be in (0, 1]")
    gap = ddp - floor
    coef = 2.0 if local_steps == 1 else 4.0  # the optimization term is coef * D / (eta T)
    needed = math.inf if gap <= 0 else coef * constants.suboptimality / (eta * gap)
    return FlopMatch(ddp_steps, ddp, needed, compute_fraction)


def backward_masking_compute_fraction(mask: Mask) -> float:
    """Compute of a backward-masked step relative to DDP's: (2 + C) / 3, C parameter-weighted.

    >>> backward_masking_compute_fraction(Mask([[1, 0], [0, 1]]))
    0.8333333333333334
    """
    sizes = np.ones(mask.blocks) if mask.block_sizes is None else np.asarray(mask.block_sizes, float)
    active = float(mask.coverage @ sizes / (mask.workers * sizes.sum()))
    return (2.0 + active) / 3.0


def drift_block_weights(mask: Mask) -> np.ndarray:
    """r_j = sum_k M_kj rho_k with rho_k = max over worker k's blocks of 1/c_j, shape (B,).

    The drift of Lemma 2 (docs/theory.md) is proportional to Gamma = sum_j r_j G_j^2. A row
    permutation leaves r unchanged, so it is the same for every round of a ``permute`` or ``cyclic``
    schedule; for a ``sequence`` it is the largest r_j over its rounds (a bound for every round).

    >>> drift_block_weights(Mask([[1, 1], [0, 1]])).tolist()
    [1.0, 1.5]
    """
    inv_c = 1.0 / mask.coverage.astype(float)

    def weights(m: np.ndarray) -> np.ndarray:
        m = m.astype(bool)
        return m.T.astype(float) @ np.where(m, inv_c, 0.0).max(axis=1)

    return np.max([weights(m) for m in mask.matrices], axis=0)  # a sequence: the worst round's, block by block


# -- internals ---------------------------------------------------------------------------------
def _drift_second_moment(mask: Mask, constants: ProblemConstants, *, eta: float, local_steps: int) -> float:
    """Bound on E||sum_{h<H} e_h||^2 (docs/theory.md, Lemma 2): (H-1) S_H L_w^2 eta^2 Gamma."""
    h = local_steps
    gamma = float(drift_block_weights(mask) @ constants.grad_sq)
    s_h = (h - 1) * h * (2 * h - 1) / 6.0
    return (h - 1) * s_h * constants.local_smoothness**2 * eta**2 * gamma


def _check_local_steps(local_steps: int) -> None:
    if isinstance(local_steps, bool) or not isinstance(local_steps, (int, np.integer)) or local_steps < 1:
        raise TheoryError(f"local_steps={local_steps!r} must be an integer >= 1")


def _check_rounds_align(mask: Mask, local_steps: int) -> None:
    """Every bound and simulation with H local steps assumes one mask for each round of H steps, as the
    runtime does (it refuses a schedule whose R is not a multiple of H)."""
    _check_local_steps(local_steps)
    if not mask.schedule.is_static and mask.schedule.every % local_steps:
        raise TheoryError(f"{mask.schedule.kind!r} schedule every={mask.schedule.every} must be a multiple of "
                          f"local_steps={local_steps}: a worker keeps one mask for a whole averaging round")


def _check_eta_steps(eta: float, steps: int, local_steps: int) -> None:
    _check_local_steps(local_steps)
    if not (math.isfinite(eta) and eta > 0):
        raise TheoryError(f"eta={eta!r} must be a finite step size > 0")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise TheoryError(f"steps={steps!r} must be an integer >= 1")
    if steps % local_steps:
        raise TheoryError(
            f"steps={steps} must be a multiple of local_steps={local_steps} (whole averaging rounds)"
        )


def _check_mask_constants(mask: Mask, constants: ProblemConstants) -> None:
    if constants.sigma_sq.size != mask.blocks:
        raise TheoryError(
            f"constants have {constants.sigma_sq.size} blocks but the mask has {mask.blocks}"
        )
    if constants.grad_sq is not None and constants.grad_sq.size != mask.blocks:
        raise TheoryError(f"grad_sq has {constants.grad_sq.size} blocks but the mask has {mask.blocks}")
