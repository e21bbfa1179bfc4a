"""`sdp plan`'s predictions against the peak memory real runs measure, for the systems of
``sdp compare --preset cpu-small``: llama-debug, 4 workers, batch 8 x 64 tokens, C = 0.5.

A torchrun launch (shared with test_sdp_training's steps) trains every configuration for 2 steps
(the second has AdamW's state, as every later step does) with the memory tracker on; each
summary.json's ``peak_memory_bytes`` is compared with `sdp_train.planning.memory.predict`: the
total within 10% on every rank and for the largest one (and within 1%, so that a forgotten buffer
shows), the persistent state (parameters, gradients, optimizer) exactly. On CPU the tracker's figures are deterministic but for one race: gloo's worker thread
holds a collective's output until it takes its queue lock again, after the caller has been woken,
so FSDP's all-gather output of a block (852,992 bytes here) is sometimes freed a moment late and
counted in the peak (seen once in CI, on one rank of bsdp+fsdp+ac). With FSDP the 1% bound allows
that one block more. The GPU variant needs 4 CUDA devices (nccl cannot put two ranks on one device)
and is skipped elsewhere; CUDA adds cuBLAS workspaces and allocator rounding that the model does
not count (docs/plan.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdp_train.compare.runner import PRESETS, run_specs
from sdp_train.models import get_model_config, model_class
from sdp_train.planning.memory import predict
from tests.distributed.conftest import run_rank_script
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
PRESET = PRESETS["cpu-small"]
# the distinct memory configurations of `sdp compare` (the FLOP-matched run only trains longer)
SPECS = [s for s in run_specs(PRESET) if not s.flop_matched and not s.heterogeneous and not s.name.startswith("bsdp-C")]
# the tracker files tensors first written during forward as activations: DDP's rebuilt bucket,
# FSDP's all-gather output, Bb-SDP's broadcast buffers
CLEAN_ACTIVATIONS = {"bsdp", "nsdp", "fsdp+ac", "bsdp+fsdp+ac"}


def _config(spec, out: Path) -> dict:
    return {"model": PRESET.model, "mode": spec.mode, "workers": PRESET.workers, "steps": 2, "memory_steps": 2,
            "batch_size": PRESET.batch_size, "seq_len": PRESET.seq_len, "active": spec.active or 0.5,
            "activation_checkpointing": spec.ac, "fsdp": spec.fsdp, "seed": 0, "eval_batches": 1,
            "max_data_bytes": 100_000, "out": str(out / spec.name)}


def _block_bytes() -> int:
    """Bytes of one transformer block's parameters unsharded: one FSDP all-gather output."""
    with torch.device("meta"):
        model = model_class(get_model_config(PRESET.model))(get_model_config(PRESET.model))
    return sum(p.numel() * p.element_size() for p in model.layers["0"].parameters())


def _predict(spec) -> dict:
    return predict(PRESET.model, mode=spec.mode, workers=PRESET.workers, active=spec.active, ac=spec.ac,
                   fsdp=spec.fsdp, batch_size=PRESET.batch_size, seq_len=PRESET.seq_len)


def launch_spec(out: Path) -> tuple[str, dict]:
    """The configurations trained on CPU, in the shared launch (`tests.distributed.shared_launch`,
    which hides CUDA devices from it: the tracker's figures, also on a GPU machine)."""
    return "train", {"configs": [_config(s, out) for s in SPECS]}


def _peaks(out: Path) -> dict[str, list[dict]]:
    return {s.name: json.loads((out / s.name / "summary.json").read_text())["peak_memory_bytes"] for s in SPECS}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    return _peaks(shared_out(tmp_path_factory, "test_plan_vs_measured"))


@pytest.fixture(scope="module")
def measured_cuda(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("plan_cuda")
    run_rank_script(PRESET.workers, "train", {"configs": [_config(s, out) for s in SPECS]}, out)
    return _peaks(out)


def test_the_compare_configurations_are_covered():
    assert [s.name for s in SPECS] == ["ddp", "fsdp", "fsdp+ac", "bsdp", "nsdp", "bbsdp", "bsdp+fsdp+ac"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_predicted_peak_is_within_10_percent_of_the_measured_peak(measured, spec):
    peaks = measured[spec.name]
    pred = _predict(spec)
    largest = max(p["total"] for p in peaks)
    assert pred["total"] == pytest.approx(largest, rel=0.10), (pred, peaks)  # what `sdp plan` promises
    for rank, (p, total) in enumerate(zip(peaks, pred["per_rank"])):
        assert total == pytest.approx(p["total"], rel=0.10), (rank, total, p)
        # every tracked tensor is modelled (the 8 KiB int64 batch is made before tracking starts): a
        # forgotten buffer, such as DDP's buckets (8% here), fails this line, not the one above
        late = _block_bytes() if spec.fsdp or spec.mode == "fsdp" else 0  # an all-gather output gloo's thread frees late
        assert total * 0.99 <= p["total"] <= total * 1.01 + late, (rank, total, p)
    # parameters, gradients, optimizer state: counted exactly (FSDP's padded shards included)
    assert pred["persistent"] == peaks[pred["rank"]]["persistent"]
    act = max(p["activations"] for p in peaks)
    if spec.name in CLEAN_ACTIVATIONS:
        assert pred["activations"] == pytest.approx(act, rel=0.10)
    else:
        assert pred["activations"] <= act <= pred["activations"] + pred["other"]


@pytest.mark.skipif(torch.cuda.device_count() < PRESET.workers, reason=f"needs {PRESET.workers} CUDA devices")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_predicted_peak_is_within_10_percent_of_the_cuda_peak(measured_cuda, spec):
    peaks = measured_cuda[spec.name]
    pred = _predict(spec)
    assert pred["total"] == pytest.approx(max(p["total"] for p in peaks), rel=0.10), (pred, peaks)
    assert sum(pred["persistent"].values()) == pytest.approx(sum(peaks[pred["rank"]]["persistent"].values()), rel=0.01)
