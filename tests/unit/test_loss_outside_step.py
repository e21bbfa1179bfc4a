"""A worker lost outside a training step (``--on-worker-loss continue``), in one process: survivors caught at
different points of a step's close meet at the furthest (one behind an evaluation takes its result from one
ahead, through a real TCP store), others stop in one line; a checkpoint whose write a loss interrupted never
passes for complete, and the one the survivors write again records them and is refused by ``--resume`` in one
line; the test hooks that kill or hold a rank there read their variables strictly. The launch (a worker killed
while the survivors of a first loss evaluate) is tests/distributed/test_worker_loss_applied.py's Bb-SDP run."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from masklab import Mask
from sdp_train.data import build_batches
from sdp_train.errors import ConfigError
from sdp_train.parallel.dist import DistInfo
from sdp_train.trainer.agreement import WorkerLossError, exited_key
from sdp_train.trainer.checkpoint import (MANIFEST, check_resumable, checkpoint_problem, latest_valid_checkpoint,
                                         save_checkpoint)
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.faults import InjectedFaults
from sdp_train.trainer.membership import Point, Survival, meeting
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run

MASK = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])


def _agree_at(store, points: dict, monkeypatch, evaluations: dict | None = None):
    """Workers 1 and 2 survive worker 0 (its exit marked), each at its point and with the evaluation it holds
    (`evaluations`), agreeing in threads on a real TCP store (no world forms: `_form_world` is a no-op). Returns
    each worker's survival, or the error it raised."""
    monkeypatch.setattr(Survival, "_form_world", lambda self, info, device, workers: None)
    store.set(exited_key(0), "-9")
    run = SimpleNamespace(steps_applied=4, faults=InjectedFaults())
    got: dict[int, object] = {}

    def survive(worker: int, point: Point) -> None:
        survival = Survival(store, worker, [0, 1, 2], MASK)
        survival.where = point
        survival.evaluation = (evaluations or {}).get(worker)
        try:
            survival._agree_and_form(run, 4, RuntimeError("Connection reset by peer"), torch.device("cpu"), None)
            got[worker] = survival
        except WorkerLossError as exc:
            got[worker] = exc

    threads = [threading.Thread(target=survive, args=(w, p)) for w, p in points.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return got


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_survivors_at_different_steps_stop_in_one_line(monkeypatch):
    """Workers 1 and 2 survive worker 0, one in the evaluation after step 4, the other in step 5 (a step further):
    no survivor can undo a step, so each stops (`WorkerLossError`), worker 1 saying why, before any world forms."""
    errors = _agree_at(_store(), {1: Point(4, "evaluating"), 2: Point(5, "step")}, monkeypatch,
                       {2: (4, [2.5, None, None])})
    assert sorted(errors) == [1, 2] and all(isinstance(e, WorkerLossError) for e in errors.values())
    assert [w for w, e in errors.items() if e.report] == [1]
    assert str(errors[1]) == ("the survivors [1, 2] of a worker loss were at different points of the run (worker 1: "
                              "evaluating after step 4; worker 2: step 5): they cannot go on together; restart from "
                              "a checkpoint (--resume)")


@pytest.mark.parametrize("ahead", [Point(4, "step"), Point(4, "checkpointing")])
def test_a_survivor_behind_an_evaluation_takes_its_result_from_one_ahead(monkeypatch, ahead):
    """Worker 1 was still waiting for the evaluation after step 4 (rank 0's broadcast had not reached it) when worker
    2, which had its result, was in step 4 or writing the checkpoint after step 4: both agree from the store alone
    that worker 1 takes worker 2's result (every value, bit for bit) and goes on to where worker 2 is; worker 2
    does its work again."""
    values = [2.0625000000000004, 0.25, 1e-7]
    got = _agree_at(_store(), {1: Point(4, "evaluating"), 2: ahead}, monkeypatch, {2: (4, values)})
    assert all(isinstance(s, Survival) for s in got.values()), got
    assert got[1].going_to == ahead and got[1].taken == tuple(values) and got[2].going_to is None
    assert got[1].skip(Point(4, "evaluating")) == tuple(values)
    if ahead.phase == "step":  # the checkpoint after step 4 (if any) was complete: worker 2 was past it
        assert got[1].skip(Point(4, "checkpointing")) is None
    assert not got[1].skips(ahead) and got[1].going_to is None  # there: it does that work with the others


def test_a_survivor_behind_a_checkpoint_goes_on_to_the_final_save(monkeypatch):
    """Worker 1 waited in the checkpoint after the last step (its last barrier) while worker 2, past it (so every
    rank had written its file and rank 0 the manifest), saved the final model: worker 1 skips the checkpoint."""
    got = _agree_at(_store(), {1: Point(4, "checkpointing"), 2: Point(4, "saving the final model")}, monkeypatch)
    assert got[1].going_to == Point(4, "saving the final model") and got[1].skips(Point(4, "checkpointing"))


@pytest.mark.parametrize(("points", "evaluations"), [
    ({1: Point(4, "evaluating"), 2: Point(4, "step")}, {}),  # nobody has the result
    ({1: Point(4, "evaluating"), 2: Point(4, "step")}, {2: (2, [1.0, None, None])}),  # an older one
    ({1: Point(4, "evaluating"), 2: Point(4, "boundary")}, {2: (4, [1.0, None, None])}),  # admitting, restoring
    ({1: Point(4, "step"), 2: Point(4, "saving the final model")}, {}),  # a step cannot be skipped
])
def test_points_the_survivors_cannot_meet_at_stop(points, evaluations):
    assert meeting(points, evaluations) is None


def test_the_meeting_is_the_furthest_point_and_the_lowest_workers_result():
    points = {1: Point(4, "evaluating"), 2: Point(4, "step"), 3: Point(4, "step")}
    assert meeting(points, {3: (4, [1.0, None, None]), 2: (4, [1.0, None, None])}) == (Point(4, "step"),
                                                                                          (1.0, None, None), 2)
    assert meeting({1: Point(4, "step"), 2: Point(4, "boundary")}, {}) == (Point(4, "step"), None, None)
    assert str(Point(4, "boundary")) == str(Point(4, "step")) == "step 4"
    assert str(Point(6, "saving the final model")) == "saving the final model after step 6"
    assert Point.from_json(Point(4, "checkpointing").to_json()) == Point(4, "checkpointing")


TINY = {"model": "llama-debug", "model_overrides": {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64},
        "mode": "ddp", "workers": 3, "steps": 8, "batch_size": 2, "seq_len": 16, "max_data_bytes": 20_000,
        "warmup_steps": 1, "memory_steps": 0, "eval_batches": 1, "checkpoint_every": 2}


def _survivor_run(tmp_path: Path):
    """Rank 0 of a world of 1 in a run of 3 workers (what is left after losing 2; DDP, whose one rank holds the
    model), with its batches."""
    prep = prepare(TrainConfig(**{**TINY, "out": str(tmp_path)}))
    return Run(prep, DistInfo(0, 1, 0), torch.device("cpu")), build_batches(prep.data, split="train", seed=0, rank=0,
                                                                            world_size=1), prep


def test_a_checkpoint_a_loss_interrupted_is_never_complete_and_the_survivors_one_is_refused_in_one_line(tmp_path):
    run, batches, prep = _survivor_run(tmp_path)
    root = tmp_path / "checkpoints"

    def lost() -> None:  # the collective after this rank's file fails: a worker was lost
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError):
        save_checkpoint(run, batches, 4, root, workers=[0, 1, 2], after_write=lost)
    assert (root / "step_4" / "rank0.pt").is_file() and not (root / "step_4" / MANIFEST).exists()
    assert checkpoint_problem(root / "step_4") == f"it has no {MANIFEST}, so its write was interrupted"
    assert latest_valid_checkpoint(root, warn=False) is None

    # what the larger world left there, then the survivor writes step_4 again, as rank 0 of its world
    for name in ("rank1.pt", "rank2.pt", ".rank2.pt.tmp1234"):
        (root / "step_4" / name).write_bytes(b"partial")
    save_checkpoint(run, batches, 4, root, workers=[2])
    assert sorted(p.name for p in (root / "step_4").iterdir()) == [MANIFEST, "rank0.pt"]
    manifest = _manifest(root / "step_4")
    assert manifest["workers"] == [2] and manifest["identity"]["world_size"] == 1
    assert checkpoint_problem(root / "step_4") is None
    message = (f"cannot resume from {root / 'step_4'}: it was written by workers [2] (in rank order) of the run's 3 "
               "after a worker loss or rejoin (--on-worker-loss continue); resuming from it is not built: resume "
               "from a checkpoint written before the change")
    with pytest.raises(ConfigError) as got:
        check_resumable(root / "step_4", prep.config, prep.model_config, prep.mask)
    assert str(got.value) == message
    with pytest.raises(ConfigError) as got:  # `--resume DIR` takes the newest complete one, and says so
        prepare(TrainConfig(**{**TINY, "out": str(tmp_path / "again"), "resume": str(root)}))
    assert str(got.value) == message


def _manifest(path: Path) -> dict:
    import json

    return json.loads((path / MANIFEST).read_text())


@pytest.mark.parametrize("value", ["eval:4:2", "evaluating:4", "evaluating:a:2", "evaluating:4:2:1", "saving::"])
def test_the_kill_hook_outside_a_step_refuses_a_malformed_value_in_one_line(value):
    with pytest.raises(ValueError) as got:
        InjectedFaults.from_environment({"SDP_TEST_KILL_OUTSIDE": value}, attempt=0)
    assert str(got.value) == (f"SDP_TEST_KILL_OUTSIDE={value!r} must be POINT:STEPS:WORKER, POINT one of evaluating, "
                              "checkpointing, saving, finished, STEPS and WORKER integers >= 0")
    assert InjectedFaults.from_environment({"SDP_TEST_KILL_OUTSIDE": "checkpointing:4:2"}, attempt=0).kill_outside == (
        "checkpointing", 4, 2)


@pytest.mark.parametrize("value", ["evaluating:4:1", "evaluating:4:1:1", "saving:4:1:0", "checkpointing:4:a:0"])
def test_the_hold_hook_refuses_a_malformed_value_in_one_line(value):
    with pytest.raises(ValueError) as got:
        InjectedFaults.from_environment({"SDP_TEST_HOLD_AT": value}, attempt=0)
    assert str(got.value) == (f"SDP_TEST_HOLD_AT={value!r} must be POINT:N:H:V, POINT one of evaluating, "
                              "checkpointing, N, H and V integers >= 0 (steps, the worker held, the worker killed; H "
                              "and V differ)")
    assert InjectedFaults.from_environment({"SDP_TEST_HOLD_AT": "checkpointing:4:2:0"}, attempt=0).hold_at == (
        "checkpointing", 4, 2, 0)


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
