"""A rank that never joins a collective ends the job with an error naming the rank and bucket."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from masklab import Mask, save_mask

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_stuck_rank_gives_a_timeout_error_naming_rank_and_bucket_not_a_hang(tmp_path):
    mask = save_mask(Mask(np.ones((2, 4), dtype=np.uint8)), tmp_path / "mask.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_COLLECTIVE_TIMEOUT_S": "3"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(__file__).with_name("stall_script.py")), str(mask), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "rank 0: the all_reduce of bucket 0 (holders [0, 1]" in proc.stderr, proc.stderr[-3000:]
    assert "did not complete" in proc.stderr
    assert time.monotonic() - start < 60  # failed at the timeout, well before rank 1 woke up


def test_collective_timeout_is_read_from_the_environment(monkeypatch):
    from sdp_train.parallel.dist import collective_timeout

    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", "12.5")
    assert collective_timeout().total_seconds() == 12.5
    for bad in ("0", "-3", "nan", "inf", "soon"):
        monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="SDP_COLLECTIVE_TIMEOUT_S"):
            collective_timeout()
