"""What a worker that rejoins an overlap-averaging run receives (`welcome_holdings`, ``sdp train --mode overlap
--max-rejoins``), and what survivors that restore the designed coverage take (`restore_holdings`, ``sdp train
--mode overlap --restore-coverage``), planned in one process: the movers send each tensor a rank newly holds
from its lowest-ranked holder (`sdp_train.parallel.schedule.plan_moves`). The launch:
tests/distributed/test_worker_loss_applied.py."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from masklab.testing.strategies import masks
from sdp_train.parallel.masking import describe
from sdp_train.parallel.overlap import restore_holdings, welcome_holdings
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
