"""The check the B-, N- and Bb-SDP schedule tests share: bytes move exactly at the steps that begin a
new round, and never after the last step (the round after it never trains)."""

from __future__ import annotations

import numpy as np

from masklab import Mask


def assert_moves_only_when_a_round_begins(ranks: list[list[dict]], mask: Mask, seed: int,
                                          changed_steps: list[bool]) -> None:
    """Each rank's cumulative ``moved`` bytes grow at exactly the steps whose round differs from the
    step before, which must be `changed_steps` (so the schedule under test really changes)."""
    steps = len(changed_steps)
    rounds = [mask.round_matrix(step, seed=seed) for step in range(steps)]
    changed = [step > 0 and not np.array_equal(rounds[step], rounds[step - 1]) for step in range(steps)]
    assert changed == changed_steps
    for trace in ranks:
        moved = [snap["moved"] for snap in trace]
        assert len(moved) == steps, moved
        assert [b > a for a, b in zip([0, *moved], moved)] == changed, moved
