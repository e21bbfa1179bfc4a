"""Distributed plumbing: the same code runs as one process or under torchrun.

Tiny helpers in the style of nanochat's ``common.py``: `get_dist_info` reads torchrun's
environment, `init_distributed` creates the default process group (gloo on CPU, nccl on GPU),
`print0` prints on rank 0, `launch_local` starts N local ranks through torch's elastic launcher
(`torch.distributed.run`, restarts included) when ``sdp train --workers N`` is run outside
torchrun, and `restart_attempt` says which restart of the group this process belongs to. This
module does not decide anything about SDP itself.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported here, before any process group exists: importing torch.distributed.tensor while a group
# exists keeps that group referenced (and its threads running) until the process exits.
from torch.distributed.tensor import DTensor


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
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"SDP_COLLECTIVE_TIMEOUT_S={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def restart_attempt() -> int:
    """How many times the elastic agent has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def run_id() -> str | None:
    """The launch this process belongs to: torchrun's rendezvous run id, the same on every rank and node
    and across the elastic agent's restarts, new for every launch (None outside a launcher)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") if under_torchrun() else None


def init_distributed(device: torch.device) -> DistInfo:
    """Create the default process group if launched by torchrun (gloo on CPU, nccl on CUDA).

    When the ranks share the elastic agent's store (torchrun's default), each restart attempt
    rendezvouses under its own key prefix ``attempt{N}``: the store outlives a failed attempt, and a
    plain ``env://`` init of a restarted gloo group can pick up the dead attempt's addresses
    ("Gloo connectFullMesh failed").
    """
    if not under_torchrun() or dist.is_initialized():
        return get_dist_info()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = collective_timeout()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
        kwargs.update(store=dist.PrefixStore(f"attempt{restart_attempt()}", store), rank=rank,
                      world_size=world_size)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return get_dist_info()


def destroy_distributed() -> None:
    """Destroy every process group so that their threads are joined here, before the process exits.

    A group is only freed (and its gloo threads joined) when nothing references it any more. What
    a finished run leaves behind still does: reference cycles through modules and hooks, and
    DTensor's sharding-propagation cache, whose specs hold FSDP's device meshes and so their
    groups. Both are released first. A group left alive is destroyed during interpreter
    shutdown instead, where a gloo thread that touches a Python object aborts the process
    (``terminate called without an active exception``) after the run has finished.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    _clear_sharding_prop_cache()
    dist.destroy_process_group()
    gc.collect()


def _clear_sharding_prop_cache() -> None:
    """Empty DTensor's sharding-propagation caches, Python and C++ (what torch's debugging helper
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does, without importing that module,
    which pulls in dynamo and inductor: about 0.7 s of every rank's start)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def print0(*args, **kwargs) -> None:
    if get_dist_info().is_main:
        print(*args, **kwargs, flush=True)


def launch_local(module_argv: Sequence[str], nproc: int, *, max_restarts: int = 0) -> int:
    """Run ``python -m sdp_train.cli <module_argv>`` on `nproc` local ranks via torch's elastic launcher.

    With ``max_restarts > 0`` the agent restarts the whole group when a worker fails (at most that
    many times); the restarted ranks see ``TORCHELASTIC_RESTART_COUNT > 0`` (`restart_attempt`).
    Returns 0, or 1 once the group has failed more often than allowed.
    """
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--module",
            "sdp_train.cli",
            *module_argv,
        ]
    )
    try:
        run(args)
    except Exception as exc:  # ChildFailedError: the rank's own error is already on stderr
        failures = getattr(exc, "failures", {})
        which = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(failures.items()))
        print(f"sdp: worker failed: {which or type(exc).__name__}", file=sys.stderr)
        return 1
    return 0
