"""An input error found inside the ranks of ``sdp train --workers N`` ends the launch as one found
before it does: one ``sdp train: error:`` line, exit 2, nothing already written lost.

The case is a checkpoint whose rank file has bad contents (its hash recomputed so the manifest
agrees): only the rank that reads the file can tell. Before, the launch exited 1 with that rank's
torch traceback, the other rank's gloo traceback (its peer was gone), the elastic agent's lines
and ``sdp: worker failed: ...``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "llama-debug", "--mode", "ddp", "--workers", "2", "--batch-size", "2",
        "--seq-len", "16", "--max-data-bytes", "100000", "--eval-batches", "1", "--memory-steps", "0", "--no-save"]

pytestmark = pytest.mark.slow


def _sdp_train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdp_train.cli", "train", *ARGS, *flags, "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != "SDP_DEBUG"}, "PYTHONPATH": str(ROOT),
             "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "SDP_COLLECTIVE_TIMEOUT_S": "60"},
    )


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """A 2-rank run stopped after 2 of 4 steps, with its checkpoint."""
    out = tmp_path_factory.mktemp("run") / "run"
    proc = _sdp_train(out, "--steps", "2", "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _bad_rng(file: Path) -> None:
    state = torch.load(file, weights_only=True)
    state["rng"]["torch"] = torch.zeros_like(state["rng"]["torch"])  # the right size, and invalid
    torch.save(state, file)


# One launch: rank 1 refuses, so rank 0 must learn of it (the collective agreement) and the launcher
# must carry a non-zero rank's line. Every kind of bad file, a malicious pickle among them, is read
# by the same function in tests/unit/test_checkpoint_integrity.py without launching ranks.
@pytest.mark.parametrize(("rank", "craft", "message"), [
    (1, _bad_rng, "rng.torch: not a torch RNG state (Invalid mt19937 state)"),
])
def test_a_rank_that_refuses_its_checkpoint_ends_the_launch_with_one_line_and_exit_2(
        checkpointed, tmp_path, rank, craft, message):
    out = Path(shutil.copytree(checkpointed, tmp_path / "run"))
    step = out / "checkpoints" / "step_2"
    file = step / f"rank{rank}.pt"
    craft(file)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][file.name].update(size=file.stat().st_size, sha256=hashlib.sha256(file.read_bytes()).hexdigest())
    (step / "manifest.json").write_text(json.dumps(manifest))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".sdp.lock"}

    proc = _sdp_train(out, "--steps", "4", "--resume", str(out / "checkpoints"))

    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sdp train: error: checkpoint file {file}: {message}"), lines
    assert "Traceback" not in proc.stderr and "weights_only=False" not in proc.stderr
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".sdp.lock"}
    assert after == before  # nothing written, nothing lost
