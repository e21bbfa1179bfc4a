"""The launcher of ``sdp train --on-worker-loss continue`` on one node: it starts each rank as a plain
process with torchrun's environment, hosts the ranks' TCP store, marks each rank that exits in it,
and (``--max-rejoins``) starts a replacement for a rank the survivors have left out.

torch's elastic agent would stop every rank when one fails, which is the rollback this avoids
(docs/design.md §7). Not here: what the ranks agree on and how a replacement joins
(`sdp_train.trainer.membership`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from sdp_train.errors import EXIT_USAGE
from sdp_train.parallel.dist import collective_timeout
from sdp_train.trainer.launch import LAUNCHER_ENV, input_error_line
from sdp_train.trainer.membership import JOIN_ENV, MEMBERS_KEY, exited_key


def launch_keeping_survivors(module_argv: Sequence[str], nproc: int, *, max_rejoins: int = 0) -> int:
    """Run ``python -m sdp_train.cli <module_argv>`` on `nproc` local ranks that outlive each other.

    Each rank gets the environment torchrun would give it, with this process's TCP store as the
    agent's store (``TORCHELASTIC_USE_AGENT_STORE``); when a rank's process ends, its exit code goes
    into the store (`exited_key`). With `max_rejoins`, a rank that failed is started again (up to
    `max_rejoins` times in all), as a replacement that joins the run (`JOIN_ENV`, `Survival.join`), once
    the survivors have agreed on a membership without it and while one of them still runs; its exit
    mark is cleared first. Returns 0 when every worker of the last membership (`MEMBERS_KEY`, all of
    them when none changed) exited 0, after one line naming the lost ones; 2 with a rank's one-line
    input error; 1 otherwise; 128 + the signal's number when interrupted (the ranks are stopped).
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout())
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="sdp-ranks-") as errors:
        def start(rank: int, joining: bool) -> subprocess.Popen:
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_ERROR_FILE": str(Path(errors) / f"rank{rank}.json"), LAUNCHER_ENV: "1"}
            if joining:
                env[JOIN_ENV] = "1"
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several local ranks
            return subprocess.Popen([sys.executable, "-m", "sdp_train.cli", *module_argv], env=env)

        procs = {rank: start(rank, False) for rank in range(nproc)}
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            codes = _wait_all(procs, store, lambda rank: start(rank, True), max_rejoins)
        except KeyboardInterrupt as exc:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait()
            sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
            print(f"sdp {module_argv[0]}: interrupted ({sig.name})", file=sys.stderr, flush=True)
            return 128 + int(sig)
        finally:
            signal.signal(signal.SIGTERM, previous)
        refused = _refused(errors, codes)
        if refused is not None:
            print(refused, file=sys.stderr, flush=True)
            return EXIT_USAGE
    members = _members(store) or list(range(nproc))
    others = [r for r in range(nproc) if r not in members]
    lost = ", ".join(f"rank {r} (exit code {codes[r]})" for r in others)
    if all(codes[r] == 0 for r in members):
        if others:
            print(f"sdp: lost {lost}; ranks {', '.join(map(str, members))} finished the run", file=sys.stderr,
                  flush=True)
        return 0
    failed = ", ".join(f"rank {r} (exit code {codes[r]})" for r in members if codes[r] != 0)
    print(f"sdp: worker failed: {failed}{f'; lost before: {lost}' if others else ''}", file=sys.stderr, flush=True)
    return 1


def _members(store: dist.Store) -> list[int]:
    """The workers of the newest membership; [] before any change."""
    return [int(w) for w in store.get(MEMBERS_KEY).decode().split(",")] if store.check([MEMBERS_KEY]) else []


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher, handled as Ctrl-C is."""


def _raise_interrupt(signum, frame) -> None:
    raise _Terminated


def _wait_all(procs: dict[int, subprocess.Popen], store: dist.Store, replace, max_rejoins: int) -> list[int]:
    """Every rank's exit code (its last process's), each marked in the store as soon as its process ends;
    a failed rank is replaced (``procs[rank] = replace(rank)``, at most `max_rejoins` times in all) once
    the survivors' membership leaves it out, while another rank still runs."""
    codes: dict[int, int] = {}
    to_replace: set[int] = set()
    while len(codes) < len(procs) or to_replace:
        for rank, p in procs.items():
            if rank not in codes and p.poll() is not None:
                codes[rank] = p.returncode
                store.set(exited_key(rank), str(p.returncode))
                if p.returncode not in (0, EXIT_USAGE) and max_rejoins > 0:
                    to_replace.add(rank)
        for rank in sorted(to_replace):
            if all(r in codes for r in procs if r != rank):  # nobody left to join: the run is over
                to_replace.discard(rank)
            elif store.check([MEMBERS_KEY]) and rank not in _members(store):  # the survivors agreed on the loss
                to_replace.discard(rank)
                max_rejoins -= 1
                store.delete_key(exited_key(rank))  # its replacement is a live worker
                print(f"sdp: rank {rank} lost (exit code {codes.pop(rank)}): starting a replacement that rejoins the "
                      f"run ({max_rejoins} more allowed)", file=sys.stderr, flush=True)
                procs[rank] = replace(rank)
        time.sleep(0.05)
    return [codes[r] for r in range(len(procs))]


def _refused(errors: str, codes: Sequence[int]) -> str | None:
    """The one-line input error of the lowest rank that exited refusing its input, or None."""
    for rank, code in enumerate(codes):
        path = Path(errors) / f"rank{rank}.json"
        if code != EXIT_USAGE or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        line = input_error_line(code, data)
        if line is not None:
            return line
    return None
