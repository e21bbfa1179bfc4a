"""Another module named `kernels` ahead of this project's on sys.path gets an error naming both files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.child_env import ROOT, child_env


def _import_api(tmp_path, *, dist_info: bool) -> subprocess.CompletedProcess:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    if dist_info:
        (tmp_path / "kernels-0.4.0.dist-info").mkdir()
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-c", "from sdp_train import SubnetworkDataParallel"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("dist_info", [False, True], ids=["a user's folder", "an installed distribution"])
def test_a_shadowing_kernels_module_is_named_with_the_expected_one(tmp_path, dist_info):
    done = _import_api(tmp_path, dist_info=dist_info)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert f"found {tmp_path / 'kernels' / '__init__.py'}" in message, message
    assert f"not this project's kernels package ({ROOT / 'kernels' / '__init__.py'})" in message, message
    assert ("Hugging Face" in message) == dist_info, message
