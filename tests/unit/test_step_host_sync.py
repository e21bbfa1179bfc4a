"""Steady-state steps make no host synchronisation: the library with torch's default ``zero_grad()``,
and ``sdp train``'s `Run.step`, in every mode (one rank; FSDP over a one-rank gloo group).

Steps 3 to 5 run under `tests.host_sync.HostSyncDetector`, which fails on ``item``, ``tolist``,
``cpu``, ``__bool__``, ``__float__`` of a tensor: finite checks, clipping and the non-finite
policy are decided on the device (docs/api.md, "No host synchronisation"), and ``sdp train``
reads a step's values one step late (`sdp_train.trainer.run.Run.finish`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from masklab import Mask
from sdp_train import MLPSpec, SubnetworkDataParallel
from sdp_train.parallel.dist import DistInfo
from tests.host_sync import HostSyncDetector

BLOCKS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                    for _ in range(BLOCKS))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = h + block(h)
        return self.head(h)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group (FSDP needs one); destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


LIBRARY = {
    "stepwise": {},
    "neuron": {"level": "neuron", "neuron_groups": 2, "mlp": MLPSpec(("0",), "2")},
    "backward": {"masking": "backward"},
    "local_steps": {"local_steps": 2},
    "comm_dtype": {"comm_dtype": torch.bfloat16},
    "fsdp": {"fsdp": True},  # a one-rank world: its only holder set is the world
}


@pytest.mark.parametrize("case", LIBRARY)
def test_library_steps_3_to_5_never_read_the_device_on_the_host(case, request):
    if LIBRARY[case].get("fsdp"):
        request.getfixturevalue("one_rank_group")  # FSDP needs a process group, one rank is enough
    options = LIBRARY[case]
    torch.manual_seed(0)
    columns = BLOCKS * options.get("neuron_groups", 1)
    model = SubnetworkDataParallel(Net(), mask=Mask(np.ones((1, columns), dtype=np.int8)), **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model.register_optimizer(optimizer)
    x, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    for step in range(6):
        with HostSyncDetector(uploads=False) if step >= 3 else contextlib.nullcontext():
            nn.functional.cross_entropy(model(x), y).backward()
            model.clip_grad_norm_(0.1)
            optimizer.step()
            optimizer.zero_grad()  # torch's default: set_to_none, new gradient addresses each step
    model.close()


TINY = {"model": "llama-debug", "model_overrides": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},
        "workers": 1, "steps": 8, "batch_size": 2, "seq_len": 16, "max_data_bytes": 20_000, "warmup_steps": 1,
        "memory_steps": 0, "eval_batches": 1}
RUNS = {
    "ddp": {"mode": "ddp"},
    "fsdp": {"mode": "fsdp"},
    "bsdp": {"mode": "bsdp", "active": 1.0},
    "nsdp": {"mode": "nsdp", "active": 1.0},
    "bbsdp": {"mode": "bbsdp", "active": 1.0},
    "bsdp-local-steps": {"mode": "bsdp", "active": 1.0, "local_steps": 2},
    "overlap": {"mode": "overlap", "active": 1.0, "local_steps": 2},
    "skip": {"mode": "bsdp", "active": 1.0, "nonfinite": "skip"},
}


@pytest.mark.parametrize("case", RUNS)
def test_sdp_train_steps_3_to_5_never_read_the_device_on_the_host(case, tmp_path, one_rank_group):
    from sdp_train.data import build_batches
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.run import Run

    prep = prepare(TrainConfig(**{**TINY, **RUNS[case], "out": str(tmp_path / "out")}))
    run = Run(prep, DistInfo(0, 1, 0), torch.device("cpu"))
    batches = build_batches(prep.data, split="train", seed=0, rank=0, world_size=1)
    try:
        for step in range(6):
            with HostSyncDetector(uploads=False) if step >= 3 else contextlib.nullcontext():
                stats = run.step(step, *next(batches))
            values = run.finish(step, stats)  # read after the step, where `sdp train` reads it a step late
            assert np.isfinite(values["loss"]) and not values["skipped"]
    finally:
        run.close()
