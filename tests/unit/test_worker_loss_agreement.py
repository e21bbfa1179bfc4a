"""Losing a worker (``--on-worker-loss continue``): the survivors' decision and their agreement through a
real TCP store, and the configs that may continue. The run itself: tests/distributed/test_worker_loss.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab import Mask
from masklab.failures import is_fatal
from masklab.testing.strategies import mask_sequences, masks
from sdp_train.errors import ConfigError
from sdp_train.trainer.agreement import WorkerLossError, agree, agreement_timeout, decide, exited_key
from sdp_train.trainer.config import TrainConfig

MASK = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])


@settings(deadline=None, max_examples=60)
@given(mask=masks(max_workers=6, max_blocks=6), data=st.data())
def test_survivors_continue_exactly_when_the_loss_is_not_fatal_and_keep_their_rows(mask, data):
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers))
    workers = [10 + k for k in range(mask.workers)]  # worker numbers of the first run, rank order
    joined = {w: 7 for k, w in enumerate(workers) if k not in lost}
    if is_fatal(mask, lost):
        with pytest.raises(WorkerLossError, match=r"^step 7: lost workers? \[.*\] held every copy of block \d+ "):
            decide(mask, workers, joined, step=7)
        return
    change = decide(mask, workers, joined, step=7)
    assert change.lost == tuple(workers[k] for k in sorted(lost))
    assert change.workers == tuple(joined) and change.rows == tuple(k for k in range(mask.workers) if k not in lost)
    assert change.mask.matrix.tolist() == mask.matrix[list(change.rows)].tolist()
    assert change.mask.matrix.any(axis=0).all()


def test_no_loss_is_no_change_and_survivors_at_different_steps_are_refused_in_one_line():
    assert decide(MASK, [0, 1, 2], {0: 3, 1: 3, 2: 3}, step=3) is None
    with pytest.raises(WorkerLossError) as info:
        decide(MASK, [0, 1, 2], {0: 3, 2: 4}, step=3)
    assert "\n" not in str(info.value) and "different numbers of steps [3, 4]" in str(info.value)


def test_a_fatal_loss_names_the_block_and_the_lost_workers_in_one_line():
    named = MASK.replace(block_names=["layers.0", "layers.1", "layers.2"])
    with pytest.raises(WorkerLossError) as info:
        decide(named, [0, 1, 2], {2: 5}, step=5)
    assert str(info.value) == ("step 5: lost workers [0, 1] held every copy of block 1 (layers.1): continuing is "
                               "impossible; restart from a checkpoint (--resume)")


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _agree_in_threads(store, generation: int, applied: dict[int, int], workers=(0, 1, 2)) -> dict[int, dict]:
    results: dict[int, dict] = {}

    def join(worker: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        results[worker] = agree(client, generation, worker, workers, applied[worker], timeout=timedelta(seconds=10))

    threads = [threading.Thread(target=join, args=(w,)) for w in applied]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_survivor_blocked_for_a_whole_collective_timeout_still_joins_the_agreement(store, monkeypatch):
    """Worker 1 learns of the loss only when its collective with worker 2 times out (worker 2 left it
    for the agreement): it joins one collective timeout late and must still be in the decision."""
    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", "0.5")
    store.set(exited_key(0), "-9")
    results: dict[int, dict] = {}

    def join(worker: int, delay: float) -> None:
        threading.Event().wait(delay)
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        results[worker] = agree(client, 1, worker, (0, 1, 2), 3, timeout=agreement_timeout())

    threads = [threading.Thread(target=join, args=(2, 0.0)), threading.Thread(target=join, args=(1, 0.7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1: {1: 3, 2: 3}, 2: {1: 3, 2: 3}}


def test_live_workers_agree_at_once_on_every_worker_the_launcher_did_not_mark_exited(store):
    store.set(exited_key(1), "-9")
    results = _agree_in_threads(store, 1, {0: 4, 2: 4})  # would wait 10 s for worker 1 without its mark
    assert results == {0: {0: 4, 2: 4}, 2: {0: 4, 2: 4}}


def test_a_worker_that_joins_after_the_decision_is_left_out_of_it(store):
    store.set(exited_key(2), "-9")
    first = _agree_in_threads(store, 1, {0: 2}, workers=(0, 2))
    late = _agree_in_threads(store, 1, {2: 2}, workers=(0, 2))
    assert first[0] == late[2] == {0: 2}


@pytest.mark.parametrize("changes, message", [
    ({"mode": "ddp"}, "mode 'ddp': continuing is built for bsdp, nsdp, bbsdp, overlap"),
    ({"fsdp": True}, "a mask without fsdp (--fsdp): FSDP shards each block"),
    ({"max_restarts": 1}, "max_restarts=1"),
    ({"workers": 1}, "workers=1"),
    ({"on_worker_loss": "rejoin"}, "not one of ('stop', 'continue')"),
    ({"on_worker_loss": "stop", "restore_coverage": True}, "acts after a worker is lost"),
    ({"mode": "overlap", "schedule": "permute", "restore_coverage": True},
     "a static mask with restore_coverage (--restore-coverage) in mode 'overlap'"),
    ({"on_worker_loss": "stop", "max_rejoins": 1}, "max_rejoins=1 (--max-rejoins) acts after a worker is lost"),
    ({"mode": "ddp", "max_rejoins": 1}, "mode 'ddp': continuing is built for"),
])
def test_configs_that_cannot_continue_after_a_loss_are_refused_naming_why(changes, message):
    with pytest.raises(ConfigError, match="on_worker_loss") as info:
        TrainConfig(**{"mode": "bsdp", "workers": 2, "on_worker_loss": "continue", **changes})
    assert message in str(info.value)


@pytest.mark.parametrize("local_steps", [1, 3])
def test_overlap_averaging_with_a_static_mask_may_take_lost_workers_back(local_steps):
    config = TrainConfig(mode="overlap", workers=4, on_worker_loss="continue", max_rejoins=1, local_steps=local_steps)
    assert config.max_rejoins == 1


@pytest.mark.parametrize("local_steps", [1, 3])
@pytest.mark.parametrize("schedule", ["permute", "cyclic"])
def test_overlap_averaging_under_a_schedule_may_continue_and_take_lost_workers_back(schedule, local_steps):
    config = TrainConfig(mode="overlap", workers=4, on_worker_loss="continue", max_rejoins=1, local_steps=local_steps,
                         schedule=schedule, every=3 * local_steps)
    assert config.max_rejoins == 1


@pytest.mark.parametrize("local_steps", [1, 3])
def test_overlap_averaging_with_a_static_mask_may_restore_the_designed_coverage(local_steps):
    config = TrainConfig(mode="overlap", workers=4, on_worker_loss="continue", restore_coverage=True, max_rejoins=1,
                         local_steps=local_steps)
    assert config.restore_coverage


@pytest.mark.parametrize("mode", ["bsdp", "nsdp"])
def test_b_sdp_and_n_sdp_with_a_static_mask_may_continue(mode):
    assert TrainConfig(mode=mode, workers=2, on_worker_loss="continue").on_worker_loss == "continue"


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
@pytest.mark.parametrize("schedule", [None, "permute", "cyclic"])
def test_b_sdp_n_sdp_and_bb_sdp_with_a_static_mask_or_a_schedule_may_take_lost_workers_back(mode, schedule):
    every = 1 if schedule is None else 3
    config = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", max_rejoins=2, schedule=schedule, every=every)
    assert config.max_rejoins == 2


@pytest.mark.parametrize("mode", ["bsdp", "nsdp"])
def test_b_sdp_and_n_sdp_with_local_steps_may_take_lost_workers_back(mode):
    config = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", max_rejoins=1, local_steps=3,
                         schedule="cyclic", every=6)
    assert config.max_rejoins == 1


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
def test_a_model_of_your_own_may_take_lost_workers_back(mode):
    cfg = TrainConfig(model="net.py:make", mode=mode, workers=2, on_worker_loss="continue", max_rejoins=1)
    assert cfg.max_rejoins == 1


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
def test_b_sdp_n_sdp_and_bb_sdp_may_take_lost_workers_back_after_restoring_the_coverage(mode):
    cfg = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", restore_coverage=True, max_rejoins=1)
    assert cfg.restore_coverage and cfg.max_rejoins == 1


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
def test_b_sdp_n_sdp_and_bb_sdp_may_restore_the_designed_coverage(mode):
    assert TrainConfig(mode=mode, workers=4, on_worker_loss="continue", restore_coverage=True).restore_coverage


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
@pytest.mark.parametrize("schedule", ["permute", "cyclic"])
def test_b_sdp_n_sdp_and_bb_sdp_under_a_schedule_may_restore_every_rounds_coverage_and_take_workers_back(mode,
                                                                                                          schedule):
    cfg = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", restore_coverage=True, max_rejoins=1,
                      schedule=schedule, every=3)
    assert cfg.restore_coverage and cfg.schedule == schedule


@pytest.mark.parametrize("mode", ["bsdp", "nsdp"])
@pytest.mark.parametrize("schedule", [None, "cyclic"])
def test_b_sdp_and_n_sdp_with_local_steps_may_restore_the_designed_coverage_and_take_lost_workers_back(mode,
                                                                                                       schedule):
    cfg = TrainConfig(mode=mode, workers=4, on_worker_loss="continue", restore_coverage=True, local_steps=3,
                      max_rejoins=1, schedule=schedule, every=3 if schedule else 1)
    assert cfg.restore_coverage and cfg.local_steps == 3


def test_the_keeping_launcher_reports_the_lowest_ranks_input_error_line_and_nothing_else(tmp_path, monkeypatch):
    """`launch_keeping_survivors` reads the ranks' error files as `launch_local` does: only a rank that
    exited 2 having left its one-line input error (`leave_error_to_launcher`) is an input error."""
    import json

    from sdp_train.trainer import launch, survivor_launcher

    def leave(rank: int, line: str) -> None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"rank{rank}.json"))
        monkeypatch.setattr(launch, "under_torchrun", lambda: True)
        assert launch.leave_error_to_launcher(line)

    leave(1, "sdp train: error: bad shard")
    leave(2, "sdp train: error: another")
    assert survivor_launcher._refused(str(tmp_path), [0, 2, 2]) == "sdp train: error: bad shard"
    assert survivor_launcher._refused(str(tmp_path), [0, 1, 2]) == "sdp train: error: another"  # rank 1 failed otherwise
    assert survivor_launcher._refused(str(tmp_path), [0, 1, 1]) is None
    (tmp_path / "rank2.json").write_text(json.dumps({"message": "a crash's record"}))  # not an input error
    assert survivor_launcher._refused(str(tmp_path), [0, 1, 2]) is None


@settings(deadline=None, max_examples=40)
@given(mask=masks(workers=st.integers(2, 5), max_blocks=5, schedule=True), data=st.data())
def test_a_loss_under_a_schedule_is_refused_exactly_when_some_round_still_to_train_loses_a_block(mask, data):
    """`decide` over `Rounds.to_train`: the rounds from the next step's to the last, by brute force."""
    from sdp_train.parallel.rounds import Rounds

    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers - 1))
    start, steps = data.draw(st.integers(0, 6)), 8
    rounds = Rounds(mask, seed=1, counts=True)
    for _ in range(start):
        rounds.step_done()
    rounds.entered(rounds.round_matrix(start), start)
    workers = list(range(mask.workers))
    joined = {w: start for w in workers if w not in lost}
    uncovered = [s for s in range(start, steps)
                 if not mask.round_matrix(s, seed=1)[[w for w in workers if w not in lost]].any(axis=0).all()]
    if uncovered:
        with pytest.raises(WorkerLossError, match=r"continuing is impossible") as info:
            decide(mask, workers, joined, step=start, rounds=rounds.to_train(steps))
        assert uncovered[0] == start or f"in the round of step {uncovered[0]}:" in str(info.value)
    else:
        change = decide(mask, workers, joined, step=start, rounds=rounds.to_train(steps))
        assert change.mask.matrix.tolist() == rounds.round_matrix(start)[list(change.rows)].tolist()


def test_the_survivors_rounds_keep_the_position_and_restrict_every_round_to_their_rows():
    from masklab import Schedule
    from sdp_train.parallel.rounds import Rounds

    mask = Mask([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], schedule=Schedule("permute", every=2))
    rounds = Rounds(mask, seed=0, counts=True)
    for _ in range(2):
        rounds.step_done()  # a change to round 1 is due (or was under way when the loss came)
    first = rounds.for_survivors([0, 2, 3])
    second = first.for_survivors([1, 2])  # later, the survivors' ranks 1 and 2: workers 2 and 3
    assert first.steps == second.steps == 2 and first.mask_step == 0
    assert first.matrix.tolist() == mask.round_matrix(0, seed=0)[[0, 2, 3]].tolist()
    assert first.due.tolist() == mask.round_matrix(2, seed=0)[[0, 2, 3]].tolist()
    for step in range(8):
        assert second.round_matrix(step).tolist() == mask.round_matrix(step, seed=0)[[2, 3]].tolist()
    assert rounds.rows is None and rounds.matrix.shape == (4, 4)  # the old position is untouched


def _train(rounds, steps: int) -> list[tuple[list, bool]]:
    """Step `rounds` as the wrapper does (`step_done`, then the change that is due) up to `steps` steps
    taken; after each step, the mask the state is in and whether it changed."""
    seen = []
    while rounds.steps < steps:
        rounds.step_done()
        due = rounds.take_due()
        if due is not None:
            rounds.entered(due, rounds.steps)
        seen.append((rounds.matrix.tolist(), due is not None))
    return seen


@settings(deadline=None, max_examples=60)
@given(mask=st.one_of(masks(workers=st.integers(2, 5), max_blocks=4, schedule=True),
                      mask_sequences(workers=st.integers(2, 5), max_blocks=4)), data=st.data())
def test_after_a_rejoin_every_round_is_the_designed_rounds_rows_of_the_workers_in_their_new_order(mask, data):
    """`Rounds.for_joiners`, for every schedule, loss and admission step and order of workers: the members'
    position (steps taken, rows restricted after the loss) and a joiner's new one agree, the members keep
    their rows of the round in force, and from then on every round is the designed round's rows of the
    workers in rank order, with a change due exactly where the designed rows of those workers change."""
    from sdp_train.parallel.rounds import Rounds

    lost_at, waited, later = data.draw(st.integers(0, 7)), data.draw(st.integers(0, 7)), 12
    lost = data.draw(st.sets(st.integers(0, mask.workers - 1), min_size=1, max_size=mask.workers - 1))
    rounds = Rounds(mask, seed=1, counts=True)
    _train(rounds, lost_at)
    survivors = [w for w in range(mask.workers) if w not in lost]
    members = rounds.for_survivors(survivors)  # ranks of the first world = workers
    _train(members, lost_at + waited)
    if members.due is not None:  # a loss can leave a change due (the members make it before admitting)
        members.entered(members.take_due(), members.steps)
    joiners = data.draw(st.permutations(sorted(lost)))[:data.draw(st.integers(1, len(lost)))]
    workers = [*survivors, *joiners]
    step = members.steps
    joined = members.for_joiners(workers)
    joiner = Rounds(mask, seed=1, counts=True).for_joiners(workers, steps=step)
    designed = mask.round_matrix(step, seed=1)[workers]
    assert joined.matrix.tolist() == joiner.matrix.tolist() == designed.tolist()
    assert joined.matrix[:len(survivors)].tolist() == members.matrix.tolist()  # no member's part changes
    assert joined.state() == joiner.state() == {"steps": step} and joined.due is joiner.due is None
    expected = [mask.round_matrix(t, seed=1)[workers].tolist() for t in range(step, step + later + 1)]
    changes = [(now, now != before) for before, now in zip(expected, expected[1:])]
    assert _train(joined, step + later) == _train(joiner, step + later) == changes


def test_members_admit_the_same_joiners_at_a_boundary_whenever_the_replacement_announces_itself(store):
    """`joiners_at`: a member that asks before worker 0's replacement waits decides for every member of
    that step's boundary; the replacement joins at the next boundary any member reaches."""
    from sdp_train.trainer.agreement import joiners_at, joining_key

    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    assert joiners_at(store, 5, [0, 3]) == []
    client.set(joining_key(0), "1")
    assert joiners_at(client, 5, [0, 3]) == []  # decided without it at step 5
    assert joiners_at(client, 6, [0, 3]) == [0] and joiners_at(store, 6, [0, 3]) == [0]


def test_with_local_steps_members_admit_only_at_a_rounds_boundary_and_read_nothing_inside_a_round(store):
    """`Survival.admit` with ``local_steps=3``: a replacement waits from step 4 on; at steps 4 and 5 (inside
    a round, where holders' copies differ) the members decide nothing; at step 6 they admit it (this fake
    run stops where the members close their sync, once the admission is written)."""
    import json
    from types import SimpleNamespace

    import torch

    from sdp_train.trainer.agreement import admission_key, joining_key
    from sdp_train.trainer.membership import Survival

    class Admitting(Exception):
        pass

    def close() -> None:
        raise Admitting

    run = SimpleNamespace(cfg=SimpleNamespace(local_steps=3, steps=9), faults=SimpleNamespace(join_at=None),
                          sync=SimpleNamespace(rounds_to_train=lambda steps: None, close=close))
    designed = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    survival = Survival(store, 1, (1, 2), Mask(designed.matrix[[1, 2]]), designed=designed)
    store.set(joining_key(0), "1")
    for step in (4, 5):
        assert survival.admit(run, step, torch.device("cpu")) is None
        assert not store.check([f"sdp/admit/{step}"]) and not store.check([admission_key(0)])
    with pytest.raises(Admitting):
        survival.admit(run, 6, torch.device("cpu"))
    assert json.loads(store.get("sdp/admit/6")) == [0] and json.loads(store.get(admission_key(0)))["step"] == 6


class _Process:
    """A rank's process as `_wait_all` sees it: running (``returncode`` None) or exited."""

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_the_launcher_replaces_a_lost_rank_once_the_survivors_left_it_out_and_at_most_max_rejoins_times(store):
    """`_wait_all` with ``max_rejoins=1``: rank 0 dies; no replacement while the survivors have not agreed
    on a membership without it (`MEMBERS_KEY`), one as soon as they have (its exit mark cleared), and
    none for the replacement's own failure: the budget is spent."""
    from sdp_train.trainer.agreement import MEMBERS_KEY
    from sdp_train.trainer.survivor_launcher import _wait_all

    procs = {0: _Process(-9), 1: _Process(), 2: _Process()}
    started: list[_Process] = []

    def replace(rank: int) -> _Process:
        started.append(_Process())
        return started[-1]

    waiting = threading.Thread(target=lambda: codes.append(_wait_all(procs, store, replace, 1)))
    codes: list[list[int]] = []
    waiting.start()
    threading.Event().wait(0.3)
    assert not started and store.check([exited_key(0)])  # the survivors have not decided yet
    store.set(MEMBERS_KEY, "1,2")
    threading.Event().wait(0.3)
    assert len(started) == 1 and procs[0] is started[0] and not store.check([exited_key(0)])
    store.set(MEMBERS_KEY, "1,2,0")  # admitted
    started[0].returncode = -9  # lost again: no budget left
    store.set(MEMBERS_KEY, "1,2")
    threading.Event().wait(0.3)
    procs[1].returncode = procs[2].returncode = 0
    waiting.join(timeout=10)
    assert codes == [[-9, 0, 0]] and len(started) == 1


def test_a_node_replaces_its_only_rank_while_the_other_nodes_ranks_run(store):
    """One rank per node: node 2's launcher replaces its lost rank 2 once the survivors (ranks 0 and 1, on
    other nodes, with no exit mark) left it out. Before, the launcher judged the run over from its own
    node's ranks alone (none left) and never replaced it."""
    from sdp_train.trainer.agreement import MEMBERS_KEY
    from sdp_train.trainer.survivor_launcher import _wait_all

    procs = {2: _Process(-9)}
    started: list[_Process] = []

    def replace(rank: int) -> _Process:
        started.append(_Process())
        return started[-1]

    codes: list[list[int]] = []
    waiting = threading.Thread(target=lambda: codes.append(_wait_all(procs, store, replace, 1, world_size=3)))
    waiting.start()
    threading.Event().wait(0.3)
    assert not started and not codes  # the survivors have not decided yet
    store.set(MEMBERS_KEY, "0,1")
    threading.Event().wait(0.3)
    assert len(started) == 1 and procs[2] is started[0]
    store.set(MEMBERS_KEY, "0,1,2")  # the members admitted it (one that never joined: tests/unit/test_launch_end.py)
    started[0].returncode = 0
    waiting.join(timeout=10)
    assert codes == [[0]]


class _Sync:
    moved_bytes = 0

    def close(self) -> None:
        pass


class _Run:
    """What `Survival` asks of a run when survivors go on: its position and the masks it goes on under."""

    def __init__(self, applied: int, local_steps: int) -> None:
        from types import SimpleNamespace

        from sdp_train.parallel.dist import DistInfo

        self.cfg, self.steps_applied, self.info = SimpleNamespace(local_steps=local_steps), applied, DistInfo(0, 2, 0)
        self.sync, self.went_on = _Sync(), []

    def continue_with(self, mask, rows, info, vote=None) -> None:
        self.went_on.append((mask.matrix.tolist(), list(rows)))
        self.sync = _Sync()


@settings(deadline=None, max_examples=60)
@given(applied=st.integers(0, 13), local_steps=st.integers(1, 4))
def test_survivors_restore_coverage_at_once_on_a_round_boundary_and_else_at_the_next_one_after_its_average(
        applied, local_steps):
    """With local steps, holders agree only right after a round's average: the survivors go on under their own
    rows (the interrupted average taken again there) and move to the restored mask at the first boundary
    from the steps they applied on, at the start of that step, before any step of the next round."""
    from sdp_train.trainer.membership import Survival, restore_step

    survival = Survival(None, 1, [0, 1, 2], MASK, restore={"coverage": 2, "groups": None, "seed": 0, "sizes": None})
    change = decide(MASK, [0, 1, 2], {1: applied, 2: applied}, step=applied)
    dropped = change.mask
    change = survival.restored(change, applied, report=True)
    restored = change.mask.matrix.tolist()
    assert change.restored and (change.mask.coverage == 2).all()
    run = _Run(applied, local_steps)
    recorded = survival._go_on(run, change, dropped, run.info, applied)
    at = restore_step(applied, local_steps)
    assert at % local_steps == 0 and applied <= at < applied + local_steps
    if local_steps == 1:
        assert run.went_on == [(restored, [1, 2])] and recorded.restored
    elif at == applied:  # on a boundary: their own rows first (the average again), then the restored mask
        assert run.went_on == [(dropped.matrix.tolist(), [1, 2]), (restored, [0, 1])] and recorded.restored
    else:
        assert run.went_on == [(dropped.matrix.tolist(), [1, 2])]
        assert (recorded.restored, recorded.restore_at, recorded.mask.matrix.tolist()) == (
            False, at, dropped.matrix.tolist())
        assert survival.mask.matrix.tolist() == dropped.matrix.tolist()  # a later loss designs from these rows
        for step in range(applied, at):
            assert survival.restore_due(run, step) is None
        made = survival.restore_due(run, at)
        assert (made.step, made.lost, made.joined, made.restored) == (at, (), (), True)
        assert run.went_on[1:] == [(restored, [0, 1])] and survival.mask.matrix.tolist() == restored
    assert survival.pending_restore is None and survival.restore_due(run, at + local_steps) is None


_MOVE_FATES = st.sampled_from(["received", "failed", "died", "received then died"])


@settings(max_examples=25, deadline=None)
@given(fates=st.lists(_MOVE_FATES, min_size=2, max_size=4), delays=st.lists(st.floats(0, 0.05), min_size=4,
                                                                             max_size=4))
def test_every_live_survivor_decides_the_same_on_a_move_and_makes_it_only_if_every_one_received_it(fates, delays):
    """The all-or-nothing answer of a move that restores coverage (`moved_everywhere`), through a real TCP
    store: whatever each survivor's fate (received every part; failed in a collective of the move; died
    before answering, the launcher marking its exit; answered received, then died; alive but never
    answering: `test_a_survivor_that_never_answers_abandons_the_move_for_all_and_cannot_answer_later`), every
    live survivor that asks gets the same answer, True exactly when every survivor answered that it received
    every part (one that answered so and then died counts)."""
    from sdp_train.trainer.agreement import moved_everywhere

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    workers = tuple(range(len(fates)))
    for w, fate in enumerate(fates):
        if fate == "received then died":  # its answer, as `moved_everywhere` writes it, before its exit mark
            store.compare_set(f"sdp/moved1/5/{w}", "", "1")
        if fate in ("died", "received then died"):
            store.set(exited_key(w), "-9")
    results: dict[int, bool] = {}

    def answer(worker: int, received: bool) -> None:
        threading.Event().wait(delays[worker])
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        results[worker] = moved_everywhere(client, 1, 5, worker, workers, received=received,
                                           timeout=timedelta(seconds=30))

    live = {w: fate == "received" for w, fate in enumerate(fates) if fate in ("received", "failed")}
    threads = [threading.Thread(target=answer, args=item) for item in live.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = all(fate in ("received", "received then died") for fate in fates)
    assert results == {w: every for w in live}


def test_a_survivor_that_never_answers_abandons_the_move_for_all_and_cannot_answer_later(store):
    """Past the timeout a survivor gives up on one that neither answered nor exited (a hung node), and writes
    that it did not receive the move for it: its late answer then reads the same, False."""
    from sdp_train.trainer.agreement import moved_everywhere

    assert moved_everywhere(store, 2, 7, 0, (0, 1), received=True, timeout=timedelta(seconds=0.2)) is False
    assert moved_everywhere(store, 2, 7, 1, (0, 1), received=True, timeout=timedelta(seconds=10)) is False


PAIRS = Mask([[1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 1], [0, 0, 1, 0, 1, 1]])  # each pair a block
RESTORE = {"coverage": 2, "groups": None, "seed": 0, "sizes": None}


class _Described:
    """A closed sync as `Run` keeps it: what a further loss is checked against and the survivors' rows in it."""

    moved_bytes = 0

    def __init__(self, matrix) -> None:
        self.matrix = matrix

    def rounds_to_train(self, steps: int):
        return [(3, self.matrix)]

    def close(self) -> None:
        pass


class _MovingRun:
    """The run of worker 1 of a 4-worker `mask` whose survivors restore coverage: its sync's build for them fails once
    after every survivor received the move (a worker `lost` then, while their holder groups are built), as
    `SubnetworkSync.for_survivors` does, the old sync then describing the rows the move left."""

    def __init__(self, store, lost, mask) -> None:
        from types import SimpleNamespace

        from sdp_train.parallel.dist import DistInfo

        self.store, self.lost, self.failures = store, lost, 1
        self.cfg, self.steps_applied, self.info = SimpleNamespace(local_steps=1, steps=6), 3, DistInfo(1, 4, 0)
        self.faults = SimpleNamespace(kill_in_recovery=None, kill_in_move=None, kill_move_voted=False)
        self.device = None
        self.sync, self.went_on = _Described(mask.matrix), []

    def continue_with(self, mask, rows, info, vote=None) -> None:
        self.went_on.append((mask.matrix.tolist(), list(rows)))
        assert vote is None or vote.agreed()
        self.sync = _Described(mask.matrix)
        if self.failures:
            self.failures -= 1
            for w in self.lost:
                self.store.set(exited_key(w), "-9")
            raise RuntimeError("Connection reset by peer")


def _restored_for_workers_1_to_3() -> Mask:
    from sdp_train.trainer.membership import Survival

    change = decide(PAIRS, [0, 1, 2, 3], {1: 3, 2: 3, 3: 3}, step=3)
    return Survival(None, 1, [0, 1, 2, 3], PAIRS, restore=RESTORE).restored(change, 3, report=False).mask


def _answered_store() -> dist.TCPStore:
    """A real TCP store where worker 0 exited (SIGKILL) and workers 2 and 3 joined two agreements after 3 steps,
    each answering that it received every part of the move of step 3."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set(exited_key(0), "-9")
    for generation in (1, 2):
        for w in (2, 3):
            store.set(f"sdp/loss{generation}/joined{w}", "3")
            store.set(f"sdp/moved{generation}/3/{w}", "1")
    return store


def _survive_a_loss_after_the_move(monkeypatch, lost, mask=PAIRS, coverage=2):
    """Worker 1 of `mask` (`_MovingRun`) after worker 0's loss at step 3, workers 1-3 alive: its recovery, the
    others' answers in a real TCP store (each survivor received every part of each move)."""
    from sdp_train.trainer.membership import Survival

    monkeypatch.setattr(Survival, "_form_world", lambda *args: None)
    store = _answered_store()
    run = _MovingRun(store, lost, mask)
    survival = Survival(store, 1, [0, 1, 2, 3], mask, restore={**RESTORE, "coverage": coverage})
    return survival, run, survival.recover(run, 3, RuntimeError("Connection reset by peer"), None)


def test_a_loss_after_every_survivor_received_the_move_is_decided_and_restored_from_the_rows_it_left(monkeypatch):
    """Worker 2 is lost once workers 1-3 all received the move to the mask restored for them, while they
    build their new sync: the state is consistent (each holds its restored rows), so workers 1 and 3 agree
    again from those rows, not their designed ones (without worker 0 and 2, block (0, 2) would have no
    holder: fatal), restore coverage again for themselves (every block on both) and go on; one change,
    every worker lost."""
    survival, run, change = _survive_a_loss_after_the_move(monkeypatch, lost=[2])
    restored = _restored_for_workers_1_to_3()
    assert (restored.coverage == 2).all()
    assert run.went_on == [(restored.matrix.tolist(), [1, 2, 3]), ([[1] * 6, [1] * 6], [0, 2])]
    assert (change.step, change.lost, change.workers, change.restored) == (3, (0, 2), (1, 3), True)
    assert survival.changes == [change] and survival.workers == (1, 3) and survival.mask.matrix.all()
    assert survival.move is None


def test_a_change_whose_first_move_alone_restored_coverage_is_recorded_as_restored(monkeypatch):
    """Coverage 3 on 4 workers: workers 1-3 move to every block each, then worker 2 is lost while they build
    their sync; workers 1 and 3 keep every block (coverage 2, all there is), nothing moves again, and the one
    change still says that coverage was restored (its `moved_bytes` are the first move's)."""
    threes = Mask([[1, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]])
    survival, run, change = _survive_a_loss_after_the_move(monkeypatch, [2], threes, coverage=3)
    assert run.went_on == [([[1] * 4] * 3, [1, 2, 3]), ([[1] * 4] * 2, [0, 2])]
    assert (change.lost, change.workers, change.restored) == ((0, 2), (1, 3), True)


def test_a_loss_after_the_move_that_leaves_a_block_of_its_rows_without_holder_stops_in_one_line(monkeypatch):
    """Workers 2 and 3 lost after the move: worker 1's restored row lacks blocks that only they held then."""
    with pytest.raises(WorkerLossError, match=r"^step 3: lost workers \[2, 3\] held every copy of block \d ") as info:
        _survive_a_loss_after_the_move(monkeypatch, lost=[2, 3])
    assert "\n" not in str(info.value)


THREES = Mask([[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]])  # coverage 3 of 4: any two losses survive


class _RoundsSync(_Described):
    """A scheduled sync as `Run` keeps it: its position (`Rounds`), what a further loss is checked against."""

    def __init__(self, rounds) -> None:
        self.rounds = rounds

    def rounds_to_train(self, steps: int):
        return self.rounds.to_train(steps)


class _ScheduledRun(_MovingRun):
    """The run of worker 1 of `THREES` under a permute schedule (every 3 steps, 6 steps), its state entered in
    the round of step 3, whose survivors restore every round's coverage: as `Run.continue_with` does, the
    survivors' sync (`Rounds.for_survivors`) is in force before the schedule's mover makes the due change to
    the restored round; the first such move fails once, `fail` being where (a worker `lost` then): ``"in the
    move"`` (before this rank's vote) or ``"after the vote"`` (every survivor received it: the change is made)."""

    def __init__(self, store, lost, mask, fail) -> None:
        from sdp_train.parallel.rounds import Rounds

        super().__init__(store, lost, mask)
        rounds = Rounds(mask, 0, counts=True)
        for _ in range(3):
            rounds.step_done()
        due = rounds.take_due()
        rounds.entered(rounds.matrix if due is None else due, 3)
        self.sync, self.fail = _RoundsSync(rounds), fail

    def continue_with(self, mask, rows, info, vote=None, *, restore=None) -> None:
        rounds = self.sync.rounds.for_survivors(rows, restore=restore)
        self.went_on.append((mask.matrix.tolist(), list(rows)))
        self.sync = _RoundsSync(rounds)
        if rounds.due is None:
            return
        if self.failures and self.fail == "in the move":
            self._lose()
        assert vote is not None and vote.agreed()
        rounds.entered(rounds.take_due(), rounds.steps)
        if self.failures and self.fail == "after the vote":
            self._lose()

    def _lose(self):
        self.failures -= 1
        for w in self.lost:
            self.store.set(exited_key(w), "-9")
        raise RuntimeError("Connection reset by peer")


@pytest.mark.parametrize("fail", ["in the move", "after the vote"])
def test_a_loss_while_blocks_move_to_restore_a_schedules_coverage_is_survived(monkeypatch, fail):
    """Under a schedule, worker 2 is lost while workers 1-3 move to the round restored for them (every block on
    each), or after every one received that move: workers 1 and 3 agree again, from their rows before the move
    or from the restored ones, and end holding every block (the round restored for two), their sync over their
    own world; one change, every worker lost, coverage restored."""
    from masklab import Schedule
    from sdp_train.trainer.membership import Survival

    monkeypatch.setattr(Survival, "_form_world", lambda *args: None)
    mask = THREES.replace(schedule=Schedule("permute", every=3))
    store = _answered_store()
    run = _ScheduledRun(store, [2], mask, fail)
    survival = Survival(store, 1, [0, 1, 2, 3], mask, restore={**RESTORE, "coverage": 3})
    change = survival.recover(run, 3, RuntimeError("Connection reset by peer"), None)
    assert (change.step, change.lost, change.workers, change.restored) == (3, (0, 2), (1, 3), True)
    assert change.mask.matrix.all() and run.sync.rounds.matrix.all() and run.sync.rounds.due is None
    assert [rows for _, rows in run.went_on] == [[1, 2, 3], [0, 2]]  # the second in the world of workers 1-3
    assert survival.changes == [change] and survival.workers == (1, 3)
