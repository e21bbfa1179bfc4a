"""A lost node, without rollback: ``sdp train --mode bsdp --on-worker-loss continue --nnodes 3`` started on
three "nodes" (three launchers on 127.0.0.1, one rank each), no checkpoint to go back to; the store hosted
by node 0's launcher, or by an ``sdp store`` process that trains nothing (``--store HOST:PORT``).

A node is lost at step 2: its rank SIGKILLs itself after step 2's collectives (``SDP_TEST_KILL_AT_STEP``)
and its launcher dies with it, before it can mark the rank exited (``SDP_TEST_NODE_DIES``), as when a
machine goes down. With node 0's store, node 2 is lost and node 0's launcher sees its beat stop; with
``sdp store``, node 0 itself is lost (its launcher, which held ``--out``, and rank 0, which wrote the
metrics) and the store's process sees its beat stop (``SDP_NODE_TIMEOUT_S=3``). Either marks the lost
rank, so the survivors agree on the loss, rerun step 3 under their rows of the mask (the lost row
dropped) and finish. Checked: the survivors' nodes exit 0 (and the store), the lost one was killed; the
loss at step 3 in summary.json and its metrics line, every step's line once; and the final model, and
every step's loss, equal the single-process reference with workers 0-2 up to step 2 and the two
survivors from step 3 on (float32 rounding; tests/distributed/test_worker_loss.py).
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


def members_rows(lost: int):
    def rows(prep, step: int) -> tuple[list[int], np.ndarray]:
        members = [0, 1, 2] if step <= KILL_STEP else [w for w in range(3) if w != lost]
        matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
        matrix[members] = prep.mask.matrix[members]
        return members, matrix
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("store", ["node 0", "sdp store"])
def test_the_survivors_of_a_lost_node_finish_as_the_reference_that_drops_its_worker(tmp_path, store):
    from safetensors.torch import load_file

    out, port = tmp_path / "run", free_port()
    lost = 2 if store == "node 0" else 0  # the store's host cannot be lost; with `sdp store`, node 0 is
    survivors = [w for w in range(3) if w != lost]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:{lost}", "SDP_COLLECTIVE_TIMEOUT_S": "60",
           "SDP_NODE_TIMEOUT_S": "3"}
    server = None
    if store == "sdp store":
        server = subprocess.Popen([sys.executable, "-m", "sdp_train.cli", "store", "--nnodes", "3",
                                   "--port", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    where = ["--master-port", str(port)] if server is None else ["--store", f"127.0.0.1:{port}"]
    argv = [sys.executable, "-m", "sdp_train.cli", "train", *ARGS, "--mode", "bsdp", "--out", str(out),
            "--nnodes", "3", *where]
    nodes = [subprocess.Popen([*argv, "--node-rank", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**env, "SDP_TEST_NODE_DIES": str(int(n == lost))})
             for n in range(3)]
    try:
        results = [p.communicate(timeout=300) for p in nodes]
        served = server.communicate(timeout=60) if server is not None else None
    finally:
        for p in [*nodes, *([server] if server else [])]:
            p.kill()
    codes = [p.returncode for p in nodes]
    assert codes == [-9 if n == lost else 0 for n in range(3)], "".join(results[n][1][-4000:] for n in survivors)
    watcher = results[0][1] if server is None else served[1]
    assert f"sdp: node {lost} lost (no sign of its launcher for 3 s)" in watcher
    finished = ", ".join(map(str, survivors))
    assert f"lost rank {lost} (node lost); ranks {finished} finished the run" in results[1][1]
    if server is not None:
        assert server.returncode == 0, served[1][-4000:]
        assert f"the run ended: ranks {finished} of 3 finished it; node(s) {lost} lost" in served[1]

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (change,) = summary["membership_changes"]
    assert (change["step"], change["lost"], change["workers"]) == (KILL_STEP + 1, [lost], survivors)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP + 1]

    expected, losses = reference("bsdp", members_of=members_rows(lost))
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
