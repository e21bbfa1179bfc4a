"""Validation assembles the full model on rank 0 only: the other ranks never hold a full copy.

Each SDP rank's peak of bytes allocated during `evaluate` (and alive together) is compared with
the full model's size: rank 0 needs one full copy (it evaluates), every other rank a few
full tensors at most (its share of the assembly, the slice it copies into it, the reduce's
scratch), never the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sdp_train.models import block_map, get_model_config
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
LLAMA = get_model_config("llama-debug")


MODES = ["bsdp", "nsdp", "bbsdp", "ddp"]


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch (`tests.distributed.shared_launch`)."""
    base = {"model": "llama-debug", "workers": 2, "batch_size": 2, "seq_len": 16, "eval_batches": 2,
            "max_data_bytes": 100_000, "active": 0.5, "out": str(out / "run")}
    return "eval_memory", {"configs": [{**base, "mode": m} for m in MODES]}


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    out = shared_out(tmp_path_factory, "test_eval_memory")
    return {m: [json.loads((out / f"eval{i}_rank{r}.json").read_text()) for r in range(2)]
            for i, m in enumerate(MODES)}


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
def test_only_rank_zero_holds_a_full_model_copy_during_validation(evals, mode):
    full_bytes = 4 * sum(int(np.prod(s)) for s in block_map(LLAMA).shapes.values())
    largest_tensor = 4 * max(int(np.prod(s)) for s in block_map(LLAMA).shapes.values())
    ranks = evals[mode]
    for r, result in enumerate(ranks):
        if r == 0:
            assert result["peak"] >= full_bytes  # rank 0 evaluates the assembled model
        else:
            assert result["peak"] <= 3 * largest_tensor < full_bytes, (r, result["peak"], full_bytes)


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp", "ddp"])
def test_every_rank_gets_rank_zeros_validation_loss(evals, mode):
    losses = [r["val_loss"] for r in evals[mode]]
    assert np.isfinite(losses[0]) and losses[0] == losses[1]
