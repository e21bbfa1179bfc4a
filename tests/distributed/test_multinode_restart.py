"""Restart across nodes: two torchrun agents (two "nodes" on 127.0.0.1, one rank each, c10d rendezvous)
share one ``--out``; a worker SIGKILLed mid-step is restarted by ``--max-restarts`` and the run finishes.

The two agents disagree on ``TORCHELASTIC_RESTART_COUNT`` within one attempt: the agent whose
worker died counts the restart, the other restarts on the membership change and does not. Before
the attempt was agreed through the agent's store, the ranks of the restarted attempt built their
process group under different store prefixes (``Gloo connectFullMesh failed``, then a hang) and
rank 0 took its restart for a new run into a directory that holds one. A small
``SDP_COLLECTIVE_TIMEOUT_S`` and a subprocess timeout make such a regression fail in about a
minute instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_STEP, KILL_RANK = 6, 2, 3, 1
ARGS = ["--model", "llama-debug", "--mode", "bsdp", "--active", "0.5", "--workers", "2", "--steps", str(STEPS),
        "--batch-size", "2", "--seq-len", "16", "--max-data-bytes", "100000", "--eval-batches", "1",
        "--memory-steps", "0", "--checkpoint-every", str(EVERY), "--seed", "3"]


@pytest.mark.slow
def test_a_worker_killed_on_one_of_two_nodes_is_restarted_and_the_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "SDP_COLLECTIVE_TIMEOUT_S": "30", "SDP_TEST_KILL_AT_STEP": f"{KILL_STEP}:{KILL_RANK}"}
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", tmp_path.name,
             "--max-restarts", "2", "--monitor-interval", "0.2", "-m", "sdp_train.cli", "train", *ARGS,
             "--out", str(out)]
    nodes = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(2)]
    try:
        results = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    logs = "\n".join(f"node {i} exit {node.returncode}\nstdout:\n{o[-3000:]}\nstderr:\n{e[-6000:]}"
                     for i, (node, (o, e)) in enumerate(zip(nodes, results)))
    assert [node.returncode for node in nodes] == [0, 0], logs
    assert "exitcode: -9" in logs, logs  # one agent saw the SIGKILL
    summary = json.loads((out / "summary.json").read_text())
    resumed = EVERY * (KILL_STEP // EVERY)
    assert (summary["restart_attempt"], summary["resumed_from_step"]) == (1, resumed), logs
    assert f"restart 1: resuming from {out / 'checkpoints' / f'step_{resumed}'}" in logs
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS))
