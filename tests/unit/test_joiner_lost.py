"""A worker lost while it joins (``--max-rejoins``): which members go on without it and from which state
(`sdp_train.trainer.membership.Survival.admit`, `members_state_kept`), in one process, over a real store
with a run and a world forming that stand in for the real ones. The launch: the first replacement of
tests/distributed/test_worker_loss_rejoin.py dies while its parts are sent and the second one joins."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from masklab import Mask
from masklab.mask import Schedule
from sdp_train.trainer.agreement import (
    MEMBERS_KEY, WorkerLossError, WorldNotFormed, admission_key, exited_key, joining_key,
)
from sdp_train.trainer.membership import Survival, members_state_kept

DESIGNED = Mask([[1, 1, 0], [1, 1, 1], [0, 1, 1]])  # workers 1 and 2 admit worker 0's replacement
RESTORED = np.array([[1, 1, 1], [1, 1, 1]])  # the members' rows after --restore-coverage
STEP = 4
SCHEDULE = Schedule("cyclic", 6)  # under a schedule: step 4 in round 0, where worker 1 alone holds every block


class _Sync:
    moved_bytes = 0
    schedule_rounds = None  # a schedule's position: the members' rows of a round (`Survival.admit`)

    def rounds_to_train(self, steps: int):
        return None

    def close(self) -> None:
        pass


class _Run:
    """What `Survival.admit` asks of the members' run; `admit` (the joiners' parts) fails when `lost_in` says so."""

    def __init__(self, lost_in: str, store=None) -> None:
        self.cfg = SimpleNamespace(local_steps=1, steps=8)
        self.faults = SimpleNamespace(join_at=None, kill_in_recovery=None, kill_in_move=None, kill_move_voted=False,
                                      kill_in_move_step=None)
        self.lost_in, self.steps_applied, self.sync, self.went_on = lost_in, STEP, _Sync(), []
        self.store, self.rounds_entered, self.restores = store, [], []

    def enter_next_round(self) -> None:
        """A change of round a loss left due (a collective): whether the joiner's admission was written then."""
        self.rounds_entered.append(self.store is not None and self.store.check([admission_key(0)]))
        if self.lost_in == "round":
            raise dist.DistBackendError("Connection closed by peer")

    def admit(self, mask, workers, joiners, info, *, welcome_mask=None) -> None:
        if self.lost_in == "welcome":
            raise dist.DistBackendError("Connection closed by peer")

    def to_designed(self, mask, vote=None) -> None:
        """From restored rows to the designed ones: lost while the parts move (``moving``), or once every rank
        answered that it received them (``moved``: the others' answers stand in the store)."""
        if self.lost_in == "moved":
            for w in (2, 0):
                self.store.set(f"sdp/moved4/{STEP}/{w}", "1")
            assert vote.agreed()
        if self.lost_in in ("moving", "moved"):
            raise dist.DistBackendError("Connection closed by peer")

    def continue_with(self, mask, rows, info, vote=None, *, restore=None) -> None:
        self.went_on.append((mask.matrix.tolist(), list(rows), info.world_size))
        self.restores.append(restore)
        self.sync = _Sync()


@pytest.fixture(scope="module")
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


# (where the joiner is lost, rows restored, scheduled) -> whether the members go on: written out, not derived.
# "welcome": while the members send its parts; "moving", "moved": then, while every rank goes from the members'
# restored rows to their designed ones, before or after every rank answered that it received the move.
MEMBERS_GO_ON = {
    ("forming", False, False): True, ("forming", True, False): True, ("welcome", False, False): True,
    ("welcome", True, False): True,  # sending changes nothing of a member's (before 2026-12-08: False)
    ("moving", True, False): True,  # all or nothing: undone on every rank (before 2026-12-08: False)
    ("moved", True, False): False,  # every rank received the move: a member may have dropped parts
    # under a schedule the same: a change of round a loss left due is made before the admission
    ("forming", False, True): True, ("forming", True, True): True,  # (before 2026-12-08: all False)
    ("welcome", False, True): True, ("welcome", True, True): True,
    ("moving", True, True): True,  # the schedule's mover makes it all or nothing too (before 2026-12-08: False)
    ("moved", True, True): False,
}


@pytest.mark.parametrize("member_lost", [False, True])
@pytest.mark.parametrize(("lost_in", "restored", "scheduled"), list(MEMBERS_GO_ON))
def test_members_go_on_with_their_rows_exactly_when_a_joiner_is_lost_before_their_state_changes(
        server, lost_in, restored, scheduled, member_lost):
    """Worker 0's replacement is lost before the new world forms, while the members send its parts or while
    the members go from restored rows to their designed ones (with worker 2, a member, lost too or not). The
    members go on, re-formed among themselves a generation later, with the rows in force and every member's
    rank kept, or without worker 2 as after any loss, exactly when their state is still theirs: not after
    every rank received the move from restored rows (static masks: all or nothing, `MoveVote`), nor in a
    schedule's move from them (under a schedule the round's rows in force; restored ones are the members'
    again, `restore`). Else every member stops in one line, as before. Either way the admission is taken
    back from the launcher's view only when they go on (`MEMBERS_KEY` without the joiner again)."""
    prefix = f"t{lost_in}{restored}{scheduled}{member_lost}/"
    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", server.port, is_master=False))
    designed = Mask(DESIGNED.matrix, schedule=SCHEDULE if scheduled else None)
    rows = RESTORED if restored else designed.round_matrix(STEP)[[1, 2]]
    restore = {"coverage": 2} if restored and scheduled else None  # a schedule's rounds restored for the members
    survival = Survival(store, 1, (1, 2), Mask(rows), designed=designed, restore=restore)
    survival.generation = 3
    formed = []

    def form_world(info, device, workers) -> None:
        formed.append((survival.generation, tuple(workers)))
        if len(formed) == 1 and lost_in == "forming":
            raise WorldNotFormed("worker(s) [0] exited before the world of generation 4 formed")

    survival._form_world = form_world
    store.set(joining_key(0), "1")
    store.set(exited_key(2) if member_lost else "sdp/loss5/joined2", str(STEP))  # worker 2's side of the agreement
    run = _Run(lost_in, store)
    if scheduled:  # the members' rows of the round in force (restored for the survivors, or the designed ones)
        run.sync.schedule_rounds = SimpleNamespace(round_matrix=lambda step: rows)
    keeps = MEMBERS_GO_ON[lost_in, restored, scheduled]
    assert (members_state_kept(Mask(designed.round_matrix(STEP)[[1, 2, 0]]), Mask(np.vstack([rows, [[1, 1, 0]]])),
                               2, moving=lost_in in ("moving", "moved"), voted=restored,
                               moved=True if lost_in == "moved" else None) is None) == keeps
    if not keeps:
        with pytest.raises(WorkerLossError) as raised:
            survival.admit(run, STEP, torch.device("cpu"))
        assert "\n" not in str(raised.value) and str(raised.value).startswith(f"step {STEP}: admitting worker(s) [0]")
        assert run.went_on == [] and store.get(MEMBERS_KEY).decode() == "1,2,0"
        assert json.loads(store.get(admission_key(0)))["rows"] == rows.tolist()  # the joiner's welcome rows
        return
    change = survival.admit(run, STEP, torch.device("cpu"))
    if lost_in == "moving":  # this member answered that it did not receive the move
        assert store.get(f"sdp/moved4/{STEP}/1") == b"0" and survival.move is None
    assert formed == [(4, (1, 2, 0)), (5, (1,) if member_lost else (1, 2))]
    assert not store.check([admission_key(0)]) and not store.check([joining_key(0)])
    if member_lost:  # a loss as usual: worker 1 alone, which holds every block
        assert (change.step, change.lost, change.workers, change.joined) == (STEP, (2,), (1,), ())
        assert run.went_on == [(rows[[0]].tolist(), [0], 1)] and store.get(MEMBERS_KEY).decode() == "1"
    else:
        assert change is None and survival.changes == []
        assert run.went_on == [(rows.tolist(), [0, 1], 2)] and store.get(MEMBERS_KEY).decode() == "1,2"
        assert run.restores == [restore]  # the new world's position has no restore: the members' comes back
    assert run.rounds_entered == ([False] if scheduled else [])  # the round's change came before the admission
    assert survival.workers == change.workers if member_lost else survival.workers == (1, 2)
    assert survival.mask.matrix.tolist() == (rows[[0]] if member_lost else rows).tolist()


@pytest.mark.parametrize("member_lost", [False, True])
def test_a_member_lost_in_a_change_of_round_a_loss_left_due_is_a_loss_before_any_admission(server, member_lost):
    """Under a schedule the members first make a change of round that a loss left due, in their own world,
    before anything of the admission is written. Worker 2 lost during it: worker 1 recovers as after any
    loss (generation 4, alone, with its row) and admits nobody at this boundary; worker 0's replacement
    still waits, with no admission of its own. No member lost: the admission follows. Before 2026-12-08 the
    change was made inside the admission, and a member lost there stopped every member."""
    store = dist.PrefixStore(f"round{member_lost}/", dist.TCPStore("127.0.0.1", server.port, is_master=False))
    designed = Mask(DESIGNED.matrix, schedule=SCHEDULE)
    rows = designed.round_matrix(STEP)[[1, 2]]
    survival = Survival(store, 1, (1, 2), Mask(rows), designed=designed)
    survival.generation = 3
    formed = []
    survival._form_world = lambda info, device, workers: formed.append((survival.generation, tuple(workers)))
    store.set(joining_key(0), "1")
    store.set(MEMBERS_KEY, "1,2")
    if member_lost:
        store.set(exited_key(2), "1")
    run = _Run("round" if member_lost else "nowhere", store)
    run.sync.schedule_rounds = SimpleNamespace(round_matrix=lambda step: rows)
    change = survival.admit(run, STEP, torch.device("cpu"))
    assert run.rounds_entered == [False]  # no admission written before the change
    if not member_lost:
        assert change.joined == (0,) and formed == [(4, (1, 2, 0))]
        return
    assert (change.step, change.lost, change.workers, change.joined) == (STEP, (2,), (1,), ())
    assert formed == [(4, (1,))] and run.went_on == [(rows[[0]].tolist(), [0], 1)]
    assert survival.workers == (1,) and survival.changes == [change] and store.get(MEMBERS_KEY).decode() == "1"
    assert not store.check([admission_key(0)]) and store.check([joining_key(0)])  # it waits for a later boundary


def test_the_admission_members_write_names_the_joiners_members_of_the_launcher_first(server):
    """While the admission runs the joiner is a member for the launcher (`MEMBERS_KEY`), so that one it loses
    then is replaced only once the members went on without it, not while they still count on it."""
    store = dist.PrefixStore("order/", dist.TCPStore("127.0.0.1", server.port, is_master=False))
    survival = Survival(store, 1, (1, 2), Mask(DESIGNED.matrix[[1, 2]]), designed=DESIGNED)
    seen = []

    def form_world(info, device, workers) -> None:
        seen.append((store.get(MEMBERS_KEY).decode(), json.loads(store.get(admission_key(0)))["workers"]))

    survival._form_world = form_world
    store.set(joining_key(0), "1")
    store.set(MEMBERS_KEY, "1,2")
    change = survival.admit(_Run("nowhere"), STEP, torch.device("cpu"))
    assert seen == [("1,2,0", [1, 2, 0])] and change.joined == (0,)


@pytest.mark.parametrize("scheduled", [False, True])
def test_the_move_back_from_restored_rows_is_voted_by_members_and_joiners(server, scheduled):
    """`welcome_vote`: every rank of the new world (the joiner too, `train_prepared`) answers whether it received
    the move from the welcome mask to the designed rows where they differ (under a schedule too, the schedule's
    mover making it); none where they are the same. `move_given_up` answers that this rank did not, once,
    where it had not answered, so that the others stop waiting (a rank that answered keeps its answer)."""
    store = dist.PrefixStore(f"vote{scheduled}/", dist.TCPStore("127.0.0.1", server.port, is_master=False))
    designed = Mask(DESIGNED.matrix, schedule=SCHEDULE if scheduled else None)
    joiner = Survival(store, 0, (1, 2, 0), Mask(DESIGNED.matrix[[1, 2, 0]]), designed=designed)
    joiner.generation = 4
    run = _Run("nowhere", store)
    mask, welcome = Mask(DESIGNED.matrix[[1, 2, 0]]), Mask(np.vstack([RESTORED, [[1, 1, 0]]]))
    assert joiner.welcome_vote(run, STEP, (1, 2, 0), mask, mask) is None
    assert joiner.welcome_vote(run, STEP, (1, 2, 0), welcome, mask) is not None
    joiner.move_given_up()
    assert store.get(f"sdp/moved4/{STEP}/0") == b"0" and joiner.move is None
    joiner.move_given_up()  # nothing under way: nothing answered
    vote = joiner.welcome_vote(run, STEP + 1, (1, 2, 0), welcome, mask)
    for w in (1, 2):
        store.set(f"sdp/moved4/{STEP + 1}/{w}", "1")
    assert vote.agreed() and joiner.moved
    joiner.move_given_up()
    assert store.get(f"sdp/moved4/{STEP + 1}/0") == b"1"


def test_the_test_faults_admit_at_several_steps_and_kill_the_joiner_of_one_and_refuse_other_text():
    from sdp_train.trainer.faults import InjectedFaults

    faults = InjectedFaults.from_environment({"SDP_TEST_JOIN_AT_STEP": "4,5", "SDP_TEST_KILL_JOINER": "4"}, attempt=0)
    assert (faults.join_at, faults.kill_joiner) == ((4, 5), 4)
    assert InjectedFaults.from_environment({"SDP_TEST_JOIN_AT_STEP": "4"}, attempt=0).join_at == (4,)
    assert InjectedFaults.from_environment({"SDP_TEST_KILL_JOINER": "4"}, attempt=1).kill_joiner is None
    moves = InjectedFaults.from_environment({"SDP_TEST_KILL_IN_MOVE": "0:4"}, attempt=0)
    assert (moves.kill_in_move, moves.kill_in_move_step) == (0, 4)
    assert InjectedFaults.from_environment({"SDP_TEST_KILL_IN_MOVE": "2"}, attempt=0).kill_in_move_step is None
    with pytest.raises(ValueError, match="^SDP_TEST_KILL_IN_MOVE='0:x' must be W, W:voted or W:S"):
        InjectedFaults.from_environment({"SDP_TEST_KILL_IN_MOVE": "0:x"}, attempt=0)
    for variable, value in (("SDP_TEST_JOIN_AT_STEP", "4,"), ("SDP_TEST_JOIN_AT_STEP", "4;5"),
                            ("SDP_TEST_KILL_JOINER", "4,5"), ("SDP_TEST_KILL_JOINER", "")):
        with pytest.raises(ValueError, match=f"^{variable}={value!r} must be "):
            InjectedFaults.from_environment({variable: value}, attempt=0)
