"""N-SDP with a hand-written mask where one worker holds every neuron group of a layer and the
others only some: that worker's MLP tensors of the layer are whole, the others' sliced. Training
and the final validation (full-model assembly) must run on real gloo ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from masklab import Mask, save_mask
from tests.distributed.conftest import run_rank_script
from tests.unit.test_sync_plan import full_layer_mask

pytestmark = pytest.mark.slow


def test_nsdp_trains_and_validates_when_one_worker_holds_a_whole_layer(tmp_path):
    mask = full_layer_mask()
    path = save_mask(Mask(mask), tmp_path / "mask.json")
    cfg = {"model": "llama-debug", "mode": "nsdp", "workers": mask.shape[0], "mask": str(path), "active": None,
           "steps": 2, "batch_size": 2, "seq_len": 16, "eval_batches": 1, "max_data_bytes": 100_000,
           "warmup_steps": 1, "out": str(tmp_path / "run")}
    run_rank_script(mask.shape[0], "train", {"configs": [cfg]}, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert np.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] > 0
    assert summary["mask"]["rows"] == ["".join(map(str, row)) for row in mask.tolist()]
