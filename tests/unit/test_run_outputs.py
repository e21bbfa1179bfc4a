"""What ``sdp train`` leaves in --out besides metrics (mask, certificate, model file) and what it shows
while it runs (--log-every lines, TensorBoard scalars); the flags reach the ranks; missing optional
packages are one error line before anything is created. The real launch that writes these files is
in tests/integration/test_cli_train.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest

import sdp_train.trainer.launch
from masklab import Mask, analyze, load_mask
from sdp_train.cli import main
from sdp_train.cli.train import config_from_args
from sdp_train.errors import ConfigError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.log import RunLog
from sdp_train.trainer.outputs import save_mask_and_certificate


def _record(step, loss=2.0, **extra):
    return {"step": step, "loss": loss, "lr": 0.001, "grad_norm": 0.5, "step_time_s": 0.01, "tokens_per_s": 3200.0,
            "comm_bytes": 4096, "wire_bytes": 2048.0, "skipped": False, **extra}


def test_saved_mask_loads_back_and_the_certificate_is_masklabs(tmp_path):
    mask = Mask(np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), block_names=["a", "b", "c"], construction="cyclic")
    mask_path, cert_path, report = save_mask_and_certificate(tmp_path, mask)
    assert load_mask(mask_path) == mask and load_mask(mask_path).block_names == ("a", "b", "c")
    assert json.loads(cert_path.read_text()) == json.loads(json.dumps(analyze(mask).to_dict()))
    assert report.optimality_ratio == pytest.approx(1.0)
    assert {oct(p.stat().st_mode & 0o777) for p in (mask_path, cert_path)} == {"0o644"}


def test_mask_and_certificate_replace_links_planted_in_out_instead_of_writing_through_them(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    for name in ("mask.json", "certificate.json"):
        os.symlink(target, out / name)
    save_mask_and_certificate(out, Mask(np.ones((2, 2))))
    assert not any(p.is_symlink() for p in out.iterdir()) and target.read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["certificate.json", "mask.json"]  # no temporary left


def test_log_every_prints_plain_flushed_lines_every_n_steps_and_at_the_last(capsys):
    log = RunLog(TrainConfig(steps=5, log_every=2), start=0, enabled=True)
    for step in range(5):
        log.update(_record(step, loss=1.0 + step, **({"val_loss": 9.5} if step == 3 else {})), None)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert lines[1] == ("step 4/5 loss=4 val_loss=9.5 lr=0.001 grad_norm=0.5 step_time_s=0.01 tokens_per_s=3200 "
                        "comm_bytes=4096 wire_bytes=2048")
    RunLog(TrainConfig(steps=5, log_every=2), start=0, enabled=False).update(_record(1), None)
    assert capsys.readouterr().out == ""  # other ranks print nothing


class _FakeSummaryWriter:
    """Records what the run gives torch's SummaryWriter: the same constructor and add_scalar signature."""

    made: list = []

    def __init__(self, log_dir=None, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        _FakeSummaryWriter.made.append(self)

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.scalars.append((tag, scalar_value, global_step))

    def close(self):
        self.closed = True


def test_tensorboard_gets_every_metric_under_its_tag_and_a_resume_purges_later_events(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=_FakeSummaryWriter))
    _FakeSummaryWriter.made.clear()
    log = RunLog(TrainConfig(steps=4, tensorboard=True, out=str(tmp_path)), start=2, enabled=True)
    log.update(_record(2, loss=float("nan"), grad_norm=None, skipped=True), None)
    log.update(_record(3, loss=1.5), None)
    log.final(1.25)
    log.close()
    writer, = _FakeSummaryWriter.made
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.purge_step == 2 and writer.closed
    step3 = {tag: value for tag, value, step in writer.scalars if step == 3}
    assert step3 == {"train/loss": 1.5, "train/lr": 0.001, "train/grad_norm": 0.5, "perf/step_time_s": 0.01,
                     "perf/tokens_per_s": 3200.0, "comm/comm_bytes": 4096, "comm/wire_bytes": 2048.0,
                     "val/loss": 1.25}
    assert "train/grad_norm" not in {tag for tag, _, step in writer.scalars if step == 2}  # a null is not a value
    RunLog(TrainConfig(steps=4, tensorboard=True, out=str(tmp_path)), start=0, enabled=True).close()
    assert _FakeSummaryWriter.made[-1].purge_step is None


def _parse(argv):
    from sdp_train.cli import build_parser

    return build_parser().parse_args(["train", *argv])


def test_output_flags_set_the_config_and_reach_the_ranks(tmp_path, monkeypatch):
    cfg = config_from_args(_parse(["--no-save", "--log-every", "7", "--tensorboard"]))
    assert (cfg.save_model, cfg.log_every, cfg.tensorboard) == (False, 7, True)
    assert config_from_args(_parse([])).save_model is True
    with pytest.raises(ConfigError, match="log_every=-1 must be an integer >= 0"):
        config_from_args(_parse(["--log-every", "-1"]))
    launched = []

    def fake_launch(argv, workers, **kwargs):
        launched.append(argv)
        return 0

    monkeypatch.setattr(sdp_train.trainer.launch, "launch_local", fake_launch)
    out = tmp_path / "run"
    assert main(["train", "--workers", "2", "--steps", "1", "--no-save", "--log-every", "3", "--out", str(out)]) == 0
    ranks_cfg = config_from_args(_parse(launched[0][1:]))
    assert (ranks_cfg.save_model, ranks_cfg.log_every, ranks_cfg.out) == (False, 3, str(out))
    assert (out / "mask.json").is_file() and (out / "certificate.json").is_file()  # written before launch


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_the_package_is_one_error_line_before_anything_is_created(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--workers", "2", "--tensorboard", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensorboard needs the tensorboard package: pip install" in err[0], err
    assert not out.exists()


def test_saving_without_safetensors_is_one_error_line_naming_no_save(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if it were not installed
    out = tmp_path / "run"
    assert main(["train", "--workers", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the safetensors package" in err[0] and "--no-save" in err[0], err
    assert not out.exists()
