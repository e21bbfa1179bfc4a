"""The survivors' mask after losing workers, with the designed coverage restored.

`survivors_mask` (`masklab.failures`) drops the lost rows: each block stays with its other holders,
so coverage falls where the lost workers held blocks. `restored_mask` designs a mask for the K - |D|
survivors with the designed coverage again (`design`, or `neuron_design` for N-SDP's neuron groups)
and hands its rows to the survivors so that the blocks they must newly hold weigh the least (a
linear assignment over the block sizes).

These are properties of masks. Moving blocks to the survivors that gain them is the runtime's job
(docs/design.md §7), which this module neither does nor assumes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from masklab.design import design
from masklab.errors import MaskError
from masklab.failures import survivors_mask
from masklab.mask import Mask
from masklab.neurons import neuron_design


def restored_mask(mask: Mask, lost: Iterable[int], *, coverage: int | None = None, groups: int | None = None,
                  construction: str = "auto", seed: int | None = None) -> Mask:
    """A static mask for the survivors of `mask` (static, K rows) after losing `lost`, with every block
    on ``min(coverage, K - |lost|)`` survivors, rows in the survivors' order.

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
        `design`'s.

    Returns
    -------
    Mask
        `survivors_mask` itself when no block fell below the coverage (nothing moves); else the
        design, its rows matched to the survivors so that the total size of the blocks a survivor
        newly holds is the least (``mask.block_sizes``, 1 each when unset).

    Examples
    --------
    >>> m = Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]])
    >>> restored_mask(m, [0]).coverage.tolist()
    [2, 2, 2, 2]
    >>> restored_mask(m, [0], coverage=1).matrix.tolist()  # every block still held: nothing moves
    [[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]
    """
    if not mask.schedule.is_static:
        raise MaskError(f"restored_mask takes the static mask in force, got a {mask.schedule.kind!r} schedule: pass "
                        "Mask(mask.round_matrix(step, seed=seed))")
    kept = survivors_mask(mask, lost)
    target = int(mask.coverage.min()) if coverage is None else coverage
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or target < 1:
        raise MaskError(f"coverage={coverage!r} must be an integer >= 1")
    target = min(int(target), kept.workers)
    if int(kept.coverage.min()) >= target:
        return kept
    if groups is None:
        new = design(kept.workers, kept.blocks, coverage=target, construction=construction, seed=seed)
    else:
        if kept.blocks % groups:
            raise MaskError(f"groups={groups} does not divide the mask's {kept.blocks} columns")
        new = neuron_design(kept.workers, kept.blocks // groups, groups, coverage=target, construction=construction,
                            seed=seed)
    rows = matched_rows(kept.matrix, new.matrix, mask.block_sizes)
    return Mask(new.matrix[rows], block_names=mask.block_names, block_sizes=mask.block_sizes,
                construction=new.construction)


def matched_rows(old: np.ndarray, new: np.ndarray, sizes: Iterable[int] | None = None) -> np.ndarray:
    """The order of `new`'s rows that gives worker k row ``new[order[k]]`` with the least total size
    of blocks gained (held in `new`'s row, not in ``old[k]``); ties go to the lowest row.

    >>> matched_rows(np.array([[1, 0, 0], [0, 0, 1]]), np.array([[0, 1, 1], [1, 1, 0]])).tolist()
    [1, 0]
    """
    from scipy.optimize import linear_sum_assignment  # scipy costs every importer of masklab ~0.4 s

    old, new = np.asarray(old, dtype=bool), np.asarray(new, dtype=bool)
    weight = np.ones(old.shape[1]) if sizes is None else np.asarray(list(sizes), dtype=float)
    gained = (new[None, :, :] & ~old[:, None, :]) @ weight  # [worker, row]
    _, order = linear_sum_assignment(gained)
    return order
