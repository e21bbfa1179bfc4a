"""ResNet BatchNorm running statistics are averaged among the holders of each block (or channel):
after steps on different batches, every entry is bit-identical on all the ranks that hold it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from masklab import Mask, save_mask
from sdp_train.models import block_map, get_model_config
from sdp_train.subnet import held_tensors
from tests.distributed.conftest import run_rank_script

pytestmark = pytest.mark.slow
K = 3
OVERRIDES = {"width_multiplier": 0.125, "in_channels": 1}
RESNET = get_model_config("resnet18-cifar", **OVERRIDES)
MASKS = {
    "block": np.array([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=np.uint8),
    "neuron": np.tile(np.array([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 0]], dtype=np.uint8), (1, 5)),
}
CASES = [("bsdp", "block"), ("nsdp", "neuron"), ("bbsdp", "block")]


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    out = tmp_path_factory.mktemp("bn")
    cases = [{"model": "resnet18-cifar", "model_overrides": OVERRIDES, "mode": mode,
              "mask": str(save_mask(Mask(MASKS[level]), out / f"{mode}.json"))} for mode, level in CASES]
    run_rank_script(K, "steps", {"steps": 2, "cases": cases}, out)
    return [[torch.load(out / f"steps{i}_rank{r}.pt", weights_only=True) for r in range(K)] for i in range(len(CASES))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_running_statistics_are_identical_among_the_holders_of_every_entry(states, case):
    mode, level = CASES[case]
    bmap = block_map(RESNET)
    held = [held_tensors(RESNET, MASKS[level][r], level) for r in range(K)]
    compared = moved = 0
    for name in bmap.shapes:
        if not name.endswith(("running_mean", "running_var")):
            continue
        full = {}  # full position -> the values of each holder
        for r in range(K):
            if name not in held[r]:
                continue
            value, spec = states[case][r]["final"][name], held[r][name]
            moved += int(not torch.equal(value, states[case][r]["initial"][name]))
            positions = range(value.shape[0]) if spec.is_whole else spec.index
            for local, i in enumerate(positions):
                full.setdefault(i, []).append(value[local])
        for i, values in full.items():
            for v in values[1:]:
                assert torch.equal(v, values[0]), f"{mode}: {name}[{i}] differs among its holders"
                compared += 1
    assert compared > 0 and moved > 0
