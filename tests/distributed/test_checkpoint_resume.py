"""Checkpoints on real gloo ranks: a resumed run continues the exact loss trajectory, and a
checkpoint of another mask, model, mode or world size is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, save_mask
from sdp_train.errors import ConfigError
from sdp_train.trainer.checkpoint import MANIFEST
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
BASE = {"model": "llama-debug", "workers": 2, "steps": 4, "batch_size": 2, "seq_len": 32, "eval_batches": 1,
        "max_data_bytes": 100_000, "memory_steps": 0, "warmup_steps": 1, "seed": 5}


def _cfg(out: Path, **kw) -> dict:
    return {**BASE, **kw, "out": str(out)}


def launch_spec(out: Path) -> tuple[str, dict]:
    """This module's rank_script case and spec for its shared launch; the files it names written into `out`."""
    mask = str(save_mask(Mask(np.array([[1, 1, 1, 0], [0, 1, 1, 1]])), out / "mask.json"))
    kinds = {"bsdp": {"mode": "bsdp", "active": 0.5}, "bsdp-fsdp": {"mode": "bsdp", "mask": mask, "active": None,
                                                                     "fsdp": True}}
    configs = []
    for name, kw in kinds.items():
        configs.append(_cfg(out / name, checkpoint_every=2, **kw))
        configs.append(_cfg(out / f"{name}-resumed", resume=str(out / name / "checkpoints" / "step_2"), **kw))
    # overlap averaging resumed at step 3: in the middle of an averaging round (H = 2) and of a
    # permute round (R = 4), with a freshly drawn mask at step 4 after the resume
    overlap = {"mode": "overlap", "active": 0.5, "schedule": "permute", "every": 4, "local_steps": 2, "steps": 7,
               "eval_every": 2}
    configs.append(_cfg(out / "overlap", checkpoint_every=3, **overlap))
    configs.append(_cfg(out / "overlap-resumed", resume=str(out / "overlap" / "checkpoints" / "step_3"), **overlap))
    # Bb-SDP under a permute schedule resumed at step 3, in the middle of a round of R = 2: the
    # optimizer state each rank saved is that of its round's blocks; later changes move it on
    # B-SDP likewise: the resumed run rebuilds step 3's subnetwork before loading its state; N-SDP
    # re-cuts its MLPs to step 3's neuron groups
    for mode in ("bbsdp", "bsdp", "nsdp"):
        kw = {"mode": mode, "active": 0.5, "schedule": "permute", "every": 2, "steps": 6}
        configs.append(_cfg(out / f"{mode}-permute", checkpoint_every=3, **kw))
        configs.append(_cfg(out / f"{mode}-permute-resumed", **kw,
                            resume=str(out / f"{mode}-permute" / "checkpoints" / "step_3")))
    # B-SDP with local steps (H = 2) resumed at step 3, between two averages
    local = {"mode": "bsdp", "active": 0.5, "local_steps": 2, "steps": 6}
    configs.append(_cfg(out / "bsdp-local", checkpoint_every=3, **local))
    configs.append(_cfg(out / "bsdp-local-resumed", **local, resume=str(out / "bsdp-local" / "checkpoints" / "step_3")))
    return "train", {"configs": configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return shared_out(tmp_path_factory, "test_checkpoint_resume")


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["bsdp", "bsdp-fsdp"])
def test_resumed_run_repeats_the_uninterrupted_loss_trajectory_exactly(runs, name):
    full, resumed = _metrics(runs / name), _metrics(runs / f"{name}-resumed")
    assert [m["step"] for m in resumed] == [2, 3]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in full[2:]]
    summary = json.loads((runs / f"{name}-resumed" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2
    assert summary["final_val_loss"] == json.loads((runs / name / "summary.json").read_text())["final_val_loss"]


def test_overlap_averaging_resumed_mid_round_repeats_the_uninterrupted_run_and_logs_its_consensus(runs):
    full, resumed = _metrics(runs / "overlap"), _metrics(runs / "overlap-resumed")
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in full[3:]]
    summaries = [json.loads((runs / name / "summary.json").read_text()) for name in ("overlap", "overlap-resumed")]
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    assert summaries[0]["final_consensus_distance"] == summaries[1]["final_consensus_distance"]
    # every copy differs after local steps: the consensus distance of every block, other, and their total
    consensus = summaries[0]["final_consensus_distance"]
    blocks = [f"layers.{i}" for i in range(4)]
    assert sorted(consensus) == sorted([*blocks, "other", "total"])
    assert consensus["total"] == pytest.approx(sum(v for k, v in consensus.items() if k != "total"))
    assert all(consensus[b] > 0 for b in blocks)
    # logged at each evaluation (steps 1, 3, 5), in the metrics line and the summary's val_history
    assert [m["step"] for m in full if "consensus_distance" in m] == [1, 3, 5]
    assert [h["consensus_distance"] for h in summaries[0]["val_history"]] == \
        [m["consensus_distance"] for m in full if "consensus_distance" in m]
    # one holder average every H = 2 steps, nothing in between but the 8-byte stats all-reduce
    sent = [m["comm_bytes"] for m in full]
    assert sent[0] == sent[2] == sent[4] == sent[6] == 8 and min(sent[1], sent[3], sent[5]) > 10_000
    assert summaries[0]["comm_bytes_per_step"] == pytest.approx(sum(sent) / len(sent))


@pytest.mark.parametrize("name", ["bbsdp-permute", "bsdp-permute", "nsdp-permute", "bsdp-local"])
def test_sdp_under_a_schedule_or_local_steps_resumed_mid_round_repeats_the_uninterrupted_run(runs, name):
    full, resumed = _metrics(runs / name), _metrics(runs / f"{name}-resumed")
    assert [m["step"] for m in resumed] == [3, 4, 5]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in full[3:]]
    summaries = [json.loads((runs / n / "summary.json").read_text()) for n in (name, f"{name}-resumed")]
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    if name.endswith("permute"):
        assert summaries[0]["mask_change_bytes"] > 0  # state moved at the changes, counted apart from comm_bytes
    else:  # one holder average every 2 steps: the others send only the 8-byte norm reduction
        assert [m["comm_bytes"] > 8 for m in full] == [False, True] * 3


def test_checkpoint_is_every_n_steps_and_at_the_end_and_loads_as_plain_tensors(runs):
    root = runs / "bsdp" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    for step in (2, 4):
        manifest = json.loads((root / f"step_{step}" / MANIFEST).read_text())
        assert manifest["step"] == step and manifest["identity"]["world_size"] == 2
        for rank in range(2):
            state = torch.load(root / f"step_{step}" / f"rank{rank}.pt", weights_only=True)
            assert state["step"] == step and state["data"]["step"] == step and state["optimizer"]["state"]
    assert not list(root.glob("step_*/.*"))  # no temporary files left behind


@pytest.mark.parametrize(("change", "message"), [
    ({"active": 1.0}, "mask: checkpoint"),
    ({"model_overrides": {"hidden_dim": 256}}, "model_config: checkpoint"),
    ({"mode": "nsdp"}, "mode: checkpoint 'bsdp', this run 'nsdp'"),
    ({"workers": 4}, "world_size: checkpoint 2, this run 4"),
])
def test_checkpoint_of_another_run_is_refused_naming_what_differs(runs, change, message):
    cfg = TrainConfig(**{**BASE, "mode": "bsdp", "active": 0.5, **change,
                         "resume": str(runs / "bsdp" / "checkpoints" / "step_2"), "out": str(runs / "x")})
    with pytest.raises(ConfigError, match=f"cannot resume from .*{message}"):
        prepare(cfg)


@pytest.mark.parametrize(("change", "message"), [
    ({"local_steps": 1, "every": 4}, "local_steps: checkpoint 2, this run 1"),
    ({"schedule": "cyclic"}, "schedule: checkpoint \\['permute', 4\\], this run \\['cyclic', 4\\]"),
])
def test_overlap_checkpoint_of_another_schedule_or_averaging_period_is_refused(runs, change, message):
    overlap = {"mode": "overlap", "active": 0.5, "schedule": "permute", "every": 4, "local_steps": 2, "steps": 7}
    cfg = TrainConfig(**{**BASE, **overlap, **change, "resume": str(runs / "overlap" / "checkpoints" / "step_3"),
                         "out": str(runs / "x")})
    with pytest.raises(ConfigError, match=f"cannot resume from .*{message}"):
        prepare(cfg)


def test_resume_picks_the_latest_checkpoint_and_refuses_one_with_nothing_left_or_none(runs, tmp_path):
    cfg = TrainConfig(**{**BASE, "mode": "bsdp", "active": 0.5, "out": str(tmp_path),
                         "resume": str(runs / "bsdp" / "checkpoints")})
    with pytest.raises(ConfigError, match="step_4: it is at step 4 and the run has steps=4"):
        prepare(cfg)
    assert prepare(TrainConfig(**{**cfg.to_dict(), "steps": 6})).resume_from.name == "step_4"
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        prepare(TrainConfig(**{**cfg.to_dict(), "resume": str(tmp_path)}))


def test_resuming_into_the_same_directory_keeps_only_the_metrics_before_the_checkpoint(tmp_path):
    from sdp_train.trainer.train import open_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(4)))
    (tmp_path / "summary.json").write_text("{}")
    open_metrics(tmp_path, 2)[0].close()
    assert [m["step"] for m in _metrics(tmp_path)] == [0, 1]
    assert not (tmp_path / "summary.json").exists()  # the resumed run has not finished yet
