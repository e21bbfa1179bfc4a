"""N-SDP on real gloo ranks: a hand-written mask where one worker holds every neuron group of a
layer and the others only some (that worker's MLP tensors of the layer are whole, the others'
sliced) trains and validates; and on designed masks the sync engine's first all_reduce starts
while backward still runs."""

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
           "warmup_steps": 1, "memory_steps": 0, "out": str(tmp_path / "run")}
    run_rank_script(mask.shape[0], "train", {"configs": [cfg]}, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert np.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] > 0
    assert summary["mask"]["rows"] == ["".join(map(str, row)) for row in mask.tolist()]


@pytest.mark.parametrize("modes", [["nsdp", "bsdp"]])
def test_first_holder_collective_starts_while_backward_still_produces_gradients(tmp_path, modes):
    """Real gloo ranks, designed masks: on every rank some all_reduce is launched inside backward,
    before the engine has seen the last gradient (communication overlaps backward)."""
    run_rank_script(2, "overlap", {"cases": [{"mode": m} for m in modes]}, tmp_path)
    for i, mode in enumerate(modes):
        for r in range(2):
            events = json.loads((tmp_path / f"overlap{i}_rank{r}.json").read_text())
            last_grad = len(events) - 1 - events[::-1].index("grad")
            assert "launch" in events and events.index("launch") < last_grad, (mode, r, events)
