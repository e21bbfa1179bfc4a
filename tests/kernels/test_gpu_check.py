"""scripts/gpu_check.sh --dry-run: every step of the GPU check runs on the CPU and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_cpu_and_writes_results(tmp_path):
    # One training mode keeps this under a minute; the script runs the four the same way.
    env = child_env(OUT=str(tmp_path), PYTHON=sys.executable)  # the script's steps run this test's interpreter
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--modes", "bsdp"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()[1:]]
    assert [s[0] for s in steps] == ["env", "kernel_tests", "bench", "train_bsdp", "plan", "memory", "bench_compiled"]
    assert all(s[1] == "0" for s in steps[:-1]) and steps[-1][1] == "skipped", steps  # no torch.compile on the dry run
    assert "passed" in (tmp_path / "kernel_tests.txt").read_text()
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert {r["case"].split(" | ")[1].split()[0] for r in rows} == {"pack", "unpack"}
    assert all(r["seconds"] > 0 and r["sector_bytes"] >= r["useful_bytes"] * 0.99 for r in rows)
    summary = json.loads((tmp_path / "train" / "bsdp" / "summary.json").read_text())
    assert summary["config"]["mode"] == "bsdp" and summary["world_size"] == 1
    memory = (tmp_path / "memory.md").read_text()
    assert "| bsdp |" in memory


def test_gpu_check_refuses_unknown_arguments_and_a_missing_out(tmp_path):
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = child_env(drop=("OUT",), PYTHON=sys.executable)
    done = subprocess.run([script, "--fast"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
    done = subprocess.run([script, "--help"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--dry-run runs every step on the CPU" in done.stdout and "set -uo" not in done.stdout
    done = subprocess.run([script, "--dry-run"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set OUT" in done.stderr
