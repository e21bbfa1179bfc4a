"""Faults a test injects into a real run through the environment, read once when the run starts.

``SDP_TEST_INJECT_NAN=S:R`` makes rank R's loss (and so its gradients) NaN at step S;
``SDP_TEST_KILL_AT_STEP=S:R`` makes rank R SIGKILL itself at step S, after its gradient
collectives and before the optimizer step; ``SDP_TEST_KILL_IN_RECOVERY=W`` makes worker W (of the
first world) SIGKILL itself in its first recovery from a lost worker (``--on-worker-loss continue``),
after the survivors' decision and before their new world forms; ``SDP_TEST_KILL_IN_MOVE=W`` makes
worker W SIGKILL itself in the first move of blocks to restore coverage (``--restore-coverage``) it takes
part in, once the blocks' values have been sent and before their optimizer state is, and
``SDP_TEST_KILL_IN_MOVE=W:voted`` once every survivor answered that it received that move, before the
survivors' new sync is built (its holder groups); ``W:S``: in a move at step S only, once its values have
been sent (such as the move of an admission at step S from the members' restored rows to their designed
ones, which a joiner takes part in too); ``SDP_TEST_JOIN_AT_STEP=S`` makes
the members of a run that misses a worker (``--max-rejoins``) admit replacements at step S's
boundary only (with ``--local-steps H``, a multiple of H: members admit nowhere else), waiting there
until every missing worker's replacement waits to join, so that a test knows the step (a
replacement's start takes seconds); ``S,T,...`` admits at each of those steps (a second replacement,
after the first was lost while it joined); ``SDP_TEST_KILL_JOINER=S`` makes the replacement admitted at
step S SIGKILL itself once its new world has formed, before its parts come (the members are then
sending them); ``SDP_TEST_KILL_OUTSIDE=POINT:N:W`` makes worker W (its number in the first world) SIGKILL
itself outside a training step, after N steps: at the start of an evaluation (``evaluating``, the final one
too), in ``save_checkpoint`` of ``step_N`` once its rank file is written (``checkpointing``), in the final
evaluation once rank 0 has saved the model (``saving``; another rank: before the result comes), or once its
part of the run is done (``finished``, N the run's steps); ``SDP_TEST_HOLD_AT=POINT:N:H:V`` puts
survivors of a loss at different points of the run: in the evaluation after N steps (``evaluating``), worker V
SIGKILLs itself once rank 0's broadcast of the result has reached it, and worker H, its part of the broadcast
posted, holds before waiting for it until V has exited (its mark in the launcher's store), then fails there as
if the result had not come (a `RuntimeError`, as a collective with a lost peer raises), while the others went on
with the result (to the next step or the checkpoint); in ``save_checkpoint`` of ``step_N`` (``checkpointing``)
likewise around its last barrier (the checkpoint complete), the others going on to the next step or the final
save. All act on the first attempt of a job only: a restarted worker group runs clean.
`sdp_train.trainer.run.Run` reads them once (`InjectedFaults.from_environment`); the step then compares two
integers, and nothing else in a run's code path differs. RELIABILITY.md lists the tests that use them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from sdp_train.trainer.launch import restart_attempt

NAN_VARIABLE = "SDP_TEST_INJECT_NAN"
KILL_VARIABLE = "SDP_TEST_KILL_AT_STEP"
RECOVERY_KILL_VARIABLE = "SDP_TEST_KILL_IN_RECOVERY"
MOVE_KILL_VARIABLE = "SDP_TEST_KILL_IN_MOVE"
JOIN_VARIABLE = "SDP_TEST_JOIN_AT_STEP"
JOINER_KILL_VARIABLE = "SDP_TEST_KILL_JOINER"
OUTSIDE_KILL_VARIABLE = "SDP_TEST_KILL_OUTSIDE"
OUTSIDE_POINTS = ("evaluating", "checkpointing", "saving", "finished")
HOLD_VARIABLE = "SDP_TEST_HOLD_AT"
HOLD_POINTS = ("evaluating", "checkpointing")
HOLD_LIMIT_S = 120.0
"""How long `hold_for` waits for worker V's exit at most (a misplaced V never dies)."""


@dataclass(frozen=True)
class InjectedFaults:
    """Where a test wants a fault: ``(step, rank)`` pairs, or None for none.

    >>> faults = InjectedFaults.from_environment({"SDP_TEST_INJECT_NAN": "3:1"}, attempt=0)
    >>> faults.nan(3, 1), faults.nan(3, 0), faults.kill(3, 1)
    (True, False, False)
    >>> moved = InjectedFaults.from_environment({"SDP_TEST_KILL_IN_MOVE": "2:voted"}, attempt=0)
    >>> moved.kill_in_move, moved.kill_move_voted
    (2, True)
    """

    nan_at: tuple[int, int] | None = None
    kill_at: tuple[int, int] | None = None
    kill_in_recovery: int | None = None
    join_at: tuple[int, ...] | None = None
    kill_joiner: int | None = None
    kill_in_move: int | None = None
    kill_outside: tuple[str, int, int] | None = None
    """``(point, steps, worker)``: ``SDP_TEST_KILL_OUTSIDE``."""
    kill_move_voted: bool = False
    """``SDP_TEST_KILL_IN_MOVE=W:voted``: worker `kill_in_move` dies after the move's vote, not during the move."""
    kill_in_move_step: int | None = None
    """With `kill_in_move`: the step of the move it is killed in; None: its first move."""
    hold_at: tuple[str, int, int, int] | None = None
    """``(point, steps, held, killed)``: ``SDP_TEST_HOLD_AT``."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *, attempt: int | None = None
                         ) -> InjectedFaults:
        """The faults ``environ`` (default ``os.environ``) asks for; none on a restarted attempt.

        Raises
        ------
        ValueError
            A variable is set but not ``STEP:RANK`` (two integers >= 0).

        >>> faults = InjectedFaults.from_environment({"SDP_TEST_KILL_IN_MOVE": "0:4"}, attempt=0)
        >>> faults.kill_in_move, faults.kill_in_move_step
        (0, 4)
        """
        environ = os.environ if environ is None else environ
        if (restart_attempt() if attempt is None else attempt) != 0:
            return cls()
        worker, join = environ.get(RECOVERY_KILL_VARIABLE), environ.get(JOIN_VARIABLE)
        joiner, mover = environ.get(JOINER_KILL_VARIABLE), environ.get(MOVE_KILL_VARIABLE)
        mover, colon, at = (None, "", "") if mover is None else mover.partition(":")
        if colon and at != "voted" and not (at.isascii() and at.isdigit()):
            raise ValueError(f"{MOVE_KILL_VARIABLE}={environ[MOVE_KILL_VARIABLE]!r} must be W, W:voted or W:S, W a "
                             "worker number and S a step, integers >= 0")
        for variable, value, what in ((RECOVERY_KILL_VARIABLE, worker, "a worker number, an integer >= 0"),
                                      (MOVE_KILL_VARIABLE, mover, "W, W:voted or W:S, W a worker number"),
                                      (JOIN_VARIABLE, join, "steps (integers >= 0) separated by commas"),
                                      (JOINER_KILL_VARIABLE, joiner, "a step, an integer >= 0")):
            parts = [] if value is None else value.split(",") if variable == JOIN_VARIABLE else [value]
            if not all(v.isascii() and v.isdigit() for v in parts):
                raise ValueError(f"{variable}={value!r} must be {what}")
        outside = environ.get(OUTSIDE_KILL_VARIABLE)
        if outside is not None:
            point, _, spec = outside.partition(":")
            steps, _, worker_of = spec.partition(":")
            if point not in OUTSIDE_POINTS or not all(v.isascii() and v.isdigit() for v in (steps, worker_of)):
                raise ValueError(f"{OUTSIDE_KILL_VARIABLE}={outside!r} must be POINT:STEPS:WORKER, POINT one of "
                                 f"{', '.join(OUTSIDE_POINTS)}, STEPS and WORKER integers >= 0")
            outside = (point, int(steps), int(worker_of))
        hold = environ.get(HOLD_VARIABLE)
        if hold is not None:
            point, *numbers = hold.split(":")
            if (point not in HOLD_POINTS or len(numbers) != 3 or not all(v.isascii() and v.isdigit() for v in numbers)
                    or numbers[1] == numbers[2]):
                raise ValueError(f"{HOLD_VARIABLE}={hold!r} must be POINT:N:H:V, POINT one of "
                                 f"{', '.join(HOLD_POINTS)}, N, H and V integers >= 0 (steps, the worker held, the "
                                 "worker killed; H and V differ)")
            hold = (point, *(int(v) for v in numbers))
        return cls(_spec(environ, NAN_VARIABLE), _spec(environ, KILL_VARIABLE),
                   None if worker is None else int(worker),
                   None if join is None else tuple(int(s) for s in join.split(",")),
                   None if joiner is None else int(joiner), None if mover is None else int(mover), outside,
                   at == "voted", int(at) if colon and at != "voted" else None, hold)

    def nan(self, step: int, rank: int) -> bool:
        """True where this step's loss on this rank is to be NaN."""
        return self.nan_at == (step, rank)

    def kill(self, step: int, rank: int) -> bool:
        """True where this rank is to SIGKILL itself at this step."""
        return self.kill_at == (step, rank)

    def kill_at_point(self, point: str, steps: int, worker: int) -> None:
        """SIGKILL this process where ``SDP_TEST_KILL_OUTSIDE`` asks for it: at `point` after `steps` steps, on
        worker `worker`; a no-op elsewhere.

        >>> InjectedFaults(kill_outside=("evaluating", 4, 2)).kill_at_point("evaluating", 4, 1)
        """
        if self.kill_outside == (point, steps, worker):
            die()


    def hold_for(self, point: str, steps: int, worker: int, exited) -> None:
        """Where ``SDP_TEST_HOLD_AT`` holds worker `worker` at `point` after `steps` steps, before the wait of its
        last collective: wait until `exited` (of a worker number) says the worker killed there has exited,
        then raise as a collective with a lost peer does; a no-op elsewhere.

        >>> InjectedFaults(hold_at=("evaluating", 4, 1, 0)).hold_for("evaluating", 4, 2, lambda w: True)
        >>> InjectedFaults(hold_at=("evaluating", 4, 1, 0)).hold_for("evaluating", 4, 1, lambda w: w == 0)
        Traceback (most recent call last):
        RuntimeError: SDP_TEST_HOLD_AT: worker 1 gave up waiting in evaluating after step 4 once worker 0 exited
        """
        if self.hold_at is None or self.hold_at[:3] != (point, steps, worker):
            return
        killed = self.hold_at[3]
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not exited(killed) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise RuntimeError(f"{HOLD_VARIABLE}: worker {worker} gave up waiting in {point} after step {steps} once "
                           f"worker {killed} exited")

    def kill_after(self, point: str, steps: int, worker: int) -> None:
        """SIGKILL worker `worker` once the last collective at `point` after `steps` steps passed, where
        ``SDP_TEST_HOLD_AT`` asks for it; a no-op elsewhere."""
        if self.hold_at is not None and (*self.hold_at[:2], self.hold_at[3]) == (point, steps, worker):
            die()


def die() -> NoReturn:
    """SIGKILL this process, where a test's fault asks for it: no handler, `finally` or exit hook runs."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL is not caught")


def _spec(environ: Mapping[str, str], variable: str) -> tuple[int, int] | None:
    text = environ.get(variable)
    if text is None:
        return None
    step, _, rank = text.partition(":")
    if not (step.isascii() and rank.isascii() and step.isdigit() and rank.isdigit()):
        raise ValueError(f"{variable}={text!r} must be STEP:RANK, two integers >= 0")
    return int(step), int(rank)
