"""What `sdp train --restore-coverage` designs the survivors' mask with (`coverage_to_restore`): a built-in
family's elements per block at block level, so that the survivors' bytes stay balanced where blocks
differ in size (a ResNet), and nothing that changes the mask where they do not (LLaMA)."""

from __future__ import annotations

import numpy as np
import torch

from masklab.survivors import restored_mask
from sdp_train.models import model_class
from sdp_train.models.subnet import held_tensors
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import coverage_to_restore

RESNET = {"model": "resnet18-cifar", "model_overrides": {"width_multiplier": 0.125}}


def _prepared(mode: str, **kw):
    return prepare(TrainConfig.from_dict({"mode": mode, "workers": 4, "active": 0.5, "steps": 1,
                                          "on_worker_loss": "continue", "restore_coverage": True, **kw}))


def test_block_level_sizes_are_the_parameter_and_buffer_elements_only_a_blocks_holders_keep():
    prep = _prepared("bsdp", **RESNET)
    with torch.device("meta"):
        model = model_class(prep.model_config)(prep.model_config)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    blocks = prep.mask.blocks

    def held(without: int | None) -> set[str]:  # what a worker holding every block (but one) keeps
        row = np.ones(blocks, dtype=bool)
        if without is not None:
            row[without] = False
        return set(held_tensors(prep.model_config, row, "block"))

    expected = [sum(tensors[n].numel() for n in held(None) - held(j)) for j in range(blocks)]
    assert coverage_to_restore(prep)["sizes"] == expected
    assert len(set(expected)) > 1


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
