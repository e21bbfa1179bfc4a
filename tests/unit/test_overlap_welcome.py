"""What a worker that rejoins an overlap-averaging run receives (`welcome_holdings`, ``sdp train --mode overlap
--max-rejoins``), and what survivors that restore the designed coverage take (`restore_holdings`, ``sdp train
--mode overlap --restore-coverage``), planned in one process: the movers send each tensor a rank newly holds
from its lowest-ranked holder (`sdp_train.parallel.schedule.plan_moves`); and under a schedule, which round's
holders a joiner takes from and which rounds survivors average again and go on in (`rounds_after_loss`,
`Rounds.for_survivors`). The launches: tests/distributed/test_worker_loss_applied.py (static mask),
tests/distributed/test_worker_loss_rounds.py (a schedule)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from masklab import Schedule
from masklab.testing.strategies import masks
from sdp_train.parallel.masking import describe
from sdp_train.parallel.overlap import restore_holdings, rounds_after_loss, trained_step, welcome_holdings
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.schedule import plan_moves


def _model(blocks: int) -> nn.Module:
    """Shared tensors (an embedding and a head around the blocks) and `blocks` blocks with a buffer each."""
    model = nn.Module()
    model.embed = nn.Embedding(3, 2)
    model.blocks = nn.ModuleList(nn.BatchNorm1d(2) for _ in range(blocks))
    model.head = nn.Linear(2, 3)
    return model


@settings(deadline=None, max_examples=80)
@given(mask=masks(workers=st.integers(2, 6), max_blocks=5), data=st.data())
def test_a_joiner_gets_every_tensor_from_its_lowest_ranked_holder_and_the_state_of_what_it_holds(mask, data):
    """For every mask and set of joiners (the last ranks; the members' rows hold every block): a joiner
    receives every tensor of the model, each block's (held or not, buffers too) from the lowest-ranked
    member holding that block and each shared one from rank 0, and the optimizer state of exactly the
    parameters its row holds, from the same members; a member receives nothing and no joiner sends."""
    members = list(range(mask.workers - data.draw(st.integers(1, mask.workers - 1))))
    assume(mask.matrix[members].any(axis=0).all())  # else no survivors to join: a block lost every holder
    joiners = list(range(len(members), mask.workers))
    layout = describe(_model(mask.blocks), [f"blocks.{j}" for j in range(mask.blocks)], "block")
    before, copies, held = welcome_holdings(layout, mask.matrix, joiners)

    def holders(name: str) -> list[int]:
        block = layout.owning_block(name)
        return members if block is None else [k for k in members if mask.matrix[k, layout.blocks.index(block)]]

    values = plan_moves(list(layout.tensors), before, copies)
    assert [name for name, _, _ in values] == list(layout.tensors)  # every tensor, the unheld blocks' too
    assert all(receivers == joiners and src == holders(name)[0] for name, src, receivers in values)
    state = plan_moves(list(layout.parameter_names), before, held)
    for name, src, receivers in state:
        block = layout.owning_block(name)
        assert src == holders(name)[0]
        assert receivers == [k for k in joiners if block is None or mask.matrix[k, layout.blocks.index(block)]]
    expected = {n for n in layout.parameter_names for k in joiners if n in layout.held(mask.matrix[k])}
    assert {name for name, _, _ in state} == expected


@settings(deadline=None, max_examples=80)
@given(mask=masks(workers=st.integers(1, 6), max_blocks=5), data=st.data())
def test_a_survivor_gets_each_block_it_newly_holds_from_its_lowest_ranked_holder_and_nothing_else(mask, data):
    """For every mask in force and every mask the ranks move to (`restore_holdings`): a rank receives every
    tensor of each block its new row gives it and its old row did not (buffers too, values; parameters, their
    optimizer state), from the lowest-ranked rank holding that block under the old rows; nothing of a block it
    held already, of one it drops (its copy stays) or of a shared tensor moves."""
    new = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=mask.blocks, max_size=mask.blocks),
                                      min_size=mask.workers, max_size=mask.workers)), dtype=int)
    old = mask.matrix
    layout = describe(_model(mask.blocks), [f"blocks.{j}" for j in range(mask.blocks)], "block")
    old_held, held = restore_holdings(layout, old, new)

    def expected(names: list[str]) -> list[tuple[str, int, list[int]]]:
        moves = []
        for name in names:
            block = layout.owning_block(name)
            if block is None:
                continue
            j = layout.blocks.index(block)
            gainers = [k for k in range(mask.workers) if new[k, j] and not old[k, j]]
            if gainers:
                moves.append((name, int(np.flatnonzero(old[:, j])[0]), gainers))
        return moves

    assert plan_moves(list(layout.tensors), old_held, held) == expected(list(layout.tensors))
    assert plan_moves(list(layout.parameter_names), old_held, held) == expected(list(layout.parameter_names))


@settings(deadline=None, max_examples=80)
@given(mask=masks(workers=st.integers(2, 6), max_blocks=5), data=st.data())
def test_under_a_schedule_a_joiner_takes_values_from_the_round_last_trained_and_state_of_the_next(mask, data):
    """`welcome_holdings` with the round last trained `trained` (whose holders have just averaged it) and the
    next step's round `matrix` (another draw: a change of round at the admission's boundary): a joiner's
    every tensor, and the optimizer state of exactly the parameters its row of `matrix` holds, come from the
    lowest-ranked member holding the tensor in `trained`; a member receives nothing and loses no state, of
    a block it holds in `matrix` only, or in `trained` only, too."""
    members = list(range(mask.workers - data.draw(st.integers(1, mask.workers - 1))))
    assume(mask.matrix[members].any(axis=0).all())
    joiners = list(range(len(members), mask.workers))
    nxt = np.array(data.draw(st.permutations(list(mask.matrix.tolist()))), dtype=int)  # a permute round
    layout = describe(_model(mask.blocks), [f"blocks.{j}" for j in range(mask.blocks)], "block")
    before, copies, held = welcome_holdings(layout, nxt, joiners, trained=mask.matrix)

    def source(name: str) -> int:
        block = layout.owning_block(name)
        return members[0] if block is None else next(k for k in members
                                                     if mask.matrix[k, layout.blocks.index(block)])

    values = plan_moves(list(layout.tensors), before, copies)
    assert [(name, src, receivers) for name, src, receivers in values] == [
        (name, source(name), joiners) for name in layout.tensors]
    state = plan_moves(list(layout.parameter_names), before, held)
    expected = [(name, source(name), [k for k in joiners if name in layout.held(nxt[k])])
                for name in layout.parameter_names]
    assert state == [move for move in expected if move[2]]
    assert all(held[k] == before[k] == copies[k] for k in members)  # nothing to or from a member's own state


@settings(deadline=None, max_examples=80)
@given(workers=st.integers(2, 5), blocks=st.integers(1, 4), kind=st.sampled_from(["permute", "cyclic"]),
       local=st.integers(1, 3), rounds_of=st.integers(1, 3), data=st.data())
def test_survivor_rounds_and_the_loss_check_are_the_designed_rows_of_the_survivors_whatever_the_boundary_state(
        workers, blocks, kind, local, rounds_of, data):
    """Overlap averaging under a schedule (R a multiple of H), a loss after `lost_at` steps, whether the rank
    had entered the next round at that boundary or its average failed first: what the loss is checked
    against (`rounds_after_loss`) is the same either way, the round last trained first and every later
    round's first step after; the survivors' position (`Rounds.for_survivors`) averages again that round's
    rows of theirs, then enters the next step's (`OverlapAveraging.enter_due`), and every later round is the
    designed round restricted to their rows."""
    rows = data.draw(st.lists(st.lists(st.integers(0, 1), min_size=blocks, max_size=blocks), min_size=workers,
                              max_size=workers))
    from masklab import Mask

    assume(all(any(r) for r in rows) and all(any(r[j] for r in rows) for j in range(blocks)))
    every, steps = local * rounds_of, 4 * local * rounds_of
    mask = Mask(rows, schedule=Schedule(kind, every=every))
    lost_at = data.draw(st.integers(0, steps - 1))
    entered = data.draw(st.booleans())  # at a boundary: this rank's average had finished (the next round entered)
    survivors = sorted(data.draw(st.sets(st.integers(0, workers - 1), min_size=1, max_size=workers - 1)))
    position = Rounds(mask, 3, counts=True)
    for _ in range(lost_at):  # as `OverlapAveraging.step_done`: a round's average, then the next round
        position.step_done()
        last = position.steps == lost_at and not entered
        if position.steps % local == 0 and not last:
            due = position.take_due()
            if due is not None:
                position.entered(due, position.steps)
    checked = rounds_after_loss(position, steps)
    designed = [mask.round_matrix(t, seed=3) for t in range(steps + 1)]
    starts = [t for t in range(lost_at, steps) if t == lost_at or t % every == 0]
    assert [(t, m.tolist()) for t, m in checked] == [(lost_at, designed[trained_step(lost_at)].tolist()),
                                                     *((t, designed[t].tolist()) for t in starts)]
    going_on = position.for_survivors(survivors)
    assert going_on.round_matrix(trained_step(lost_at)).tolist() == designed[trained_step(lost_at)][survivors].tolist()
    due = going_on.take_due()  # `enter_due`
    if due is not None:
        going_on.entered(due, going_on.steps)
    assert going_on.matrix.tolist() == designed[lost_at][survivors].tolist() and going_on.due is None
    for t in range(lost_at, steps):
        assert going_on.round_matrix(t).tolist() == designed[t][survivors].tolist()


@pytest.mark.parametrize("entered", [False, True])
def test_a_loss_fatal_only_in_the_next_round_stops_the_survivors_in_one_line_whichever_round_they_are_in(entered):
    """Two workers under a cyclic schedule that swaps their rows every 2 steps (averaging every 2): losing worker
    1 in the average that ends round 0 leaves worker 0 every block of round 0 but not of round 1, so the
    loss is refused at once (`agreement.decide` over `rounds_after_loss`), whether worker 0 had entered round 1."""
    from masklab import Mask
    from sdp_train.trainer.agreement import WorkerLossError, decide

    mask = Mask([[1, 1], [0, 1]], schedule=Schedule("cyclic", every=2))
    position = Rounds(mask, 0, counts=True)
    position.step_done()
    position.step_done()
    if entered:
        position.entered(position.take_due(), position.steps)
    with pytest.raises(WorkerLossError, match=r"^step 1: lost worker \[1\] would hold every copy of block 0 "
                                              r"\(block0\) in the round of step 2: continuing is impossible"):
        decide(mask, [0, 1], {0: 2}, step=1, rounds=rounds_after_loss(position, 6))
