"""A finished run leaves no process group, hook or thread behind (the abort-at-exit defect).

Before this test, about one finished run in six exited with SIGABRT after writing summary.json
(``terminate called without an active exception``): the runs' process groups were never freed,
because hooks registered in C++ (the sync engine's gradient hooks, DDP's comm hook) held the
objects that held them, and the groups' gloo threads were still running when the interpreter
shut down. The check here is deterministic: after `train` returns, no gloo thread is alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import ROOT, torchrun

COMMON = {"model": "llama-debug", "steps": 2, "batch_size": 2, "seq_len": 16, "eval_batches": 1,
          "max_data_bytes": 100000, "memory_steps": 1, "checkpoint_every": 2}
# FSDP modes are not here: torch's DTensor caches (sharding propagation, redistribute plans) keep
# FSDP's device meshes, and so their groups, referenced after the run. For them, and for any
# group a user's code keeps, the `sdp` rank process ends without interpreter shutdown
# (`sdp_train.cli.rank_main`), which the launches below exercise.
CONFIGS = [  # on 3 ranks: C = 2/3, each block held by 2 of them
    {"mode": "ddp"},
    # every SDP mode under a schedule: the groups made at the start, as with a static mask, and
    # groups made mid-run, at mask changes, for holder sets the first round did not have
    {"mode": "bsdp", "active": 2 / 3, "schedule": "permute", "every": 1},
    {"mode": "nsdp", "active": 2 / 3, "schedule": "permute", "every": 1},
    {"mode": "bbsdp", "active": 2 / 3, "schedule": "permute", "every": 1},
    {"mode": "overlap", "active": 2 / 3, "schedule": "permute", "every": 1},
]


@pytest.mark.slow
def test_no_process_group_or_gloo_thread_outlives_a_finished_run_in_any_mode(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"configs": [{**COMMON, **c} for c in CONFIGS]}))
    script = str(Path(__file__).with_name("teardown_script.py"))
    torchrun(3, [script, str(spec), str(tmp_path)])
    left = []
    for rank in range(3):
        for entry in json.loads((tmp_path / f"threads_rank{rank}.json").read_text()):
            gloo = [t for t in entry["threads"] if "gloo" in t]
            if entry["initialized"] or gloo:
                left.append(f"rank {rank} {entry['config']}: initialized={entry['initialized']}, gloo threads {gloo}")
    assert not left, "process groups outlived train():\n" + "\n".join(left)


@pytest.mark.slow
def test_no_gloo_thread_outlives_destroy_process_group_in_a_users_own_loop(tmp_path):
    """The examples' shape: the user's loop ends with ``dist.destroy_process_group()``; after it no
    gloo thread may run, whether ``sdp_train.parallel.wrapper`` was imported before the group existed or after.

    The first meta-device operation imports ``torch._dynamo``, which imports
    ``torch.distributed.nn.functional``, whose default arguments are ``group.WORLD`` read at
    import: imported while a group exists (a pass-through's first call probes its block on the
    meta device), they kept the default group alive past ``destroy_process_group`` to interpreter
    shutdown; a fresh clone's run of examples/train_custom_model.py aborted so.
    """
    script = str(Path(__file__).with_name("api_teardown_script.py"))
    torchrun(2, [script, str(tmp_path)])  # rank 0 imports the API first, rank 1 makes the group first
    for rank, order in enumerate(("import-first", "init-first")):
        threads = json.loads((tmp_path / f"threads_{order}_rank{rank}.json").read_text())
        assert not [t for t in threads if "gloo" in t], f"rank {rank} ({order}): gloo threads after destroy: {threads}"


LAUNCHES = [  # (ranks, mode flags): FSDP, whose groups torch keeps referenced after the run, with
    (3, ["--mode", "bsdp", "--active", "0.6667", "--fsdp", "--ac"]),  # holder-set groups besides the world
]


@pytest.mark.slow
def test_finished_runs_exit_zero_in_every_launch_including_fsdp(tmp_path):
    """A real `sdp train` launch of FSDP exits 0 with its summary written.

    Before the fix about one run in six (4 ranks) aborted after "done". One launch catches that
    rate with probability 1/6 per CI run only; the deterministic check above guards the non-FSDP
    modes on every run, and this launch (B-SDP + FSDP + AC on 3 ranks: the world's group and
    holder-set groups, all kept referenced by DTensor's caches) that FSDP's ranks exit cleanly.
    """
    for i, (ranks, flags) in enumerate(LAUNCHES):
        out = tmp_path / f"run{i}"
        proc = subprocess.run(
            [sys.executable, "-m", "sdp_train.cli", "train", "--model", "llama-debug", *flags, "--workers",
             str(ranks), "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
             "--max-data-bytes", "100000", "--memory-steps", "0", "--out", str(out)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"})
        assert proc.returncode == 0, f"launch {i} {flags}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
        assert "terminate called" not in proc.stderr, proc.stderr[-6000:]
        assert (out / "summary.json").is_file()
