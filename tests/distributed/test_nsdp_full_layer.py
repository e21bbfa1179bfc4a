"""N-SDP on real gloo ranks: a hand-written mask where one worker holds every neuron group of a
layer and the others only some (that worker's MLP tensors of the layer are whole, the others'
sliced) trains and validates. (That the sync engine's first all_reduce starts while backward
still runs is checked, eager and compiled, in test_compile_blocks.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from masklab import Mask, save_mask
from tests.distributed.shared_launch import shared_out
from tests.unit.test_sync_plan import full_layer_mask

pytestmark = pytest.mark.slow


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch; the mask file written into `out`."""
    mask = full_layer_mask()
    path = save_mask(Mask(mask), out / "mask.json")
    cfg = {"model": "llama-debug", "mode": "nsdp", "workers": mask.shape[0], "mask": str(path), "active": None,
           "steps": 2, "batch_size": 2, "seq_len": 16, "eval_batches": 1, "max_data_bytes": 100_000,
           "warmup_steps": 1, "memory_steps": 0, "out": str(out / "run")}
    return "train", {"configs": [cfg]}


def test_nsdp_trains_and_validates_when_one_worker_holds_a_whole_layer(tmp_path_factory):
    out = shared_out(tmp_path_factory, "test_nsdp_full_layer")  # a 3-rank launch: the mask's workers
    mask = full_layer_mask()
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert np.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] > 0
    assert summary["mask"]["rows"] == ["".join(map(str, row)) for row in mask.tolist()]
