"""What the launcher of ``sdp train --workers N`` imports: what it uses, not the training loop.

Importing is most of what a short run costs (the suite starts hundreds of processes). A rank
cannot avoid dynamo, DTensor, sympy and triton: torch's optimizers import dynamo when they are
built. The launcher checks the config, builds the model's shapes on the meta device, prints the
mask's certificate and starts the ranks: it must load none of them (seconds of every launch).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.child_env import child_env

HEAVY = ("torch.distributed.tensor", "torch._dynamo", "sympy", "triton")

SCRIPT = """
import json, sys
import sdp_train.trainer.launch as launch
launch.launch_local = lambda argv, nproc, **kw: 0  # everything the launcher does but starting the ranks
from sdp_train.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps([code, sorted({h for m in sys.modules for h in %r if m == h or m.startswith(h + ".")})]))
""" % (HEAVY,)


def _launcher_modules(tmp_path, *flags: str) -> list:
    argv = ["train", "--model", "llama-debug", "--mode", "bsdp", "--active", "0.5", "--workers", "2", "--steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--max-data-bytes", "100000", "--out", str(tmp_path / "run"),
            *flags]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argv)], env=child_env(TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_launcher_loads_no_dynamo_dtensor_sympy_or_triton(tmp_path):
    assert _launcher_modules(tmp_path) == [0, []]
    assert _launcher_modules(tmp_path / "fsdp", "--fsdp", "--ac") == [0, []]
