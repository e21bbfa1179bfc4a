"""Helpers for multi-rank tests: launch a script on K local gloo ranks through torchrun, pick a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("rank_script.py")


def torchrun(nproc: int, args: list[str], *, timeout: float = 300, interpret_triton: bool = False,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone`` with `nproc` ranks; fail with its output.

    With `interpret_triton` on a CPU machine the ranks' sync engine runs the Triton kernels in the
    interpreter (slow, so only for short cases); otherwise it dispatches to the PyTorch reference.
    `env` adds to (or replaces in) the environment the launch inherits.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    env["TRITON_INTERPRET"] = "1" if interpret_triton else "0"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a launch's store or rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_script(nproc: int, case: str, spec: dict, out: Path, *, interpret_triton: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / f"{case}_spec.json"
    spec_path.write_text(json.dumps(spec))
    torchrun(nproc, [str(RANK_SCRIPT), case, str(spec_path), str(out)], interpret_triton=interpret_triton)
