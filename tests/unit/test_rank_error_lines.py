"""An input error found inside a rank of ``sdp train``'s own launcher reaches the launcher as one
line and exit 2, checked without launching ranks (the real launch: tests/distributed/test_rank_input_errors.py).

The rank leaves its ``sdp train: error:`` line in its elastic error file (``TORCHELASTIC_ERROR_FILE``)
instead of printing it; the launcher prints it once and exits with the rank's 2. Before, the launch
exited 1 with ``sdp: worker failed: rank 1 (exit code 2)`` and the elastic agent's lines around it.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from sdp_train.cli import main
from sdp_train.trainer.launch import launch_local
from sdp_train.trainer.rundir import LOCKED_ENV

RANK_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
AGENT = logging.getLogger("torch.distributed.elastic.multiprocessing.api")


@pytest.fixture
def agent_lines():
    """The messages the elastic agent's logger lets through (torch's loggers do not propagate to caplog's)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    AGENT.addHandler(handler)
    yield lines
    AGENT.removeHandler(handler)


def test_a_rank_of_sdp_trains_launcher_leaves_its_input_error_to_the_launcher(monkeypatch, capsys, tmp_path):
    error_file = tmp_path / "error.json"
    for name, value in {**RANK_ENV, LOCKED_ENV: "123", "TORCHELASTIC_ERROR_FILE": str(error_file)}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--workers", "0"]) == 2
    assert capsys.readouterr().err == ""  # the launcher says it, once
    assert json.loads(error_file.read_text())["message"] == "sdp train: error: workers=0 must be an integer >= 1"


def test_a_rank_under_another_launcher_prints_its_input_error(monkeypatch, capsys, tmp_path):
    for name, value in {**RANK_ENV, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(LOCKED_ENV, raising=False)
    assert main(["train", "--workers", "0"]) == 2
    assert capsys.readouterr().err == "sdp train: error: workers=0 must be an integer >= 1\n"


def _failures(tmp_path, exits: dict[int, int], refused: dict[int, str]) -> dict[int, ProcessFailure]:
    failures = {}
    for rank, code in exits.items():
        error_file = tmp_path / f"error{rank}.json"
        if rank in refused:
            error_file.write_text(json.dumps({"message": refused[rank], "timestamp": 0, "sdp_input_error": True}))
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(error_file))
    return failures


@pytest.mark.parametrize(("exits", "refused"), [
    ({0: -15, 1: 2}, {1}),  # the agent stopped rank 0 after rank 1 refused its input
    ({0: 2, 1: 2}, {0, 1}),  # every rank refused (an error they agreed on): said once
    ({0: 2, 1: -15, 2: 2}, {0, 2}),
])
def test_the_launcher_prints_a_ranks_input_error_once_and_exits_2(monkeypatch, capsys, agent_lines, tmp_path, exits,
                                                                    refused):
    line = "sdp train: error: checkpoint file /x/rank1.pt: rng.torch: not a torch RNG state"

    def failed(args):
        for rank, code in exits.items():  # what the agent logs when it stops the group
            if code == -15:
                AGENT.warning("Sending process %s closing signal %s", 100 + rank, "SIGTERM")
        AGENT.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, min(refused), 100, "python")
        raise ChildFailedError("sdp_train.cli", _failures(tmp_path, exits, {r: line for r in refused}))
    monkeypatch.setattr(torch.distributed.run, "run", failed)
    assert launch_local(["train", "--steps", "3"], len(exits)) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert agent_lines == []  # the agent's lines about it are not shown


def test_other_failures_keep_the_agents_failure_line_and_exit_1(monkeypatch, capsys, agent_lines, tmp_path):
    def failed(args):
        AGENT.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -9, 1, 101, "python")
        raise ChildFailedError("sdp_train.cli", _failures(tmp_path, {0: -15, 1: -9}, {}))
    monkeypatch.setattr(torch.distributed.run, "run", failed)
    assert launch_local(["train", "--steps", "3"], 2) == 1
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "sdp: worker failed: rank 1 (exit code -9); stopped by the launcher after it: rank 0"]
    assert agent_lines == ["failed (exitcode: -9) local_rank: 1 (pid: 101) of binary: python"]


def test_an_exit_2_without_the_ranks_line_is_a_worker_failure(monkeypatch, capsys, tmp_path):
    def failed(args):
        raise ChildFailedError("sdp_train.cli", _failures(tmp_path, {0: 2, 1: -15}, {}))
    monkeypatch.setattr(torch.distributed.run, "run", failed)
    assert launch_local(["train", "--steps", "3"], 2) == 1
    assert capsys.readouterr().err.splitlines() == [
        "sdp: worker failed: rank 0 (exit code 2); stopped by the launcher after it: rank 1"]
