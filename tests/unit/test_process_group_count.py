"""The process groups a mask needs, counted three ways that must agree.

`masklab.analysis.process_group_holder_sets` counts them from the mask alone (one per distinct
holder set of 2 to K-1 workers; single holders too with FSDP); `sdp_train.planning.comm`'s function of
the same name counts what the runtime plans from each rank's held tensors, for every mode (`sdp
plan` shows it); and a run built in one process on torch's fake backend, with
``torch.distributed.new_group`` recorded, shows the groups the runtime really creates. On NCCL
each group is a communicator, hundreds of MiB of device memory on every member, so a count that
drifts from the runtime's is a memory prediction that is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from masklab import Mask
from masklab.analysis import process_group_holder_sets as mask_holder_sets
from masklab.testing import masks
from sdp_train.errors import ConfigError
from sdp_train.models import get_model_config
from sdp_train.models.subnet import held_tensors
from sdp_train.parallel.dist import DistInfo
from sdp_train.planning.comm import process_group_holder_sets as planned_holder_sets
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run

SMALL_RESNET = {"width_multiplier": 0.125}
EXAMPLES = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


def _held(config, mask: Mask, level: str):
    try:
        return [held_tensors(config, mask.matrix[k].astype(bool), level) for k in range(mask.workers)]
    except ConfigError:  # a row the model's structural rules refuse (a layer with no neuron group)
        assume(False)


@EXAMPLES
@given(mask=masks(workers=st.integers(2, 6), blocks=4))
def test_llama_block_level_groups_are_the_masks_distinct_holder_sets_in_every_mode(mask):
    config = get_model_config("llama-debug")
    held = _held(config, mask, "block")
    for mode in ("bsdp", "bbsdp"):
        assert planned_holder_sets(config, mode, held, mask.workers) == mask_holder_sets(mask)
    fsdp = planned_holder_sets(config, "bsdp", held, mask.workers, fsdp=True)
    assert fsdp == mask_holder_sets(mask, singletons=True)


@EXAMPLES
@given(mask=masks(workers=st.integers(2, 4), blocks=32, active=(0.6, 1.0)))
def test_llama_neuron_level_groups_are_the_masks_distinct_holder_sets(mask):
    config = get_model_config("llama-debug")
    assert planned_holder_sets(config, "nsdp", _held(config, mask, "neuron"), mask.workers) == mask_holder_sets(mask)


@EXAMPLES
@given(mask=masks(workers=st.integers(2, 5), blocks=8))
def test_resnet_groups_with_batchnorm_averaging_are_the_masks_distinct_holder_sets(mask):
    config = get_model_config("resnet18-cifar", **SMALL_RESNET)
    held = _held(config, mask, "block")
    assert planned_holder_sets(config, "bsdp", held, mask.workers) == mask_holder_sets(mask)
    assert planned_holder_sets(config, "bsdp", held, mask.workers, fsdp=True) == mask_holder_sets(mask, singletons=True)


def test_the_baselines_and_one_rank_need_no_group_of_their_own():
    config = get_model_config("llama-debug")
    assert planned_holder_sets(config, "ddp", None, 4) == planned_holder_sets(config, "fsdp", None, 4) == ()
    one = Mask([[1, 1, 1, 1]])
    assert planned_holder_sets(config, "bsdp", _held(config, one, "block"), 1) == mask_holder_sets(one) == ()


@pytest.fixture
def fake_world(monkeypatch):
    """A 4-rank world in this process (torch's fake backend: collectives do nothing), recording
    the keyword arguments of every ``new_group`` call."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls: list[dict] = []
    create = dist.new_group

    def recording(*args, **kwargs):
        calls.append(kwargs if not args else {"positional": args, **kwargs})
        return create(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield calls
    finally:
        dist.destroy_process_group()


RUNS = [
    ("llama-debug", "nsdp", False, 0.5, {}),
    ("llama-debug", "bsdp", True, 0.25, {}),  # single holders: FSDP meshes of one rank
    ("resnet18-cifar", "bsdp", False, 0.5, SMALL_RESNET),  # parameters and BatchNorm statistics
    # B-SDP+FSDP with BatchNorm: FSDP's meshes and the statistics' buckets share each holder set's group
    ("resnet18-cifar", "bsdp", True, 0.5, SMALL_RESNET),
]


@pytest.mark.parametrize(("model", "mode", "fsdp", "active", "overrides"), RUNS)
def test_a_run_creates_exactly_the_planned_groups_each_splittable_from_the_world(fake_world, model, mode, fsdp,
                                                                                 active, overrides):
    cfg = TrainConfig(model=model, mode=mode, workers=4, active=active, fsdp=fsdp, model_overrides=overrides)
    prep = prepare(cfg)
    run = Run(prep, DistInfo(rank=0, world_size=4, local_rank=0), torch.device("cpu"))
    run.close()
    level = "neuron" if mode == "nsdp" else "block"
    planned = planned_holder_sets(prep.model_config, mode, _held(prep.model_config, prep.mask, level), 4, fsdp=fsdp)
    assert planned == mask_holder_sets(prep.mask, singletons=fsdp)
    assert sorted(tuple(call["ranks"]) for call in fake_world) == list(planned)
    # NCCL splits a new group from the default communicator (ncclCommSplit) only on torch's plain
    # path: every rank calls new_group for every set, members or not, with no device_id other than
    # the default group's and no use_local_synchronization (docs/design.md §5).
    assert all(set(call) <= {"ranks", "timeout"} for call in fake_world), fake_world


def test_the_runtime_groups_of_a_mask_from_a_file_are_its_holder_sets(fake_world, tmp_path):
    from masklab import save_mask

    matrix = np.array([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=np.uint8)
    save_mask(Mask(matrix), tmp_path / "mask.json")
    cfg = TrainConfig(model="llama-debug", mode="bbsdp", workers=4, mask=str(tmp_path / "mask.json"))
    Run(prepare(cfg), DistInfo(rank=0, world_size=4, local_rank=0), torch.device("cpu")).close()
    assert sorted(tuple(call["ranks"]) for call in fake_world) == [(0, 1), (0, 2), (1, 2, 3)]


def test_inspect_shows_how_many_process_groups_a_saved_mask_needs(tmp_path, capsys):
    import json

    from masklab import save_mask
    from sdp_train.cli import main

    save_mask(Mask([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [0, 1, 1, 1, 0]]), tmp_path / "mask.json")
    assert main(["inspect", str(tmp_path / "mask.json")]) == 0
    assert "process groups: 3 (B-SDP+FSDP: 4)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "mask.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["process_groups"], report["process_groups_fsdp"]) == (3, 4)
