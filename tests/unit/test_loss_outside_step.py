"""A worker lost outside a training step (``--on-worker-loss continue``): the survivors' failed collective
in an evaluation, a checkpoint or the final save stops the run in one line (`Survival.losses_stop`), not a
traceback; a failure with no worker lost goes through as it is."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from masklab import Mask
from sdp_train.trainer.agreement import WorkerLossError, exited_key
from sdp_train.trainer.membership import Survival

MASK = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])


def _survival(store: dist.Store) -> Survival:
    return Survival(store, 1, [0, 1, 2], MASK)


def test_a_collective_failed_by_a_lost_worker_outside_a_step_stops_in_one_line():
    store = dist.HashStore()
    store.set(exited_key(2), "-9")
    with pytest.raises(WorkerLossError, match=r"^lost worker\(s\) \[2\] while checkpointing: --on-worker-loss "
                                              r"continue survives a loss inside a training step only; restart ") as got:
        with _survival(store).losses_stop("checkpointing"):
            raise RuntimeError("Connection reset by peer")
    assert not got.value.report  # worker 0 survives and says it, once
    store.set(exited_key(0), "-9")
    with pytest.raises(WorkerLossError, match=r"^lost worker\(s\) \[0, 2\] while") as got:
        with _survival(store).losses_stop("checkpointing"):
            raise RuntimeError("Connection reset by peer")
    assert got.value.report


def test_a_failure_with_no_worker_lost_goes_through_as_it_is():
    with pytest.raises(RuntimeError, match="^a bug$"):
        with _survival(dist.HashStore()).losses_stop("checkpointing", mark_wait=0.1):
            raise RuntimeError("a bug")
    with pytest.raises(ValueError):  # not a collective's failure: never read as a loss
        store = dist.HashStore()
        store.set(exited_key(0), "-9")
        with _survival(store).losses_stop("checkpointing"):
            raise ValueError("bad input")
    with _survival(dist.HashStore()).losses_stop("checkpointing"):
        pass


def test_a_recovery_releases_what_the_failed_collectives_frames_held():
    """`release_frames` (called first by `Survival.recover`): the failed collective's work, here a stand-in
    watched by a weak reference, is no longer held by the error's frames, nor by those of the error it
    chains (a gloo work keeps its context's connections open, and a peer reading one waits out the
    collective timeout)."""
    import gc
    import weakref

    from sdp_train.trainer.agreement import release_frames

    class Work:
        pass

    refs = []

    def collective():
        work = Work()
        refs.append(weakref.ref(work))
        raise RuntimeError("Connection reset by peer")

    def step():
        try:
            collective()
        except RuntimeError:
            collective()  # a second failure while handling the first: its __context__

    try:
        step()
    except RuntimeError as exc:
        error = exc
    gc.collect()
    assert all(ref() is not None for ref in refs)  # held by the frames until released
    release_frames(error)
    gc.collect()
    assert all(ref() is None for ref in refs)
