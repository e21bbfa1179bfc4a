"""Forming the world of a new membership (`sdp_train.trainer.agreement.gather`): a worker that died during
the recovery fails the forming as soon as the launcher marks its exit, and one that gave the world up (it
began the next agreement) as soon as it did, not after the collective timeout.
The launch: tests/distributed/test_worker_loss_recovery.py."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.trainer.agreement import WorldNotFormed, exited_key, gather

LONG = timedelta(seconds=60)  # never reached where a worker has an exit mark or every worker came


@settings(deadline=None, max_examples=40)
@given(workers=st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.sampled_from(
    ["came", "exited", "both"]), min_size=k - 1, max_size=k - 1))), generation=st.integers(1, 4))
def test_forming_goes_on_when_every_worker_came_and_fails_at_once_naming_the_exited_ones(workers, generation):
    k, states = workers
    store = dist.HashStore()
    others = list(range(1, k))
    for w, state in zip(others, states):
        if state in ("came", "both"):
            store.set(f"sdp/form{generation}/came{w}", "1")
        if state in ("exited", "both"):  # "both": it came, then exited; the rendezvous fails on it later
            store.set(exited_key(w), "-9")
    exited_absent = [w for w, state in zip(others, states) if state == "exited"]
    began = time.monotonic()
    if exited_absent:
        message = f"worker(s) {exited_absent} exited before the world of generation {generation} formed"
        with pytest.raises(WorldNotFormed, match=f"^{re.escape(message)}$"):
            gather(store, generation, 0, range(k), timeout=LONG)
    else:
        gather(store, generation, 0, range(k), timeout=LONG)
    assert time.monotonic() - began < LONG.total_seconds() / 2  # neither waited for the timeout
    assert store.check([f"sdp/form{generation}/came0"])  # this worker came, for the others to see


def test_a_worker_that_neither_came_nor_exited_fails_the_forming_at_the_timeout():
    store = dist.HashStore()
    store.set("sdp/form1/came2", "1")
    with pytest.raises(WorldNotFormed, match=r"^worker\(s\) \[1\] did not come to form the world of generation 1 "
                                             r"within 0.2 s$"):
        gather(store, 1, 0, [0, 1, 2], timeout=timedelta(seconds=0.2))


def test_a_generation_sees_only_its_own_arrivals():
    store = dist.HashStore()
    store.set("sdp/form1/came1", "1")  # worker 1 came to generation 1's world, not to generation 2's
    with pytest.raises(WorldNotFormed, match="did not come"):
        gather(store, 2, 0, [0, 1], timeout=timedelta(seconds=0.1))


@settings(deadline=None, max_examples=30)
@given(k=st.integers(2, 5), generation=st.integers(1, 4), data=st.data())
def test_forming_fails_at_once_naming_a_worker_that_began_the_next_agreement(k, generation, data):
    """A worker that gave the world up (it agrees again, a generation later: its own forming failed, or a
    member's admission of a joiner) fails the forming of every other one that waits for an absent worker;
    an earlier agreement (its own generation's, which led to this world) does not."""
    store = dist.HashStore()
    left = data.draw(st.lists(st.integers(1, k - 1), min_size=1, unique=True), label="left")
    for w in left:
        store.set(f"sdp/loss{generation}/joined{w}", "4")  # the agreement that formed this world
    absent = data.draw(st.integers(1, k - 1), label="absent")
    with pytest.raises(WorldNotFormed, match="did not come"):
        gather(store, generation, 0, range(k), timeout=timedelta(seconds=0.05))
    for w in left:
        store.set(f"sdp/loss{generation + 1}/joined{w}", "4")
        if w != absent:
            store.set(f"sdp/form{generation}/came{w}", "1")  # it came, then gave up
    began = time.monotonic()
    message = f"worker(s) {sorted(left)} gave up the world of generation {generation} before it formed"
    with pytest.raises(WorldNotFormed, match=f"^{re.escape(message)}$"):
        gather(store, generation, 0, range(k), timeout=LONG)
    assert time.monotonic() - began < LONG.total_seconds() / 2
