"""A lost node, without rollback: ``sdp train --mode bsdp --on-worker-loss continue --nnodes 3`` started on
three "nodes" (three launchers on 127.0.0.1, one rank each, node 0's launcher hosting the store), no
checkpoint to go back to.

Node 2 is lost at step 2: its rank SIGKILLs itself after step 2's collectives (``SDP_TEST_KILL_AT_STEP``)
and its launcher dies with it, before it can mark the rank exited (``SDP_TEST_NODE_DIES``), as when a
machine goes down. Node 0's launcher sees node 2's beat stop (``SDP_NODE_TIMEOUT_S=3``) and marks its
rank lost, so the survivors (workers 0 and 1, on nodes 0 and 1) agree on the loss, rerun step 3 under
their rows of the mask (the lost row dropped) and finish. Checked: nodes 0 and 1 exit 0, node 2 was
killed; the loss at step 3 in summary.json and its metrics line, every step's line once; and the final
model, and every step's loss, equal the single-process reference with workers 0-2 up to step 2 and
workers 0 and 1 from step 3 on (float32 rounding; tests/distributed/test_worker_loss.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.conftest import free_port
from tests.distributed.test_worker_loss import ARGS, KILL_STEP, STEPS, reference

ROOT = Path(__file__).resolve().parents[2]
LOST_NODE = 2


def members_rows(prep, step: int) -> tuple[list[int], np.ndarray]:
    members = [0, 1, 2] if step <= KILL_STEP else [0, 1]
    matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
    matrix[members] = prep.mask.matrix[members]
    return members, matrix


@pytest.mark.slow
def test_the_survivors_of_a_lost_node_finish_as_the_reference_that_drops_its_worker(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:{LOST_NODE}", "SDP_COLLECTIVE_TIMEOUT_S": "60",
           "SDP_NODE_TIMEOUT_S": "3"}
    argv = [sys.executable, "-m", "sdp_train.cli", "train", *ARGS, "--mode", "bsdp", "--out", str(out),
            "--nnodes", "3", "--master-port", str(free_port())]
    nodes = [subprocess.Popen([*argv, "--node-rank", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**env, "SDP_TEST_NODE_DIES": str(int(n == LOST_NODE))})
             for n in range(3)]
    try:
        results = [p.communicate(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    codes = [p.returncode for p in nodes]
    assert codes == [0, 0, -9], results[0][1][-4000:] + results[1][1][-4000:]
    assert "sdp: node 2 lost (no sign of its launcher for 3 s)" in results[0][1]
    assert "lost rank 2 (node lost); ranks 0, 1 finished the run" in results[1][1]

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (change,) = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"]) == (KILL_STEP + 1, [LOST_NODE], [0, 1])
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP + 1]

    expected, losses = reference("bsdp", members_of=members_rows)
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
