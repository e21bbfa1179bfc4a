"""`sdp train`: bad configs and masks are refused before any process starts; a real launch writes
the documented files (metrics, summary, mask, certificate, the final model) and --log-every lines."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from masklab import Mask, Schedule, analyze, load_mask, save_mask
from masklab.io import mask_to_dict
from sdp_train.cli import main
from sdp_train.cli.train import config_from_args
from sdp_train.errors import ConfigError
from sdp_train.models import model_class
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.train import validation_sums
from tests.child_env import child_env

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "comm_bytes"}
SUMMARY_KEYS = {"final_train_loss", "final_val_loss", "comm_bytes_per_step", "step_time_s", "tokens_per_s",
                "config", "mask"}


def _refused(capsys, argv, message):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp train: error:"), err
    assert message in err[0]


@pytest.mark.parametrize(
    ("mask", "argv", "message"),
    [
        (np.ones((3, 4)), ["--workers", "2"], "the mask has 3 workers (rows) but the run has --workers 2"),
        (np.ones((2, 5)), ["--workers", "2"], "the mask has 5 blocks (columns) but llama-debug has 4 maskable blocks"),
        (np.ones((2, 31)), ["--workers", "2", "--mode", "nsdp"], "has 32 maskable blocks at level 'neuron'"),
    ],
)
def test_mask_that_does_not_fit_the_model_is_refused_before_launch(tmp_path, capsys, mask, argv, message):
    path = save_mask(Mask(mask), tmp_path / "m.json")
    out = tmp_path / "run"
    _refused(capsys, ["--mask", str(path), "--steps", "2", "--out", str(out), *argv], message)
    assert not out.exists()


def test_scheduled_mask_and_structural_violations_are_refused(tmp_path, capsys):
    scheduled = save_mask(Mask(np.ones((2, 4)), schedule=Schedule("cyclic", 5)), tmp_path / "s.json")
    _refused(capsys, ["--mask", str(scheduled), "--workers", "2", "--mode", "bsdp", "--fsdp"], "FSDP's holder meshes")
    neurons = np.ones((2, 32), dtype=int)
    neurons[1, 8:16] = 0  # worker 1 keeps no neuron group of layer 1: fine for a static mask, not for a schedule
    path = save_mask(Mask(neurons, schedule=Schedule("cyclic", 5)), tmp_path / "n.json")
    _refused(capsys, ["--mask", str(path), "--workers", "2", "--mode", "nsdp"], "row 1 holds none of block 1")
    resnet = np.ones((2, 32), dtype=np.uint8)  # 8 blocks x 4 channel groups
    resnet[1, :4] = 0  # worker 1 keeps no channel group of block layer1.0
    path = save_mask(Mask(resnet), tmp_path / "r.json")
    _refused(capsys, ["--model", "resnet18-cifar", "--mode", "nsdp", "--mask", str(path), "--workers", "2"],
             "mask row 1 (worker 1) does not fit resnet18-cifar")


def test_a_mask_files_schedule_trains_in_mode_overlap_and_schedule_flags_replace_it(tmp_path, capsys):
    path = save_mask(Mask(np.ones((2, 4)), schedule=Schedule("cyclic", 4)), tmp_path / "s.json")
    base = {"workers": 2, "mask": str(path), "active": None}
    assert prepare(TrainConfig(**base, mode="overlap", local_steps=2)).mask.schedule == Schedule("cyclic", 4)
    assert prepare(TrainConfig(**base, mode="overlap", schedule="permute", every=2)).mask.schedule == \
        Schedule("permute", 2)
    assert prepare(TrainConfig(**base, mode="bsdp", schedule="static")).mask.schedule.is_static
    assert prepare(TrainConfig(**base, mode="bsdp")).mask.schedule == Schedule("cyclic", 4)  # B-SDP trains it too
    _refused(capsys, ["--mask", str(path), "--workers", "2", "--mode", "overlap", "--local-steps", "3"],
             "changes it every 4 steps, not a multiple of local_steps=3")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--active", "0"], "active=0.0 must be in (0, 1]"),
        (["--steps", "0"], "steps=0 must be an integer >= 1"),
        (["--model", "gpt-9"], "gpt-9"),
        (["--lr", "nan"], "lr=nan must be a finite number"),
        (["--data", "cifar:/nonexistent"], "is not a directory"),
        (["--model", "resnet18-cifar", "--data", "stdlib"], "does not fit model"),
        (["--mask", "/nonexistent.json"], "no such mask file"),
        (["--mode", "fsdp", "--schedule", "permute"], "changes a mask; mode 'fsdp' has none"),
        (["--mode", "nsdp", "--model", "resnet18-cifar", "--data", "digits", "--schedule", "permute"],
         "N-SDP trains schedules for LLaMA models and --model-class ones, not 'resnet18-cifar'"),
        (["--fsdp", "--schedule", "permute"], "with fsdp (--fsdp): FSDP's holder meshes are fixed"),
        (["--mode", "ddp", "--schedule", "cyclic"], "changes a mask; mode 'ddp' has none"),
        (["--every", "2"], "every=2 (--every) needs schedule"),
        (["--mode", "overlap", "--schedule", "static", "--every", "4"], "got schedule='static'"),
        (["--local-steps", "2", "--mode", "bbsdp"], "got mode 'bbsdp'; backward masking with local steps is --mode overlap"),
        (["--local-steps", "2", "--fsdp"], "modes 'overlap', 'bsdp' and 'nsdp' (without --fsdp), got mode 'bsdp' with fsdp"),
        (["--mode", "overlap", "--schedule", "permute", "--every", "3", "--local-steps", "2"],
         "every=3 (--every) must be a multiple of local_steps=2"),
    ],
)
def test_bad_flags_are_one_clear_line(capsys, argv, message):
    _refused(capsys, ["--workers", "2", *argv], message)


def test_config_file_is_read_strictly_and_flags_override_it(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"model": "llama-debug", "steps": 7, "lr": 0.01}))
    args = _parse(["--config", str(cfg_file), "--steps", "9"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.lr) == (9, 0.01)
    cfg_file.write_text(json.dumps({"stepz": 7}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stepz'\]"):
        config_from_args(_parse(["--config", str(cfg_file)]))
    cfg_file.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        config_from_args(_parse(["--config", str(cfg_file)]))


def _parse(argv):
    from sdp_train.cli import build_parser

    return build_parser().parse_args(["train", *argv])


def test_train_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="mode 'zero3' is not one of"):
        TrainConfig(mode="zero3")
    with pytest.raises(ConfigError, match="needs --active C or --mask FILE"):
        TrainConfig(mode="bsdp", active=None)


@pytest.mark.slow
def test_sdp_train_launches_ranks_and_writes_metrics_summary_mask_certificate_and_model(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "train", "--model", "llama-debug", "--mode", "bsdp",
         "--active", "0.5", "--workers", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
         "--max-data-bytes", "100000", "--eval-batches", "1", "--log-every", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(TRITON_INTERPRET="0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all(METRIC_KEYS <= set(m) for m in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["mask"]["workers"] == 2 and summary["config"]["mode"] == "bsdp"
    logged = [line for line in proc.stdout.splitlines() if line.startswith("step ")]  # --log-every 2, no terminal
    assert [line.split()[1] for line in logged] == ["2/3", "3/3"], proc.stdout
    assert f"loss={lines[1]['loss']:.5g}" in logged[0]
    # the mask, printed and saved with its certificate; `sdp train --mask` takes the file back
    mask = load_mask(out / "mask.json")
    assert mask_to_dict(mask) == summary["mask"] and "  worker 1: " in proc.stdout
    assert json.loads((out / "certificate.json").read_text()) == json.loads(json.dumps(analyze(mask).to_dict()))
    # the final full model: the built-in model's keys, and the validation loss summary.json reports
    assert summary["model_file"] == "model.safetensors"
    state = load_file(out / "model.safetensors")
    prep = prepare(TrainConfig.from_dict(summary["config"]))
    model = model_class(prep.model_config)(prep.model_config)
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state, strict=True)
    sums = validation_sums(model, prep, world_size=2, device=torch.device("cpu"))
    assert float(sums[0] / sums[1]) == pytest.approx(summary["final_val_loss"], rel=1e-6)


@pytest.mark.slow
def test_swin_trains_with_bsdp_and_its_assembled_model_scores_the_reported_validation_loss(tmp_path):
    """The Swin family end to end: two workers holding different blocks (two stages, patch merging
    shared), and the full model rank 0 assembles from their held blocks."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "train", "--model", "swin-debug", "--mode", "bsdp", "--active", "0.5",
         "--workers", "2", "--steps", "3", "--eval-batches", "1", "--memory-steps", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(TRITON_INTERPRET="0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    held = load_mask(out / "mask.json").matrix
    assert held.shape == (2, 4) and (held.sum(axis=0) == 1).all()  # C = 0.5: each block on one worker
    assert len(set(summary["num_params_trained"])) == 2
    prep = prepare(TrainConfig.from_dict(summary["config"]))
    model = model_class(prep.model_config)(prep.model_config)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    sums = validation_sums(model, prep, world_size=2, device=torch.device("cpu"))
    assert float(sums[0] / sums[1]) == pytest.approx(summary["final_val_loss"], rel=1e-6)

@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("model", 123, "model=123 must be a string"), ("out", None, "out=None must be a string"),
     ("mask", 5, "mask=5 must be a string or null"), ("fsdp", "yes", "fsdp='yes' must be true or false")],
)
def test_config_fields_of_the_wrong_type_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({field: value})
    assert message in str(err.value)
