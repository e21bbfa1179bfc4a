"""The survivors' mask after losing workers, with the designed coverage restored.

`survivors_mask` (`masklab.failures`) drops the lost rows: each block stays with its other holders,
so coverage falls where the lost workers held blocks. `restored_mask` designs a mask for the K - |D|
survivors with the designed coverage again (`design`, or `neuron_design` for N-SDP's neuron groups;
`design_for_costs` when the blocks' bytes differ or the survivors have memory budgets, so that the
survivors' bytes stay balanced and within budget) and hands its rows to the survivors so that the
blocks they must newly hold weigh the least (a linear assignment over the block sizes, among the
assignments that keep every survivor within its budget).

These are properties of masks. Moving blocks to the survivors that gain them is the runtime's job
(docs/design.md §7), which this module neither does nor assumes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from masklab.design import design
from masklab.errors import DesignError, MaskError
from masklab.failures import survivors_mask
from masklab.mask import Mask
from masklab.neurons import neuron_design


def restored_mask(mask: Mask, lost: Iterable[int], *, coverage: int | None = None, groups: int | None = None,
                  construction: str = "auto", seed: int | None = None, sizes: Sequence[int] | None = None,
                  budgets: Sequence[int] | None = None, fixed_bytes: int | Sequence[int] = 0) -> Mask:
    """A static mask for the survivors of `mask` (static, K rows) after losing `lost`, with every block
    on ``min(coverage, K - |lost|)`` survivors, rows in the survivors' order; on more where fewer holder
    slots than survivors would leave one without a block (N-SDP: without a group of each block), as
    `design` and `neuron_design` refuse that: ``ceil((K - |lost|) / B)`` (``/ groups``).

    Parameters
    ----------
    mask : Mask
        The mask in force (a schedule's round: ``Mask(mask.round_matrix(step))``).
    lost : iterable of int
        Rows of `mask` lost; a loss that leaves a block without holder raises `MaskError`
        (`survivors_mask`'s), since no survivor can hand that block on.
    coverage : int, optional
        The designed holders per block; default the least coverage of `mask`.
    groups : int, optional
        N-SDP: neuron groups per block (columns are ``block * groups + group``); the design is
        then `neuron_design`'s, which keeps a group of every block on every survivor.
    construction, seed
        `design`'s (`seed` also `design_for_costs`'s).
    sizes : sequence of int, optional
        Bytes that holding each block costs a worker (``masklab.BlockCosts.block_bytes``); default
        ``mask.block_sizes``, 1 each when unset. When they differ (block level), the survivors' mask
        is `design_for_costs`'s, which balances the survivors' bytes; `design` balances block counts.
    budgets : sequence of int, optional
        One memory budget in bytes per row of `mask` (the lost rows' are ignored), block level only:
        the design keeps every survivor's ``fixed_bytes + sum of its blocks' sizes`` within its
        budget (`design_for_costs`), and so does the matching of rows to survivors.
    fixed_bytes : int or sequence of int
        With `budgets`: bytes every worker holds whatever its blocks, counted against its budget, one
        int or one per row of `mask`.

    Returns
    -------
    Mask
        `survivors_mask` itself when no block fell below the coverage (nothing moves); else the
        design, its rows matched to the survivors so that the total size of the blocks a survivor
        newly holds is the least.

    Raises
    ------
    MaskError
        A loss that leaves a block without holder, a schedule, or an invalid `coverage`/`groups`.
    DesignError
        `budgets` or `sizes` of the wrong length or value, `budgets` with `groups`, `fixed_bytes`
        without `budgets`, or no mask found for the survivors fits their budgets
        (`design_for_costs`'s message names the worker).

    Examples
    --------
    >>> m = Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]])
    >>> restored_mask(m, [0]).coverage.tolist()
    [2, 2, 2, 2]
    >>> restored_mask(m, [0], coverage=1).matrix.tolist()  # every block still held: nothing moves
    [[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]
    >>> from masklab import design
    >>> five, sizes = design(5, 6, coverage=2, seed=0), [9, 1, 1, 1, 9, 1]
    >>> (restored_mask(five, [0], seed=0).matrix @ sizes).tolist()  # block counts balanced, bytes not
    [11, 3, 11, 19]
    >>> (restored_mask(five, [0], sizes=sizes, seed=0).matrix @ sizes).tolist()  # bytes balanced
    [11, 11, 11, 11]
    """
    if not mask.schedule.is_static:
        raise MaskError(f"restored_mask takes the static mask in force, got a {mask.schedule.kind!r} schedule: pass "
                        "Mask(mask.round_matrix(step, seed=seed))")
    kept = survivors_mask(mask, lost)
    target = int(mask.coverage.min()) if coverage is None else coverage
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or target < 1:
        raise MaskError(f"coverage={coverage!r} must be an integer >= 1")
    target = min(int(target), kept.workers)
    weights = _block_bytes(mask, sizes)
    survivors = [k for k in range(mask.workers) if k not in set(lost)]
    room = fixed = None  # with budgets: what each survivor's blocks may take, and what it holds besides
    if budgets is not None:
        from masklab.costs import per_worker

        if groups is not None:
            raise DesignError("budgets of restored_mask are per block-level worker; N-SDP's neuron groups "
                              f"(groups={groups}) are spread over every survivor by neuron_design")
        fixed = np.array(per_worker("fixed_bytes", fixed_bytes, mask.workers))[survivors]
        room = np.array(per_worker("budgets", budgets, mask.workers, minimum=1))[survivors] - fixed
    elif not isinstance(fixed_bytes, (int, np.integer)) or fixed_bytes:
        raise DesignError(f"fixed_bytes={fixed_bytes!r} counts against budgets, and budgets is None: give budgets "
                          "too, or leave fixed_bytes 0")
    if int(kept.coverage.min()) >= target:
        return kept
    if groups is None and (room is not None or len(set(weights.tolist())) > 1):
        from masklab.balance import design_for_costs  # its local search imports scipy

        new = design_for_costs([int(w) for w in weights], kept.workers, min_coverage=target,
                               budgets=None if room is None else [int(r + f) for r, f in zip(room, fixed)],
                               fixed_bytes=None if fixed is None else [int(f) for f in fixed], seed=seed)
    elif groups is None:  # at least ceil(K' / B) holders, so that every survivor holds a block
        new = design(kept.workers, kept.blocks, coverage=max(target, -(-kept.workers // kept.blocks)),
                     construction=construction, seed=seed)
    else:
        if kept.blocks % groups:
            raise MaskError(f"groups={groups} does not divide the mask's {kept.blocks} columns")
        new = neuron_design(kept.workers, kept.blocks // groups, groups, construction=construction, seed=seed,
                            coverage=max(target, -(-kept.workers // groups)))  # every survivor: a group of each
    fits = None if room is None else (new.matrix @ weights)[None, :] <= room[:, None]  # [survivor, row]
    rows = matched_rows(kept.matrix, new.matrix, weights, fits=fits)
    return Mask(new.matrix[rows], block_names=mask.block_names, block_sizes=mask.block_sizes,
                construction=new.construction)


def _block_bytes(mask: Mask, sizes: Sequence[int] | None) -> np.ndarray:
    """`sizes`, else ``mask.block_sizes``, else 1 per block, as an int64 array checked against the mask."""
    if sizes is None:
        return np.ones(mask.blocks, dtype=np.int64) if mask.block_sizes is None else np.array(mask.block_sizes)
    from masklab.costs import BlockCosts

    weights = BlockCosts(sizes).block_bytes  # integers >= 1, or DesignError naming the entry
    if len(weights) != mask.blocks:
        raise DesignError(f"sizes has {len(weights)} entries but the mask has {mask.blocks} blocks")
    return np.array(weights, dtype=np.int64)


def matched_rows(old: np.ndarray, new: np.ndarray, sizes: Iterable[int] | None = None, *,
                 fits: np.ndarray | None = None) -> np.ndarray:
    """The order of `new`'s rows that gives worker k row ``new[order[k]]`` with the least total size
    of blocks gained (held in `new`'s row, not in ``old[k]``); ties go to the lowest row. `fits`: a
    (worker, row) boolean matrix of the rows each worker may take (its budget); the order is the best
    among those that give every worker a row it may take, or DesignError when there is none.

    >>> matched_rows(np.array([[1, 0, 0], [0, 0, 1]]), np.array([[0, 1, 1], [1, 1, 0]])).tolist()
    [1, 0]
    """
    from scipy.optimize import linear_sum_assignment  # scipy costs every importer of masklab ~0.4 s

    old, new = np.asarray(old, dtype=bool), np.asarray(new, dtype=bool)
    weight = np.ones(old.shape[1]) if sizes is None else np.asarray(list(sizes), dtype=float)
    gained = (new[None, :, :] & ~old[:, None, :]) @ weight  # [worker, row]
    if fits is not None:  # a forbidden pair costs more than every allowed assignment together
        gained = np.where(fits, gained, gained.sum() + 1.0)
    workers, order = linear_sum_assignment(gained)
    if fits is not None and not fits[workers, order].all():
        k = int(workers[~fits[workers, order]][0])
        raise DesignError(f"no row of the survivors' mask that fits worker {k}'s budget is left for it")
    return order
