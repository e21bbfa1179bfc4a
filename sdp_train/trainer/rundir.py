"""The output directory of one run: who owns it, what it may replace, and rank processes tied to their launcher.

- `check_out_dir` refuses, before anything is launched or written, a new run into a directory that
  holds another run's results (`RESULTS`: summary.json, metrics.jsonl, checkpoints, ...) unless ``--overwrite``
  (or ``--resume``) says what to do with them; `clear_previous_run` then removes them, so that a
  later restart can never adopt the old run's checkpoints.
- `OutLock` makes one run at a time the owner of ``--out``: an exclusive ``flock`` on
  ``DIR/.sdp.lock``, whose text names the owner (pid, host, start time). The kernel releases the
  lock when its holder dies, so a lock file left by a killed run is stale and is taken over.
- `die_with_parent` ties a rank process to the launcher that started it (Linux ``PR_SET_PDEATHSIG``):
  a SIGKILLed launcher takes its ranks with it instead of leaving them to finish on their own.

Not here: the files a run writes (`sdp_train.trainer.train`, `sdp_train.trainer.checkpoint`).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from sdp_train.errors import ConfigError

LOCK_NAME = ".sdp.lock"
LOCKED_ENV = "SDP_OUT_LOCKED_BY"  # set for ranks whose launcher holds the lock
RESULTS = ("summary.json", "metrics.jsonl", "checkpoints",  # sdp_train.trainer.train, sdp_train.trainer.checkpoint
           "model.safetensors", "config.json", "mask.json", "certificate.json",  # run_outputs
           "tensorboard")  # run_log


def previous_results(out: Path) -> list[str]:
    """The results of an earlier run that `out` holds (names relative to `out`)."""
    return [name for name in RESULTS if (out / name).exists() or (out / name).is_symlink()]


def check_out_dir(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse an unusable ``--out``, or one holding another run's results that nobody said to replace."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"out={str(out)!r} exists and is not a directory")
    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"out={str(out)!r}: {parent} is not writable")
    if len(out.name.encode()) > 200:
        raise ConfigError(f"out={str(out)!r}: the directory name is {len(out.name.encode())} bytes (at most 200)")
    found = previous_results(out) if out.is_dir() else []
    if found and not (resume or overwrite):
        raise ConfigError(f"out={str(out)!r} already holds a run ({', '.join(found)}); pass --overwrite to "
                          f"replace it, --resume {out / 'checkpoints'} to continue it, or choose another --out")


def clear_previous_run(out: str | Path, *, keep: tuple[str | Path, ...] = ()) -> list[str]:
    """Remove an earlier run's results from `out` (``--overwrite``); returns what was removed.

    Files in `keep` stay: the ``--config`` file of the run that replaces them may be one of them
    (``sdp compare`` keeps each run's config in its directory), and the ranks read it after this.
    """
    out = Path(out)
    kept = {Path(k).resolve() for k in keep}
    removed = [name for name in previous_results(out) if (out / name).resolve() not in kept]
    for name in removed:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


class OutLock:
    """Exclusive ownership of an output directory for the lifetime of this object (or process)."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns the stale owner's description if a dead run left the file, else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise ConfigError(f"out={str(self.path.parent)!r} is in use by another run ({owner}); wait for it "
                              f"to end or choose another --out") from None
        stale = os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode(), 0)
        self._fd = fd
        return stale

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the launcher) dies; Linux only."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the rank then merely outlives a killed launcher, as before
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)
