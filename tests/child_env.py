"""The environment of a child process a test starts: this checkout first on its import path.

Tests start children with ``sys.executable`` (the interpreter running pytest, however the project
was installed: a venv, conda, a system site, or not installed at all) and this environment, so the
child imports the same masklab, kernels and sdp_train as the test, never a stray copy found by PATH.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """``os.environ`` less `drop`, plus `extra`, with ROOT prepended to PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
