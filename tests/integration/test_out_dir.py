"""``--out`` belongs to one run: finished runs are not overwritten silently, two runs never share a
directory, a killed launcher takes its ranks with it, and the CLI refuses what it would ignore.

Each test fails on the code before these guarantees: a second run into a finished run's directory
replaced it silently, two concurrent runs both exited 0 with a mixed metrics.jsonl, and the ranks
of a SIGKILLed launcher trained on to the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdp_train.cli import main
from sdp_train.cli.train import report_mask
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.rundir import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "llama-debug", "--mode", "bsdp", "--active", "1", "--batch-size", "2", "--seq-len", "16",
        "--max-data-bytes", "100000", "--eval-batches", "1", "--memory-steps", "0"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}


def _sdp(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sdp_train.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, **kw)


@pytest.fixture(autouse=True)
def _kernels_on_the_reference_backend(monkeypatch):
    """The one-worker runs here train in this process: Triton's interpreter (which the suite
    turns on for tests/kernels) would make each take 30 s instead of 5."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _one_process_run(out: Path, *extra: str) -> int:
    return main(["train", *TINY, "--workers", "1", "--steps", "2", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One finished 3-step run with a checkpoint after every step, started over a dead run's lock.
    Tests work on copies of it (`_copy_of`), so each launch they add is one of their own checks."""
    out = tmp_path_factory.mktemp("finished") / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("pid 999999 on host gone, since 2026-01-01T00:00:00Z\n")  # a dead run's
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")  # as the autouse fixture does for each test
        assert _one_process_run(out, "--steps", "3", "--checkpoint-every", "1") == 0
    assert "took over the lock of a run that no longer runs (pid 999999" in err.getvalue()
    return out


def _copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


@pytest.mark.slow
def test_out_dir_lifecycle_stale_lock_refusal_overwrite_and_resume_from_the_run_directory(
        finished_run, tmp_path, capsys):
    out = _copy_of(finished_run, tmp_path)
    first = (out / "summary.json").read_text()
    assert _one_process_run(out, "--lr", "0.01") == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "summary.json").read_text() == first  # nothing lost
    assert main(["train", *TINY, "--workers", "1", "--steps", "4", "--out", str(out),
                 "--resume", str(out)]) == 0  # the run directory means its checkpoints
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 3
    capsys.readouterr()
    # the config file a run reads may live in the directory it replaces (as sdp compare's do): it is kept
    (out / "config.json").write_text(json.dumps({"lr": 0.01}))
    assert _one_process_run(out, "--config", str(out / "config.json"), "--overwrite") == 0
    assert json.loads((out / "summary.json").read_text())["config"]["lr"] == 0.01
    assert json.loads((out / "config.json").read_text()) == {"lr": 0.01}
    assert oct((out / "summary.json").stat().st_mode & 0o777) == oct((out / "metrics.jsonl").stat().st_mode & 0o777)
    assert not (out / "checkpoints").exists()  # an old run's checkpoints cannot be adopted later


@pytest.mark.slow
def test_a_second_run_into_a_directory_in_use_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    first = _sdp("train", *TINY, "--workers", "1", "--steps", "100000", "--out", str(out))
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        second = _sdp("train", *TINY, "--workers", "1", "--steps", "2", "--out", str(out), "--overwrite")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert "is in use by another run (pid" in err and len(err.strip().splitlines()) == 1, err
    finally:
        # SIGTERM, not SIGINT: a test runner started in the background (``cmd &`` in a script, and
        # pytest-xdist's workers) has SIGINT ignored, and its children inherit that, so a SIGINT
        # would leave this run training its 100000 steps through the rest of the suite
        first.terminate()
        first.communicate(timeout=120)


@pytest.mark.parametrize("argv, message", [
    (["--mode", "ddp", "--active", "0.3"], "would be ignored"),
    (["--mode", "fsdp", "--mask", "m.json"], "would be ignored"),
])
def test_baseline_modes_refuse_mask_arguments_they_would_ignore(tmp_path, capsys, argv, message):
    assert main(["train", "--model", "llama-debug", *argv, "--out", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_abbreviated_flags_are_refused_and_version_exists(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--step", "3"])
    assert exc.value.code == 2 and "unrecognized arguments: --step" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("sdp ")


def test_the_mask_is_printed_and_a_rounded_active_fraction_or_disconnected_graph_warned(tmp_path, capsys):
    report_mask(prepare(TrainConfig(model="llama-debug", mode="bsdp", workers=16, active=0.69, out=str(tmp_path))))
    captured = capsys.readouterr()
    assert "mask 16 workers x 4 blocks" in captured.out and "C = 0.6875" in captured.out
    assert "--active 0.69 became C = 0.6875" in captured.err
    report_mask(prepare(TrainConfig(model="llama-debug", mode="bsdp", workers=2, active=0.5, out=str(tmp_path))))
    assert "disconnected" in capsys.readouterr().err


@pytest.mark.slow
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    out = tmp_path / "run"
    launcher = _sdp("train", *TINY, "--workers", "2", "--steps", "100000", "--out", str(out))
    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()[1][-4000:]
        time.sleep(0.5)
    launcher.kill()
    launcher.communicate()
    # the kernel's SIGKILL to the ranks is immediate: within 5 s no rank is left, and nothing grows the file
    deadline = time.monotonic() + 5
    while alive := subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split():
        assert time.monotonic() < deadline, f"ranks still running 5 s after their launcher died: {alive}"
        time.sleep(0.2)
    size = (out / "metrics.jsonl").stat().st_size
    time.sleep(0.5)
    assert (out / "metrics.jsonl").stat().st_size == size, "something kept writing after the launcher died"


@pytest.mark.slow
def test_a_resume_over_a_damaged_metrics_file_names_file_and_line_and_deletes_nothing(finished_run, tmp_path, capsys):
    out = _copy_of(finished_run, tmp_path)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0][:-5], *lines[1:]]) + "\n")  # step 0's line cut short
    summary = (out / "summary.json").read_text()
    resume = ["train", *TINY, "--workers", "1", "--steps", "4", "--out", str(out), "--resume", str(out)]
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert f"{metrics}:1: damaged metrics line" in err and len(err.strip().splitlines()) == 1, err
    assert (out / "summary.json").read_text() == summary  # nothing deleted
    metrics.write_text("\n".join([*lines, '{"step": 3, "lo']) + "\n")  # a line half-written after the checkpoint
    assert main(resume) == 0
    assert "kept steps 0..2 (the checkpoint's), dropped 1 later line(s)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]


@pytest.mark.slow
def test_links_planted_in_out_are_replaced_never_written_through(finished_run, tmp_path):
    out, elsewhere = _copy_of(finished_run, tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim.txt"
    victim.write_text("keep me")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(victim)
    shutil.rmtree(out / "checkpoints" / "step_2")
    (out / "checkpoints" / "step_2").symlink_to(elsewhere)
    assert main(["train", *TINY, "--workers", "1", "--steps", "2", "--checkpoint-every", "1", "--out", str(out),
                 "--resume", str(out / "checkpoints" / "step_1")]) == 0
    assert victim.read_text() == "keep me" and sorted(p.name for p in elsewhere.iterdir()) == ["victim.txt"]
    assert not (out / "metrics.jsonl").is_symlink() and (out / "metrics.jsonl").read_text()
    assert not (out / "checkpoints" / "step_2").is_symlink()
    assert (out / "checkpoints" / "step_2" / "manifest.json").is_file()


def _shards(root: Path, train_tokens: int, val_tokens: int) -> Path:
    root.mkdir()
    (root / "train0.bin").write_bytes(bytes(2 * train_tokens))
    (root / "val0.bin").write_bytes(bytes(2 * val_tokens))
    return root


@pytest.mark.parametrize(("setup", "message"), [
    (lambda t: ["--data", f"bin:{_shards(t / 'small', 1000, 10000)}"], "train split in"),
    (lambda t: ["--data", f"bin:{_shards(t / 'smallval', 100000, 10)}"], "val split in"),
    (lambda t: ["--out", str(_touch(t / "a-file"))], "exists and is not a directory"),
    (lambda t: ["--out", str(t / ("x" * 230))], "the directory name is 230 bytes"),
])
def test_bad_data_or_out_is_refused_in_the_launcher_in_one_line_creating_nothing(tmp_path, capsys, setup, message):
    extra = setup(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    argv = ["train", "--model", "llama-debug", "--mode", "bsdp", "--workers", "4", "--out", str(tmp_path / "run"),
            *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp train: error:") and message in err[0], err
    assert sorted(tmp_path.rglob("*")) == before  # nothing created


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path
