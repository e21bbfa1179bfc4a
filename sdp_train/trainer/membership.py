"""Losing a worker and training on (``sdp train --on-worker-loss continue``): the survivors' agreement on
who is left, and the members' admission of workers that join.

The ranks run under `sdp_train.trainer.survivor_launcher.launch_keeping_survivors`, which hosts their TCP
store and marks each rank that exits in it. When a step fails on a rank (a collective with a dead peer
raises), `Survival.recover` closes this rank's groups (so a peer blocked on one fails too), agrees with
the other live ranks on the survivors through the store (`agreement.agree`: the first decision written wins),
refuses a loss that leaves a block without holder (`decide`: in the mask in force and, under a mask
schedule, in every round still to train), re-forms the world over a new store prefix with the
survivors renumbered in the old order, and has the run rebuild its holder groups and sync for the
survivors' mask (`masklab.failures.survivors_mask`, or with ``--restore-coverage``
`masklab.survivors.restored_mask`, whose new holders first receive their blocks; under a schedule every
later round's, `sdp_train.parallel.rounds.restored_round`; with local steps at a round's boundary, right
after the holders' average: `restore_step`, `Survival.restore_due`). The run then reruns
the interrupted step on its batch, unless every survivor had applied it (Bb-SDP and overlap averaging,
lost while the new values were sent or averaged). A worker lost while the survivors rebuild their sync
or move blocks to restore coverage (all or nothing: `sdp_train.parallel.changes.MoveVote`,
`agreement.moved_everywhere`) leaves each survivor at its state from before, or, once every survivor
received the move, at its restored rows; those still alive agree again from there and go on
(`Survival._go_on`). After a loss outside a step (an evaluation, a checkpoint, the
final save) the run does that work again; survivors caught at different points of the same step's close
(`Survival.where`, a `Point`) meet at the furthest (`meeting`: one behind an evaluation takes its result
from one ahead), others stop. Why the store and not torchft: docs/design.md §7.

With ``--max-rejoins N`` the launcher starts a replacement for a lost worker (the same worker number)
once the survivors have agreed on the loss. The replacement announces itself in the store
(`joining_key`) and waits; at every step boundary while a worker is missing (with local steps, and in
overlap averaging, every round's), each member reads the store once (`Survival.admit`: the first member
there decides, by compare-and-set, which waiting workers join at that boundary, so every member admits
the same ones at the same step; no device is synchronised), and the members and joiners then form a new
world (the members' ranks first, the joiners' last, so that every block's lowest-ranked holder is a
member), give each joiner its blocks (overlap averaging: its copy of every block), the shared tensors
and their optimizer state (`ModeSync.welcome`) and go back to the designed mask (under a schedule, the
designed round's rows at the same position; members whose rows were restored for the survivors gain and
drop parts, `Run.to_designed`, all or nothing: `welcome_vote`).

Not here: the store's keys and the agreement itself (`sdp_train.trainer.agreement`), what a mode
rebuilds (`sdp_train.trainer.modes.ModeSync.for_survivors`, `for_joiners`), the loop that reruns the
step or starts a joiner at its step (`sdp_train.trainer.train`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from masklab import Mask
from masklab.errors import DesignError, MaskError
from masklab.survivors import restored_mask
from sdp_train.parallel.changes import MoveVote
from sdp_train.parallel.dist import DistInfo, collective_timeout
from sdp_train.parallel.rounds import restore_step, restored_round
from sdp_train.trainer.agreement import (MEMBERS_KEY, STEPS_DONE_KEY, MembershipChange, RunEnded, WorkerLossError,
                                         admission_key, agree, agreement_timeout, decide, exited_key, gather,
                                         joiners_at, joining_fails, joining_key, moved_everywhere, release_frames)
from sdp_train.trainer.faults import die
from sdp_train.trainer.launch import _agent_store, destroy_distributed, restart_attempt


PHASES = ("evaluating", "checkpointing", "boundary", "step", "saving the final model")
"""What a worker does after `Point.steps` steps, in the run's order: the evaluation and the checkpoint that close
the last step, the boundary's work before the next step (a restore due, an admission), that step, or (after the
last step) the final save. The boundary and its step are one point of the run."""
_PLACE = {"evaluating": 0, "checkpointing": 1, "boundary": 2, "step": 2, "saving the final model": 3}


@dataclasses.dataclass(frozen=True)
class Point:
    """Where a worker is in the run (`Survival.where`): `phase` (one of `PHASES`) after `steps` steps.

    >>> str(Point(4, "evaluating")), str(Point(4, "step")), Point(4, "checkpointing").place < Point(4, "step").place
    ('evaluating after step 4', 'step 4', True)
    """

    steps: int
    phase: str

    @property
    def place(self) -> tuple[int, int]:
        """Its order in the run (a boundary and its step: the same)."""
        return self.steps, _PLACE[self.phase]

    @property
    def during(self) -> str | None:
        """The work outside a step it is (`MembershipChange.during`), None in a step or at its boundary."""
        return None if self.phase in ("boundary", "step") else self.phase

    def __str__(self) -> str:
        return f"step {self.steps}" if self.during is None else f"{self.phase} after step {self.steps}"

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "phase": self.phase}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Point:
        return cls(int(data["steps"]), str(data["phase"]))


def meeting(points: Mapping[int, Point], evaluations: Mapping[int, tuple[int, Sequence[Any]] | None]
            ) -> tuple[Point, tuple[Any, ...] | None, int | None] | None:
    """Where the survivors of a loss, each at its point (`points`, by worker), go on together: the furthest
    point, the evaluation's values that those behind it take (None where none is behind an evaluation) and
    the worker they come from; None where they cannot meet. `evaluations`: each worker's last evaluation
    (``(steps, values)``), written to the store with its point.

    They meet where every survivor has the same steps and those behind are only behind the close of step
    `steps` (its evaluation, its checkpoint) while the others went on to the next step's training or the
    final save: a survivor is past the evaluation once rank 0's broadcast of its result reached it, and
    past the checkpoint once its last barrier passed, after every rank wrote its file and rank 0 the
    manifest (the checkpoint is complete). The evaluation changes no training state and its value is the
    same in any world, so those behind take the result of the lowest-numbered survivor that has it; a
    checkpoint complete needs nothing; nobody goes back. Not met: different steps (no survivor undoes a
    step), one ahead at a boundary (its restore or admission made there, that those behind would redo),
    one behind in a step or at a boundary, one behind an evaluation whose result nobody has.

    >>> meeting({1: Point(4, "evaluating"), 2: Point(4, "step")}, {2: (4, [2.5, None, None])})
    (Point(steps=4, phase='step'), (2.5, None, None), 2)
    >>> meeting({1: Point(4, "checkpointing"), 2: Point(5, "step")}, {}) is None
    True
    """
    far = max(points.values(), key=lambda p: (p.place, p.phase == "step"))
    if all(p.place == far.place for p in points.values()):
        return far, None, None
    steps = far.steps
    if any(p.steps != steps for p in points.values()):
        return None
    if any(p.place == far.place and p.phase == "boundary" for p in points.values()):
        return None
    behind = [p for p in points.values() if p.place < far.place]
    if any(p.phase not in ("evaluating", "checkpointing") for p in behind):
        return None
    if not any(p.phase == "evaluating" for p in behind):
        return far, None, None
    for w in sorted(points):
        held = evaluations.get(w)
        if points[w].place > Point(steps, "evaluating").place and held is not None and held[0] == steps:
            return far, tuple(held[1]), w
    return None


class Survival:
    """This rank's side of ``--on-worker-loss continue``: its worker number in the original run, the
    workers of the current world (rank order), the mask in force and the changes so far.

    `restore`: keyword arguments of `masklab.survivors.restored_mask` (``coverage``, ``groups``, ``seed``,
    ``sizes``; ``budgets``, one per worker of the original run, with ``fixed_bytes``) to restore the
    designed coverage after a loss (``--restore-coverage``); None keeps the survivors' rows as they are.
    `designed`: the run's mask, one row per worker of the original run, which workers that join take
    back (``--max-rejoins``; under a schedule, its rounds drawn with `seed`); None: nobody joins."""

    def __init__(self, store: dist.Store, worker: int, workers: Sequence[int], mask: Mask, *,
                 restore: Mapping[str, Any] | None = None, designed: Mask | None = None, seed: int = 0) -> None:
        self.store, self.worker, self.workers, self.mask = store, worker, tuple(workers), mask
        self.restore = None if restore is None else dict(restore)
        self.designed, self.seed = designed, seed
        self.scheduled = not (mask if designed is None else designed).schedule.is_static
        """The run's mask has a schedule: a restore is every round's (`Rounds.for_survivors`), not one mask."""
        self.pending_restore: Mask | None = None
        """With local steps: the restored mask the survivors of a loss inside a round move to at its boundary."""
        self.pending_round_restore: tuple[int, int, float] | None = None
        """Under a schedule with local steps: the step at whose start the survivors of a loss inside a round are in
        the restored round (the schedule's mover made that change after the round's average), and the bytes
        the schedule had moved and the seconds its changes took at the loss; `restore_due` records the change
        with the difference (`recovery_s`: the time of that change)."""
        self.generation = 0
        self.world, self.groups_met = self.workers, 0
        """The workers of the current world in rank order (during an admission already the joiners too) and how
        many process groups it has made (`meet_for_group`)."""
        self.changes: list[MembershipChange] = []
        self.move: tuple[int, tuple[int, ...]] | None = None
        """The move to restore coverage under way: its step and the workers of its world (`_vote`)."""
        self.moved: bool | None = None
        """Whether every survivor received that move (`moved_everywhere`); None before they answered."""
        self.where = Point(0, "boundary")
        """Where in the run this worker is (the loop sets it: a step, or work outside one), where the survivors
        of a loss meet to go on together (`_agree_and_form`, `meeting`)."""
        self.evaluation: tuple[int, tuple[Any, ...]] | None = None
        """The last evaluation this worker finished: its steps and values (the loop sets it)."""
        self.going_to: Point | None = None
        """After a loss that found this worker behind the others (`meeting`): their point, until it is there."""
        self.taken: tuple[Any, ...] | None = None
        """The evaluation's values it took from a survivor ahead (`meeting`), for the evaluation it skips."""

    def skips(self, point: Point) -> bool:
        """Whether this worker skips the work at `point`, behind the point where the survivors of a loss met
        (`going_to`); once there it skips nothing more."""
        if self.going_to is not None and point.place < self.going_to.place:
            return True
        self.going_to = None
        return False

    def meets_in(self, step: int) -> bool:
        """Whether the survivors of a loss met in `step` ahead of this worker (`going_to`), having done the work
        of its boundary (a restore due, an admission) before it: this worker then skips that work."""
        met, self.going_to = self.going_to == Point(step, "step"), None
        return met

    def skip(self, point: Point) -> tuple[Any, ...] | None:
        """What the work at `point` that it `skips` gives: an evaluation's values taken from a survivor ahead
        (`taken`); None for a checkpoint (complete: a survivor was past it)."""
        return self.taken if point.phase == "evaluating" else None

    @classmethod
    def for_run(cls, mask: Mask, info: DistInfo, *, restore: Mapping[str, Any] | None = None,
                rejoin: bool = False, seed: int = 0) -> Survival:
        """The survival of a run that `launch_keeping_survivors` started (its store is the launcher's);
        `rejoin`: replacements of lost workers may join (``--max-rejoins``); `seed`: the run's."""
        store = _agent_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size)
        return cls(store, info.rank, range(info.world_size), mask, restore=restore, designed=mask if rejoin else None,
                   seed=seed)

    @classmethod
    def join(cls, designed: Mask, worker: int, device: torch.device, *, restore: Mapping[str, Any] | None = None,
             seed: int = 0) -> tuple[Survival, DistInfo, MembershipChange]:
        """A replacement for worker `worker` (its process started by `launch_keeping_survivors`): wait in the
        store until the members admit it (`admit`), then form the new world with them. Returns this
        worker's survival (`restore` as the members'), its place in the world and the change that
        admitted it (its step, the members' ranks `rows`, the joiners after them, the members' rows in
        force in `welcome_mask`); raises `RunEnded` when the members ran the last step (`STEPS_DONE_KEY`) or
        every member has exited first."""
        store = _agent_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), designed.workers)
        store.set(joining_key(worker), "1")
        while not store.check([admission_key(worker)]):
            members = store.get(MEMBERS_KEY).decode().split(",") if store.check([MEMBERS_KEY]) else []
            if store.check([STEPS_DONE_KEY]) or members and all(store.check([exited_key(int(w))]) for w in members):
                raise RunEnded(f"worker {worker}: the run ended before it could rejoin; this replacement has "
                               "nothing to do")
            time.sleep(0.05)
        admitted = json.loads(store.get(admission_key(worker)))
        store.delete_key(admission_key(worker))  # a later replacement of this worker waits for its own
        workers = tuple(admitted["workers"])
        step = admitted["step"]
        survival = cls(store, worker, workers, _rows(designed, workers, step, seed), restore=restore, designed=designed,
                       seed=seed)
        survival.generation = admitted["generation"]
        info = DistInfo(workers.index(worker), len(workers), 0)
        with joining_fails(worker, step):
            survival._form_world(info, device, workers)
        joined = workers[admitted["members"]:]
        change = MembershipChange(step, (), workers, tuple(range(admitted["members"])), survival.mask, joined=joined,
                                  welcome_mask=_welcome_mask(designed, admitted["rows"], joined, step, seed))
        survival.changes.append(change)
        return survival, info, change

    def loss_begun(self) -> str | None:
        """Why to give up a collective that waits (`sdp_train.parallel.dist.watch_waits`): another member
        has begun agreeing on a loss (`agree`'s key of the next generation), so a peer of this
        collective failed out of it; None while none has."""
        prefix = f"sdp/loss{self.generation + 1}/joined"
        began = [w for w in self.workers if w != self.worker and self.store.check([f"{prefix}{w}"])]
        return f"worker {began[0]} began recovering from a lost worker" if began else None

    def meet_for_group(self, ranks: Sequence[int]) -> None:
        """Before the world's ranks `ranks` make a process group (`sdp_train.parallel.dist.meet_before_groups`;
        every rank calls it, members or not, in one order): each member says in the store that it came and waits
        until every member has, so that ``new_group`` waits for no member that will never come. Gives up
        (RuntimeError, handled as a collective that failed) once the launcher marked a member exited
        (`exited_key`) or another worker began agreeing on a loss (`loss_begun`); a slow member is waited for up
        to the collective timeout, as ``new_group`` would."""
        made, self.groups_met = self.groups_met, self.groups_met + 1
        if self.world.index(self.worker) not in ranks:
            return
        members = [self.world[r] for r in ranks]
        prefix = f"sdp/attempt{restart_attempt()}/groups{self.generation}/{made}/"
        self.store.set(f"{prefix}{self.worker}", "1")
        keys = [f"{prefix}{w}" for w in members]
        began = time.monotonic()
        looked = began
        while not self.store.check(keys):
            now = time.monotonic()
            if now - looked >= 0.1:  # exit marks come from the launcher's poll: a tenth of a second is soon enough
                looked = now
                gone = [w for w in members if self.store.check([exited_key(w)])]
                reason = f"worker {gone[0]} exited" if gone else self.loss_begun()
                if reason is not None:
                    raise RuntimeError(f"gave up making the process group of workers {members}: {reason}")
                if now - began > collective_timeout().total_seconds():
                    raise RuntimeError(f"gave up making the process group of workers {members}: not every one "
                                       f"came within the collective timeout ({collective_timeout()})")
            time.sleep(0.005)

    def admit(self, run, step: int, device: torch.device) -> MembershipChange | None:
        """At the boundary before `step` (a step follows): admit the replacements waiting in the store, if
        any (every member calls it; None when none joins). While a worker of the designed mask is
        missing, each member reads the store once per step: the first member at this boundary writes
        which waiting workers join (compare-and-set, first write wins) and every member reads that, so
        all admit the same workers at the same step, with no collective and no device synchronisation.
        The members and the joiners then form a new world (joiners last), each joiner receives its part
        under the members' rows in force and its designed row, and the run goes back to the designed
        mask's rows of its workers (`Run.admit`, `Run.to_designed`: members whose rows were restored for the
        survivors gain and drop parts, all or nothing, `welcome_vote`). Under a schedule
        the designed round's rows, at the same position; a change of round that a loss left due the members
        first make among themselves, in their world, before anything of the admission is written: a member
        lost there is a loss as any other (`recover`; its change is returned and the joiners wait for a later
        boundary). With local steps only at a round's boundary, right after the holders' average: inside a
        round their copies differ (every member skips the others alike, reading nothing). When the admission
        fails and the members' state is still what it was (`members_state_kept`: the failure came before the
        new world formed, while the members only sent the joiners' parts, or in the move back from
        restored rows before every rank received it) they go on without the joiners (`_without_joiners`;
        None, or the change when a member was lost meanwhile); else every
        member stops, `WorkerLossError`."""
        if self.designed is None or len(self.workers) == self.designed.workers or step % run.cfg.local_steps:
            return None
        missing = [w for w in range(self.designed.workers) if w not in self.workers]
        if run.faults.join_at is not None:  # tests only: admit at those steps, once the replacements wait
            if step not in run.faults.join_at:
                return None
            self.store.wait([joining_key(w) for w in missing], collective_timeout())
        joined = joiners_at(self.store, step, missing)
        if not joined:
            return None
        began = time.perf_counter()
        if self.scheduled:  # a change of round a loss left due, made in the members' world before the admission
            try:
                run.enter_next_round()
            except RuntimeError as exc:  # a member lost: a loss as any other; the joiners wait for a later boundary
                if isinstance(exc, WorkerLossError):
                    raise
                return self.recover(run, step, exc, device)
        trained = run.sync.rounds_to_train(run.cfg.steps)  # what a member lost in the admission is checked against
        workers = (*self.workers, *joined)
        mask = _rows(self.designed, workers, step, self.seed)
        # the members' rows in force: as the survivors left them (restored, static masks); under a schedule the
        # round's, once a change a loss left due is made: the designed rows, or those restoring its coverage (a
        # mode that keeps no `Rounds` of its own: the designed rows)
        rounds = None if self.designed.schedule.is_static else run.sync.schedule_rounds
        rows = (self.mask.matrix if self.designed.schedule.is_static else mask.matrix[:len(self.workers)]
                if rounds is None else rounds.round_matrix(step)).tolist()
        welcome = _welcome_mask(self.designed, rows, joined, step, self.seed)
        info = DistInfo(self.workers.index(self.worker), len(workers), 0)
        if info.is_main:  # the joiners are members for the launcher first: one lost from here on is not replaced
            self.store.set(MEMBERS_KEY, ",".join(map(str, workers)))  # until the members go on without it
            for w in joined:
                self.store.delete_key(joining_key(w))
                self.store.set(admission_key(w), json.dumps({"step": step, "generation": self.generation + 1,
                                                             "workers": workers, "members": len(self.workers),
                                                             "rows": rows}))
        moving = False  # the members go from their rows in force to their designed ones (`Run.to_designed`)
        vote = self.welcome_vote(run, step, workers, welcome, mask)
        try:
            run.sync.close()  # its hooks hold the groups
            destroy_distributed()
            self.generation += 1
            self._form_world(info, device, workers)
            run.admit(mask, workers, range(len(self.workers), len(workers)), info, welcome_mask=welcome)
            moving = True
            run.to_designed(mask, vote)
        except RuntimeError as exc:  # DistError and CollectiveError included: a worker lost meanwhile
            kept = members_state_kept(mask, welcome, len(self.workers), moving=moving, voted=vote is not None,
                                      moved=self.moved)
            if kept is not None:
                raise WorkerLossError(f"step {step}: admitting worker(s) {joined} failed ({type(exc).__name__}) "
                                      f"{kept}: restart from a checkpoint (--resume)", report=info.is_main) from exc
            self.move_given_up()
            return self._without_joiners(run, step, joined, exc, device, began, trained)
        self.move = None
        change = MembershipChange(step, (), workers, tuple(range(len(self.workers))), mask,
                                  recovery_s=time.perf_counter() - began, moved_bytes=run.sync.moved_bytes,
                                  joined=tuple(joined), welcome_mask=welcome)
        self.workers, self.mask = workers, mask
        self.changes.append(change)
        return change

    def welcome_vote(self, run, step: int, workers: Sequence[int], welcome: Mask, mask: Mask) -> MoveVote | None:
        """The all-or-nothing answer of an admission's move at `step` among the new world's `workers` (members
        and joiners alike call it), from the `welcome` mask to the designed rows `mask` (`Run.to_designed`)
        where a member's rows in force were restored for the survivors of a loss (under a schedule the
        schedule's mover makes it, all or nothing as well), else None: nothing moves. A member drops nothing
        until every rank answered that it received every part (`moved_everywhere`, `MoveVote`)."""
        return self._vote(run, step, workers, not np.array_equal(welcome.matrix, mask.matrix))

    def move_given_up(self) -> None:
        """After a failure during a move of `_vote` (this rank's state back to before it): answer that this
        rank did not receive it, where it had not answered, so that the others stop waiting for it."""
        if self.move is not None and self.moved is None:
            moved_everywhere(self.store, self.generation, self.move[0], self.worker, self.move[1], received=False,
                             timeout=timedelta(0))
        self.move = None

    def _without_joiners(self, run, step: int, joined: Sequence[int], error: BaseException, device: torch.device,
                         began: float, rounds: Sequence[tuple[int, np.ndarray]] | None) -> MembershipChange | None:
        """After admitting `joined` at the boundary before `step` failed (`error`) while the members' state was
        still theirs (`members_state_kept`): the members agree among themselves (a new generation, as after a
        loss: one that died meanwhile is lost, fatal or not, checked against `rounds`, the members'
        `rounds_to_train` before the admission), form their world again and go on from `step` with the rows
        they had, without the joiners, whose admission the new rank 0 takes back (the launcher may then start
        another replacement). Under a schedule the position goes on over the members' rows (`Rounds.for_survivors`;
        after ``--restore-coverage`` every round restored for them again, the same design, so nothing moves).
        Returns the change when a member was lost, else None."""
        run.sync.close()  # the new world's, where it was built
        change, dropped, info = self._agree_and_form(run, step, error, device, rounds, keep_all=True)
        if info.is_main:
            for w in joined:  # a replacement started from now on waits for an admission of its own
                self.store.delete_key(admission_key(w))
            self.store.set(MEMBERS_KEY, ",".join(map(str, self.workers if change is None else change.workers)))
        if change is None:
            # the new world's wrapper (members first) has the welcome mask's position: a schedule's restore is
            # the members' own again (the same rows: the same restored rounds)
            restore = self.restore if self.scheduled and run.steps_applied < run.cfg.steps else None
            run.continue_with(self.mask, range(len(self.workers)), info, restore=restore)
            if info.is_main:
                print(f"sdp train: step {step + 1}/{run.cfg.steps}: worker(s) {list(joined)} lost while joining "
                      f"({type(error).__name__}); {_workers_go_on(self.workers)} on from this step "
                      f"without {'them' if len(joined) > 1 else 'it'} ({time.perf_counter() - began:.2f} s)",
                      flush=True)
            return None
        change = self._go_on(run, change, dropped, info, step)
        change = dataclasses.replace(change, recovery_s=time.perf_counter() - began, moved_bytes=run.sync.moved_bytes)
        self.changes.append(change)
        return change

    def _form_world(self, info: DistInfo, device: torch.device, workers: Sequence[int]) -> None:
        """The default group of this membership (generation) over `workers`, in rank order, every member and
        joiner in it; fails at once (`gather`) when one of them has exited before coming."""
        gather(self.store, self.generation, self.worker, workers, timeout=collective_timeout())
        self.world, self.groups_met = tuple(workers), 0
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=collective_timeout(),
                                store=dist.PrefixStore(f"attempt{restart_attempt()}/members{self.generation}",
                                                       self.store),
                                rank=info.rank, world_size=info.world_size)
        dist.barrier()  # every member is in the new world

    def restored(self, change: MembershipChange, step: int, report: bool,
                 rounds: Sequence[tuple[int, np.ndarray]] | None = None) -> MembershipChange:
        """`change` with the survivors' mask redesigned to the designed coverage (``restore``), the same
        on every survivor (a seeded design, no communication); as it is when nothing needs to move.
        Under a schedule (`rounds`: `ModeSync.rounds_to_train`'s, rows in the old rank order) the mask
        is that of the round of the next step (`restored_round`, as `Rounds.round_matrix` gives it to
        the survivors' wrapper; none when no step follows), after checking that the survivors have a
        design at all (`_design_fits`): every later round's is the same design, matched to the round."""
        if self.restore is None:
            return change
        lost = [k for k, w in enumerate(self.workers) if w in change.lost]
        restore = dict(self.restore)
        within = ""
        if "budgets" in restore:  # one per worker of the run: those of this world's workers, in rank order
            restore["budgets"] = [restore["budgets"][w] for w in self.workers]
            kept = [b for b, w in zip(restore["budgets"], self.workers) if w in change.workers]
            within = (f" within their memory budgets (--restore-budgets: {kept} bytes, {restore['fixed_bytes']} of "
                      "each held whatever its blocks; a worker number below counts the survivors from 0)")
        if self.scheduled and len(rounds or ()) < 2:  # the last step was applied: no round follows
            return change
        try:
            if self.scheduled:
                _design_fits(len(change.workers), self.mask.blocks, change.workers, self.restore, self.mask)
                matrix = restored_round(np.asarray(rounds[1][1])[list(change.rows)], change.workers, self.restore,
                                        self.mask)
                mask = Mask(matrix, block_names=self.mask.block_names, block_sizes=self.mask.block_sizes)
            else:
                mask = restored_mask(self.mask, lost, **restore)
        except (DesignError, MaskError) as exc:
            raise WorkerLossError(f"step {step}: the survivors {list(change.workers)} cannot restore the designed "
                                  f"coverage{within}: {exc}; restart from a checkpoint (--resume)",
                                  report=report) from None
        if np.array_equal(mask.matrix, change.mask.matrix):
            return change
        return dataclasses.replace(change, mask=mask, restored=True)

    def recover(self, run, step: int, error: BaseException, device: torch.device, *, during: str | None = None
                ) -> MembershipChange:
        """After `error` interrupted `step`: agree on the survivors and re-form the world and `run`'s sync
        for them (every survivor calls it); re-raises `error` when no worker was lost. `during`: the error
        came outside a step, while the workers were doing that (evaluating, checkpointing, saving the final
        model), `step` being the next step to train; the survivors then do it again (`train_prepared`).

        A loss during the recovery (a survivor that dies before the new world forms) makes the new
        world's forming fail; the agreement then starts again with the workers still alive. So does a loss
        while the survivors rebuild their sync, or move blocks to restore coverage (`_go_on`). Survivors
        that were at different points of the run (`where`: one had the evaluation's result that another had
        not) meet at the furthest where they can (`meeting`): this worker, if behind, goes on to `going_to`
        (the change's `during` is that point's), else they stop, `WorkerLossError`.
        """
        began = time.perf_counter()
        release_frames(error)
        rounds = run.sync.rounds_to_train(run.cfg.steps)
        run.sync.close()  # its hooks hold the groups
        change, dropped, info = self._agree_and_form(run, step, error, device, rounds)
        if info.is_main:
            self.store.set(MEMBERS_KEY, ",".join(map(str, change.workers)))
        change = self._go_on(run, change, dropped, info, step)
        if self.going_to is not None:  # behind the others: what they do again is what this worker goes on to
            during = self.going_to.during
        change = dataclasses.replace(change, recovery_s=time.perf_counter() - began,
                                     moved_bytes=run.sync.moved_bytes, during=during)
        self.changes.append(change)
        return change

    def _agree_and_form(self, run, step: int, error: BaseException, device: torch.device, rounds, *,
                        keep_all: bool = False) -> tuple[MembershipChange | None, Mask | None, DistInfo]:
        """The live workers of this world agree (`agree`, `decide`: `rounds` as `run.sync.rounds_to_train` gave
        them) and form their new world, again with those still alive when one is lost meanwhile. Returns the
        change (and the survivors' own rows, `dropped`, before any restore) and this rank's place in the world.
        With no worker lost `error` is raised again, unless `keep_all` (the change is then None and the same
        workers formed their world again)."""
        while True:
            destroy_distributed()  # closes this rank's connections: a peer waiting on one of them fails now
            self.generation += 1
            # before it joins: where it is and, for survivors behind it, the result of its last evaluation
            self.store.set(f"sdp/loss{self.generation}/where{self.worker}",
                           json.dumps({**self.where.to_json(), "evaluation": self.evaluation}))
            joined = agree(self.store, self.generation, self.worker, self.workers, run.steps_applied,
                           timeout=agreement_timeout())
            if self.worker not in joined:
                raise WorkerLossError(f"step {step}: worker {self.worker} joined the survivors after they had "
                                      "decided without it; it stops") from error
            keys = {w: f"sdp/loss{self.generation}/where{w}" for w in sorted(joined)}  # each set it before joining
            read = {w: json.loads(self.store.get(key)) for w, key in keys.items() if self.store.check([key])}
            where = {w: Point.from_json(r) for w, r in read.items()}
            met = meeting(where, {w: r["evaluation"] for w, r in read.items()})
            if met is None:
                raise WorkerLossError(f"the survivors {sorted(joined)} of a worker loss were at different points of "
                                      f"the run ({'; '.join(f'worker {w}: {p}' for w, p in where.items())}): they "
                                      "cannot go on together; restart from a checkpoint (--resume)",
                                      report=self.worker == min(joined)) from error
            far, self.taken, source = met
            self.going_to = far if self.where.place < far.place else None
            try:
                change = decide(self.mask, self.workers, joined, step=step, rounds=rounds)
            except WorkerLossError as exc:
                raise WorkerLossError(str(exc), report=self.worker == min(joined)) from error
            if change is None and not keep_all:
                raise error
            dropped = None if change is None else change.mask
            if change is not None:
                change = self.restored(change, step, report=self.worker == min(joined), rounds=rounds)
            workers = self.workers if change is None else change.workers
            info = DistInfo(workers.index(self.worker), len(workers), 0)
            if run.faults.kill_in_recovery == self.worker and self.generation == 1:  # tests only
                die()
            try:
                self._form_world(info, device, workers)
            except RuntimeError:  # DistError and timeouts included: another worker was lost meanwhile; the
                continue  # next agreement, over the same workers, leaves it out too
            behind = [w for w, p in where.items() if p.place < far.place]
            if info.is_main and behind:
                took = "" if source is None else f" with the evaluation's result of worker {source}"
                print(f"sdp train: note: the survivors were at different points of the run "
                      f"({'; '.join(f'worker {w}: {p}' for w, p in where.items())}): worker{'s' * (len(behind) > 1)} "
                      f"{', '.join(map(str, behind))} go{'es' * (len(behind) == 1)} on to {far}{took}", flush=True)
            return change, dropped, info

    def _go_on(self, run, change: MembershipChange, dropped: Mask, info: DistInfo, step: int) -> MembershipChange:
        """Rebuild `run`'s sync for the survivors of `change` in their new world (`info`): under `change.mask`,
        except that with local steps a mask restoring coverage waits for a round's boundary, where every
        holder of a block has the same values. The survivors first go on under their own rows `dropped`
        (the round's average taken again when the last step ended it), then move to the restored mask at
        once on a boundary, else at the next one (`pending_restore`, `restore_due`). Under a schedule every
        round from that boundary on is restored (`Run.continue_with` with ``restore``; the schedule's mover
        makes the move, `restore_due` records it). Returns `change` as recorded: with `restore_at` and the
        survivors' rows where the move waits.

        A worker lost meanwhile (a collective of the new sync fails, or of the move that restores coverage,
        which is all or nothing across the survivors: `MoveVote`, `moved_everywhere`) leaves every survivor
        at its state from before: its rows `dropped`; with a static mask the old sync in force, under a
        schedule the survivors' (the schedule's mover undid its part: `RoundsMixin.enter_next_round`, the
        change to the restored round no longer due; this sync is closed). A loss after every survivor received
        the move, while they build their new sync (static) or holder groups (a schedule's), leaves each
        holding its rows of `change.mask`, which the sync in force, closed, then describes
        (`ModeSync.for_survivors`; under a schedule the round entered). Either way those still alive agree
        again (the next generation), decide from the rows they hold (under a schedule also every later round's
        designed rows; a block without holder there stops the run in one line, `WorkerLossError`), restore
        coverage for themselves and go on or move again (`_again`); the change recorded has every worker lost,
        `restored` where a move was made, and `moved_bytes` every move made."""
        self.pending_restore = self.pending_round_restore = None  # a later loss designs from the rows in force
        local_steps = run.cfg.local_steps
        rows = change.rows  # the survivors' ranks in the world of `run.sync`
        scheduled_restore = self.scheduled and self.restore is not None and run.steps_applied < run.cfg.steps
        made = False  # a move every survivor received, before a worker was lost while they built their sync
        while True:
            self.move, self.moved, before = None, None, run.sync
            try:
                if scheduled_restore:
                    # every round restored from the next step's on (none after the run's last step), made by the
                    # schedule's mover at once (all or nothing), or with local steps at the boundary after the
                    # round the loss interrupted
                    at = restore_step(run.steps_applied, local_steps)
                    now = at == run.steps_applied
                    run.continue_with(change.mask if now else dropped, rows, info,
                                      self._vote(run, step, change.workers, change.restored and now),
                                      restore=self.restore)
                    if at > run.steps_applied:
                        self.pending_round_restore = (at, run.mask_change_bytes, run.mask_change_seconds)
                        change = dataclasses.replace(change, mask=dropped, restored=False, restore_at=at)
                    break
                if change.restored and local_steps > 1 and change.lost:
                    run.continue_with(dropped, rows, info)
                    rows = tuple(range(len(change.workers)))
                    at = restore_step(run.steps_applied, local_steps)
                    if at > run.steps_applied:
                        self.pending_restore = change.mask
                        change = dataclasses.replace(change, mask=dropped, restored=False, restore_at=at)
                        break
                    run.sync.close()
                run.continue_with(change.mask, rows, info, self._vote(run, step, change.workers, change.restored))
                break
            except RuntimeError as exc:  # DistError and CollectiveError included: a worker lost meanwhile
                if run.sync is not before:  # under a schedule the survivors' sync was in force when the move failed
                    run.sync.close()
                    rows = tuple(range(len(change.workers)))
                made = made or bool(self.moved)
                change, dropped, info, rows = self._again(run, step, exc, change, dropped, rows)
        self.move = None
        self.workers, self.mask = change.workers, change.mask
        return dataclasses.replace(change, restored=True) if made else change

    def _vote(self, run, step: int, workers: Sequence[int], restored: bool) -> MoveVote | None:
        """The all-or-nothing answer of a move to restore coverage at `step` among `workers` (the new world's),
        None where nothing moves (not `restored`). Tests only: ``SDP_TEST_KILL_IN_MOVE=W`` kills worker W
        once the move's values have been sent, before its optimizer state is; ``W:voted`` once every survivor
        answered that it received the move, before the survivors' new sync is built; ``W:S`` only in a move at
        step S (an admission's too, `welcome_vote`)."""
        self.move, self.moved = ((step, tuple(workers)) if restored else None), None
        if not restored:
            return None

        def agreed() -> bool:
            self.moved = moved_everywhere(self.store, self.generation, step, self.worker, workers, received=True,
                                          timeout=agreement_timeout())
            if self.moved and run.faults.kill_in_move == self.worker and run.faults.kill_move_voted:
                die()
            return self.moved

        def began() -> None:
            if (run.faults.kill_in_move == self.worker and not run.faults.kill_move_voted
                    and run.faults.kill_in_move_step in (None, step)):
                die()

        return MoveVote(agreed, began)

    def _again(self, run, step: int, error: BaseException, change: MembershipChange, dropped: Mask,
               rows: Sequence[int]) -> tuple[MembershipChange, Mask, DistInfo, tuple[int, ...]]:
        """After `error` interrupted the survivors of `change` going on (`_go_on`). Where the move that restores
        coverage was not made (no move, or not every survivor received it: `moved` not True), every survivor
        is at its rows `dropped` and `run.sync` is the old one, in whose world `rows` are their ranks; this
        rank answers that it did not receive the move (if it had not answered). Where every survivor received
        it, each holds its rows of `change.mask` with their values and optimizer state (what it dropped is
        gone), and `run.sync`, closed, describes that state in the world of `change.workers`
        (`ModeSync.for_survivors`): a fresh loss from there. Either way the workers still alive agree again
        from those rows and form their world; returns their change (every worker lost so far), their rows
        before any restore, this rank's place and their ranks in `run.sync`'s world."""
        if isinstance(error, WorkerLossError):
            raise error
        if self.moved:  # the survivors' rows in force are the restored ones, their ranks those of its world
            dropped, rows = change.mask, tuple(range(len(change.workers)))
        elif self.move is not None and self.moved is None:  # the others stop waiting for this rank's answer
            moved_everywhere(self.store, self.generation, self.move[0], self.worker, self.move[1], received=False,
                             timeout=timedelta(0))
        release_frames(error)
        self.workers, self.mask = change.workers, dropped
        rounds = run.sync.rounds_to_train(run.cfg.steps)
        rounds = None if rounds is None else [(at, np.asarray(m)[list(rows)]) for at, m in rounds]
        new, new_dropped, info = self._agree_and_form(run, step, error, run.device, rounds)
        if info.is_main:
            self.store.set(MEMBERS_KEY, ",".join(map(str, new.workers)))
        rows = tuple(rows[r] for r in new.rows)
        return dataclasses.replace(new, lost=(*change.lost, *new.lost), rows=rows), new_dropped, info, rows

    def restore_due(self, run, step: int) -> MembershipChange | None:
        """At the boundary before `step` (a step follows; every member calls it): with local steps, move to
        the mask that restores the designed coverage that a loss inside the last round left due
        (`pending_restore`), now that the round's average made every holder's copy the same; each
        survivor gains what its restored row gives it, with the AdamW state, from the lowest-ranked
        holder (`Run.continue_with` with every worker kept: `MaskChanges.hand_over`). Under a schedule
        the schedule's mover has made that move already, right after the average that ended the last
        step (`Rounds.restore_from`): only the record is made here (`pending_round_restore`; none where
        the round's designed rows kept the coverage). None when nothing is due here. With a static mask a
        worker lost during the move is survived as in `recover` (`_go_on`): the change returned then has it
        lost."""
        if self.pending_round_restore is not None and step == self.pending_round_restore[0]:
            moved = run.mask_change_bytes - self.pending_round_restore[1]  # the one change since the loss
            seconds = run.mask_change_seconds - self.pending_round_restore[2]
            self.pending_round_restore = None
            rounds = run.sync.schedule_rounds
            self.mask = Mask(rounds.matrix, block_names=self.mask.block_names, block_sizes=self.mask.block_sizes)
            if np.array_equal(rounds.matrix, rounds.designed_rows(step)):
                return None  # no block fell below the coverage in this round: nothing was restored
            change = MembershipChange(step, (), self.workers, tuple(range(len(self.workers))), self.mask,
                                      restored=True, moved_bytes=moved, recovery_s=seconds)
            self.changes.append(change)
            return change
        if self.pending_restore is None or step % run.cfg.local_steps:
            return None
        began = time.perf_counter()
        mask, self.pending_restore = self.pending_restore, None
        change = MembershipChange(step, (), self.workers, tuple(range(len(self.workers))), mask, restored=True)
        run.sync.close()
        change = self._go_on(run, change, self.mask, run.info, step)
        change = dataclasses.replace(change, recovery_s=time.perf_counter() - began, moved_bytes=run.sync.moved_bytes)
        self.changes.append(change)
        return change


def _workers_go_on(workers: Sequence[int]) -> str:
    """``workers 1, 2 go`` or, for one, ``worker 1 goes``.

    >>> _workers_go_on([1, 2]), _workers_go_on([2])
    ('workers 1, 2 go', 'worker 2 goes')
    """
    return f"workers {', '.join(map(str, workers))} go" if len(workers) > 1 else f"worker {workers[0]} goes"


def members_state_kept(mask: Mask, welcome: Mask, members: int, *, moving: bool, voted: bool,
                       moved: bool | None) -> str | None:
    """Why the members of an admission that failed must stop (the words that say so), or None when their
    values, buffers and optimizer state are those they had before it, so that they go on without the
    joiners (`Survival.admit`). `mask`: the designed rows of the new world's workers, the `members`
    members first (under a schedule, of the round in force); `welcome`: the admission's welcome mask (the
    members' rows in force first); `moving`: the failure came once the joiners had their parts, while
    every rank went from `welcome` to `mask` (`Run.to_designed`), else before; `voted`: that move was all
    or nothing (`MoveVote`); `moved`: every rank had answered that it received it.

    Before the world forms nothing of a member's has changed (under a schedule the members made a change
    of round that a loss left due before the admission began, `Survival.admit`). While the joiners receive
    their parts a member only sends (`send_parts`, `move_optimizer_state`: what a member held before, it
    holds after). Where its rows in force are not its designed ones (restored for the survivors of a
    loss) it then gains and drops parts, all or nothing (with a static mask as survivors restore coverage,
    under a schedule by the schedule's mover): undone on every rank until every rank received the move,
    after which a failure (while the new sync or holder groups are built) stops the members.

    >>> designed = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    >>> mask = Mask(designed.matrix[[1, 2, 0]])  # workers 1 and 2 admit worker 0
    >>> members_state_kept(mask, mask, 2, moving=True, voted=False, moved=None) is None
    True
    >>> restored = Mask([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    >>> members_state_kept(mask, restored, 2, moving=False, voted=True, moved=None) is None
    True
    >>> members_state_kept(mask, restored, 2, moving=True, voted=True, moved=False) is None  # undone everywhere
    True
    >>> members_state_kept(mask, restored, 2, moving=True, voted=True, moved=True).split(";")[0]
    'after every member and joiner received the parts of the designed rows, while they built their new sync'
    >>> members_state_kept(mask, restored, 2, moving=True, voted=False, moved=None).split(";")[0]
    'while the members went from their restored rows to the designed ones of the round'
    """
    if not moving or np.array_equal(welcome.matrix[:members], mask.matrix[:members]):
        return None
    if not voted:
        return ("while the members went from their restored rows to the designed ones of the round; a loss while "
                "members gain and drop parts under a schedule is not recovered")
    if moved:
        return ("after every member and joiner received the parts of the designed rows, while they built their new "
                "sync; a loss then is not recovered")
    return None


def _design_fits(survivors: int, blocks: int, workers: Sequence[int], restore: Mapping[str, Any], mask: Mask) -> None:
    """Raise `DesignError` where `survivors` workers (`workers`, rank order) have no mask restoring the designed
    coverage under `restore` (its budgets): `restored_round` of a round in which each block has one holder,
    which designs (coverage 2 or more) and matches under the budgets as every round that needs a design does."""
    matrix = np.zeros((survivors, blocks), dtype=np.uint8)
    matrix[np.arange(blocks) % survivors, np.arange(blocks)] = 1
    matrix[np.arange(survivors), np.arange(survivors) % blocks] = 1
    restored_round(matrix, workers, restore, mask)


def _welcome_mask(designed: Mask, rows: Sequence[Sequence[int]], joined: Sequence[int], step: int, seed: int
                  ) -> Mask:
    """The mask joiners receive their parts under: the members' `rows` in force, then the designed rows of
    the `joined` workers (under a schedule drawn with `seed`, of the round in force at optimizer step `step`)."""
    matrix = np.vstack([np.asarray(rows, dtype=designed.matrix.dtype).reshape(-1, designed.blocks),
                        designed.round_matrix(step, seed=seed)[list(joined)]])
    return Mask(matrix, block_names=designed.block_names, block_sizes=designed.block_sizes,
                construction=designed.construction)


def _rows(designed: Mask, workers: Sequence[int], step: int, seed: int) -> Mask:
    """The designed mask's rows of `workers`, in their order (under a schedule drawn with `seed`, of the round
    in force at optimizer step `step`)."""
    return Mask(designed.round_matrix(step, seed=seed)[list(workers)], block_names=designed.block_names,
                block_sizes=designed.block_sizes, construction=designed.construction)
