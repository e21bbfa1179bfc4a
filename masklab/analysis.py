"""Analysis of a `Mask` (docs/design.md §3): coverage, masking error, variance inflation, the worker
mixing graph and its spectral gap, the block co-training graph, and the optimality certificate.

For a schedule every quantity is the exact expectation over the schedule (the average over all K
rotations for ``cyclic``, over the rounds of a ``sequence``, the closed form over uniform
permutations for ``permute``), never a Monte-Carlo estimate. Eigenvalues: dense LAPACK for small or dense graphs (the mixing graph of a
mask with C >= ~1/sqrt(K) is complete, so storing it sparse buys nothing), sparse shift-invert
ARPACK for large sparse graphs, and closed forms where the schedule gives one. This module does
not build masks (see `masklab.constructions`) and imports no torch.
"""

from __future__ import annotations

import importlib

import numpy as np

from masklab.errors import MaskError
from masklab.mask import Mask


class _OnFirstUse:
    """A module imported when first used: scipy costs every importer of masklab about 0.4 s, and
    most (``sdp train``'s rank processes) never analyse a mask."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


linalg = _OnFirstUse("scipy.linalg")
sp = _OnFirstUse("scipy.sparse")
csgraph = _OnFirstUse("scipy.sparse.csgraph")
spla = _OnFirstUse("scipy.sparse.linalg")

DENSE_EIGEN_MAX = 1024  # up to this many nodes a dense symmetric eigensolver is fastest and exact
_DENSE_MATMUL_MAX = 1 << 24  # K*B entries up to which M @ M.T goes through dense BLAS
_METHODS = ("auto", "dense", "sparse")


def redrawn_every_update(mask: Mask) -> bool:
    """Whether the mask is redrawn independently of the iterate at every step (``permute``, every 1).

    Only then is the mean over the schedule the weight the theory may use (docs/theory.md, Theorem 2).
    """
    return mask.schedule.kind == "permute" and mask.schedule.every == 1


def block_masking_errors(mask: Mask) -> np.ndarray:
    """eps_j = sqrt(K) * ||w_j - u||_2 per block as the theory uses it, shape (B,).

    A ``permute`` schedule redrawn every step averages every worker over every row independently of
    the iterate, so E[w_j] = u and eps_j = 0. A static mask, a ``cyclic`` rotation or any mask held
    for R > 1 steps is correlated with the iterate, and the bound uses the mask in force:
    eps_j^2 = K / c_j - 1 (docs/theory.md, Theorem 1 and its correction for schedules).

    >>> block_masking_errors(Mask([[1, 1], [1, 0]])).round(6).tolist()
    [0.0, 1.0]
    """
    if redrawn_every_update(mask):
        return np.zeros(mask.blocks)
    return np.sqrt(np.maximum(mask.workers / mask.coverage - 1.0, 0.0))


def masking_error(mask: Mask) -> float:
    """eps(M) = max_j eps_j."""
    return float(block_masking_errors(mask).max())


def block_variance_inflation(mask: Mask) -> np.ndarray:
    """K * E[1/c_j] per block, shape (B,); 1 for DDP. Coverage is invariant under schedules."""
    return mask.workers / mask.coverage.astype(float)


def variance_inflation(mask: Mask) -> float:
    """The worst block's variance inflation, max_j K * E[1/c_j]."""
    return float(block_variance_inflation(mask).max())


def block_weight_variance(mask: Mask) -> np.ndarray:
    """E||w_j - E[w_j]||^2 per block as the theory uses it, shape (B,).

    1/c_j - 1/K for a mask redrawn every step; 0 otherwise (the bound is at the mask in force).
    """
    if not redrawn_every_update(mask):
        return np.zeros(mask.blocks)
    return 1.0 / mask.coverage - 1.0 / mask.workers


def mixing_graph(mask: Mask) -> sp.csr_array:
    """Weighted adjacency of the worker mixing graph, a_kl = (1/B) sum_j E[M_kj M_lj / c_j] (k != l).

    Symmetric, zero diagonal, shape (K, K).

    >>> mixing_graph(Mask([[1, 1], [1, 1]])).toarray().tolist()
    [[0.0, 0.5], [0.5, 0.0]]
    """
    kind = mask.schedule.kind
    k = mask.workers
    if kind == "permute":
        weight = _permute_pair_weight(mask)
        a = np.full((k, k), weight)
        np.fill_diagonal(a, 0.0)
        return sp.csr_array(a)
    if kind == "sequence":  # the exact mean over the period: every round equally often
        rounds = mask.matrices
        return sp.csr_array(sum(_static_pair_weights(mask, m) for m in rounds) / len(rounds))
    a = _static_pair_weights(mask)
    if kind == "cyclic":
        a = _circulant_from_offsets(_cyclic_offset_weights(a))
    return a


def mixing_laplacian(mask: Mask) -> sp.csr_array:
    """L(M) = D - A of the mixing graph; trace(L) = (1/B) sum_j (c_j - 1)."""
    a = mixing_graph(mask)
    degree = np.asarray(a.sum(axis=1)).ravel()
    return sp.csr_array(sp.diags_array(degree) - a)


def averaging_operator(mask: Mask) -> sp.csr_array:
    """W(M) = I - L(M): symmetric and doubly stochastic."""
    return sp.csr_array(sp.eye_array(mask.workers) - mixing_laplacian(mask))


def is_connected(mask: Mask) -> bool:
    """Whether the mixing graph is connected (a single worker is)."""
    if mask.workers == 1:
        return True
    if mask.schedule.kind == "permute":
        return _permute_pair_weight(mask) > 0
    n, _ = csgraph.connected_components(mixing_graph(mask), directed=False)
    return n == 1


def spectral_gap(mask: Mask, *, method: str = "auto") -> float:
    """gamma(M) = lambda_2(L(M)) = 1 - lambda_2(W(M)), in [0, 1].

    Exactly 0.0 for a disconnected mixing graph; 1.0 for a single worker (nothing to mix).

    Parameters
    ----------
    method : {"auto", "dense", "sparse"}
        ``auto`` uses closed forms for schedules, LAPACK for K <= 1024 or a dense graph, and
        sparse shift-invert ARPACK otherwise.

    >>> round(spectral_gap(Mask([[1, 1, 1]] * 4)), 12)  # DDP: the complete graph, gap 1
    1.0
    """
    if method not in _METHODS:
        raise MaskError(f"method {method!r} is not one of {_METHODS}")
    k = mask.workers
    if k == 1:
        return 1.0
    kind = mask.schedule.kind
    if kind == "permute" and method == "auto":
        return float(k * _permute_pair_weight(mask))
    if kind == "cyclic" and method == "auto":
        return _circulant_gap(_cyclic_offset_weights(_static_pair_weights(mask)))
    if not is_connected(mask):
        return 0.0
    return _second_smallest_laplacian_eigenvalue(mixing_laplacian(mask), method)


def spectral_gap_bound(mask: Mask) -> float:
    """The trace bound gamma <= trace(L) / (K - 1) = (mean coverage - 1) / (K - 1); 1.0 for K = 1."""
    if mask.workers == 1:
        return 1.0
    return float((mask.coverage.mean() - 1.0) / (mask.workers - 1))


def optimality_ratio(mask: Mask, *, gap: float | None = None) -> float:
    """gamma / bound, in [0, 1]; 1 iff all pairwise weights a_kl are equal (a 2-design).

    When the bound is 0 (every block held once) the gap is 0 as well and the design attains the
    cap, so the ratio is 1.0.
    """
    bound = spectral_gap_bound(mask)
    if gap is None:
        gap = spectral_gap(mask)
    if bound == 0.0:
        return 1.0
    return float(gap / bound)


def cotraining_graph(mask: Mask) -> sp.csr_array:
    """Block co-training graph, b_ij = sum_k M_ki M_kj for i != j, shape (B, B).

    Row permutations leave it unchanged, so it is the same under ``permute`` and ``cyclic``; under
    a ``sequence`` it is the mean over the rounds.
    """
    m = sp.csr_array(np.vstack(mask.matrices).astype(np.float64))
    b = sp.csr_array(m.T @ m / len(mask.matrices))
    b.setdiag(0.0)
    b.eliminate_zeros()
    return b


def cotraining_gap(mask: Mask) -> float:
    """Second-smallest eigenvalue of the co-training graph's normalized Laplacian.

    0.0 when some group of blocks was never trained together with the rest (disconnected graph);
    1.0 for a single block. Computed without forming the B x B graph when B is large.
    """
    b = mask.blocks
    if b == 1:
        return 1.0
    # a sequence's rounds stacked as more rows: P times the mean graph, whose normalized Laplacian is the same
    m = sp.csr_array(np.vstack(mask.matrices).astype(np.float64))
    bipartite = sp.block_array([[None, m], [m.T, None]])
    n, _ = csgraph.connected_components(bipartite, directed=False)
    if n != 1:
        return 0.0
    coverage = np.asarray(m.sum(axis=0)).ravel()
    degree = np.asarray(m.T @ m.sum(axis=1)).ravel() - coverage  # sum_{j != i} b_ij
    inv_sqrt = 1.0 / np.sqrt(degree)
    if b <= DENSE_EIGEN_MAX:
        adj = (m.T @ m).toarray()
        np.fill_diagonal(adj, 0.0)
        norm_adj = inv_sqrt[:, None] * adj * inv_sqrt[None, :]
        mu = linalg.eigh(norm_adj, eigvals_only=True, subset_by_index=[b - 2, b - 1])
        return float(1.0 - mu[0])
    mt = sp.csr_array(m.T)

    def matvec(x: np.ndarray) -> np.ndarray:
        y = inv_sqrt * x.ravel()
        return inv_sqrt * (mt @ (m @ y) - coverage * y)

    op = spla.LinearOperator((b, b), matvec=matvec, dtype=np.float64)
    v0 = np.sqrt(degree)  # near the top eigenvector; any fixed start keeps results reproducible
    mu = spla.eigsh(op, k=2, which="LA", v0=v0, tol=1e-12, return_eigenvectors=False)
    return float(1.0 - np.sort(mu)[0])


def process_group_holder_sets(mask: Mask, *, singletons: bool = False) -> tuple[tuple[int, ...], ...]:
    """The holder sets that need a process group of their own, sorted: one per distinct S_j.

    A block held by every worker is averaged over the world's group, and a block with a single
    holder needs no communication, so neither gets a group; with ``singletons=True`` single
    holders count too (FSDP shards a block over a mesh even when only one worker holds it). Each
    group on NCCL is one communicator on every member's device (docs/design.md §5). Computed on
    ``mask.matrix`` for static masks and round 0 of ``permute`` and ``cyclic`` (whose later rounds
    may need more, made when they first occur), on every round of a ``sequence``.

    Parameters
    ----------
    mask : Mask
    singletons : bool
        Count holder sets of one worker (B-SDP composed with FSDP).

    Examples
    --------
    >>> m = Mask([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [0, 1, 1, 1, 0]])
    >>> process_group_holder_sets(m)
    ((0, 1), (0, 2), (1, 2))
    >>> len(process_group_holder_sets(m, singletons=True))
    4
    """
    columns = np.unique(np.hstack(mask.matrices).astype(bool), axis=1).T  # one row per distinct holder set
    sets = (tuple(int(k) for k in np.flatnonzero(col)) for col in columns)
    smallest = 1 if singletons else 2
    return tuple(sorted(s for s in sets if smallest <= len(s) < mask.workers))


def to_networkx(mask: Mask):
    """The mixing graph as a ``networkx.Graph`` with edge attribute ``weight`` = a_kl."""
    import networkx as nx

    g = nx.Graph()
    g.add_nodes_from(range(mask.workers))
    coo = sp.triu(mixing_graph(mask), k=1).tocoo()
    g.add_weighted_edges_from(zip(coo.row.tolist(), coo.col.tolist(), coo.data.tolist()))
    return g


# -- internals ---------------------------------------------------------------------------------
def _static_pair_weights(mask: Mask, matrix: np.ndarray | None = None) -> sp.csr_array:
    """a_kl of `matrix` (default: the mask's) held fixed; every round of a schedule has the mask's coverage."""
    matrix = mask.matrix if matrix is None else matrix
    k, b = matrix.shape
    inv_c = 1.0 / mask.coverage.astype(np.float64)
    if k * b <= _DENSE_MATMUL_MAX:
        m = matrix.astype(np.float64)
        a = (m * inv_c) @ m.T / b
        np.fill_diagonal(a, 0.0)
        return sp.csr_array(a)
    m = sp.csr_array(matrix.astype(np.float64))
    a = sp.csr_array((m @ sp.diags_array(inv_c)) @ m.T / b)
    a.setdiag(0.0)
    a.eliminate_zeros()
    return a


def _permute_pair_weight(mask: Mask) -> float:
    """a_kl under uniform row permutations: (1/B) sum_j (c_j - 1) / (K (K - 1)), the same for all pairs."""
    k = mask.workers
    if k == 1:
        return 0.0
    c = mask.coverage.astype(np.float64)
    return float(np.mean(c - 1.0) / (k * (k - 1)))


def _cyclic_offset_weights(a: sp.csr_array) -> np.ndarray:
    """Average of a over all K rotations: abar[d] = (1/K) sum_k a[k, (k + d) mod K]."""
    k = a.shape[0]
    coo = a.tocoo()
    return np.bincount((coo.col - coo.row) % k, weights=coo.data, minlength=k) / k


def _circulant_from_offsets(abar: np.ndarray) -> sp.csr_array:
    k = abar.size
    idx = (np.arange(k)[None, :] - np.arange(k)[:, None]) % k
    return sp.csr_array(abar[idx])


def _circulant_gap(abar: np.ndarray) -> float:
    """lambda_2 of the circulant Laplacian: its eigenvalues are sum_d abar[d] (1 - cos(2 pi d m / K))."""
    k = abar.size
    eig = abar.sum() - np.fft.fft(abar).real  # abar is symmetric (abar[d] = abar[K - d])
    eig[0] = np.inf
    gap = float(eig.min())
    if _circulant_disconnected(abar):
        return 0.0
    return max(gap, 0.0) if k > 1 else 1.0


def _circulant_disconnected(abar: np.ndarray) -> bool:
    k = abar.size
    support = np.flatnonzero(abar > 0)
    return int(np.gcd.reduce(np.append(support, k))) != 1


def _second_smallest_laplacian_eigenvalue(lap: sp.csr_array, method: str) -> float:
    k = lap.shape[0]
    dense = method == "dense" or (
        method == "auto" and (k <= DENSE_EIGEN_MAX or lap.nnz > k * k // 4)
    )
    if dense:
        return float(linalg.eigh(lap.toarray(), eigvals_only=True, subset_by_index=[1, 1])[0])
    # Shift-invert about a small negative sigma: L - sigma I is positive definite, so a sparse LU
    # exists, and the two eigenvalues nearest sigma are lambda_1 = 0 and lambda_2.
    sigma = -1e-3 * float(lap.diagonal().max())
    vals = spla.eigsh(lap.tocsc(), k=2, sigma=sigma, which="LM", tol=0, return_eigenvectors=False,
                      v0=np.linspace(1.0, 2.0, k))
    return float(np.sort(vals)[1])
