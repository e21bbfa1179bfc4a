"""Which theorem of docs/theory.md covers a training run, and its bound ratio to DDP.

A run is described by its mode (the runtime's ``ddp``, ``fsdp``, ``bsdp``, ``nsdp``, ``bbsdp``),
its mask and schedule, its local steps H and whether it averages stepwise (every holder gets the
same value, and non-holders receive it) or by overlap averaging (copies kept, holders average,
non-holders keep theirs), and by its training rule: every theorem is for plain SGD with a constant
step, so a run with another optimizer (AdamW), a step-size schedule (warm-up, cosine decay) or
gradient clipping is covered by none. Forward-masked SDP (``bsdp``, ``nsdp``) is covered by no
theorem either: a held block's gradient is then taken at a point other than the iterate, which
Lemma 1 does not allow.
This module only classifies and evaluates; the bounds are in `theory.bounds` and
`theory.consensus`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from masklab.mask import Mask, Schedule
from theory.bounds import ddp_bound, optimal_step_size, sdp_bound
from theory.consensus import optimal_overlap_step_size, overlap_bound
from theory.constants import worst_case_constants
from theory.errors import TheoryError

RUN_MODES = ("ddp", "fsdp", "bsdp", "nsdp", "bbsdp")
OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "warmup", "cosine", "warmup+cosine")
_FORWARD_MASKED = ("bsdp", "nsdp")
_FULL_MODEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class Coverage:
    """The theorem that covers a run (None if none does) and the regime it is stated for."""

    theorem: str | None
    regime: str

    @property
    def covered(self) -> bool:
        return self.theorem is not None


def covering_theorem(
    mode: str, schedule: Schedule | None = None, *, local_steps: int = 1, overlap: bool = False,
    optimizer: str = "sgd", lr_schedule: str = "constant", clipping: bool = False,
) -> Coverage:
    """Which theorem bounds a run of `mode` with `schedule` (static if None) and its training rule.

    >>> covering_theorem("bbsdp", Schedule("permute", 1)).theorem
    "Theorem 2'"
    >>> covering_theorem("bsdp").covered
    False
    >>> covering_theorem("ddp", optimizer="adamw", lr_schedule="warmup+cosine", clipping=True).theorem is None
    True
    """
    if mode not in RUN_MODES:
        raise TheoryError(f"mode={mode!r} is not one of {RUN_MODES}")
    if isinstance(local_steps, bool) or not isinstance(local_steps, (int, np.integer)) or local_steps < 1:
        raise TheoryError(f"local_steps={local_steps!r} must be an integer >= 1")
    if optimizer not in OPTIMIZERS:
        raise TheoryError(f"optimizer={optimizer!r} is not one of {OPTIMIZERS}")
    if lr_schedule not in LR_SCHEDULES:
        raise TheoryError(f"lr_schedule={lr_schedule!r} is not one of {LR_SCHEDULES}")
    schedule = Schedule() if schedule is None else schedule
    rule = [w for w, off in ((optimizer, optimizer != "sgd"), (f"{lr_schedule} step size", lr_schedule != "constant"),
                             ("gradient clipping", clipping)) if off]
    if rule:
        return Coverage(None, f"{', '.join(rule)}: no theorem covers it (every theorem is for plain SGD with a "
                              "constant step, docs/theory.md)")
    if mode in _FULL_MODEL:
        if local_steps > 1:
            return Coverage("Theorem 3", "DDP with local steps (every block held by all K workers)")
        return Coverage("Corollary (DDP)", "minibatch SGD on all K workers")
    if mode in _FORWARD_MASKED:
        return Coverage(None, "forward masking: no theorem covers it (docs/theory.md §6)")
    if overlap:
        return Coverage("Theorem 6", f"backward masking, overlap averaging every {local_steps} local steps, "
                                     f"{_schedule_words(schedule)}; consensus by Theorem 4; for masks held over "
                                     "rounds the smaller of Theorems 6 and 6.3; bounds the mean of "
                                     "all K copies (the exported model, each block its holders' mean: "
                                     "Corollary 6.1)")
    redrawn = schedule.kind == "permute" and schedule.every == local_steps
    drawn = "mask redrawn every update" if redrawn else f"mask in force at each update ({_schedule_words(schedule)})"
    if local_steps > 1:
        return Coverage("Theorem 3", f"backward masking, {local_steps} local steps then stepwise averaging, {drawn}")
    return Coverage("Theorem 2'" if redrawn else "Theorem 1", f"backward masking, stepwise averaging, {drawn}")


def covered_bound_ratio(
    mode: str, mask: Mask | None, *, steps: int, local_steps: int = 1, overlap: bool = False,
    optimizer: str = "sgd", lr_schedule: str = "constant", clipping: bool = False,
) -> float | None:
    """The covering theorem's bound over DDP's, each at its best step size; None if not covered.

    Unit constant totals (L = sigma = zeta = D = 1, and G = 1 for local steps or overlap averaging)
    split across blocks in the worst way (docs/theory.md, Proposition 1), as `sdp verify` does.
    ``inf`` when the theorem gives no finite bound (e.g. overlap averaging with a static mask).
    `mask` may be None for ``ddp``/``fsdp``, whose ratio is 1. The training rule (`optimizer`,
    `lr_schedule`, `clipping`) is as in `covering_theorem`: None for any but constant-step SGD.
    With overlap averaging the bound is Theorem 6's, for the mean of all K copies.

    >>> m = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    >>> covered_bound_ratio("bsdp", m, steps=100) is None
    True
    >>> covered_bound_ratio("bbsdp", m, steps=100) > 1
    True
    """
    coverage = covering_theorem(mode, None if mask is None else mask.schedule, local_steps=local_steps,
                                overlap=overlap, optimizer=optimizer, lr_schedule=lr_schedule, clipping=clipping)
    if not coverage.covered:
        return None
    if mode in _FULL_MODEL and local_steps == 1:
        return 1.0
    if mask is None:
        raise TheoryError(f"mode={mode!r} with local_steps={local_steps} needs the run's mask")
    if mode in _FULL_MODEL:
        # every worker holds everything, in every round of the schedule
        complete = [np.ones_like(m) for m in mask.matrices]
        mask = Mask(complete[0], block_sizes=mask.block_sizes, schedule=mask.schedule,
                    rounds=complete if mask.rounds is not None else None)
    grad = 1.0 if (local_steps > 1 or overlap) else None
    constants = worst_case_constants(mask, smoothness=1.0, sigma=1.0, zeta=1.0, suboptimality=1.0, grad_bound=grad)
    full = Mask(np.ones_like(mask.matrix), block_sizes=mask.block_sizes)
    ddp = ddp_bound(mask, constants, eta=optimal_step_size(full, constants, steps=steps), steps=steps).total
    if overlap:
        eta = optimal_overlap_step_size(mask, constants, steps=steps, local_steps=local_steps)
        total = overlap_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps).total
    else:
        eta = optimal_step_size(mask, constants, steps=steps, local_steps=local_steps)
        total = sdp_bound(mask, constants, eta=eta, steps=steps, local_steps=local_steps).total
    return total / ddp if math.isfinite(total) else math.inf


def _schedule_words(schedule: Schedule) -> str:
    if schedule.is_static:
        return "static mask"
    return f"{schedule.kind} every {schedule.every} steps"

