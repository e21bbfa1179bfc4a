"""Activation checkpointing after a loss or a rejoin (``--ac`` with ``--on-worker-loss continue``): the wrapper
the survivors or the members build next (`SubnetworkSync.for_survivors`, `for_joiners`) keeps the blocks it
has as they are, checkpointed inside, and must checkpoint the blocks it gains later (a schedule's mask
changes, a hand-over that restores coverage) and hand that on to the wrapper after it. Built on one
process: the flags are what `MaskChanges` reads when it builds a gained block."""

from __future__ import annotations

import pytest
import torch

from sdp_train.parallel.dist import DistInfo
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.modes import build_sync
from sdp_train.trainer.prepare import prepare


@pytest.mark.parametrize("ac", [True, False])
def test_the_next_wrapper_checkpoints_what_it_gains_as_the_run_does(ac):
    prep = prepare(TrainConfig.from_dict({"model": "llama-debug", "mode": "bsdp", "workers": 1, "active": 1.0,
                                          "steps": 4, "activation_checkpointing": ac, "schedule": "permute",
                                          "every": 2}))
    info = DistInfo(0, 1, 0)
    sync = build_sync(prep, info, torch.device("cpu"))
    optimizer = torch.optim.AdamW(sync.trainable())
    sync.attach(optimizer)
    assert sync.sdp.activation_checkpointing is ac and sync.sdp.changes.activation_checkpointing is ac
    sync.close()
    survivors = sync.for_survivors(prep.mask, [0], info, optimizer)
    assert survivors.sdp.activation_checkpointing is ac and survivors.sdp.changes.activation_checkpointing is ac
    survivors.close()
    members = survivors.for_joiners(prep.mask, info, [0])
    assert members.sdp.activation_checkpointing is ac and members.sdp.changes.activation_checkpointing is ac
    members.close()
