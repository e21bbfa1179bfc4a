"""N-SDP masks: the neuron groups of every layer take their holder sets from one family.

An N-SDP mask has one column per neuron group: layers x groups columns, column ``l * groups + g``
being group g of layer l, and every worker must keep a group of every layer. Each distinct holder
set is a process group (an NCCL communicator on GPUs), so a mask designed layer by layer needs up
to layers x groups of them. `neuron_design` draws every layer's holder sets from the family B-SDP
uses for the same (K, layers, C), `design(K, layers, ...)` with the same seed, each family set
serving the same number of groups: the mask then has exactly B-SDP's process groups and mixing
graph, hence its spectral gap. Where no such arrangement reaches every worker in every layer
(groups x c close to K), layers cycle through ``floor(P / groups)`` K x groups designs, P being the
family's process groups, so the count still stays within B-SDP's. docs/design.md §5 says why.

Not here: the mask of one layer (`masklab.design`), schedules (`masklab.mask.Schedule`).
"""

from __future__ import annotations

import numpy as np

from masklab.analysis import process_group_holder_sets
from masklab.constructions import SeedLike, _check_balanced, _check_sizes
from masklab.design import coverage_from_active, design
from masklab.errors import DesignError
from masklab.mask import Mask

_UNCOVERED = 10**9  # the weight of a worker with no group of a layer: any cover beats any balance
_MAX_SWAPS = 20_000


def neuron_design(K: int, layers: int, groups: int, *, active: float | None = None, coverage: int | None = None,
                  construction: str = "auto", seed: SeedLike = None) -> Mask:
    """A K x (layers * groups) N-SDP mask whose holder sets are those of the layers' B-SDP design.

    Parameters
    ----------
    K, layers, groups : int
        Workers, layers (the model's maskable blocks) and neuron groups per layer, all >= 1.
    active, coverage : float or int
        Exactly one: the active fraction C (`coverage_from_active`) or the holders per group c;
        groups * c >= K is required so that every worker can keep a group of every layer.
    construction : str
        `design`'s, for the family (and for the per-layer designs of the fallback).
    seed : int, numpy.random.Generator or None
        Turned once into a generator: the family is ``design(K, layers, ..., seed=seed)``, the very
        mask B-SDP trains, then the arrangement draws from the same generator.

    Returns
    -------
    Mask
        Every group held by c workers, every worker holding a group of every layer; construction
        ``"shared <family>"``, or ``"cycled <m> x <design>"`` for the fallback.

    Raises
    ------
    DesignError
        On invalid sizes or coverage, groups * c < K, or a forced `construction` that does not fit a
        design over the layers (the message says so: it is not one layer's design).

    Examples
    --------
    >>> from masklab.analysis import process_group_holder_sets as groups_of, spectral_gap
    >>> m = neuron_design(8, 18, 8, active=0.5, seed=0)
    >>> b = design(8, 18, active=0.5, seed=0)
    >>> (m.workers, m.blocks), len(groups_of(m)) == len(groups_of(b)), round(spectral_gap(m), 4) == round(spectral_gap(b), 4)
    ((8, 144), True, True)
    """
    _check_sizes(K, layers)
    _check_sizes(K, groups)
    if (active is None) == (coverage is None):
        raise DesignError(f"give exactly one of active (C in (0, 1]) and coverage (c in [1, K]); "
                          f"got active={active!r}, coverage={coverage!r}")
    c = _check_balanced(K, K, coverage_from_active(K, active) if coverage is None else coverage)
    if groups * c < K:
        raise DesignError(f"groups * coverage = {groups} * {c} = {groups * c} < K={K}: some worker would keep no "
                          f"neuron group of a layer; use more groups per layer or a larger active fraction")
    rng = np.random.default_rng(seed)
    per_set = -(-K // (layers * c))  # family columns per layer: enough sets to reach every worker
    try:
        family = design(K, layers * per_set, coverage=c, construction=construction, seed=rng)
    except DesignError as exc:
        raise DesignError(f"N-SDP takes its holder sets from a design over the layers (B = {layers * per_set}, "
                          f"{layers} layers): {exc}") from None
    table = _arrange(family.matrix.astype(bool), layers, groups, rng)
    if table is not None:
        matrix = family.matrix[:, table.reshape(-1)]
        return Mask(matrix, construction=f"shared {family.construction}")
    return _cycled(K, layers, groups, c, len(process_group_holder_sets(family)), construction, rng)


def _arrange(family: np.ndarray, layers: int, groups: int, rng: np.random.Generator) -> np.ndarray | None:
    """A (layers, groups) table of family columns, each column used equally often (to within one),
    every layer reaching every worker and its row sums as even as the local search gets them; None
    when some layer still misses a worker."""
    K, P = family.shape
    cols = family.astype(np.int64)
    slots = np.tile(np.arange(P), -(-layers * groups // P))[: layers * groups]
    table = rng.permutation(slots).reshape(layers, groups)
    rows = cols[:, table].sum(axis=2).T  # (layers, K): groups of each layer a worker keeps
    target = groups * cols[:, 0].sum() / K

    def cost(r: np.ndarray) -> float:
        return float(np.count_nonzero(r == 0) * _UNCOVERED + ((r - target) ** 2).sum())

    frac = target - np.floor(target)
    floor_cost = K * frac * (1 - frac)  # a layer whose rows are all floor(target) or ceil(target)
    costs = np.array([cost(r) for r in rows])
    for _ in range(min(_MAX_SWAPS, 40 * layers * groups)):
        if costs.sum() <= layers * floor_cost + 1e-9 or layers == 1:
            break
        i, j = rng.choice(layers, size=2, replace=False)
        missing = np.flatnonzero(rows[i] == 0)
        if missing.size:  # bring a column that reaches a missing worker from another layer
            w = missing[rng.integers(missing.size)]
            where = np.argwhere(family[w, table] & (np.arange(layers) != i)[:, None])
            if not len(where):
                continue
            j, h = where[rng.integers(len(where))]
        else:
            h = rng.integers(groups)
        g = rng.integers(groups)
        a, b = table[i, g], table[j, h]
        if a == b:
            continue
        delta = cols[:, b] - cols[:, a]
        ri, rj = rows[i] + delta, rows[j] - delta
        ci, cj = cost(ri), cost(rj)
        if ci + cj <= costs[i] + costs[j]:
            rows[i], rows[j], costs[i], costs[j] = ri, rj, ci, cj
            table[i, g], table[j, h] = b, a
    return None if np.any(rows == 0) else table


def _cycled(K: int, layers: int, groups: int, c: int, sets: int, construction: str,
            rng: np.random.Generator) -> Mask:
    """Layer l takes design ``l mod m`` of m = floor(sets / groups) K x groups designs, each after the
    first with its workers relabelled at random (at most `sets` process groups in all); one design
    limited to `sets` groups when groups > sets; one per layer when the family needs no process
    group at all (c = 1 or c = K)."""
    if sets == 0:
        count, limit = layers, None
    else:
        count, limit = max(1, min(layers, sets // groups)), (sets if groups > sets else None)
    kwargs = {"max_groups": limit} if limit is not None and construction == "auto" else {}
    designs = [design(K, groups, coverage=c, construction=construction, seed=rng, **kwargs) for _ in range(count)]
    # the search often returns the same (cyclic) design for every seed; relabelled workers connect them
    matrices = [d.matrix[rng.permutation(K)] if i else d.matrix for i, d in enumerate(designs)]
    matrix = np.hstack([matrices[layer % count] for layer in range(layers)])
    return Mask(matrix, construction=f"cycled {count} x {designs[0].construction}")
