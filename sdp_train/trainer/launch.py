"""Starting and ending a run's ranks: the default process group, local launches, restarts, rank errors.

`init_distributed` creates the default process group (gloo on CPU, nccl on GPU), `launch_local`
starts N local ranks through torch's elastic launcher (`torch.distributed.run`, restarts
included) when ``sdp train --workers N`` is run outside torchrun, `restart_attempt` says which
attempt of the group this process belongs to, the same on every rank and node, and
`leave_error_to_launcher` hands a rank's one-line input error to the launcher, which prints it once.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from sdp_train.errors import EXIT_USAGE
from sdp_train.parallel.dist import DistInfo, collective_timeout, get_dist_info, share_split_resources, under_torchrun


LAUNCHER_ENV = "SDP_KEEPS_SURVIVORS"  # set for the ranks of `survivor_launcher.launch_keeping_survivors`


def restart_attempt() -> int:
    """Which attempt of the worker group this process belongs to (0 on the first), the same on every rank.

    Under torchrun with the agent's store (its default) the ranks agree on it through that store
    (`agree_attempt`, once per process). ``TORCHELASTIC_RESTART_COUNT`` cannot serve there: it
    counts the restarts of this node's agent, and on two nodes the agent whose worker failed counts
    one while the other, restarted by the membership change, does not. Without the agent's store
    (one process, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) it is that count, right on one node.
    The ranks of ``--on-worker-loss continue``'s own launcher (`LAUNCHER_ENV`) are attempt 0: that
    launcher never restarts the group, and a replacement it starts for one lost worker joins the run.
    """
    if not uses_agent_store():
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get(LAUNCHER_ENV):  # never restarted as a group; a replacement worker must not open an attempt
        return 0
    return _agreed_attempt(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                           int(os.environ["WORLD_SIZE"]))


def uses_agent_store() -> bool:
    """True when the ranks share the elastic agent's TCP store (MASTER_ADDR:MASTER_PORT), which outlives attempts."""
    return under_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


@functools.cache
def _agent_store(addr: str, port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=collective_timeout())


STARTUP_TIMEOUT_S = 300  # the least a rank waits for the others of its attempt to start


def startup_timeout() -> timedelta:
    """How long the attempt agreement waits for the other ranks to come: the collective timeout, but at
    least `STARTUP_TIMEOUT_S`. Ranks start seconds apart (imports, a loaded machine), and a short
    collective timeout is for a stuck collective, not for a start; a rank that dies before it comes
    is the elastic agent's to see, which stops the group."""
    return max(collective_timeout(), timedelta(seconds=STARTUP_TIMEOUT_S))


@functools.cache  # one agreement per process (its launcher's environment does not change)
def _agreed_attempt(addr: str, port: int, rank: int, world_size: int) -> int:
    return agree_attempt(_agent_store(addr, port, world_size), rank, world_size, timeout=startup_timeout())


_OPENED = "sdp/attempts_opened"


def agree_attempt(store: dist.Store, rank: int, world_size: int, *, timeout: timedelta) -> int:
    """The number of this attempt of the worker group, agreed by its `world_size` ranks through `store`.

    The store outlives attempts and holds whatever earlier, dead attempts left (the elastic agent
    stops every worker of an attempt before it starts the next). Rank 0 opens attempt ``a`` (a
    counter), waits until every other rank has joined ``a``, then marks it ready. Another rank joins
    the newest opened attempt and returns when that attempt is ready; it moves on when a newer one
    is opened. A rank that finds its own earlier join in ``a`` (its previous process joined it),
    or finds ``a`` not ready yet, knows that ``a`` may be a dead attempt's and waits: a ready mark
    it did not help bring about cannot be this attempt's. A `timeout` without agreement is an error.
    """
    if rank == 0:
        attempt = store.add(_OPENED, 1) - 1
        try:
            store.wait([f"sdp/attempt{attempt}/joined{r}" for r in range(1, world_size)], timeout)
        except dist.DistStoreError:
            raise TimeoutError(f"rank 0: not every rank of attempt {attempt} joined it in the elastic agent's store "
                               f"within {timeout.total_seconds():g} s") from None
        store.set(f"sdp/attempt{attempt}/ready", "1")
        return attempt
    deadline = time.monotonic() + timeout.total_seconds()
    looked_at, first_join = -1, False
    while True:
        newest = store.add(_OPENED, 0) - 1
        if newest > looked_at:
            looked_at = newest
            first_join = store.add(f"sdp/attempt{newest}/joined{rank}", 1) == 1
        if first_join and store.check([f"sdp/attempt{looked_at}/ready"]):
            return looked_at
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 of this attempt did not show up in the elastic agent's store "
                               f"within {timeout.total_seconds():g} s")
        time.sleep(0.02)


def run_id() -> str | None:
    """The launch this process belongs to: torchrun's rendezvous run id, the same on every rank and node
    and across the elastic agent's restarts, new for every launch (None outside a launcher)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") if under_torchrun() else None


def init_distributed(device: torch.device, *, preload: Iterable[str] = ("torch.distributed.tensor",)) -> DistInfo:
    """Create the default process group if launched by torchrun (gloo on CPU, nccl on CUDA).

    When the ranks share the elastic agent's store (torchrun's default), each attempt rendezvouses
    under its own key prefix ``attempt{N}`` (`restart_attempt`, agreed by all ranks): the store
    outlives a failed attempt, and a plain ``env://`` init of a restarted gloo group can pick up
    the dead attempt's addresses ("Gloo connectFullMesh failed").

    `preload` names the modules the run will use that must be imported before the group exists:
    ``torch.distributed.tensor`` (FSDP) or torch's memory tracker, imported while a group exists,
    keep it referenced (and its threads running) to the end of the process. The default suits a
    run that may use FSDP; ``sdp train`` passes what its configuration needs (`modules_before_groups`).

    On CUDA the holder-set groups' communicators, split from the default one, share its resources
    (`sdp_train.parallel.dist.share_split_resources`) unless ``NCCL_COMM_SPLIT_SHARE_RESOURCES`` is set.
    """
    if not under_torchrun() or dist.is_initialized():
        return get_dist_info()
    for name in preload:
        importlib.import_module(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        share_split_resources()  # before the default communicator: NCCL reads it once
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = collective_timeout()
    if uses_agent_store():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _agent_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size)
        kwargs.update(store=dist.PrefixStore(f"attempt{restart_attempt()}", store), rank=rank, world_size=world_size)
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
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:  # never imported: no cache to clear
        return
    tensor.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def describe_failures(failures) -> str:
    """The ranks that failed on their own, then those the agent stopped because of them.

    When one rank exits with an error the elastic agent sends SIGTERM to the others, which then
    report exit code -15; which rank's own exit the agent saw first is a race. A rank's own failure
    is any other exit code (an error's 1, a crash's signal); only when every rank ended by SIGTERM
    (the group was killed from outside) are they all listed as such."""
    ranks = sorted(failures.items())
    own = [(r, f) for r, f in ranks if f.exitcode != -signal.SIGTERM]
    stopped = [r for r, f in ranks if f.exitcode == -signal.SIGTERM]
    if not own:
        return ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in ranks)
    text = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in own)
    if stopped:
        text += f"; stopped by the launcher after it: rank{'s' if len(stopped) > 1 else ''} " \
                + ", ".join(map(str, stopped))
    return text


_INPUT_ERROR = "sdp_input_error"  # marks a rank's elastic error file written by `leave_error_to_launcher`


def leave_error_to_launcher(line: str) -> bool:
    """Write `line`, this rank's one-line input error, into its elastic error file (``TORCHELASTIC_ERROR_FILE``),
    where `launch_local` reads it; False where there is none (no launcher set one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun() else None
    if not path:
        return False
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time()), _INPUT_ERROR: True}, f)
    except OSError:
        return False
    return True


def input_error_line(exitcode: int, data) -> str | None:
    """The one-line input error a rank left with `leave_error_to_launcher`, given its exit code and
    its error file's contents; None for any other ending."""
    if (exitcode == EXIT_USAGE and isinstance(data, dict) and data.get(_INPUT_ERROR)
            and isinstance(data.get("message"), str)):
        return data["message"]
    return None


def _refused_input(failures) -> tuple[int, str] | None:
    """(exit code, line) of the lowest rank that exited refusing its input, or None (another failure)."""
    for _, failure in sorted(failures.items()):
        line = input_error_line(failure.exitcode, failure.error_file_data)
        if line is not None:
            return failure.exitcode, line
    return None


class _QuietAgent(logging.Filter):
    """Drops the elastic agent's lines that `launch_local`'s own line says: the ranks it stops after
    a failure ("Sending process P closing signal SIGTERM": "stopped by the launcher after it") and the
    failure of a rank that refused its input (exit code 2: its one line says what is wrong)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Sending process ")
                    or text.startswith("failed (exitcode: ") and bool(record.args) and record.args[0] == EXIT_USAGE)


def launch_local(module_argv: Sequence[str], nproc: int, *, max_restarts: int = 0) -> int:
    """Run ``python -m sdp_train.cli <module_argv>`` on `nproc` local ranks via torch's elastic launcher.

    With ``max_restarts > 0`` the agent restarts the whole group when a worker fails (at most that
    many times); the restarted ranks resume (`restart_attempt`). Returns 0; 1 once the group has
    failed more often than allowed; 2 with the rank's one line when a rank refused its input
    (`leave_error_to_launcher`: bad checkpoint contents, ...), as if this process had found it;
    128 + the signal's number when this process is interrupted (130 for SIGINT, 143 for SIGTERM,
    as a shell reports it), after the agent has stopped the ranks.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    agent_log, quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api"), _QuietAgent()
    agent_log.addFilter(quiet)
    try:
        run(args)
    except SignalException as exc:  # the agent's handler of SIGINT/SIGTERM/...: the ranks are stopped
        print(f"sdp {module_argv[0]}: interrupted ({signal.Signals(exc.sigval).name})", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except Exception as exc:  # ChildFailedError: the rank's own error is already on stderr, or left to us
        failures = getattr(exc, "failures", {})
        if (refused := _refused_input(failures)) is not None:
            print(refused[1], file=sys.stderr, flush=True)
            return refused[0]
        print(f"sdp: worker failed: {describe_failures(failures) or type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        agent_log.removeFilter(quiet)
    return 0
