"""FSDP2 as a baseline and composed with B-SDP, on real gloo ranks.

The FSDP baseline must follow DDP's loss trajectory, B-SDP with ``fsdp=True`` (each block sharded
among its holders) must follow B-SDP's, and activation checkpointing must change neither, nor the
chunked loss (``loss_chunks``) against the plain one. A shared torchrun launch trains every configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, save_mask
from sdp_train.errors import ConfigError
from sdp_train.models import block_map, get_model_config
from sdp_train.parallel.dist import DistInfo
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run
from tests.distributed.shared_launch import shared_out

LLAMA = get_model_config("llama-debug")
MASK = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])  # blocks 1, 2 shared by both workers; 0, 3 single holders
RESNET = {"model": "resnet18-cifar", "model_overrides": {"width_multiplier": 0.125}, "batch_size": 8,
          "active": 0.5}


def _cfg(out: Path, **kw) -> dict:
    base = {"model": "llama-debug", "workers": 2, "steps": 4, "batch_size": 2, "seq_len": 32, "eval_batches": 1,
            "max_data_bytes": 100_000, "memory_steps": 1, "warmup_steps": 1, "seed": 3}
    return {**base, **kw, "out": str(out)}


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch; the files it names written into `out`."""
    mask = str(save_mask(Mask(MASK), out / "mask.json"))
    sdp = {"mode": "bsdp", "mask": mask, "active": None}
    configs = [
        _cfg(out / "ddp", mode="ddp"),
        _cfg(out / "ddp-plain", mode="ddp", loss_chunks=0),
        _cfg(out / "fsdp", mode="fsdp"),
        _cfg(out / "fsdp-ac", mode="fsdp", activation_checkpointing=True),
        _cfg(out / "bsdp", **sdp),
        _cfg(out / "bsdp-fsdp", fsdp=True, **sdp),
        _cfg(out / "bsdp-fsdp-plain", fsdp=True, loss_chunks=0, **sdp),
        _cfg(out / "bsdp-fsdp-ac", fsdp=True, activation_checkpointing=True, **sdp),
        _cfg(out / "resnet-bsdp", mode="bsdp", **RESNET),
        _cfg(out / "resnet-bsdp-fsdp-ac", mode="bsdp", fsdp=True, activation_checkpointing=True, **RESNET),
    ]
    return "train", {"configs": configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return shared_out(tmp_path_factory, "test_fsdp_composition")


def _metrics(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def _summary(out: Path, name: str) -> dict:
    return json.loads((out / name / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("run", "reference"), [
    ("fsdp", "ddp"), ("fsdp-ac", "ddp"), ("bsdp-fsdp", "bsdp"), ("bsdp-fsdp-ac", "bsdp"),
    ("resnet-bsdp-fsdp-ac", "resnet-bsdp"),
])
def test_fsdp_follows_the_loss_trajectory_of_the_same_run_without_it(runs, run, reference):
    got, expected = _metrics(runs, run), _metrics(runs, reference)
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in expected], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in got], [m["grad_norm"] for m in expected], rtol=1e-4)
    assert _summary(runs, run)["final_val_loss"] == pytest.approx(_summary(runs, reference)["final_val_loss"],
                                                                   rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("run", "reference"), [("ddp", "ddp-plain"), ("bsdp-fsdp", "bsdp-fsdp-plain")])
def test_the_chunked_loss_follows_the_trajectory_of_the_plain_loss_over_the_full_logits(runs, run, reference):
    """The default ``loss_chunks`` (the head in chunks, under DDP, and under the library API with the head
    in FSDP's root unit) against ``loss_chunks=0``: the same losses and gradient norms, to rounding."""
    got, expected = _metrics(runs, run), _metrics(runs, reference)
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in expected], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in got], [m["grad_norm"] for m in expected], rtol=1e-4)
    assert _summary(runs, run)["config"]["loss_chunks"] == TrainConfig.loss_chunks > 0


@pytest.mark.slow
def test_sdp_with_fsdp_holds_each_block_sharded_among_its_holders(runs):
    bmap = block_map(LLAMA)
    numel = {n: int(np.prod(s)) for n, s in bmap.shapes.items() if n in bmap.parameter_names}
    shared = sum(numel[n] for n in bmap.shared("block") if n in numel)
    block = [sum(numel[n] for n, _ in bmap.owned("block", j)) for j in range(4)]
    alone, sharded = _summary(runs, "bsdp")["peak_memory_bytes"], _summary(runs, "bsdp-fsdp")["peak_memory_bytes"]
    for rank in range(2):
        held = np.flatnonzero(MASK[rank])
        expected = shared / 2 + sum(block[j] / MASK[:, j].sum() for j in held)
        assert sharded[rank]["persistent"]["parameters"] == 4 * expected
        assert sum(sharded[rank]["persistent"].values()) < sum(alone[rank]["persistent"].values())


@pytest.mark.slow
def test_fsdp_comm_bytes_count_every_all_gather_and_reduce_scatter(runs):
    bmap = block_map(LLAMA)
    params = {n: int(np.prod(s)) for n, s in bmap.shapes.items() if n in bmap.parameter_names}
    in_blocks = sum(params[n] for j in range(4) for n, _ in bmap.owned("block", j))
    # all-gather every parameter in forward, the blocks and the embedding (a unit of its own, resharded
    # after forward; the head's unit stays gathered) again in backward, reduce-scatter every gradient,
    # plus the [loss, grad-norm^2] all-reduce
    expected = 4 * (2 * sum(params.values()) + in_blocks + params["tok_embeddings.weight"]) + 8
    assert {m["comm_bytes"] for m in _metrics(runs, "fsdp")} == {expected}


@pytest.mark.slow
def test_sdp_fsdp_comm_bytes_are_the_plans_each_shared_block_gathered_in_forward_and_backward(runs):
    from sdp_train.planning.memory import predict

    # blocks 1, 2 (two holders) gathered twice and reduced, 0 and 3 (one holder) send nothing
    expected = predict("llama-debug", mode="bsdp", fsdp=True, workers=2, mask=Mask(MASK), batch_size=2, seq_len=32)
    for name in ("bsdp-fsdp", "bsdp-fsdp-ac"):
        assert {m["comm_bytes"] for m in _metrics(runs, name)} == {expected["comm_bytes_per_step"]}, name
        assert _summary(runs, name)["wire_bytes_per_step"] == pytest.approx(expected["wire_bytes_per_step"]), name


@pytest.mark.slow
def test_activation_checkpointing_composes_with_sdp_and_fsdp_and_lowers_activations(runs):
    plain = _summary(runs, "bsdp-fsdp")["peak_memory_bytes"]
    ac = _summary(runs, "bsdp-fsdp-ac")["peak_memory_bytes"]
    for before, after in zip(plain, ac):
        assert after["activations"] < before["activations"]


@pytest.mark.parametrize("mode", ["nsdp", "bbsdp", "ddp", "fsdp"])
def test_fsdp_composition_outside_bsdp_is_refused_with_the_reason(mode):
    with pytest.raises(ConfigError, match=f"composes with mode 'bsdp' only, got mode '{mode}'"):
        TrainConfig(mode=mode, fsdp=True)


def test_fsdp_without_a_process_group_is_refused(tmp_path):
    prep = prepare(TrainConfig(mode="fsdp", workers=1, out=str(tmp_path)))
    with pytest.raises(ConfigError, match="needs torch.distributed"):
        Run(prep, DistInfo(0, 1, 0), torch.device("cpu"))


def test_parallelism_memory_and_checkpoint_flags_reach_the_config_and_the_launched_ranks():
    from sdp_train.cli import build_parser
    from sdp_train.cli.train import argv_of, config_from_args

    argv = ["--mode", "bsdp", "--fsdp", "--ac", "--memory-steps", "1", "--checkpoint-every", "3", "--resume", "d"]
    args = build_parser().parse_args(["train", *argv])
    cfg = config_from_args(args)
    assert (cfg.fsdp, cfg.activation_checkpointing, cfg.memory_steps, cfg.checkpoint_every, cfg.resume) == \
        (True, True, 1, 3, "d")
    relaunched = config_from_args(build_parser().parse_args(["train", *argv_of(args)]))
    assert relaunched == cfg
