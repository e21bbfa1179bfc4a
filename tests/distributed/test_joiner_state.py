"""What a worker that joins a run receives (`MaskChanges.welcome`, ``sdp train --max-rejoins``), on 3 real
gloo ranks through the public API, at block level (B-SDP) and neuron level (N-SDP, whose parts are
neuron groups held by different workers).

Every rank trains 2 steps with AdamW; then rank 0 plays the joiner: its parameters are overwritten and
its optimizer state dropped, and every rank calls ``welcome`` with joiners ``[0]``. Rank 0 must end
with its values and its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) of before, bit for bit: every
part comes from its lowest-ranked other holder, whose copy equals it after a step. The end-to-end
rejoin is tests/distributed/test_worker_loss_rejoin.py's; this is the part of it that N-SDP changes,
in a launch the suite already makes (shared_launch.py's ``library3``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask
from tests.distributed.mlp_net import HIDDEN, batch, make_net

pytestmark = pytest.mark.slow
BASE = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
CASES = {"blocks": Mask(BASE), "neurons": Mask(np.hstack([BASE, np.roll(BASE, 1, axis=0), BASE]))}


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    from sdp_train import MLPSpec, SubnetworkDataParallel

    rank = dist.get_rank()
    for case, mask in CASES.items():
        kw = dict(level="neuron", neuron_groups=3, mlp=MLPSpec(("up",), "down")) if case == "neurons" else {}
        model = SubnetworkDataParallel(make_net(), mask=mask, seed=1, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            x, y = batch(step, rank)
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        names = {id(p): n for n, p in model.module.named_parameters()}

        def snapshot() -> dict:
            return {"values": {n: t.clone() for n, t in model.module.state_dict().items()},
                    "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items() if s}}

        before = snapshot()
        if rank == 0:  # the joiner: nothing of what it held is left
            with torch.no_grad():
                for param in model.module.parameters():
                    param.fill_(float("nan"))
            opt.state.clear()
        model.changes.welcome(opt, model.held_by_rank, [0])
        torch.save({"before": before, "after": snapshot()}, out / f"{case}{rank}.pt")
        model.close()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_joiner_state")


@pytest.mark.parametrize("case", list(CASES))
def test_a_joiner_receives_its_values_and_adamw_state_from_the_other_holders_bit_for_bit(out, case):
    saved = torch.load(out / f"{case}0.pt", weights_only=False)
    before, after = saved["before"], saved["after"]
    assert set(after["values"]) == set(before["values"]) and set(after["state"]) == set(before["state"])
    for name, value in before["values"].items():
        assert torch.equal(after["values"][name], value), name
    for name, slots in before["state"].items():
        assert set(after["state"][name]) == set(slots) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert all(torch.equal(after["state"][name][k], v) for k, v in slots.items()), name
    if case == "neurons":  # rank 0 holds 2 of block 0's 3 neuron groups: its parts and their state are cut
        assert before["values"]["layers.0.up.weight"].shape[0] == 2 * HIDDEN // 3
