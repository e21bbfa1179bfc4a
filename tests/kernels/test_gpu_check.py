"""scripts/gpu_check.sh --dry-run: every step of the GPU check runs on the CPU, within its budget, into summary.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[2]


BUDGET_S, GRACE_S = 420, 5  # the 7 minutes; each step's kill grace


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_cpu_and_writes_the_summary(tmp_path):
    # One memory configuration keeps this short; the script runs the four the same way.
    env = child_env(OUT=str(tmp_path), PYTHON=sys.executable)  # the script's steps run this test's interpreter
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--configs", "bsdp"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()[1:]]
    assert [s[0] for s in steps] == ["env", "kernel_tests", "bench", "step_host", "sync_debug", "memory_bsdp", "plan",
                                     "summary"]
    assert all(s[1] == "0" for s in steps), steps
    # with the four GPU configurations (three more memory steps of the same limit) the limits and
    # their kill grace still fit the budget
    limits = {s[0]: int(s[3]) for s in steps}
    assert sum(limits.values()) + 3 * limits["memory_bsdp"] + (len(steps) + 3) * GRACE_S <= BUDGET_S, limits
    # the dry run kills a step only after 20 x its GPU limit: a busy CPU does not fail it (on a
    # loaded machine `env`, which imports torch and triton, once took more than its 15 s)
    assert all(int(s[4]) == 20 * int(s[3]) for s in steps), steps
    assert "passed" in (tmp_path / "kernel_tests.txt").read_text()
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert {r["case"].split(" | ")[1].split()[0] for r in rows} == {"pack", "unpack"}
    host = json.loads((tmp_path / "step_host.json").read_text())
    assert [r["what"].split()[0] for r in host["sdp"]] == ["bsdp", "nsdp"] and host["ddp"]["buckets"] >= 1
    assert all(r["step_ms"] > 0 and r["launches_per_step"] >= r["communicating"] for r in host["sdp"])
    summary = (tmp_path / "summary.md").read_text()
    for section in ("## Steps", "## Kernels", "## Sync engine host time", "## Host synchronisation", "## Peak memory"):
        assert section in summary, section
    assert "bsdp: steps 3-5 made no host synchronisation" in summary
    memory = next(line for line in summary.splitlines() if line.startswith("| bsdp |"))
    measured, predicted, ratio = (cell.strip() for cell in memory.split("|")[2:5])
    assert len(measured.split(", ")) == 2 and float(predicted) > 0 and 0.5 < float(ratio) < 2, memory


def test_gpu_check_refuses_step_limits_over_its_budget(tmp_path):
    # eight memory configurations of 30 s cannot fit in 7 minutes beside the other steps
    env = child_env(OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--configs", " ".join(["bsdp"] * 8)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "over the 420 s budget" in done.stderr


def test_gpu_check_refuses_unknown_arguments_and_a_missing_out(tmp_path):
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = child_env(drop=("OUT",), PYTHON=sys.executable)
    done = subprocess.run([script, "--fast"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
    done = subprocess.run([script, "--help"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--dry-run runs every step on the CPU" in done.stdout and "set -uo" not in done.stdout
    done = subprocess.run([script, "--dry-run"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set OUT" in done.stderr
