"""Losing a worker in Bb-SDP and overlap averaging (``--on-worker-loss continue --restore-coverage``), whose
survivors fail after applying the step (in the broadcast or the average of the new values) and go on with the
next; in overlap averaging the survivors take the blocks their restored rows give them, values and AdamW state,
right after the average taken again among them, and worker 0's replacement then rejoins (``--max-rejoins 1``,
`check_rejoined`), every worker going back to its designed row.
The runs and their checks are tests/distributed/test_worker_loss.py's (module doc there); a module of
their own so that pytest-xdist runs them beside B-SDP's and N-SDP's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_worker_loss import REJOINS, RESTORES, check_rejoined, check_survivors, launch


@pytest.fixture(scope="module", params=["bbsdp", "overlap"])
def run(request, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, Path]:
    return launch(request.param, tmp_path_factory)


@pytest.mark.slow
def test_the_survivors_of_a_sigkill_finish_as_the_reference_that_switches_to_the_survivors_mask(run):
    if run[0] in REJOINS:  # overlap averaging: and, once the replacement rejoins, to the designed rows
        check_rejoined(*run, restored=run[0] in RESTORES)
    else:
        check_survivors(*run)
