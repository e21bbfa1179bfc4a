"""What `sdp train --restore-coverage` designs the survivors' mask with (`coverage_to_restore`): a built-in
family's bytes per block at block level, so that the survivors' bytes stay balanced where blocks
differ in size (a ResNet), and nothing that changes the mask where they do not (LLaMA); with
``--restore-budgets`` each survivor's budget and the bytes every worker holds, which the restored mask
keeps every survivor within, or the run stops."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from masklab import Mask
from masklab.survivors import restored_mask
from sdp_train.cli import build_parser
from sdp_train.cli.train import config_from_args
from sdp_train.errors import ConfigError
from sdp_train.models import model_class
from sdp_train.models.subnet import held_tensors
from sdp_train.trainer.agreement import WorkerLossError, decide
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.membership import Survival
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import coverage_to_restore

RESNET = {"model": "resnet18-cifar", "model_overrides": {"width_multiplier": 0.125}}


def _prepared(mode: str, **kw):
    return prepare(TrainConfig.from_dict({"mode": mode, "workers": 4, "active": 0.5, "steps": 1,
                                          "on_worker_loss": "continue", "restore_coverage": True, **kw}))


def held(prep, without: int | None) -> set[str]:
    """The tensors a worker holding every block (but block `without`) keeps."""
    row = np.ones(prep.mask.blocks, dtype=bool)
    if without is not None:
        row[without] = False
    return set(held_tensors(prep.model_config, row, "block"))


def test_block_level_sizes_are_the_bytes_of_the_parameters_and_buffers_only_a_blocks_holders_keep():
    prep = _prepared("bsdp", **RESNET)
    with torch.device("meta"):
        model = model_class(prep.model_config)(prep.model_config)
    parameters = dict(model.named_parameters())
    tensors = {**parameters, **dict(model.named_buffers())}
    expected = [sum((16 if n in parameters else 4) * tensors[n].numel() for n in held(prep, None) - held(prep, j))
                for j in range(prep.mask.blocks)]
    assert coverage_to_restore(prep)["sizes"] == expected
    assert len(set(expected)) > 1
    assert "budgets" not in coverage_to_restore(prep)


def test_resnet_survivors_largest_holds_fewer_elements_than_with_block_counts_balanced():
    prep = _prepared("bsdp", **RESNET)
    restore = coverage_to_restore(prep)
    sizes = np.array(restore["sizes"])
    for lost in range(4):
        by_bytes = restored_mask(prep.mask, [lost], **restore)
        by_counts = restored_mask(prep.mask, [lost], **{**restore, "sizes": None})
        assert (by_bytes.coverage >= 2).all()
        assert (by_bytes.matrix @ sizes).max() < (by_counts.matrix @ sizes).max(), lost


def test_equal_blocks_and_neuron_groups_restore_as_before():
    llama = coverage_to_restore(_prepared("bsdp"))
    assert len(set(llama["sizes"])) == 1
    nsdp = coverage_to_restore(_prepared("nsdp"))
    assert nsdp["sizes"] is None and nsdp["groups"] >= 1


@pytest.mark.parametrize("mode, per_parameter", [("bsdp", 16), ("bbsdp", 12), ("overlap", 12)])
def test_block_bytes_and_fixed_bytes_add_up_to_a_worker_that_holds_every_block(mode, per_parameter):
    """Bytes per block are what only its holders keep (Bb-SDP's and overlap averaging's workers keep every
    parameter: a holder adds its gradient and AdamW's moments); the fixed bytes are the rest of a worker that
    holds every block."""
    prep = _prepared(mode, **RESNET, restore_budgets="1GB,1GB,1GB,1GB")
    with torch.device("meta"):
        model = model_class(prep.model_config)(prep.model_config)
    parameters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    restore = coverage_to_restore(prep)
    whole = 16 * sum(p.numel() for p in parameters.values()) + 4 * sum(b.numel() for b in buffers.values())
    assert restore["fixed_bytes"] + sum(restore["sizes"]) == whole
    assert restore["budgets"] == [10**9] * 4
    first = held(prep, None) - held(prep, 0)  # the first block's tensors
    assert restore["sizes"][0] == per_parameter * sum(parameters[n].numel() for n in first if n in parameters) + (
        4 * sum(buffers[n].numel() for n in first if n in buffers) if mode == "bsdp" else 0)


def test_the_restored_mask_keeps_every_survivor_within_its_budget_where_plain_balance_would_not():
    prep = _prepared("bsdp", **RESNET, restore_budgets="1GB,1GB,1GB,1GB")
    restore = coverage_to_restore(prep)
    sizes, fixed = np.array(restore["sizes"]), restore["fixed_bytes"]
    workers = (3, 0, 1, 2)  # worker numbers of the original run, in rank order (after a rejoin, say)
    mask = Mask(prep.mask.matrix[list(workers)], block_names=prep.mask.block_names)
    change = decide(mask, workers, {w: 5 for w in workers if w != 3}, step=5)
    plain = {k: v for k, v in restore.items() if k not in ("budgets", "fixed_bytes")}
    unbudgeted = Survival(None, 0, workers, mask, restore=plain)
    held = unbudgeted.restored(change, 5, report=True).mask.matrix @ sizes
    budgets = [10**9] * 4
    budgets[1] = fixed + int(held.min()) + 1  # worker 1 (survivor 1) could hold the least loaded row, no more
    assert held[1] > budgets[1] - fixed  # without budgets it holds more
    survival = Survival(None, 0, workers, mask, restore={**restore, "budgets": budgets})
    restored = survival.restored(change, 5, report=True)
    assert restored.restored and (restored.mask.coverage >= 2).all()
    assert (fixed + restored.mask.matrix @ sizes <= [budgets[w] for w in change.workers]).all()


def test_a_loss_whose_restore_cannot_fit_the_budgets_stops_in_one_line_naming_them():
    prep = _prepared("bsdp", **RESNET, restore_budgets="1GB,1GB,1GB,1GB")
    restore = coverage_to_restore(prep)
    budgets = [restore["fixed_bytes"] + max(restore["sizes"])] * 4  # no survivor holds half of the blocks
    change = decide(prep.mask, range(4), {0: 2, 1: 2, 2: 2}, step=2)
    survival = Survival(None, 0, range(4), prep.mask, restore={**restore, "budgets": budgets})
    with pytest.raises(WorkerLossError) as info:
        survival.restored(change, 2, report=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith("step 2: the survivors [0, 1, 2] cannot restore")
    assert f"--restore-budgets: {budgets[:3]} bytes" in message and "budget" in message.split("):", 1)[1]


@pytest.mark.parametrize("changes, message", [
    ({"restore_budgets": "1GB,1GB,1GB"}, "gives 3 sizes but workers=4"),
    ({"restore_budgets": "1GB,1GB,1GB,lots"}, "budget of worker 3"),
    ({"restore_budgets": "1GB,1GB,1GB,1GB", "restore_coverage": False}, "need restore_coverage"),
    ({"restore_budgets": "1GB,1GB,1GB,1GB", "mode": "nsdp"}, "mode 'nsdp'"),
    ({"restore_budgets": "1GB,1GB,1GB,1GB", "model": "net.py:make"}, "your own model"),
    ({"restore_budgets": ["1GB"] * 4}, "must be a string or null"),
])
def test_restore_budgets_are_refused_in_one_line_naming_the_flag_unless_one_per_worker_of_a_block_restore(
        changes, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{"mode": "bsdp", "workers": 4, "on_worker_loss": "continue", "restore_coverage": True,
                       **changes})
    assert "restore_budgets" in str(info.value) and message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("mode", ["bsdp", "bbsdp"])
def test_restore_budgets_round_trip_through_the_config_and_the_command_line(mode):
    cfg = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", restore_coverage=True,
                      restore_budgets="80GB, 80GB,24GiB,1000")
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.restore_budget_bytes == [80 * 10**9, 80 * 10**9, 24 * 2**30, 1000]
    args = build_parser().parse_args(["train", "--mode", mode, "--workers", "4", "--on-worker-loss", "continue",
                                      "--restore-coverage", "--restore-budgets", "80GB, 80GB,24GiB,1000"])
    assert config_from_args(args) == cfg
