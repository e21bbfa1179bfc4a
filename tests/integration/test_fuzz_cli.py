"""Fuzzed command lines end in one ``sdp CMD: error:`` line and exit 2, never a traceback, and a
failing command leaves no file that a later run could take for a finished one.

Flags get negative, NaN, ``inf``, huge, empty and non-numeric values and paths that are missing,
directories, garbage or under a file. Runs are in-process (`sdp_train.cli.main`); for ``sdp train``
training and the rank launcher are replaced by stand-ins that raise `_WouldStart` after `prepare`,
so an accepted command line costs a validation, not a training run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import sdp_train.trainer.launch
import sdp_train.trainer.train
from masklab import Mask, save_mask
from sdp_train.cli import main
from sdp_train.cli.train import _FLAGS, _SWITCHES
from sdp_train.trainer.config import MODES, TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run
from sdp_train.trainer.train import train
from tests.child_env import child_env

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMBERS = ["0", "-1", "1", "2", "3", "nan", "inf", "-inf", "1e400", "", "abc", "9" * 30, "0.5", "-0.0", "1e-320"]
PATH_KINDS = ["missing", "directory", "garbage", "under-a-file", "long-name", "empty-name", "mask", "config"]


class _WouldStart(Exception):
    """Raised by the stand-ins for training and launching: the command line was accepted."""


@pytest.fixture
def paths(tmp_path):
    """One path of each kind in PATH_KINDS (a valid 2 x 4 mask and a valid config among them)."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "garbage").write_bytes(b"\x80\x00{[not json")
    (tmp_path / "file").write_text("{}")
    save_mask(Mask(np.array([[1, 1, 0, 0], [0, 0, 1, 1]])), tmp_path / "mask.json")
    (tmp_path / "config.json").write_text(json.dumps({"model": "llama-debug", "workers": 2, "steps": 1}))
    return {"missing": str(tmp_path / "nope.json"), "directory": str(tmp_path / "dir"),
            "garbage": str(tmp_path / "garbage"), "under-a-file": str(tmp_path / "file" / "x.json"),
            "long-name": str(tmp_path / ("n" * 5000)), "empty-name": "", "mask": str(tmp_path / "mask.json"),
            "config": str(tmp_path / "config.json")}


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Replace training and launching by `prepare` + `_WouldStart`, in `tmp_path` (an accepted relative
    ``--out`` is locked, so created, there and not in the checkout)."""
    monkeypatch.chdir(tmp_path)
    def fake_train(cfg: TrainConfig):
        prepare(cfg)
        raise _WouldStart

    def fake_launch(*args, **kwargs):
        raise _WouldStart

    monkeypatch.setattr(sdp_train.trainer.train, "train", fake_train)
    monkeypatch.setattr(sdp_train.trainer.launch, "launch_local", fake_launch)


def _exit_code_and_stderr(capsys, argv: list[str]) -> tuple[int | None, str]:
    """(exit code, stderr) of ``sdp ARGV``; exit code None when a stand-in says training would start."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage lines, then one error line
        code = exc.code
    except _WouldStart:
        code = None
    return code, capsys.readouterr().err


def _assert_one_error_line(command: str, code: int | None, err: str) -> None:
    event("accepted" if code is None else f"exit {code}" + (" (argparse)" if err.startswith("usage:") else ""))
    if code in (0, None):
        return
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert sum("error:" in line for line in lines) == 1 and lines[-1].startswith(f"sdp {command}: error:"), err
    assert "Traceback" not in err
    if not lines[0].startswith("usage:"):  # ours, not argparse's
        assert len(lines) == 1, err


INTS = ["0", "-1", "1", "2", "3", "9" * 30]
FLOATS = ["0", "-1", "0.5", "1", "nan", "inf", "-inf", "1e400", "-0.0", "1e-320"]


def _value(flag: str) -> st.SearchStrategy:
    """Mostly values argparse accepts for the flag's type (so our validation sees them), sometimes any."""
    typ = _FLAGS[flag][1] if flag in _FLAGS else str
    good = {"--mode": list(MODES), "--model": ["llama-debug", "resnet18-cifar", "vit-tiny", "gpt-9"],
            "--data": ["auto", "stdlib", "digits", "bin:/nonexistent", "cifar:", "zzz"],
            "--construction": ["auto", "cyclic", "magic"], "--workers": ["1", "2", "3", "4097"],
            "--seq-len": ["8", "300"], "--active": ["0.5", "1", "1.5"]}.get(flag, [])
    typed = st.sampled_from(good + (INTS if typ is int else FLOATS if typ is float else []) or NUMBERS)
    paths = st.sampled_from(PATH_KINDS).map(lambda kind: "@" + kind)
    return st.one_of(typed, typed, typed, paths if typ is str else typed, st.sampled_from(NUMBERS))


train_argv = st.lists(st.sampled_from([*_FLAGS, "--config"]), max_size=6, unique=True).flatmap(
    lambda flags: st.tuples(*[st.tuples(st.just(f), _value(f)) for f in flags])) .map(
    lambda pairs: [x for pair in pairs for x in pair])


@given(train_argv, st.lists(st.sampled_from(list(_SWITCHES)), max_size=2, unique=True))
@FUZZ
def test_fuzzed_train_flags_are_accepted_or_one_error_line(capsys, paths, no_training, tmp_path, argv, switches):
    argv = [paths[a[1:]] if a.startswith("@") else a for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "run")]
    code, err = _exit_code_and_stderr(capsys, ["train", *argv, *switches])
    _assert_one_error_line("train", code, err)
    assert code != 0  # an accepted command line reaches the stand-ins
    if code is None:  # accepted: the run has locked (so created) its --out; start the next example afresh
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
    assert not (tmp_path / "run").exists()  # validation writes nothing


@given(st.sampled_from(PATH_KINDS), st.lists(st.sampled_from(["--json", "--plot"]), max_size=1),
       st.sampled_from(["x.txt", "dir", "missing/x.png"]))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_inspect_arguments_exit_cleanly(capsys, paths, tmp_path, kind, extra, plot):
    argv = ["inspect", paths[kind], *extra]
    if extra == ["--plot"]:
        argv.append(str(tmp_path / plot))  # never a writable .png: plotting is covered elsewhere
    code, err = _exit_code_and_stderr(capsys, argv)
    _assert_one_error_line("inspect", code, err)
    assert code == (0 if kind == "mask" and not extra[:1] == ["--plot"] else 2)


numbers = st.sampled_from(NUMBERS)
VERIFY_FLAGS = ["--smoothness", "--sigma", "--zeta", "--eta", "--steps", "--suboptimality", "--local-steps",
                "--grad-bound"]


@given(st.sampled_from(PATH_KINDS) | st.just("mask"),
       st.fixed_dictionaries({f: st.sampled_from(["1", "0.1", "100"]) | numbers for f in VERIFY_FLAGS[:6]},
                             optional={f: st.sampled_from(["1", "4"]) | numbers for f in VERIFY_FLAGS[6:]}))
@FUZZ
def test_fuzzed_verify_arguments_exit_cleanly(capsys, paths, kind, flags):
    argv = ["verify", paths[kind], *[x for flag, value in flags.items() for x in (flag, value)]]
    code, err = _exit_code_and_stderr(capsys, argv)
    _assert_one_error_line("verify", code, err)
    assert code in (0, 2)


@given(st.sampled_from(["4", "6", "0", "-1", "5000", "abc"]), st.sampled_from(["6", "4", "0", "2000000"]),
       st.sampled_from(["--coverage=2", "--coverage=9", "--active=0.5", "--active=nan"]),
       st.sampled_from(["existing", "new", "directory", "missing-dir", None]),
       st.sampled_from(["x.txt", "dir", "missing/x.png", None]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_failing_design_leaves_existing_outputs_intact_and_writes_nothing(capsys, tmp_path, k, b, budget, out, plot):
    root = tmp_path / f"case{time.monotonic_ns()}"
    root.mkdir()
    (root / "dir").mkdir()
    (root / "existing.json").write_text("precious")
    before = sorted(p.name for p in root.iterdir())
    argv = ["design", "-K", k, "-B", b, budget]
    if out is not None:
        argv += ["--out", str(root / {"existing": "existing.json", "new": "new.json", "directory": "dir",
                                      "missing-dir": "missing/m.json"}[out])]
    if plot is not None:
        argv += ["--plot", str(root / plot)]  # never a writable .png
    code, err = _exit_code_and_stderr(capsys, argv)
    _assert_one_error_line("design", code, err)
    assert (root / "existing.json").read_text() == "precious" or (code == 0 and out == "existing")
    if code != 0:
        assert sorted(p.name for p in root.iterdir()) == before  # no partial, temporary or new file
        assert list((root / "dir").iterdir()) == []


def test_a_bad_config_fails_in_the_launching_process_with_one_line(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"workers": 2, "steps": 2, "model_overrides": {"dim": 10**12, "n_heads": 2}}))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sdp_train.cli", "train", "--config", str(config), "--out", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env=child_env(drop=("RANK", "WORLD_SIZE", "SDP_DEBUG")))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdp train: error: llama-debug: "), proc.stderr
    assert "parameters exceed the supported maximum" in lines[0]
    assert not out.exists()  # no rank was launched: nothing created the output directory


def _tiny(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(**{"model_overrides": {"dim": 16, "n_layers": 2, "n_heads": 2, "hidden_dim": 32},
                          "mode": "ddp", "workers": 1, "steps": 2, "batch_size": 2, "seq_len": 8, "eval_batches": 1,
                          "memory_steps": 0, "max_data_bytes": 200_000, "out": str(tmp_path / "run"), **overrides})


def test_a_run_that_fails_before_training_creates_no_output_directory(tmp_path):
    with pytest.raises(ValueError, match="no such mask file"):
        train(_tiny(tmp_path, mask=str(tmp_path / "missing.json"), mode="bsdp"))
    assert not (tmp_path / "run").exists()


def test_a_new_run_removes_a_stale_summary_before_its_first_step(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"final_train_loss": 1.0}')  # a finished earlier run

    def crash(self, *args, **kwargs):
        raise RuntimeError("killed mid-run")

    monkeypatch.setattr(Run, "step", crash)
    with pytest.raises(RuntimeError, match="killed mid-run"):
        train(_tiny(tmp_path))
    assert not (out / "summary.json").exists()  # the interrupted run does not look finished
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["metrics.jsonl"]


def test_summary_is_written_last_and_atomically(tmp_path, monkeypatch):
    summary = train(_tiny(tmp_path))
    out = tmp_path / "run"
    assert json.loads((out / "summary.json").read_text())["final_train_loss"] == summary["final_train_loss"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary file left

    def fail_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="No space left"):
        train(_tiny(tmp_path))
    assert not (out / "summary.json").exists()  # a summary that could not be written completely is absent


@pytest.mark.parametrize("kind", ["data-name-too-long", "out-is-a-file", "out-under-a-file"])
def test_path_errors_from_the_os_are_one_error_line(capsys, tmp_path, kind):
    (tmp_path / "file").write_text("x")
    argv = {"data-name-too-long": ["--data", "bin:" + "d" * 5000],
            "out-is-a-file": ["--out", str(tmp_path / "file")],
            "out-under-a-file": ["--out", str(tmp_path / "file" / "run")]}[kind]
    tiny = ["--workers", "1", "--mode", "ddp", "--steps", "1", "--batch-size", "2", "--seq-len", "8",
            "--memory-steps", "0", "--eval-batches", "1", "--max-data-bytes", "200000"]
    code, err = _exit_code_and_stderr(capsys, ["train", *tiny, *argv])
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("sdp train: error:"), err
    assert (tmp_path / "file").read_text() == "x"
