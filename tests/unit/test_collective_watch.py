"""`sdp_train.parallel.dist.wait` with a `watch_waits` check: a gloo collective that has not completed is
given up when the check says so (a survivor blocked on a peer that failed out of the collective
without closing its connections), completes normally when its peers come, and reports its own error
when it fails; without a check, or on CUDA, it is one plain ``Work.wait()``. And
`Survival.loss_begun`, the trainer's check: another member began agreeing on a loss. That gloo's
``Work.wait(timeout)`` raises without aborting the collective, which completes later with the right
values, was checked by hand with two ranks (docs/design.md §7); two gloo groups built by two threads of
one process can deadlock in their rendezvous, so this module does not build them."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sdp_train.parallel import dist as sdp_dist
from sdp_train.parallel.dist import wait, watch_waits


@pytest.fixture(autouse=True)
def no_watch():
    yield
    watch_waits(None)


class _Work:
    """A collective that completes after `slices` timed-out waits (never: None), or fails (`error`)."""

    def __init__(self, slices: int | None, error: str | None = None) -> None:
        self.slices, self.error, self.waits = slices, error, []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.error is not None:
            raise RuntimeError(self.error)
        if timeout is None or (self.slices is not None and len(self.waits) > self.slices):
            return True
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.error is not None


def test_without_a_check_or_on_cuda_a_wait_is_one_plain_wait():
    work = _Work(slices=None)
    wait(work, torch.device("cpu"))
    watch_waits(lambda: "lost")
    wait(work, torch.device("cuda", 0))
    assert work.waits == [None, None]


def test_a_watched_wait_gives_up_when_the_check_says_so_and_not_before():
    answers = iter([None, None, "worker 2 began recovering"])
    watch_waits(lambda: next(answers))
    work = _Work(slices=None)
    with pytest.raises(RuntimeError, match="gave up waiting for a collective: worker 2 began recovering"):
        wait(work, torch.device("cpu"))
    assert work.waits == [sdp_dist.WATCH_EVERY] * 3


def test_a_watched_wait_returns_when_the_collective_completes_and_reraises_its_own_error():
    calls = []
    watch_waits(lambda: calls.append(1))
    wait(_Work(slices=2), torch.device("cpu"))
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        wait(_Work(slices=None, error="Connection reset by peer"), torch.device("cpu"))
    assert len(calls) == 2


def test_survival_says_a_loss_began_when_another_member_joins_the_next_agreement():
    from masklab import Mask
    from sdp_train.trainer.membership import Survival

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    survival = Survival(store, 1, [0, 1, 2], Mask([[1, 1], [1, 0], [0, 1]]))
    assert survival.loss_begun() is None
    store.set("sdp/loss1/joined1", "3")  # its own key does not count
    assert survival.loss_begun() is None
    store.set("sdp/loss1/joined2", "3")
    assert survival.loss_begun() == "worker 2 began recovering from a lost worker"
    survival.generation = 1  # that loss is over: the next one has not begun
    assert survival.loss_begun() is None


def test_the_state_moves_of_a_mask_change_or_an_admission_are_watched_waits(monkeypatch):
    """`broadcast_packed` (a schedule's change, a restore's or a joiner's parts) waits on its broadcasts
    through `wait`, so a survivor blocked there gives up when another member began agreeing on a loss."""
    from sdp_train.parallel import schedule
    from sdp_train.parallel.wire import ByteCount

    launched = []
    monkeypatch.setattr(schedule.dist, "broadcast",
                        lambda buffer, src, async_op=False: launched.append(async_op) or _Work(slices=None))
    monkeypatch.setattr(schedule.dist, "get_world_size", lambda: 2)
    watch_waits(lambda: "worker 1 began recovering")
    with pytest.raises(RuntimeError, match="gave up waiting for a collective: worker 1 began recovering"):
        schedule.broadcast_packed([(1, [0], (2, 3), torch.float32, "w")], read=lambda key: torch.zeros(2, 3),
                                  write=lambda key, value: None, rank=0, device=torch.device("cpu"),
                                  counter=ByteCount())
    assert launched == [True]
