"""Measured peak memory on real gloo ranks: what SDP, FSDP and activation checkpointing save.

Every figure is the CPU tracker's (deterministic), read from each run's summary.json. A shared
torchrun launch (`tests.distributed.shared_launch`) trains every configuration for one step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, save_mask
from sdp_train.models import block_map, model_class
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
MODES = ("ddp", "fsdp", "bsdp", "nsdp", "bbsdp")
MASKS = {  # 2 workers x 4 blocks of llama-debug
    "one": [[1, 0, 0, 0], [1, 1, 1, 1]],  # rank 0 holds 1 block
    "two": [[1, 1, 0, 0], [1, 1, 1, 1]],  # rank 0 holds 2 blocks
}
RESNET = {"model": "resnet18-cifar", "model_overrides": {"width_multiplier": 0.125}, "batch_size": 8}
VIT = {"model": "vit-tiny", "batch_size": 8,
       "model_overrides": {"dim": 32, "n_heads": 2, "hidden_dim": 64, "n_layers": 4, "patch_size": 2}}


def _cfg(out: Path, **kw) -> dict:
    base = {"model": "llama-debug", "workers": 2, "steps": 1, "batch_size": 2, "seq_len": 32, "eval_batches": 1,
            "max_data_bytes": 100_000, "memory_steps": 1, "active": 0.5}
    return {**base, **kw, "out": str(out)}


def launch_spec(out: Path) -> tuple[str, dict]:
    """The configurations the shared launch trains (`tests.distributed.shared_launch`), masks written into `out`."""
    configs = []
    for mode in MODES:
        for ac in (False, True):
            configs.append(_cfg(out / f"{mode}-ac{int(ac)}", mode=mode, activation_checkpointing=ac))
    for name, matrix in MASKS.items():
        path = save_mask(Mask(np.array(matrix)), out / f"{name}.json")
        configs.append(_cfg(out / f"mask-{name}", mode="bsdp", mask=str(path), active=None))
    configs.append(_cfg(out / "overlap-two", mode="overlap", mask=str(out / "two.json"), active=None, local_steps=2))
    for ac in (False, True):
        configs.append(_cfg(out / f"resnet-ac{int(ac)}", mode="bsdp", activation_checkpointing=ac, **RESNET))
        configs.append(_cfg(out / f"vit-ac{int(ac)}", mode="bsdp", activation_checkpointing=ac, **VIT))
    configs.append(_cfg(out / "vit-ddp", mode="ddp", **VIT))
    configs.append(_cfg(out / "vit-nsdp", mode="nsdp", **VIT))
    return "train", {"configs": configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return shared_out(tmp_path_factory, "test_memory_savings")


def _summary(out: Path, name: str) -> dict:
    return json.loads((out / name / "summary.json").read_text())


def _peaks(out: Path, name: str) -> list[dict]:
    return _summary(out, name)["peak_memory_bytes"]


def _state_bytes(peak: dict) -> int:
    return sum(peak["persistent"].values())


def test_every_rank_reports_a_peak_with_its_breakdown(runs):
    for mode in MODES:
        peaks = _peaks(runs, f"{mode}-ac0")
        assert len(peaks) == 2
        for peak in peaks:
            assert peak["total"] > 0 and peak["parameters"] > 0 and peak["activations"] > 0
            assert peak["total"] >= sum(peak[c] for c in ("parameters", "gradients", "optimizer", "other"))


def test_bsdp_half_active_worker_holds_at_most_055_of_ddp_parameter_gradient_optimizer_bytes(runs):
    # llama-debug's shared parameters (embeddings, head, final norm) are ~7% of the model
    ddp = _state_bytes(_peaks(runs, "ddp-ac0")[0])
    for peak in _peaks(runs, "bsdp-ac0"):
        assert _state_bytes(peak) <= 0.55 * ddp, (peak, ddp)


def test_forward_masked_worker_activations_shrink_with_the_blocks_it_drops(runs):
    one, two = _peaks(runs, "mask-one"), _peaks(runs, "mask-two")
    full = two[1]["activations"]  # rank 1 holds all 4 blocks in both runs
    assert one[1]["activations"] == full
    per_block = two[0]["activations"] - one[0]["activations"]
    assert per_block > 0
    assert full - two[0]["activations"] == pytest.approx(2 * per_block, rel=0.05)


def test_overlap_averaging_with_a_static_mask_reports_the_parameters_its_optimizer_updates(runs):
    """Backward masking keeps the whole model on every worker, but its optimizer steps only the held
    blocks and the shared parameters: num_params_trained counts those (it counted the whole model)."""
    summary = _summary(runs, "overlap-two")
    model_config = prepare(TrainConfig.from_dict(summary["config"])).model_config
    with torch.device("meta"):
        model = model_class(model_config)(model_config)
    blocks = block_map(model_config).block_names("block")

    def held(rank: int, name: str) -> bool:
        block = next((j for j, b in enumerate(blocks) if name.startswith(f"{b}.")), None)
        return block is None or bool(MASKS["two"][rank][block])

    expected = [sum(p.numel() for n, p in model.named_parameters() if held(k, n)) for k in range(2)]
    assert expected[0] < expected[1] == sum(p.numel() for p in model.parameters())
    assert summary["num_params_trained"] == expected


@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_lowers_activation_memory_without_changing_the_loss(runs, mode):
    plain, ac = _summary(runs, f"{mode}-ac0"), _summary(runs, f"{mode}-ac1")
    for before, after in zip(plain["peak_memory_bytes"], ac["peak_memory_bytes"]):
        assert after["activations"] < 0.8 * before["activations"], (before, after)
    assert ac["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-6)
    assert ac["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=1e-6)


def test_activation_checkpointing_updates_batchnorm_statistics_once_per_step(runs):
    plain, ac = _summary(runs, "resnet-ac0"), _summary(runs, "resnet-ac1")
    # the validation loss uses the running statistics: recomputation must not update them again
    assert ac["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=1e-6)
    assert ac["peak_memory_bytes"][0]["activations"] < plain["peak_memory_bytes"][0]["activations"]


def test_vit_block_and_neuron_workers_hold_less_and_checkpointing_lowers_their_activations(runs):
    ddp = _peaks(runs, "vit-ddp")[0]
    for name in ("vit-ac0", "vit-nsdp"):
        assert np.isfinite(_summary(runs, name)["final_val_loss"])
        for peak in _peaks(runs, name):
            assert peak["persistent"]["parameters"] < ddp["persistent"]["parameters"]
    plain, ac = _summary(runs, "vit-ac0"), _summary(runs, "vit-ac1")
    assert ac["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-6)
    for before, after in zip(plain["peak_memory_bytes"], ac["peak_memory_bytes"]):
        assert after["activations"] < before["activations"]
