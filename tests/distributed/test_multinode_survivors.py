"""A lost node, without rollback: ``sdp train --mode bsdp --on-worker-loss continue --nnodes 3`` started on
three "nodes" (three launchers on 127.0.0.1, one rank each), no checkpoint to go back to; the store hosted
by node 0's launcher, or by an ``sdp store`` process that trains nothing (``--store HOST:PORT``).

A node is lost at step 2: its rank SIGKILLs itself after step 2's collectives (``SDP_TEST_KILL_AT_STEP``)
and its launcher dies with it, before it can mark the rank exited (``SDP_TEST_NODE_DIES``), as when a
machine goes down. With node 0's store, node 2 is lost and node 0's launcher sees its beat stop; with
``sdp store``, node 0 itself is lost (its launcher, which held ``--out``, and rank 0, which wrote the
metrics) and the store's process sees its beat stop (``SDP_NODE_TIMEOUT_S=3``). Either marks the lost
rank, so the survivors agree on the loss, rerun step 3 under their rows of the mask (the lost row
dropped). The test then starts the lost node's launcher again (a replacement node, ``--max-rejoins 1``):
it waits until the survivors have left its rank out, and the rank rejoins at step 4
(``SDP_TEST_JOIN_AT_STEP``). Checked: every launcher of the end exits 0 (and the store), the lost one was
killed; the loss at step 3 and the rejoin at step 4 in summary.json and on their metrics lines, every
step's line once; and the final model, and every step's loss, equal the single-process reference with
workers 0-2, the two survivors at step 3, and workers 0-2 again from step 4 (float32 rounding;
tests/distributed/test_worker_loss.py).
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
from tests.distributed.test_worker_loss import ARGS, JOIN_STEP, KILL_STEP, STEPS, reference

ROOT = Path(__file__).resolve().parents[2]


def members_rows(lost: int):
    def rows(prep, step: int) -> tuple[list[int], np.ndarray]:
        members = [w for w in range(3) if w != lost] if step == KILL_STEP + 1 else [0, 1, 2]
        matrix = np.zeros_like(prep.mask.matrix, dtype=bool)
        matrix[members] = prep.mask.matrix[members]
        return members, matrix
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("store", ["node 0", "sdp store"])
def test_the_survivors_of_a_lost_node_go_on_and_its_replacement_rejoins_as_in_the_reference(tmp_path, store):
    from safetensors.torch import load_file

    out, port = tmp_path / "run", free_port()
    lost = 2 if store == "node 0" else 0  # the store's host cannot be lost; with `sdp store`, node 0 is
    survivors = [w for w in range(3) if w != lost]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:{lost}", "SDP_COLLECTIVE_TIMEOUT_S": "60",
           "SDP_NODE_TIMEOUT_S": "3", "SDP_TEST_JOIN_AT_STEP": str(JOIN_STEP)}
    server = None
    if store == "sdp store":
        server = subprocess.Popen([sys.executable, "-m", "sdp_train.cli", "store", "--nnodes", "3",
                                   "--port", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    where = ["--master-port", str(port)] if server is None else ["--store", f"127.0.0.1:{port}"]
    argv = [sys.executable, "-m", "sdp_train.cli", "train", *ARGS, "--mode", "bsdp", "--out", str(out),
            "--nnodes", "3", *where, "--max-rejoins", "1"]

    def launcher(n: int, dies: bool) -> subprocess.Popen:
        return subprocess.Popen([*argv, "--node-rank", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env={**env, "SDP_TEST_NODE_DIES": str(int(dies))})

    nodes = [launcher(n, n == lost) for n in range(3)]
    try:
        gone = nodes[lost].communicate(timeout=300)
        nodes.append(launcher(lost, False))  # the lost node's replacement, on a "new machine"
        results = [p.communicate(timeout=300) for p in nodes[:lost] + nodes[lost + 1:]]
        served = server.communicate(timeout=60) if server is not None else None
    finally:
        for p in [*nodes, *([server] if server else [])]:
            p.kill()
    results.insert(lost, gone)
    codes = [p.returncode for p in nodes]
    assert codes == [-9 if n == lost else 0 for n in range(4)], "".join(r[1][-3000:] for r in results)
    watcher = results[0][1] if server is None else served[1]
    assert f"sdp: node {lost} lost (no sign of its launcher for 3 s)" in watcher
    assert f"sdp: node {lost} is back (a replacement's launcher beats)" in watcher
    assert f"sdp: node {lost}: replacing a node of the run: its rank(s) {lost} rejoin" in results[3][1]
    if server is not None:
        assert server.returncode == 0, served[1][-4000:]
        assert "the run ended: ranks 1, 2, 0 of 3 finished it" in served[1]

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    left, joined = summary["membership_changes"]
    assert (left["step"], left["lost"], left["workers"]) == (KILL_STEP + 1, [lost], survivors)
    assert (joined["step"], joined["joined"], joined["workers"]) == (JOIN_STEP, [lost], [*survivors, lost])
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["step"] for m in metrics if "membership" in m] == [KILL_STEP + 1, JOIN_STEP]

    expected, losses = reference("bsdp", members_of=members_rows(lost))
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5)
