"""Making a holder-set group under ``--on-worker-loss continue`` (`sdp_train.parallel.dist.meet_before_groups` with
`Survival.meet_for_group`): a member lost before it came is given up within about a second, as a loss inside a
collective, not after the group's timeout; a slow member is waited for and the group made. One process, a real TCP
store; the lost member's group is a real gloo rendezvous that nobody else joins (where the old code waited)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from masklab import Mask
from sdp_train.parallel.dist import meet_before_groups
from sdp_train.parallel.sync import holder_set_groups
from sdp_train.trainer.agreement import exited_key
from sdp_train.trainer.launch import restart_attempt
from sdp_train.trainer.membership import Survival


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@pytest.fixture(autouse=True)
def no_meeting():
    yield
    meet_before_groups(None)


def _client(store: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))


def _survival(store: dist.TCPStore) -> Survival:
    """Worker 0 of a world of workers 0-2, which meets before every group it makes."""
    survival = Survival(_client(store), 0, [0, 1, 2], Mask([[1, 1], [1, 0], [0, 1]]))
    meet_before_groups(survival.meet_for_group)
    return survival


@pytest.mark.parametrize("loss", ["exited", "agreeing"])
def test_a_member_lost_before_a_new_group_is_given_up_within_a_second_not_at_the_groups_timeout(
        store, monkeypatch, loss):
    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", "8")
    made = []

    def gloo_group(ranks, timeout):  # gloo's rendezvous of rank 0 of the group: worker 1 never comes
        made.append(ranks)
        return dist.ProcessGroupGloo(dist.PrefixStore(f"group{len(made)}", _client(store)), 0, len(ranks), timeout)

    monkeypatch.setattr(dist, "new_group", gloo_group)
    _survival(store)
    outcome: list[BaseException | None] = []

    def make() -> None:
        try:
            holder_set_groups([(0, 1)], 3, singletons=False)
            outcome.append(None)
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=make, daemon=True)
    began = time.monotonic()
    thread.start()
    time.sleep(0.3)
    # the launcher's mark of worker 1's exit; or worker 2 failed elsewhere and began agreeing on the loss
    store.set(exited_key(1) if loss == "exited" else "sdp/loss1/joined2", "1")
    thread.join(timeout=3)
    assert not thread.is_alive(), "still making the group 3 s after the loss was known"
    assert time.monotonic() - began < 2.5
    assert made == [] and len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    reason = "worker 1 exited" if loss == "exited" else "worker 2 began recovering from a lost worker"
    assert str(outcome[0]) == f"gave up making the process group of workers [0, 1]: {reason}"


def test_a_slow_member_is_waited_for_and_each_group_made_once_every_member_came(store, monkeypatch):
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout: made.append((ranks, time.monotonic())) or object())
    survival = _survival(store)
    store.set(exited_key(2), "1")  # a worker outside the group exited: the group is still made

    def slow_worker_1() -> None:
        time.sleep(1.5)
        for made_before in (0, 1):  # worker 1 comes to both groups, in the same order
            store.set(f"sdp/attempt{restart_attempt()}/groups0/{made_before}/1", "1")

    threading.Thread(target=slow_worker_1, daemon=True).start()
    began = time.monotonic()
    groups = holder_set_groups([(1, 2), (0, 1)], 3, singletons=False)
    assert [ranks for ranks, _ in made] == [[0, 1], [1, 2]]  # every rank calls new_group, members or not
    assert made[0][1] - began >= 1.4 and list(groups) == [(0, 1), (1, 2)]  # worker 0 waits for (0, 1) only
    assert survival.groups_met == 2  # members or not, every rank counts every group of the world alike
