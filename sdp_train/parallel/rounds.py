"""Where training is in a mask's schedule: one step counter for `SubnetworkDataParallel` and
`OverlapAveraging`.

`Rounds` counts optimizer steps, knows the round whose mask this worker's state is in, and says
when a round that ended is followed by one with another mask (a change is *due*); it saves and
restores that position. After workers are lost, `Rounds.for_survivors` keeps the position with
every round's mask restricted to the survivors' rows, or (``--restore-coverage``) with every round the
mask that restores that round's designed coverage for them (`restored_round`, built once per round on
every rank alike); when workers join, `Rounds.for_joiners` keeps it with every round the designed
round's rows of the new world's workers; `Rounds.over` keeps it over
another static mask (survivors that restore coverage, joiners welcomed under the members' rows). It moves nothing: the
wrapper that owns it makes the change (`sdp_train.parallel.schedule` moves blocks and optimizer
state). Reasoning: docs/design.md §5.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from masklab import Mask
from sdp_train.errors import ConfigError

RESTORED_ROUNDS_KEPT = 4
"""Restored rounds `Rounds` keeps computed: the round in force, the next, and the rounds a check looks at."""


class Rounds:
    """The schedule position of `mask` (drawn with `seed`); `counts` says whether steps are counted
    at all (a static mask without local steps has no position to keep)."""

    def __init__(self, mask: Mask, seed: int, *, counts: bool) -> None:
        self.mask, self.seed, self.counts = mask, seed, counts
        self.rows: np.ndarray | None = None
        """The rows of `mask` the workers are, in rank order, once some were lost (None: all of them)."""
        self.restore: dict[str, Any] | None = None
        """Once survivors restore coverage under a schedule: `restored_round`'s keyword arguments, with which
        every round's mask is the one restoring its designed coverage for `rows` (None: the rows as they are)."""
        self._restored: dict[int, np.ndarray] = {}  # round index -> its restored mask, the latest few
        self.restore_from = 0
        """With `restore`: the first step trained under a restored mask (with local steps, the boundary after
        the round a loss interrupted: `restore_step`); before it the rows as they are."""
        self.steps = 0
        """Optimizer steps taken."""
        self.matrix = self.round_matrix(0)
        """The mask of the round this worker's state is in."""
        self.mask_step = 0  # a step of `matrix`'s round
        self.due: np.ndarray | None = None  # the next round's mask, when a change is due

    def round_matrix(self, step: int) -> np.ndarray:
        """The (K, B) mask in force at optimizer step `step`, the same on every rank: the designed round's
        rows of the workers (`designed_rows`), or with `restore` the mask restoring that round's designed
        coverage for them (`restored_round`), computed once per round.

        >>> from masklab import Schedule
        >>> mask = Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], schedule=Schedule("cyclic"))
        >>> rounds = Rounds(mask, 0, counts=True).for_survivors([1, 2, 3], restore={"coverage": 2, "seed": 0})
        >>> rounds.round_matrix(1).sum(axis=0).tolist(), rounds.designed_rows(1).sum(axis=0).tolist()
        ([2, 2, 2, 2], [2, 1, 1, 2])
        """
        if self.restore is None or self.rows is None or self.mask.schedule.is_static or step < self.restore_from:
            return self.designed_rows(step)
        index = step // self.mask.schedule.every
        if index in self._restored:
            return self._restored[index]
        designed = self.designed_rows(step)
        if not designed.any(axis=0).all():  # no survivor holds a block: a round the survivors never train (the
            return designed  # loss is refused where one is to be trained, `decide`), asked by `step_done` at the end
        if len(self._restored) >= RESTORED_ROUNDS_KEPT:
            del self._restored[min(self._restored)]
        self._restored[index] = restored_round(designed, self.rows, self.restore, self.mask)
        return self._restored[index]

    def designed_rows(self, step: int) -> np.ndarray:
        """The designed mask of optimizer step `step`'s round, restricted to the workers' rows (rank order)."""
        matrix = self.mask.round_matrix(step, seed=self.seed)
        return matrix if self.rows is None else matrix[self.rows]

    def for_survivors(self, rows: Sequence[int], *, restore: Mapping[str, Any] | None = None,
                      restore_from: int | None = None) -> Rounds:
        """This position over the workers of `rows` (ranks of the current world, in their new order):
        every round's mask restricted to their rows (with `restore`, or a `restore` given at an earlier
        loss: the mask restoring each round's designed coverage for them, `restored_round`, from step
        `restore_from` on, default the next), this worker's state still in the round it was in, and the
        change to the round of the next step due when that round differs (also when a loss interrupted
        the change that was being made; with `restore`, whenever the restored round holds other blocks
        than the survivors' rows; with a later `restore_from`, once `step_done` reaches it)."""
        survivors = copy.copy(self)
        survivors.rows = np.asarray(rows) if self.rows is None else self.rows[list(rows)]
        if restore is not None:
            assert not self.mask.schedule.is_static, "a static mask restores coverage over a new mask: over"
            survivors.restore = dict(restore)
            survivors.restore_from = self.steps if restore_from is None else restore_from
        survivors._restored = {}  # other workers: other restored rounds
        survivors.matrix = self.matrix[list(rows)]
        upcoming = survivors.round_matrix(self.steps)
        survivors.due = None if np.array_equal(upcoming, survivors.matrix) else upcoming
        return survivors

    def for_joiners(self, workers: Sequence[int], *, steps: int | None = None,
                    in_force: np.ndarray | None = None) -> Rounds:
        """This position over a world that workers joined: `workers` are the rows of `mask`, the designed
        one, of the new world's ranks in their order (a member's worker number is its row), and every
        round is the designed round's rows of those workers (no restore: the designed rows are back),
        from the round of the next step on. Every rank's state is in that round's mask (nothing is
        due), or in `in_force` (rank order: the members' rows in force, restored ones after a loss,
        then the joiners' designed rows), the change to the designed rows then due. A member calls it
        where no change is due (make it first). A joiner calls it on a new `Rounds` of the designed
        mask, with `steps` taken by the members.

        >>> from masklab import Schedule
        >>> mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]], schedule=Schedule("cyclic", every=2))
        >>> joined = Rounds(mask, 0, counts=True).for_joiners([2, 0], steps=3)  # worker 1 missing
        >>> joined.matrix.tolist() == mask.round_matrix(3)[[2, 0]].tolist(), joined.due is None
        (True, True)
        """
        assert self.due is None, "a member makes the due change before workers join"
        joined = copy.copy(self)
        joined.rows, joined.restore, joined._restored, joined.restore_from = np.asarray(workers), None, {}, 0
        joined.steps = self.steps if steps is None else steps
        joined.matrix, joined.mask_step = joined.round_matrix(joined.steps), joined.steps
        if in_force is not None and not np.array_equal(in_force, joined.matrix):
            joined.matrix, joined.due = np.asarray(in_force), joined.matrix
        return joined

    def over(self, mask: Mask) -> Rounds:
        """This position (the steps taken) over another static `mask`, rows in rank order: survivors that
        move to a mask restoring coverage, members that welcome joiners under their rows in force. A
        static mask's rounds are all `mask` itself, so the state is in it and nothing is due.

        >>> rounds = Rounds(Mask([[1, 0], [0, 1]]), 0, counts=True)
        >>> rounds.steps = 3
        >>> moved = rounds.over(Mask([[1, 1], [1, 1]]))
        >>> moved.steps, moved.matrix.tolist(), moved.due is None
        (3, [[1, 1], [1, 1]], True)
        """
        assert mask.schedule.is_static and self.mask.schedule.is_static, "a schedule's rounds go on: for_survivors"
        moved = Rounds(mask, self.seed, counts=self.counts)
        moved.steps = self.steps
        return moved

    def to_train(self, steps: int) -> list[tuple[int, np.ndarray]]:
        """``(step, matrix)``: the mask this worker's state is in, at the next step, then the designed mask
        of the next step's round and of every later round of a run of `steps` steps, at its first step,
        restricted to the workers (`designed_rows`: what survivors that restore coverage design from)."""
        out = [(self.steps, self.matrix)]
        if not self.mask.schedule.is_static:
            every = self.mask.schedule.every
            starts = [self.steps, *range((self.steps // every + 1) * every, steps, every)]
            out += [(step, self.designed_rows(step)) for step in starts if step < steps]
        return out

    def step_done(self) -> None:
        """Count one optimizer step; a change becomes due when the next step's round has another mask."""
        self.steps += 1
        if not self.mask.schedule.is_static:
            upcoming = self.round_matrix(self.steps)
            self.due = None if np.array_equal(upcoming, self.matrix) else upcoming

    def take_due(self) -> np.ndarray | None:
        """The mask of a due change (no longer due), or None."""
        due, self.due = self.due, None
        return due

    def entered(self, matrix: np.ndarray, step: int) -> None:
        """This worker's state is in `matrix`, the mask of step `step`'s round, from now on."""
        self.matrix, self.mask_step = matrix, step

    def state(self) -> dict[str, int]:
        """``{"steps": n}`` (and ``"mask_step"`` while a change is due), ``{}`` when not counting."""
        if not self.counts:
            return {}
        if self.due is not None:
            return {"steps": self.steps, "mask_step": self.mask_step}
        return {"steps": self.steps}

    def load(self, state: dict[str, int], what: str) -> tuple[np.ndarray, int] | None:
        """Continue from `state`; returns the saved round's mask and step when the worker must enter
        that round (call `entered` once it has), else None. `what` names the owner in errors."""
        if not self.counts and not state:
            return None
        steps = state.get("steps") if isinstance(state, dict) else None
        # a checkpoint taken before a due change keeps the ended round's state (written before there was
        # "mask_step", a checkpoint's state was always the round of "steps")
        mask_step = state.get("mask_step", steps) if isinstance(state, dict) else None
        schedule = not self.mask.schedule.is_static
        if (not self.counts or not _count(steps) or not _count(mask_step) or mask_step > steps
                or (mask_step != steps and not schedule)):
            expected = ("{}" if not self.counts else "{'steps': n} with an integer n >= 0"
                        + (", and 'mask_step': m with 0 <= m <= n" if schedule else ""))
            raise ConfigError(f"schedule state {state!r} does not fit {what}: expected {expected}")
        self.steps = steps
        if not schedule:
            return None
        matrix = self.round_matrix(mask_step)
        upcoming = self.round_matrix(steps)
        self.due = None if np.array_equal(upcoming, matrix) else upcoming
        return None if np.array_equal(matrix, self.matrix) else (matrix, mask_step)


def restored_round(matrix: np.ndarray, workers: Sequence[int], restore: Mapping[str, Any], mask: Mask
                   ) -> np.ndarray:
    """The rows that restore the designed coverage for the survivors `workers` (rows of the designed
    mask, rank order) in a round whose designed mask restricted to them is `matrix`: the mask of
    `masklab.survivors.restored_mask` with `restore` (its keyword arguments; ``budgets``, one per
    worker of the designed mask, are taken for `workers`), designed from `matrix` itself and its rows
    matched to the survivors in rank order so that the fewest block bytes move from `matrix`; `matrix`
    as it is where no block is below ``min(coverage, survivors)`` holders. `mask`: the run's, for the
    block names and sizes. The same on every rank, whatever the round: the design depends only on the
    survivors' number and `restore`, the matching on `matrix`. Raises `DesignError` or `MaskError` as
    `restored_mask` does (a block no survivor holds, budgets that no design fits).

    >>> restored_round(np.array([[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]), [1, 2, 3], {"coverage": 2},
    ...                Mask(np.eye(4, dtype=int))).sum(axis=0).tolist()
    [2, 2, 2, 2]
    """
    from masklab.survivors import restored_mask  # scipy: only survivors that restore coverage import it

    restore = dict(restore)
    if "budgets" in restore:
        restore["budgets"] = [restore["budgets"][w] for w in workers]
    survivors = Mask(np.asarray(matrix), block_names=mask.block_names, block_sizes=mask.block_sizes)
    return restored_mask(survivors, [], **restore).matrix.astype(np.asarray(matrix).dtype)


def _count(value) -> bool:
    """Whether `value` is a count of steps: an integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def restore_step(steps_applied: int, local_steps: int) -> int:
    """The step at whose start survivors that applied `steps_applied` steps move to a mask restoring the
    designed coverage: at once on a round's boundary (every `local_steps`-th step, right after the
    holders' average, where every holder of a block has the same values), else at the next one.

    >>> restore_step(3, 3), restore_step(4, 3), restore_step(5, 1)
    (3, 6, 5)
    """
    return -(-steps_applied // local_steps) * local_steps
