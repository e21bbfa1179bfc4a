"""Distributed plumbing shared by the library and the trainer: the same code runs as one process or under torchrun.

Tiny helpers in the style of nanochat's ``common.py``: `get_dist_info` reads torchrun's
environment, `default_device` picks the rank's device, `collective_timeout` is every collective's
and group's timeout, `wait` waits for a collective (`watch_waits`: and gives it up when the caller
says so), `meet_before_groups` lets the caller watch the making of process groups likewise, `print0`
prints on rank 0. Creating the default group, launching ranks and
agreeing on restarts is the trainer's (`sdp_train.trainer.launch`). This module decides nothing
about SDP itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) has set the rendezvous environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def get_dist_info() -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    if under_torchrun():
        return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    return DistInfo(0, 1, 0)


def rank_and_world() -> tuple[int, int]:
    """This rank and the world size of the default group, ``(0, 1)`` without one (the library's view)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", get_dist_info().local_rank)
    return torch.device("cpu")


DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def collective_timeout() -> timedelta:
    """How long any collective may wait for a peer before it fails (``SDP_COLLECTIVE_TIMEOUT_S``).

    Set deliberately (default 600 s) so that a stuck or dead rank ends the job with an error
    instead of an endless hang.
    """
    raw = os.environ.get("SDP_COLLECTIVE_TIMEOUT_S", str(DEFAULT_COLLECTIVE_TIMEOUT_S))
    try:
        seconds = float(raw) if raw.isascii() else float("nan")  # float() also reads '٣٠٠'
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"SDP_COLLECTIVE_TIMEOUT_S={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


NCCL_SPLIT_SHARE_ENV = "NCCL_COMM_SPLIT_SHARE_RESOURCES"
"""NCCL's switch for communicators split from a parent (every holder-set group: docs/design.md §5)
to share the parent's buffers, streams and proxy instead of allocating their own."""


def share_split_resources() -> None:
    """Turn NCCL's resource sharing for split communicators on, unless ``NCCL_COMM_SPLIT_SHARE_RESOURCES``
    is set already (``=0`` keeps them apart). NCCL reads it once, at its first communicator: call
    before the default group exists. Sharing serialises the collectives of the groups on a device,
    safe because every rank issues them in one global order (docs/design.md §5)."""
    os.environ.setdefault(NCCL_SPLIT_SHARE_ENV, "1")


def split_resources_shared() -> bool:
    """Whether this process's NCCL communicators share their parent's resources: on unless
    ``NCCL_COMM_SPLIT_SHARE_RESOURCES`` says ``0`` (what `share_split_resources` leaves in place)."""
    return os.environ.get(NCCL_SPLIT_SHARE_ENV, "1").strip() != "0"


def print0(*args, **kwargs) -> None:
    if get_dist_info().is_main:
        print(*args, **kwargs, flush=True)


WATCH_EVERY = timedelta(seconds=1)
_watch: Callable[[], str | None] | None = None


def watch_waits(check: Callable[[], str | None] | None) -> None:
    """While `check` is set, `wait` asks it every `WATCH_EVERY` whether to give up a gloo collective that
    has not completed (a string: why, raised as RuntimeError); None: wait until the collective ends.

    Why: a peer that fails out of a collective does not always close its connections at once (its
    process groups can outlive ``destroy_process_group`` while gloo's threads still hold them), so a
    rank blocked on it would wait for the whole collective timeout. The trainer's worker-loss recovery
    sets a check that says when the survivors have begun agreeing on a loss (docs/design.md §7).
    """
    global _watch
    _watch = check


def wait(work: dist.Work, device: torch.device) -> None:
    """``work.wait()``; on CPU (gloo) with a `watch_waits` check set, in slices of `WATCH_EVERY`, giving
    the collective up when the check says so. A timed-out slice leaves the collective running
    (``Work.wait(timeout)`` of gloo raises without aborting it); NCCL's wait is never sliced, since
    its timeout aborts the communicator."""
    check = _watch
    if check is None or device.type != "cpu":
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=WATCH_EVERY)
            return
        except RuntimeError:
            if work.is_completed():  # the collective itself failed: its own error
                raise
        reason = check()
        if reason is not None:
            raise RuntimeError(f"gave up waiting for a collective: {reason}")


_meet: Callable[[Sequence[int]], None] | None = None


def meet_before_groups(meet: Callable[[Sequence[int]], None] | None) -> None:
    """While `meet` is set, `before_new_group` calls it with a group's ranks before every process group that
    `sdp_train.parallel.sync.holder_set_groups` makes, on every rank, members or not, in one order; `meet` returns
    once every member has come, or raises RuntimeError (why it gave up); None: make groups at once.

    Why: on gloo, making a group connects every pair of its members through the store, and a member lost
    before it came is waited for up to the group's timeout, with no collective to watch (`watch_waits`). The
    trainer's worker-loss recovery sets a meeting in the store that gives up once the launcher marked a member
    exited or a survivor began agreeing on a loss (docs/design.md §7).
    """
    global _meet
    _meet = meet


def before_new_group(ranks: Sequence[int]) -> None:
    """Called right before ``dist.new_group(ranks)`` (`meet_before_groups`): nothing while no meeting is set."""
    meet = _meet
    if meet is not None:
        meet(ranks)


def all_gather_objects(value: object, device: torch.device) -> list[object]:
    """Every rank's `value` (picklable; this process's own data, never a peer's input to trust), in rank order: a
    collective over the default group whose waits are watched (`wait`), so that on CPU a rank blocked on a peer
    that failed out of it gives up once a worker loss is being recovered from; on a GPU ``all_gather_object``."""
    import pickle

    world_size = dist.get_world_size()
    if device.type != "cpu":
        values: list[object] = [None] * world_size
        dist.all_gather_object(values, value)
        return values
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    wait(dist.all_gather(sizes, size, async_op=True), device)
    padded = torch.zeros(int(max(s.item() for s in sizes)), dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    wait(dist.all_gather(parts, padded, async_op=True), device)
    return [pickle.loads(p[:int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]
