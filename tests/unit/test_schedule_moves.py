"""What moves at a mask change under backward masking (`sdp_train.parallel.schedule.plan_moves`): every
tensor a worker starts to hold comes from exactly one old holder, the lowest-ranked, in one order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.parallel.blockmap import WHOLE
from sdp_train.parallel.schedule import plan_moves


@st.composite
def two_rounds(draw):
    workers, tensors = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    held = st.lists(st.lists(st.booleans(), min_size=tensors, max_size=tensors), min_size=workers, max_size=workers)
    return [f"t{i}" for i in range(tensors)], np.array(draw(held)), np.array(draw(held))


def _held(matrix: np.ndarray, names: list[str]) -> list[dict]:
    return [{n: WHOLE for n, keep in zip(names, row) if keep} for row in matrix]


@settings(max_examples=200, deadline=None)
@given(two_rounds())
def test_every_new_holder_receives_once_from_the_lowest_old_holder_in_name_order(rounds):
    names, old, new = rounds
    moves = plan_moves(names, _held(old, names), _held(new, names))
    assert [m[0] for m in moves] == [n for n in names if n in {m[0] for m in moves}]  # the names' order
    by_name = {name: (src, receivers) for name, src, receivers in moves}
    for j, name in enumerate(names):
        gained = [k for k in range(len(new)) if new[k, j] and not old[k, j]]
        if not gained or not old[:, j].any():  # nothing new, or nobody to send it
            assert name not in by_name
            continue
        src, receivers = by_name[name]
        assert src == int(np.flatnonzero(old[:, j])[0]) and receivers == gained


def test_a_parameter_regained_while_still_in_its_optimizer_group_is_not_added_again():
    """Backward masking keeps a dropped block's parameters in the optimizer's group (their state goes): a
    worker that regains the block (a restore of coverage, then a rejoin's return to the designed rows) must
    not list them twice, or AdamW steps them twice; a parameter that is not there joins its group once."""
    import torch
    from torch import nn

    from sdp_train.parallel.schedule import OptimizerPlaces

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight]},
                                   {"params": [model[0].bias]}])
    places = OptimizerPlaces()
    places.add(optimizer, model, 1)
    places.place["1.bias"] = (0, 1)  # where its holders keep it (learnt from them on several ranks)
    places.insert(dict(model.named_parameters()), model)
    assert [[id(p) for p in group["params"]] for group in optimizer.param_groups] == [
        [id(model[0].weight), id(model[1].weight)], [id(model[0].bias), id(model[1].bias)]]
