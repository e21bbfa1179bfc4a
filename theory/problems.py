"""Test problems whose constants are known exactly, for the simulators in `theory.simulate`.

Two families, both split into blocks of consecutive coordinates (block j of the parameter vector is
mask column j):

* heterogeneous quadratics f_k(x) = 1/2 (x - x_k)^T H_k (x - x_k) with diagonal per-worker
  Hessians H_k and optima x_k, built so that x^* = 0, f(x_0) - f^* = D and the heterogeneity at x^*
  is exactly zeta_j on every block;
* l2-regularised logistic regression on generated per-worker data sets.

Both add Gaussian noise with per-block variance exactly sigma_j^2 to every worker's gradient (the
simulator draws it). Heterogeneity and gradient second moments of the quadratic with unequal
Hessians vary with x; the simulator records their values at every visited point so a test can check
that Assumptions A3/A6 held along the run. This module does not run SDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.optimize

from theory.bounds import ProblemConstants
from theory.errors import TheoryError


@dataclass(frozen=True, eq=False)
class Problem:
    """A finite-sum problem f = (1/K) sum_k f_k on R^d with its constants.

    `worker_grads` maps points of shape (S, K, d) (one per seed and worker) to the exact worker
    gradients, same shape; `value` maps (S, d) to f, shape (S,).
    """

    name: str
    block_sizes: tuple[int, ...]
    x0: np.ndarray
    f_star: float
    constants: ProblemConstants
    params: dict

    @property
    def workers(self) -> int:
        return int(self.params["workers"])

    @property
    def dim(self) -> int:
        return int(self.x0.size)

    @property
    def noise_std(self) -> np.ndarray:
        """Per-coordinate noise standard deviation, shape (d,): sigma_j / sqrt(size_j) on block j."""
        sizes = np.asarray(self.block_sizes)
        return np.repeat(np.sqrt(self.constants.sigma_sq / sizes), sizes)

    def worker_grads(self, points: np.ndarray) -> np.ndarray:
        p = self.params
        if self.name == "quadratic":
            return p["hess"] * (points - p["optima"])
        z = (p["features"] @ points[..., None])[..., 0] * p["labels"]  # (S, K, n)
        coef = -p["labels"] * _sigmoid(-z) / p["labels"].shape[1]
        return (coef[..., None, :] @ p["features"])[..., 0, :] + p["ridge"] * points

    def value(self, x: np.ndarray) -> np.ndarray:
        p = self.params
        if self.name == "quadratic":
            diff = x[:, None, :] - p["optima"]
            return 0.5 * np.einsum("skd,kd,skd->s", diff, p["hess"], diff) / self.workers
        z = np.einsum("knd,sd->skn", p["features"], x) * p["labels"]
        return np.logaddexp(0.0, -z).mean(axis=(1, 2)) + 0.5 * p["ridge"] * np.sum(x * x, axis=1)


def make_quadratic(
    block_sizes: tuple[int, ...] | list[int],
    workers: int,
    *,
    smoothness: float,
    sigma: float,
    zeta: float,
    suboptimality: float,
    hessian_spread: float = 0.0,
    condition: float = 10.0,
    sigma_split: list[float] | np.ndarray | None = None,
    zeta_split: list[float] | np.ndarray | None = None,
    worker_pattern: np.ndarray | None = None,
    seed: int | np.random.Generator | None = None,
) -> Problem:
    """Heterogeneous diagonal quadratics with known constants.

    The totals sigma^2 and zeta^2 are spread over blocks by `sigma_split` and `zeta_split` (shares
    >= 0 summing to 1, one per block), in proportion to block sizes when not given. Worker k's
    heterogeneity on block j is random unless `worker_pattern` (shape (K, B)) is given: then it is
    proportional to the centred pattern[k, j] along one random direction per block, e.g. the
    centred mask column w_j - u, which makes the masking bias ||b_j||^2 = eps_j^2 zeta_j^2 exact.

    Curvatures lie in [L/condition, L] and every worker's curvature is at most L, so f and every
    f_k are L-smooth. With ``hessian_spread = 0`` all workers share the Hessian and the
    heterogeneity is exactly zeta_j at every x; with spread s in (0, 1) worker curvatures differ by
    up to a factor (1 +- s), the heterogeneity at x^* is zeta_j / sqrt(2) and grows with ||x||.

    >>> q = make_quadratic([3, 2], 4, smoothness=2.0, sigma=1.0, zeta=1.0, suboptimality=5.0, seed=0)
    >>> round(float(q.value(q.x0[None])[0] - q.f_star), 9), q.constants.zeta_sq.tolist()
    (5.0, [0.6, 0.4])
    """
    sizes = _check_sizes(block_sizes)
    _check_positive(smoothness=smoothness, condition=condition, workers=workers)
    _check_nonnegative(sigma=sigma, zeta=zeta, suboptimality=suboptimality)
    if not 0.0 <= hessian_spread < 1.0:
        raise TheoryError(f"hessian_spread={hessian_spread!r} must be in [0, 1)")
    rng = np.random.default_rng(seed)
    d = int(sum(sizes))
    sigma_share = _shares(sigma_split, sizes, "sigma_split")
    share = _shares(zeta_split, sizes, "zeta_split")
    mean_curv = np.exp(rng.uniform(-np.log(condition), 0.0, size=d))
    mean_curv[rng.integers(d)] = 1.0
    offsets = rng.uniform(-1.0, 1.0, size=(workers, d))
    offsets -= offsets.mean(axis=0)
    offsets /= max(np.abs(offsets).max(), 1e-300)
    hess = smoothness / (1.0 + hessian_spread) * mean_curv * (1.0 + hessian_spread * offsets)
    starts = np.cumsum((0,) + sizes[:-1])
    centred = rng.standard_normal((workers, d))
    if worker_pattern is not None:
        pattern = np.asarray(worker_pattern, dtype=float)
        if pattern.shape != (workers, len(sizes)) or not np.all(np.isfinite(pattern)):
            raise TheoryError(f"worker_pattern has shape {pattern.shape}, expected ({workers}, {len(sizes)})")
        centred = np.repeat(pattern - pattern.mean(axis=0), sizes, axis=1) * centred[0]  # a constant column: exactly 0
    centred -= centred.mean(axis=0)
    spread = hess - hess.mean(axis=0)
    norm = np.sum(spread * spread, axis=0)
    proj = np.divide(np.sum(centred * spread, axis=0), norm, out=np.zeros(d), where=norm > 0)
    centred -= proj * spread  # orthogonal to the curvature spread: no cross term in zeta_j(x)^2
    target = zeta**2 * share * (0.5 if hessian_spread > 0 else 1.0)
    energy = np.add.reduceat(np.mean(centred * centred, axis=0), starts)
    scale = np.sqrt(np.divide(target, energy, out=np.zeros_like(target), where=energy > 0))
    shift = centred * np.repeat(scale, sizes)  # -H_k x_k: worker gradients at x* = 0, summing to 0
    optima = -shift / hess
    mean_hess = hess.mean(axis=0)
    direction = rng.standard_normal(d)
    x0 = direction * np.sqrt(2.0 * suboptimality / (direction @ (mean_hess * direction)))
    f_star = float(0.5 * np.sum(hess * optima * optima) / workers)
    constants = ProblemConstants(
        smoothness=float(mean_hess.max()),
        sigma_sq=sigma**2 * sigma_share,
        zeta_sq=zeta**2 * share,
        suboptimality=float(suboptimality),
        worker_smoothness=float(max(hess.max(), mean_hess.max())),  # equal up to round-off without spread
    )
    params = {"workers": workers, "hess": hess, "optima": optima}
    return Problem("quadratic", sizes, x0, f_star, constants, params)


def make_logistic(
    block_sizes: tuple[int, ...] | list[int],
    workers: int,
    *,
    smoothness: float,
    sigma: float,
    suboptimality: float,
    samples: int = 32,
    heterogeneity: float = 1.0,
    ridge_fraction: float = 0.1,
    sigma_split: list[float] | np.ndarray | None = None,
    seed: int | np.random.Generator | None = None,
) -> Problem:
    """l2-regularised logistic regression, `samples` points per worker, with known constants.

    sigma^2 is spread over blocks by `sigma_split` (as in `make_quadratic`), by size when not given.

    f_k(x) = mean_i log(1 + exp(-y_i a_i^T x)) + (lam/2)||x||^2. Features are scaled so that
    L = lambda_max(A^T A) / (4N) + lam equals `smoothness` (lam = ridge_fraction * L; also every
    f_k's bound, reported as worker_smoothness). Workers draw features around their own mean
    (`heterogeneity` scales the shift) and labels from their own teacher. zeta_j^2 is a global
    bound, see `_logistic_zeta_sq`. f^* is bracketed by strong convexity, and x_0 is placed on
    a ray from the minimiser with f(x_0) - f^* <= `suboptimality` (equal up to that bracket).
    """
    sizes = _check_sizes(block_sizes)
    _check_positive(smoothness=smoothness, workers=workers, samples=samples)
    _check_nonnegative(sigma=sigma, suboptimality=suboptimality, heterogeneity=heterogeneity)
    if not 0.0 < ridge_fraction < 1.0:
        raise TheoryError(f"ridge_fraction={ridge_fraction!r} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    d = int(sum(sizes))
    centres = heterogeneity * rng.standard_normal((workers, 1, d)) / np.sqrt(d)
    features = centres + rng.standard_normal((workers, samples, d)) / np.sqrt(d)
    teachers = rng.standard_normal((workers, d)) + rng.standard_normal(d)
    labels = np.where(np.einsum("knd,kd->kn", features, teachers) >= 0, 1.0, -1.0)
    flat = features.reshape(-1, d)
    top = np.linalg.eigvalsh(flat.T @ flat)[-1] if d <= flat.shape[0] else np.linalg.eigvalsh(flat @ flat.T)[-1]
    ridge = ridge_fraction * smoothness
    features *= np.sqrt((smoothness - ridge) * 4.0 * flat.shape[0] / top)
    starts = np.cumsum((0,) + sizes[:-1])
    zeta_sq = _logistic_zeta_sq(features, starts)
    params = {"workers": workers, "features": features, "labels": labels, "ridge": ridge}
    probe = Problem("logistic", sizes, np.zeros(d), 0.0,
                    ProblemConstants(smoothness, np.zeros(len(sizes)), zeta_sq, 0.0), params)
    x_hat, f_lower = _minimise(probe, ridge)
    direction = rng.standard_normal(d)
    direction /= np.linalg.norm(direction)

    def excess(t: float) -> float:
        return float(probe.value((x_hat + t * direction)[None])[0]) - f_lower - suboptimality

    hi = 1.0
    while excess(hi) < 0:
        hi *= 2.0
    t = scipy.optimize.brentq(excess, 0.0, hi, xtol=1e-14) if suboptimality > 0 else 0.0
    x0 = x_hat + t * direction
    d0 = max(float(probe.value(x0[None])[0]) - f_lower, 0.0)
    constants = ProblemConstants(
        smoothness=float(smoothness),
        sigma_sq=sigma**2 * _shares(sigma_split, sizes, "sigma_split"),
        zeta_sq=zeta_sq,
        suboptimality=d0,
        worker_smoothness=float(smoothness) * _worker_factor(features, samples, smoothness, ridge),
    )
    return Problem("logistic", sizes, x0, f_lower, constants, params)


def _minimise(problem: Problem, ridge: float) -> tuple[np.ndarray, float]:
    """The minimiser and a certified lower bound f(x) - ||grad f(x)||^2 / (2 lam) on f^*."""
    d = problem.dim
    k = problem.workers

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        grad = problem.worker_grads(np.broadcast_to(x, (1, k, d))).mean(axis=1)[0]
        return float(problem.value(x[None])[0]), grad

    res = scipy.optimize.minimize(fun, np.zeros(d), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000})
    value, grad = fun(res.x)
    return res.x, value - float(grad @ grad) / (2.0 * ridge)


def _worker_factor(features: np.ndarray, samples: int, smoothness: float, ridge: float) -> float:
    """max_k L_k / L with L_k = lambda_max(A_k^T A_k)/(4n) + lam (A5 for the local-step theorem)."""
    worst = max(np.linalg.eigvalsh(a @ a.T)[-1] for a in features) / (4.0 * samples)
    return max(1.0, (worst + ridge) / smoothness)


def _logistic_zeta_sq(features: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """A bound on (1/K) sum_k ||grad_j f_k - grad_j f||^2 valid at every x, shape (B,).

    The ridge cancels in the difference and a variance is at most the second moment, so it is at
    most (1/K) sum_k ||A_{k,j}^T s / n||^2 with |s_i| <= 1: at most (mean_i ||a_{k,i,j}||)^2 and at
    most ||A_{k,j}||_2^2 / n. Each worker contributes the smaller of the two.
    """
    samples = features.shape[1]
    bounds = []
    for block in np.split(features, starts[1:], axis=2):  # (K, n, size_j)
        rows = np.linalg.norm(block, axis=2).mean(axis=1) ** 2
        spectral = np.linalg.norm(block, ord=2, axis=(1, 2)) ** 2 / samples
        bounds.append(np.minimum(rows, spectral).mean())
    return np.asarray(bounds)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _check_sizes(block_sizes) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in block_sizes)
    if not sizes or any(s < 1 for s in sizes):
        raise TheoryError(f"block_sizes={tuple(block_sizes)!r} must be one or more integers >= 1")
    return sizes


def _shares(split, sizes: tuple[int, ...], name: str) -> np.ndarray:
    if split is None:
        return np.asarray(sizes, float) / sum(sizes)
    share = np.asarray(split, dtype=float)
    if share.shape != (len(sizes),) or not np.all(np.isfinite(share)) or np.any(share < 0) \
            or not abs(share.sum() - 1.0) <= 1e-9:
        raise TheoryError(f"{name}={split!r} must be {len(sizes)} shares >= 0 (one per block) summing to 1")
    return share


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not np.isfinite(value) or value <= 0:
            raise TheoryError(f"{name}={value!r} must be a finite number > 0")


def _check_nonnegative(**values: float) -> None:
    for name, value in values.items():
        if not np.isfinite(value) or value < 0:
            raise TheoryError(f"{name}={value!r} must be a finite number >= 0")
