"""OverlapAveraging's configuration errors and its one-process behaviour (no group needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from masklab import Mask, Schedule
from sdp_train import OverlapAveraging
from sdp_train.errors import ConfigError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_bad_local_steps_and_a_schedule_out_of_step_with_the_rounds_are_refused():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match=f"local_steps must be a positive integer, got {bad!r}"):
            OverlapAveraging(Net(), mask=Mask(np.ones((1, 2), dtype=int)), local_steps=bad)
    cyclic = Mask(np.ones((1, 2), dtype=int)).replace(schedule=Schedule("cyclic", every=3))
    with pytest.raises(ConfigError, match="changes it every 3 steps, not a multiple of local_steps=2"):
        OverlapAveraging(Net(), mask=cyclic, local_steps=2)
    with pytest.raises(ConfigError, match="schedule must be a masklab.Schedule, got str"):
        OverlapAveraging(Net(), active=1.0, schedule="permute")
    with pytest.raises(ConfigError, match="the mask has 2 workers"):
        OverlapAveraging(Net(), mask=Mask(np.eye(2, dtype=int)))
    OverlapAveraging(Net(), mask=cyclic, local_steps=3)  # R a multiple of H: fine


def test_one_worker_trains_as_plain_torch_and_has_no_disagreement():
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    model = OverlapAveraging(Net(), active=1.0, local_steps=2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    model.register_optimizer(opts[1])
    x = torch.randn(5, 3)
    for _ in range(4):
        for m, opt in zip((plain, model), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert model.steps == 4 and model.comm_bytes == 0 and model.held_blocks == ("layers.0", "layers.1")
    for name, value in model.full_state_dict().items():
        assert torch.equal(value, plain.state_dict()[name])
    assert model.consensus_distance() == {"layers.0": 0.0, "layers.1": 0.0, "other": 0.0, "total": 0.0}


def test_the_forward_shows_the_wrapped_model_signature_and_the_wrapper_is_freed_when_dropped():
    """As `SubnetworkDataParallel`'s: Hugging Face's Trainer keeps only the batch columns that
    ``inspect.signature(model.forward)`` names, and ``forward(*args, **kwargs)`` names none."""
    import gc
    import inspect
    import weakref

    net = Net()
    overlap = OverlapAveraging(net, mask=Mask(np.ones((1, 2), dtype=int)))
    assert inspect.signature(overlap.forward) == inspect.signature(net.forward)
    x = torch.randn(5, 3)
    torch.testing.assert_close(overlap(x), net(x))
    gc.disable()  # freed by reference counting, not only by the cycle collector
    try:
        ref = weakref.ref(overlap)
        del overlap
        assert ref() is None
    finally:
        gc.enable()
