"""The survivors' agreement through the launcher's TCP store (``sdp train --on-worker-loss continue``):
the store's keys, who is left and what they go on with (`agree`, `decide`), forming a new world
(`gather`), whether every survivor received a move that restores coverage (`moved_everywhere`), which
waiting workers join (`joiners_at`), and the errors that stop a run in one line.
`sdp_train.trainer.membership.Survival` drives them; why a store and not torchft: docs/design.md §7.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from masklab import Mask
from masklab.failures import survivors_mask
from masklab.io import mask_to_dict
from sdp_train.parallel.dist import collective_timeout


JOIN_ENV = "SDP_JOINS"  # set by `launch_keeping_survivors` for a replacement worker, which joins a run in progress
MEMBERS_KEY = "sdp/members"  # the workers of the newest membership, comma-separated (the launcher reads it)
STEPS_DONE_KEY = "sdp/steps_done"  # set once the members ran the last step: no worker can join any more


def joining_key(worker: int) -> str:
    """The store key a replacement for worker `worker` sets when it waits to join."""
    return f"sdp/joining/{worker}"


def admission_key(worker: int) -> str:
    """The store key the members set, to the step, world and workers it joins, when they admit `worker`."""
    return f"sdp/admitted/{worker}"


def exited_key(worker: int) -> str:
    """The store key the launcher sets, to the exit code, when worker `worker`'s process has ended."""
    return f"sdp/exited/{worker}"


def finished_key(worker: int) -> str:
    """The store key worker `worker` sets once its part of the run is done (the last collective behind it;
    on rank 0, summary.json written): an exit that comes after it does not fail the run."""
    return f"sdp/finished/{worker}"


class RunEnded(Exception):
    """A replacement for a lost worker (``--max-rejoins``) found the run past its last step, or every member
    exited: there is nothing left for it to join. Not a failure: it stops with a note, exit 0."""


class WorkerLossError(RuntimeError):
    """Losing workers that the survivors cannot continue from: a block lost every holder, the
    survivors applied different steps, or this worker was counted lost. One line; the run stops
    and a checkpoint restart (``--resume``) is the way on. `report`: whether this rank prints it
    (one survivor does; every survivor stops)."""

    def __init__(self, message: str, *, report: bool = True) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class MembershipChange:
    """Who was lost at `step` (the step rerun by the survivors), as workers of the original run."""

    step: int
    lost: tuple[int, ...]
    workers: tuple[int, ...]
    """The survivors, in the order of their new ranks."""
    rows: tuple[int, ...]
    """The survivors' ranks in the world they leave (their rows of the mask in force)."""
    mask: Mask
    """The survivors' mask: the mask in force without the lost rows, or (`restored`) a mask designed for
    the survivors with the designed coverage."""
    recovery_s: float = 0.0
    """Seconds from the failure to the new world and sync, this rank's."""
    restored: bool = False
    """Whether `mask` restores the designed coverage (blocks moved to survivors that did not hold them)."""
    moved_bytes: int = 0
    """Buffer bytes of the blocks and optimizer state moved to restore coverage or to joiners (this rank's
    broadcasts)."""
    joined: tuple[int, ...] = ()
    """Workers that joined at `step` (replacements of lost ones: `lost` is then empty); `mask` is the
    designed mask's rows of `workers` (under a schedule, of the round in force at `step`)."""
    restore_at: int | None = None
    """With local steps, a loss inside a round whose survivors restore the designed coverage: the step at
    whose start they move to the restored mask (the round's boundary, after its average; `mask` is the
    survivors' rows until then, and that move is a change of its own, `restored`, neither lost nor joined)."""
    welcome_mask: Mask | None = None
    """Workers that joined: the mask they receive their parts under, the members' rows in force (the
    survivors' restored rows after ``--restore-coverage``) then the joiners' designed rows; every worker
    goes on to `mask` from it (`sdp_train.trainer.run.Run.to_designed`)."""
    during: str | None = None
    """A loss outside a training step: what the workers were doing (``evaluating``, ``checkpointing``,
    ``saving the final model``), which the survivors do again; `step` is then the next step to train (the
    steps applied). None: the loss came inside step `step`."""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "lost": list(self.lost), "joined": list(self.joined), "workers": list(self.workers),
                "recovery_s": self.recovery_s, "coverage_restored": self.restored, "moved_bytes": self.moved_bytes,
                "restore_at": self.restore_at, "during": self.during, "mask": mask_to_dict(self.mask)}


def decide(mask: Mask, workers: Sequence[int], joined: Mapping[int, int], *, step: int,
           rounds: Sequence[tuple[int, np.ndarray]] | None = None) -> MembershipChange | None:
    """The membership change when `joined` (worker -> optimizer steps it has applied) are the live ones
    of `workers` (the current world's workers, rank order, whose rows `mask` has); None when no worker
    was lost. Raises `WorkerLossError` in one line when the survivors cannot continue.

    Under a schedule, `rounds` (`ModeSync.rounds_to_train`: the mask the workers' state is in, then the
    first step of every round still to train and its mask, rows as `workers`) are checked instead of
    `mask`: a loss that leaves a block without holder in a later round is refused now, since no
    survivor could train that round. The change's mask is then the survivors' rows of the first.

    >>> m = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    >>> decide(m, [0, 1, 2], {0: 4, 2: 4}, step=4).mask.matrix.tolist()
    [[1, 1, 0], [1, 0, 1]]
    >>> decide(m, [0, 1, 2], {0: 4}, step=4)
    Traceback (most recent call last):
    ...
    sdp_train.trainer.agreement.WorkerLossError: step 4: lost workers [1, 2] held every copy of block 2 (block2): continuing is impossible; restart from a checkpoint (--resume)
    >>> two = Mask([[1, 1], [0, 1]])  # under a schedule, rows swap at step 6
    >>> decide(two, [0, 1], {0: 4}, step=4, rounds=[(4, two.matrix), (6, two.matrix[[1, 0]])])
    Traceback (most recent call last):
    ...
    sdp_train.trainer.agreement.WorkerLossError: step 4: lost worker [1] would hold every copy of block 0 (block0) in the round of step 6: continuing is impossible; restart from a checkpoint (--resume)
    """
    lost = tuple(w for w in workers if w not in joined)
    if not lost:
        return None
    many = "s" * (len(lost) > 1)
    steps = sorted(set(joined.values()))
    if len(steps) > 1:
        raise WorkerLossError(f"step {step}: after losing worker{many} {list(lost)} the survivors "
                              f"had applied different numbers of steps {steps}: no survivor can undo a step; "
                              "restart from a checkpoint (--resume)")
    rows = [k for k, w in enumerate(workers) if w in joined]
    for n, (at, matrix) in enumerate(rounds or [(step, mask.matrix)]):
        held = np.asarray(matrix)[rows].any(axis=0)
        if not held.all():
            j = int(np.flatnonzero(~held)[0])
            what = f"would hold every copy of block {j} ({mask.block_names[j]}) in the round of step {at}" if n else (
                f"held every copy of block {j} ({mask.block_names[j]})")
            raise WorkerLossError(f"step {step}: lost worker{many} {list(lost)} {what}: continuing is impossible; "
                                  "restart from a checkpoint (--resume)")
    gone = [k for k, w in enumerate(workers) if w not in joined]
    in_force = mask if rounds is None else Mask(rounds[0][1], block_names=mask.block_names,
                                                block_sizes=mask.block_sizes)
    return MembershipChange(step, lost, tuple(workers[k] for k in rows), tuple(rows), survivors_mask(in_force, gone))


def agreement_timeout() -> timedelta:
    """How long the survivors wait for each other to join an agreement: twice the collective timeout.

    A survivor learns of a loss from a collective that fails. One blocked in a collective with
    another survivor that has already left it (for the agreement) gives the collective up within a
    second of that survivor's joining the agreement (`loss_begun`, checked by gloo waits that take
    longer: `sdp_train.parallel.dist.watch_waits`); a collective that is not watched (NCCL's, or a
    gloo one outside the wrapper and the step's statistics) fails only when it times out, so a
    survivor may join up to one collective timeout after the first; a wait of one timeout would then
    decide without it, and it would stop although alive (seen under load in the suite).
    """
    return 2 * collective_timeout()


def agree(store: dist.Store, generation: int, worker: int, workers: Sequence[int], applied: int, *,
          timeout: timedelta) -> dict[int, int]:
    """The live workers of `workers` and the steps each applied, the same on every one of them.

    Each live worker writes the steps it applied under this `generation`'s keys, then waits until
    every worker has either written or been marked exited by the launcher (`exited_key`), or for
    `timeout`. The first to finish waiting writes the decision (a compare-and-set: the first write
    wins), which every worker then reads: a worker that joins after it is not in it.
    """
    prefix = f"sdp/loss{generation}/"
    store.set(f"{prefix}joined{worker}", str(applied))
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if all(store.check([f"{prefix}joined{w}"]) or store.check([exited_key(w)]) for w in workers):
            break
        time.sleep(0.02)
    live = {w: int(store.get(f"{prefix}joined{w}")) for w in workers
            if store.check([f"{prefix}joined{w}"]) and not store.check([exited_key(w)])}
    decided = store.compare_set(f"{prefix}decision", "", json.dumps(sorted(live.items())))
    return {int(w): int(s) for w, s in json.loads(decided)}


def release_frames(error: BaseException) -> None:
    """Clear the locals of the frames that `error`, and the errors it chains, unwound.

    The failed or given-up collective's gloo work stays referenced from them, and with it its gloo
    context, whose connections to the peers then stay open after ``destroy_process_group``: a peer
    still reading from one waits out the collective timeout (docs/design.md §7).
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class WorldNotFormed(RuntimeError):
    """A worker of a world being formed exited, or did not come in time, before the forming (`gather`)."""


def gather(store: dist.Store, generation: int, worker: int, workers: Sequence[int], *, timeout: timedelta) -> None:
    """Wait until every worker of `workers` has come to form the world of `generation` (this one included).

    Raises `WorldNotFormed` as soon as one that has not come has an exit mark from the launcher
    (`exited_key`), or after `timeout`: without this a survivor waits the whole collective timeout in the
    process group's rendezvous for a worker that died during the recovery (600 s by default). A worker
    that dies after it came still fails the rendezvous by its timeout. Likewise as soon as one of them
    has begun the next generation's agreement (`agree`): it gave this world up (its own forming failed,
    or a member's admission of a joiner), and while one has not come none has formed it.
    """
    prefix = f"sdp/form{generation}/"
    store.set(f"{prefix}came{worker}", "1")
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        absent = [w for w in workers if not store.check([f"{prefix}came{w}"])]
        if not absent:
            return
        gone = [w for w in absent if store.check([exited_key(w)])]
        if gone:
            raise WorldNotFormed(f"worker(s) {gone} exited before the world of generation {generation} formed")
        left = [w for w in workers if w != worker and store.check([f"sdp/loss{generation + 1}/joined{w}"])]
        if left:
            raise WorldNotFormed(f"worker(s) {left} gave up the world of generation {generation} before it formed")
        if time.monotonic() >= deadline:
            raise WorldNotFormed(f"worker(s) {absent} did not come to form the world of generation {generation} "
                               f"within {timeout.total_seconds():g} s")
        time.sleep(0.02)


def moved_everywhere(store: dist.Store, generation: int, step: int, worker: int, workers: Sequence[int], *,
                     received: bool, timeout: timedelta) -> bool:
    """Whether every worker of `workers` (this one included) received every part of the move that restores
    coverage at `step` in the world of `generation`: the move is all or nothing, each survivor drops
    anything only when this says True, and undoes what it received when False.

    Each worker writes whether it `received` every part, once, and then reads the others': False as soon
    as one wrote that it did not, or has an exit mark from the launcher without having written, or has
    not written within `timeout`. Every key is written once, by a compare-and-set (the first write wins:
    a worker that gives up on an absent one writes False for it), so every worker that asks reads the
    same answers and decides alike; the exit marks are read before the answers, so one that wrote True
    and then exited counts as having received."""
    prefix = f"sdp/moved{generation}/{step}/"

    def answer(w: int, value: str) -> bool:
        return store.compare_set(f"{prefix}{w}", "", value) == b"1"

    if not answer(worker, "1" if received else "0"):
        return False
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        exited = {w for w in workers if store.check([exited_key(w)])}
        answered = {w: store.get(f"{prefix}{w}") == b"1" for w in workers if store.check([f"{prefix}{w}"])}
        if not all(answered.values()):
            return False
        absent = [w for w in workers if w not in answered]
        if not absent:
            return True
        if (exited & set(absent)) or time.monotonic() >= deadline:
            if not all(answer(w, "0") for w in absent):
                return False
        time.sleep(0.02)


def joiners_at(store: dist.Store, step: int, missing: Sequence[int]) -> list[int]:
    """The workers of `missing` that join at the boundary before `step`, the same for every member that
    asks: the first to ask writes those whose replacement waits (`joining_key`) with a compare-and-set
    (the first write wins), and every member reads that; a replacement that comes later joins later."""
    waiting = [w for w in missing if store.check([joining_key(w)])]
    return json.loads(store.compare_set(f"sdp/admit/{step}", "", json.dumps(waiting)))


@contextmanager
def joining_fails(worker: int, step: int) -> Iterator[None]:
    """Where a replacement for worker `worker`, admitted at `step`, forms its world and receives its parts: a
    failure there (the members gave up its admission, or one of them was lost) stops it in one line,
    `WorkerLossError`; the members go on without it where they can (`Survival.admit`)."""
    try:
        yield
    except RuntimeError as exc:  # DistError, WorldNotFormed and a failed collective included
        if isinstance(exc, WorkerLossError):
            raise
        raise WorkerLossError(f"worker {worker}: its admission at step {step} failed ({type(exc).__name__}); it "
                              "stops") from exc
