"""How a launch under ``--on-worker-loss continue`` ends when a rank goes at the very end of the run
(RELIABILITY.md, "Random kills"): a rank killed after it finished its part (its last collective behind
it, summary.json written) does not fail the launch, and a replacement started as the run ended stops
with a note, not an error line. One process each: the launcher's ranks are stand-ins that exit as a
killed rank does, and the replacement is `train` itself, reading the launcher's real TCP store."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from sdp_train.trainer import survivor_launcher
from sdp_train.trainer.agreement import MEMBERS_KEY, STEPS_DONE_KEY, exited_key, finished_key


class _Rank:
    """A rank's process as the launcher starts it (`subprocess.Popen`'s surface that it uses): it reaches the
    launcher's store like a rank, marks itself finished where `finished` says, and exits with `codes`'s code."""

    def __init__(self, codes: dict[int, int], finished: set[int], argv, env) -> None:
        rank = int(env["RANK"])
        if rank in finished:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=10))
            store.set(finished_key(rank), "1")
        self.returncode = codes[rank]

    def poll(self) -> int:
        return self.returncode

    def wait(self) -> int:
        return self.returncode


def _launch(monkeypatch, codes: dict[int, int], finished: set[int]) -> int:
    monkeypatch.setattr(survivor_launcher.subprocess, "Popen", lambda argv, env: _Rank(codes, finished, argv, env))
    return survivor_launcher.launch_keeping_survivors(["train"], 3)


def test_a_rank_killed_after_it_finished_its_part_ends_the_launch_with_exit_0_and_a_note(monkeypatch, capsys):
    assert _launch(monkeypatch, {0: 0, 1: 0, 2: -9}, {0, 1, 2}) == 0
    assert capsys.readouterr().err.splitlines() == [
        "sdp: note: rank 2 (exit code -9) ended after it had finished its part of the run, which is complete"]


def test_a_rank_killed_before_it_finished_still_fails_the_launch(monkeypatch, capsys):
    assert _launch(monkeypatch, {0: 0, 1: 0, 2: -9}, {0, 1}) == 1
    assert capsys.readouterr().err.splitlines() == ["sdp: worker failed: rank 2 (exit code -9)"]


def test_the_outcome_counts_the_last_membership_only():
    store = dist.HashStore()
    store.set(MEMBERS_KEY, "1,2")
    store.set(finished_key(2), "1")
    assert survivor_launcher.launch_outcome(store, {0: -9, 1: 0, 2: -9}, 3) == (0, [
        "sdp: note: rank 2 (exit code -9) ended after it had finished its part of the run, which is complete",
        "sdp: lost rank 0 (exit code -9); ranks 1, 2 finished the run"])
    assert survivor_launcher.launch_outcome(store, {0: 0, 1: 1, 2: 0}, 3) == (
        1, ["sdp: worker failed: rank 1 (exit code 1); lost before: rank 0 (exit code 0)"])
    store.set(MEMBERS_KEY, "2")
    assert survivor_launcher.launch_outcome(store, {0: -9, 1: -9, 2: 0}, 3) == (0, [
        "sdp: lost rank 0 (exit code -9), rank 1 (exit code -9); rank 2 finished the run"])


@pytest.mark.parametrize("ended", ["members exited", "steps done"])
def test_a_replacement_that_starts_after_the_run_ended_stops_with_a_note_not_an_error(ended, tmp_path, monkeypatch,
                                                                                     capsys):
    """`train` as worker 0's replacement (``SDP_JOINS=1``) finds every member exited, or the members past their
    last step (`STEPS_DONE_KEY`): it returns, printing a note (the launch exits 0), no error line."""
    from sdp_train.trainer.agreement import JOIN_ENV
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.launch import LAUNCHER_ENV
    from sdp_train.trainer.train import train

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set(MEMBERS_KEY, "1,2")
    if ended == "members exited":
        store.set(exited_key(1), "0")
        store.set(exited_key(2), "0")
    else:
        store.set(STEPS_DONE_KEY, "1")
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), LAUNCHER_ENV: "1",
                        JOIN_ENV: "1", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    cfg = TrainConfig.from_dict({"model": "llama-debug", "mode": "bsdp", "workers": 3, "active": 0.67, "steps": 2,
                                 "batch_size": 2, "seq_len": 16, "max_data_bytes": 100000,
                                 "on_worker_loss": "continue", "max_rejoins": 1, "out": str(tmp_path / "run")})
    assert train(cfg) is None
    err = capsys.readouterr().err
    assert "error" not in err
    assert err.splitlines() == ["sdp train: note: worker 0: the run ended before it could rejoin; this replacement "
                                "has nothing to do"]


class _Process:
    """A rank's process for `_wait_all`: running for `polls` polls, then ended with `code`."""

    def __init__(self, code: int, polls: int = 0) -> None:
        self.code, self.polls, self.returncode = code, polls, None

    def poll(self) -> int | None:
        self.polls -= 1
        if self.polls < 0:
            self.returncode = self.code
        return self.returncode


def test_a_replacement_that_never_joined_leaves_the_loss_its_code_in_the_last_line(capsys):
    store = dist.HashStore()
    store.set(MEMBERS_KEY, "1,2")  # the survivors left rank 0 out; its replacement then found nothing to do
    procs = {0: _Process(-9), 1: _Process(0, polls=40), 2: _Process(0, polls=40)}
    codes = survivor_launcher._wait_all(procs, store, lambda rank: _Process(0), 1)
    assert codes == [-9, 0, 0], codes  # not the replacement's 0: the run lost rank 0 (SIGKILL)
    assert survivor_launcher.launch_outcome(store, dict(enumerate(codes)), 3)[1] == [
        "sdp: lost rank 0 (exit code -9); ranks 1, 2 finished the run"]
    assert "starting a replacement" in capsys.readouterr().err
