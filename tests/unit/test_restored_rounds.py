"""Survivors that restore the designed coverage under a mask schedule (``--restore-coverage --schedule``):
every round's restored mask (`Rounds.round_matrix` after `Rounds.for_survivors` with ``restore``,
`restored_round`), a later loss and a rejoin over restored rounds, and what `Survival.restored` records
and refuses. The run itself: tests/distributed/test_worker_loss_rounds.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from masklab import Mask, Schedule
from masklab.testing.strategies import mask_sequences, masks
from sdp_train.parallel.rounds import Rounds, restored_round
from sdp_train.trainer.agreement import WorkerLossError, decide

STEPS = 10


def _covered(mask: Mask, step: int, rows) -> bool:
    """Whether the survivors `rows` hold every block in the designed round of `step` (else `decide` refuses)."""
    return bool(mask.round_matrix(step, seed=1)[list(rows)].any(axis=0).all())


@settings(deadline=None, max_examples=40)
@given(mask=st.one_of(masks(workers=st.integers(2, 6), max_blocks=6, schedule=True).filter(
    lambda m: not m.schedule.is_static), mask_sequences(workers=st.integers(2, 6), max_blocks=5)), data=st.data())
def test_every_restored_round_has_the_designed_coverage_and_is_the_same_in_any_order(mask, data):
    """For every schedule, loss and order of asking: each round's restored mask holds every block on
    ``min(c, survivors)`` survivors at least (c: the designed least coverage, every round's), gives every
    survivor a block, is the round's designed rows as they are where those have the coverage already, and
    is the same whichever rounds were asked before (a second position, asked in a random order, and the
    first asked again after its cache of the latest rounds has moved on)."""
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers - 1))
    survivors = [w for w in range(mask.workers) if w not in lost]
    coverage = int(mask.coverage.min())
    restore = {"coverage": coverage, "seed": 1}
    steps = [s for s in range(STEPS) if _covered(mask, s, survivors)]
    assume(0 in steps)  # the survivors' position is in round 0 (a loss that uncovers it is refused: `decide`)
    first = Rounds(mask, seed=1, counts=True).for_survivors(survivors, restore=restore)
    second = Rounds(mask, seed=1, counts=True).for_survivors(survivors, restore=restore)
    in_order = {s: first.round_matrix(s).copy() for s in steps}
    shuffled = {s: second.round_matrix(s) for s in data.draw(st.permutations(steps))}
    again = {s: first.round_matrix(s) for s in reversed(steps)}
    target = min(coverage, len(survivors))
    for s in steps:
        restored, designed = in_order[s], mask.round_matrix(s, seed=1)[survivors]
        assert restored.tolist() == shuffled[s].tolist() == again[s].tolist()
        assert (restored.sum(axis=0) >= target).all() and restored.any(axis=1).all()
        if designed.sum(axis=0).min() >= target:
            assert restored.tolist() == designed.tolist()  # nothing moves where nothing fell below
        assert first.designed_rows(s).tolist() == designed.tolist()


@settings(deadline=None, max_examples=40)
@given(mask=masks(workers=st.integers(3, 6), max_blocks=6, schedule=True).filter(lambda m: not m.schedule.is_static),
       data=st.data())
def test_a_later_loss_restores_from_the_designed_rounds_of_the_workers_left_and_a_rejoin_goes_back_to_them(
        mask, data):
    """A second loss over restored rounds: every round is restored again from the designed round's rows of
    the workers still there (rows of the designed mask: `Rounds.rows`), not from the rounds restored for
    the first survivors; `to_train` (what `decide` checks) gives those designed rows. When workers join,
    the state stays in the rows in force (the members' restored rows, then the joiners' designed ones)
    and the change to the designed round's rows of the new world is due, with nothing restored after."""
    restore = {"coverage": int(mask.coverage.min()), "seed": 1}
    lost = data.draw(st.integers(0, mask.workers - 1))
    survivors = [w for w in range(mask.workers) if w != lost]
    ranks = sorted(data.draw(st.sets(st.integers(0, len(survivors) - 1), min_size=1, max_size=len(survivors) - 1)))
    left = [survivors[k] for k in ranks]
    assume(_covered(mask, 0, left))  # else `decide` refuses the losses
    first = Rounds(mask, seed=1, counts=True).for_survivors(survivors, restore=restore)
    second = first.for_survivors(ranks)  # the restore goes on from the first loss
    assert second.rows.tolist() == left and second.matrix.tolist() == first.matrix[ranks].tolist()
    for s in range(STEPS):
        if _covered(mask, s, left):
            expected = restored_round(mask.round_matrix(s, seed=1)[left], left, restore, mask)
            assert second.round_matrix(s).tolist() == expected.tolist()
    for step, matrix in second.to_train(STEPS)[1:]:
        assert matrix.tolist() == mask.round_matrix(step, seed=1)[left].tolist()
    members = second.for_survivors(range(len(left)))  # a state in the round in force, as members have
    members.entered(members.round_matrix(0), 0)
    members.due = None
    workers = [*left, *[w for w in range(mask.workers) if w not in left]]
    in_force = np.vstack([members.matrix, mask.round_matrix(0, seed=1)[workers[len(left):]]])
    joined = members.for_joiners(workers, in_force=in_force)
    designed = mask.round_matrix(0, seed=1)[workers]
    assert joined.restore is None and joined.matrix.tolist() == in_force.tolist()
    assert (joined.due is None) == (in_force.tolist() == designed.tolist())
    assert joined.round_matrix(STEPS).tolist() == mask.round_matrix(STEPS, seed=1)[workers].tolist()


def _schedule_mask() -> Mask:
    """4 workers, 4 blocks on 2 each, rows permuted every 3 steps."""
    return Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], schedule=Schedule("permute", every=3))


def test_survivors_record_the_restored_round_of_the_next_step_that_their_rounds_then_train():
    from sdp_train.trainer.membership import Survival

    mask, restore = _schedule_mask(), {"coverage": 2, "groups": None, "seed": 0, "sizes": None}
    rounds = Rounds(mask, seed=0, counts=True)
    for _ in range(3):
        rounds.step_done()  # a loss at the end of round 0: round 1's change is due
    survival = Survival(None, 1, [0, 1, 2, 3], mask, restore=restore, seed=0)
    change = decide(mask, [0, 1, 2, 3], {1: 3, 2: 3, 3: 3}, step=3, rounds=rounds.to_train(STEPS))
    change = survival.restored(change, 3, report=True, rounds=rounds.to_train(STEPS))
    survivors = rounds.for_survivors(change.rows, restore=restore)
    assert change.restored and change.mask.matrix.tolist() == survivors.round_matrix(3).tolist()
    assert (change.mask.coverage == 2).all() and survivors.due.tolist() == change.mask.matrix.tolist()


def test_survivors_whose_budgets_fit_no_restored_round_stop_in_one_line_naming_them():
    from sdp_train.trainer.membership import Survival

    mask = _schedule_mask()
    restore = {"coverage": 2, "groups": None, "seed": 0, "sizes": [10, 10, 10, 10], "budgets": [25] * 4,
               "fixed_bytes": 0}  # 3 survivors, 8 holder slots of 10 bytes: one of them needs 30
    rounds = Rounds(mask, seed=0, counts=True)
    survival = Survival(None, 1, [0, 1, 2, 3], mask, restore=restore, seed=0)
    change = decide(mask, [0, 1, 2, 3], {1: 0, 2: 0, 3: 0}, step=0, rounds=rounds.to_train(STEPS))
    with pytest.raises(WorkerLossError, match=r"^step 0: the survivors \[1, 2, 3\] cannot restore the designed "
                                              r"coverage within their memory budgets .*--resume\)$"):
        survival.restored(change, 0, report=True, rounds=rounds.to_train(STEPS))


def test_after_the_last_step_was_applied_no_round_follows_and_nothing_is_restored():
    from sdp_train.trainer.membership import Survival

    mask = _schedule_mask()
    rounds = Rounds(mask, seed=0, counts=True)
    for _ in range(3):
        rounds.step_done()
    survival = Survival(None, 1, [0, 1, 2, 3], mask, restore={"coverage": 2, "seed": 0}, seed=0)
    change = decide(mask, [0, 1, 2, 3], {1: 3, 2: 3, 3: 3}, step=2, rounds=rounds.to_train(3))
    assert survival.restored(change, 2, report=True, rounds=rounds.to_train(3)) is change



def test_a_round_after_the_run_that_no_survivor_could_train_is_not_restored_and_ends_the_run_quietly():
    """`step_done` after the last step asks for the round of the step after it, which `decide` never checked:
    where no survivor holds some block there, it is the designed rows, not a `MaskError` at the run's end."""
    mask = Mask([[1, 0], [0, 1], [0, 1]], schedule=Schedule("cyclic", every=2))  # rows shift every 2 steps
    survivors = [0, 2]  # worker 1 lost: rounds 0 and 1 (steps 0-3) covered, round 2 (step 4) not
    assert [_covered(mask, s, survivors) for s in (0, 2, 4)] == [True, True, False]
    rounds = Rounds(mask, seed=1, counts=True).for_survivors(survivors, restore={"coverage": 1, "seed": 0})
    for _ in range(4):  # a run of 4 steps
        rounds.step_done()
        due = rounds.take_due()
        if due is not None:
            rounds.entered(due, rounds.steps)
    assert rounds.round_matrix(4).tolist() == mask.round_matrix(4, seed=1)[survivors].tolist()


@settings(deadline=None, max_examples=40)
@given(mask=masks(workers=st.integers(3, 6), max_blocks=6, schedule=True).filter(lambda m: not m.schedule.is_static),
       data=st.data())
def test_with_local_steps_the_restore_waits_for_the_boundary_after_the_interrupted_round(mask, data):
    """Local steps: survivors of a loss after s steps train under their rows up to `restore_step(s, H)`, the
    first boundary from s on (there every holder's copy is the average), and from there under every round's
    restored mask; the change to it falls due exactly when `step_done` reaches that boundary."""
    from sdp_train.trainer.membership import restore_step

    lost = data.draw(st.integers(0, mask.workers - 1))
    survivors = [w for w in range(mask.workers) if w != lost]
    assume(all(_covered(mask, s, survivors) for s in range(STEPS)))
    every = mask.schedule.every  # a multiple of local steps (`TrainConfig`)
    local_steps = data.draw(st.sampled_from([h for h in range(1, every + 1) if every % h == 0]))
    applied = data.draw(st.integers(0, STEPS - every - 1))
    rounds = Rounds(mask, seed=1, counts=True)
    for _ in range(applied):
        rounds.step_done()
        due = rounds.take_due()
        if due is not None:
            rounds.entered(due, rounds.steps)
    at = restore_step(applied, local_steps)
    restore = {"coverage": int(mask.coverage.min()), "seed": 1}
    survivors_rounds = rounds.for_survivors(survivors, restore=restore, restore_from=at)
    reference = Rounds(mask, seed=1, counts=True).for_survivors(survivors, restore=restore)  # restored from 0 on
    for s in range(STEPS):
        expected = reference.round_matrix(s) if s >= at else mask.round_matrix(s, seed=1)[survivors]
        assert survivors_rounds.round_matrix(s).tolist() == expected.tolist()
    while True:  # as the wrapper trains: the change that is due made before each step
        due = survivors_rounds.take_due()
        if due is not None:
            assert survivors_rounds.steps == at  # no change inside the interrupted round, none before `at`
            survivors_rounds.entered(due, survivors_rounds.steps)
        if survivors_rounds.steps == at:
            break
        assert survivors_rounds.matrix.tolist() == mask.round_matrix(applied, seed=1)[survivors].tolist()
        survivors_rounds.step_done()
    assert survivors_rounds.matrix.tolist() == reference.round_matrix(at).tolist()


def test_a_restore_a_loss_left_due_under_a_schedule_is_recorded_with_the_bytes_and_time_of_its_change():
    """Under a schedule with local steps the schedule's change at the boundary makes the restore
    (`Survival.restore_due` only records it): its record has what that change moved and how long it took
    (the run's `mask_change_bytes` and `mask_change_seconds` since the loss), not 0 s."""
    from types import SimpleNamespace

    from sdp_train.trainer.membership import Survival

    mask = Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], schedule=Schedule("cyclic"))
    rounds = Rounds(mask, 0, counts=True).for_survivors([1, 2, 3], restore={"coverage": 2, "seed": 0})
    rounds.entered(rounds.round_matrix(3), 3)
    survival = Survival(None, 1, [1, 2, 3], Mask(rounds.designed_rows(3)), restore={"coverage": 2, "seed": 0})
    survival.pending_round_restore = (3, 1000, 1.25)  # at the loss: 1000 bytes moved, 1.25 s of changes so far
    run = SimpleNamespace(mask_change_bytes=1800, mask_change_seconds=1.75, cfg=SimpleNamespace(local_steps=3),
                          sync=SimpleNamespace(schedule_rounds=rounds))
    change = survival.restore_due(run, 3)
    assert (change.step, change.restored, change.moved_bytes) == (3, True, 800)
    assert change.recovery_s == pytest.approx(0.5)
    assert survival.restore_due(run, 4) is None
