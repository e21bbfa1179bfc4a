"""Per-rank checkpoints: what each rank holds, so that a resumed run continues the same trajectory.

A checkpoint is a directory ``step_N`` with one ``rank{r}.pt`` per rank and a ``manifest.json``.
A rank file holds plain tensors and dicts only (``torch.load(weights_only=True)`` reads it): the
rank's held parameters and buffers (its local shards under FSDP), its optimizer state, its data
stream position, its RNG state and, under overlap averaging, its position in the mask schedule
(the optimizer steps taken; the schedule's draws are a function of that and the seed, so nothing
else of the schedule needs saving). Under overlap averaging the model is the worker's own copy.
The manifest holds what the run must match to resume (model
config, mode, world size, mask matrix, FSDP), the full TrainConfig, and the size and sha256 of
every rank file.

Integrity: every file is written to a temporary name, fsynced, renamed, and the directory
fsynced; the manifest is written last, after every rank's file, so its presence means the
checkpoint is complete. `checkpoint_problem` says why a checkpoint cannot be used: no manifest
(its write was interrupted), a rank file missing, shorter or longer than recorded (truncated) or
with another sha256 (altered bytes). `find_checkpoint` on a ``checkpoints`` directory walks the
``step_N`` from newest to oldest, warning on stderr about each one it skips; a ``step_N`` named
explicitly must be valid. Validation reads every rank file, on every rank that resumes (they must
all make the same choice before any process group exists).

Rotation: with ``keep_checkpoints = N > 0``, rank 0 deletes, after each complete save, the older
``step_N`` beyond the N newest complete ones (the one just written always stays).

Shared directory: on several nodes the checkpoints need one ``--out`` that every node sees;
`check_out_shared` refuses, before the first step, a run whose ranks do not.

After a membership change (``--on-worker-loss continue``) the manifest records the workers of the
first world that wrote it (``workers``, rank order) and their world size; resuming from it is refused
(`check_resumable`, docs/design.md §7).

Not here: converting a checkpoint between masks or world sizes (refused), or assembling the
full model (``Run.full_state`` does that).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from masklab.io import atomic_write
from sdp_train.errors import ConfigError
from sdp_train.parallel.grads import is_dtensor
from sdp_train.parallel.grads import local as _local
from sdp_train.parallel.dist import DistInfo, all_gather_objects, get_dist_info, under_torchrun, wait
from sdp_train.trainer.launch import run_id
from sdp_train.trainer.rundir import LOCK_NAME, LOCKED_ENV

if TYPE_CHECKING:
    from masklab import Mask
    from sdp_train.data.batches import Batches
    from sdp_train.models import ModelConfig
    from sdp_train.trainer.config import TrainConfig

MANIFEST = "manifest.json"


class RunState(Protocol):
    """What a checkpoint saves and restores of a run (`sdp_train.trainer.run.Run` is one); prepare and run
    import this module, so this module names no type of theirs."""

    info: DistInfo
    cfg: TrainConfig
    model_config: ModelConfig
    mask: Mask | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    def schedule_state(self) -> dict[str, int]: ...

    def load_schedule_state(self, state: dict[str, int]) -> None: ...


def identity(cfg: TrainConfig, model_config: ModelConfig, mask: Mask | None) -> dict[str, Any]:
    """What a checkpoint and the run resuming from it must agree on (JSON-normalised)."""
    ident = {"model_config": asdict(model_config), "mode": cfg.mode, "world_size": cfg.workers,
             "fsdp": cfg.fsdp, "mask": None if mask is None else mask.matrix.astype(int).tolist(),
             "seed": cfg.seed,  # the data order continues from the checkpoint's: another seed would not
             # absent (None) where they cannot differ, so checkpoints written before they existed still match
             "schedule": None if mask is None or mask.schedule.is_static else [mask.schedule.kind, mask.schedule.every]
             + ([] if mask.rounds is None else [mask.rounds.astype(int).tolist()]),  # a sequence's masks too
             "local_steps": cfg.local_steps if cfg.mode == "overlap" or cfg.local_steps != 1 else None}
    return json.loads(json.dumps(ident))


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint to resume from: `path` itself if it is one, else its newest valid ``step_N``.

    `path` may also be a run's output directory, meaning its ``checkpoints``.

    A ``step_N`` below `path` that is incomplete or damaged is skipped with a warning that names it
    and the reason, and the next older one is tried. A checkpoint named explicitly (a ``step_N``
    directory, or any directory holding a manifest or rank files) must itself be valid.
    """
    path = Path(path)
    if (path / "checkpoints").is_dir() and not _steps(path):  # a run's --out directory: its checkpoints
        path = path / "checkpoints"
    if (path / MANIFEST).exists() or _step_of(path) is not None or any(path.glob("rank*.pt")):
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(f"resume={str(path)!r}: cannot resume from this checkpoint: {problem}")
        return path
    # the ranks that sdp train's launcher started walk what it walked (and warned about) before launching
    found = latest_valid_checkpoint(path, warn=not (under_torchrun() and LOCKED_ENV in os.environ))
    if found is None:
        raise ConfigError(f"resume={str(path)!r}: no complete checkpoint ({MANIFEST}) in it or in a step_N below it")
    return found


def latest_valid_checkpoint(root: str | Path, *, run_id: str | None = None, warn: bool = True) -> Path | None:
    """The newest ``root/step_N`` that `checkpoint_problem` accepts, warning (with `warn`) about each newer one it skips.

    With `run_id`, only checkpoints that this very launch wrote count (a restarted attempt must not
    continue another run's trajectory); others are skipped with a warning.
    """
    for _, candidate in sorted(_steps(Path(root)), reverse=True):
        problem = checkpoint_problem(candidate)
        if problem is None and run_id is not None:
            written_by = json.loads((candidate / MANIFEST).read_text(encoding="utf-8")).get("run_id")
            if written_by != run_id:
                problem = f"it was written by another launch (run id {written_by!r}, this one {run_id!r})"
        if problem is None:
            return candidate
        if warn:
            _warn(f"checkpoint {candidate} skipped: {problem}; trying the previous one")
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint directory `path` cannot be used (incomplete, truncated, altered), or None if it is valid.

    Reads every rank file once to compare its size and sha256 with the manifest's.
    """
    if not path.is_dir():
        return "it does not exist or is not a directory"
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"it has no {MANIFEST}, so its write was interrupted"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"its {MANIFEST} is not valid JSON (its bytes were altered)"
    except RecursionError:
        return f"its {MANIFEST} is nested too deeply to be one of ours"
    problem = _manifest_problem(manifest)
    if problem is not None:
        return f"its {MANIFEST} {problem}"
    files = manifest["files"]
    ranks = {f"rank{r}.pt" for r in range(manifest["identity"]["world_size"])}
    if set(files) != ranks:
        return f"its {MANIFEST} lists files {sorted(files)}, expected one per rank {sorted(ranks)}"
    for name, expected in sorted(files.items()):
        file = path / name
        if file.is_symlink() or not file.is_file():
            return f"{name} is missing" if not file.is_symlink() else f"{name} is a symbolic link, not a rank file"
        try:
            size, sha256 = int(expected["size"]), str(expected["sha256"])
        except (KeyError, TypeError, ValueError):
            return f"its {MANIFEST} entry for {name} is malformed: {expected!r}"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size} (truncated or altered)"
        with open(file, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != sha256:
                return f"{name} does not match its sha256 checksum in the manifest (its bytes were altered)"
    return None


MAX_WORLD_SIZE = 4096  # as TrainConfig.workers


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest's fields (types and ranges), before any of them is used."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2**40:
        return f"has step={step!r}; expected an integer in [0, 2**40]"
    ident = manifest.get("identity")
    if not isinstance(ident, dict) or not {"mode", "world_size", "model_config"} <= set(ident):
        return "has no identity with mode, world_size and model_config"
    world = ident["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD_SIZE:
        return f"has identity.world_size={world!r}; expected an integer in [1, {MAX_WORLD_SIZE}]"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no rank files with checksums"
    return None


def check_resumable(path: Path, cfg: TrainConfig, model_config: ModelConfig, mask: Mask | None, *,
                    finished_ok: bool = False, same_config: bool = False) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; ConfigError naming every field that differs from this run.

    A checkpoint at the run's last step is refused (nothing left to train) unless `finished_ok`:
    a restarted attempt that failed after its final checkpoint only has to validate and summarise.
    """
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    if "workers" in manifest:  # written after a membership change (`save_checkpoint`)
        raise ConfigError(f"cannot resume from {path}: it was written by workers {manifest['workers']} (in rank order) "
                          f"of the run's {manifest.get('config', {}).get('workers')} after a worker loss or rejoin "
                          "(--on-worker-loss continue); resuming from it is not built: resume from a checkpoint "
                          "written before the change")
    current = identity(cfg, model_config, mask)
    diffs = [f"{key}: checkpoint {manifest['identity'].get(key)!r}, this run {value!r}"
             for key, value in current.items() if manifest["identity"].get(key) != value]
    if same_config:  # a restart continues the very run it belongs to: every field must agree
        config, saved = cfg.to_dict(), manifest.get("config", {})
        diffs += [f"config.{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
                  for key, value in config.items() if saved.get(key) != value]
    if diffs:
        raise ConfigError(f"cannot resume from {path}: it was written by a different run; " + "; ".join(diffs))
    if manifest["step"] > cfg.steps or (manifest["step"] == cfg.steps and not finished_ok):
        raise ConfigError(f"cannot resume from {path}: it is at step {manifest['step']} and the run has "
                          f"steps={cfg.steps}; nothing is left to train")
    return manifest


def save_checkpoint(run: RunState, batches: Batches, step: int, root: Path, *, keep: int = 0,
                    workers: Sequence[int] | None = None, after_write: Callable[[], None] | None = None,
                    held: tuple[Callable[[], None], Callable[[], None]] | None = None) -> Path:
    """Write every rank's state after ``step`` steps to ``root/step_{step}``; collective.

    Rank files first (each rank sends rank 0 its file's size and sha256), then rank 0 writes the
    manifest and, with ``keep > 0``, deletes older ``step_N`` beyond the `keep` newest complete ones.
    A manifest left in ``step_{step}`` by an earlier attempt, or by a world that lost a worker while it
    wrote, is removed before any rank file is replaced, so a write interrupted now cannot pass for
    complete; so are the rank files (and temporary files) of ranks beyond this world's. `workers`: the
    workers of the first world this world's ranks are, in rank order (``--on-worker-loss continue``);
    where they are not all of them in their order (survivors of a loss, or a world that workers
    rejoined) the manifest records them and its world size is this world's, and `check_resumable`
    refuses it. `after_write` (tests only: `sdp_train.trainer.faults`) runs once this rank's file is written;
    `held` (tests only, ``SDP_TEST_HOLD_AT``): two callables run before the wait of the last barrier and after it.
    """
    path = root / f"step_{step}"
    name = f"rank{run.info.rank}.pt"
    if run.info.is_main:
        for link in (root, path):  # never write through a link planted in --out: replace it
            if link.is_symlink():
                link.unlink()
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)
        for stale in [*path.glob("rank*.pt"), *path.glob(".rank*.pt.*")]:  # of a larger world that lost a worker
            rank = stale.name.lstrip(".").removeprefix("rank").split(".")[0]
            if not rank.isdigit() or int(rank) >= run.info.world_size:
                stale.unlink(missing_ok=True)
    _barrier(run.device)
    for stale in path.glob(f".{name}.*"):  # temporary file of a write that a killed attempt left behind
        stale.unlink(missing_ok=True)
    state = {
        "step": step,
        "model": {n: _local(t).detach().clone() for n, t in run.model.state_dict().items()},
        "optimizer": _to_local(run.optimizer.state_dict()),
        "data": batches.state_dict(),
        "rng": _rng_state(run.device),
        "schedule": run.schedule_state(),  # mode overlap: the optimizer steps that fix the round and its mask
    }
    files = {name: _write_atomic(path / name, lambda f: torch.save(state, f))}
    if after_write is not None:
        after_write()
    if dist.is_initialized():
        files = {k: v for part in all_gather_objects(files, run.device) for k, v in part.items()}
    if run.info.is_main:
        manifest = {"step": step, "run_id": run_id(), "identity": identity(run.cfg, run.model_config, run.mask),
                    "config": run.cfg.to_dict(), "files": files}
        if workers is not None and list(workers) != list(range(run.cfg.workers)):
            manifest["workers"] = list(workers)
            manifest["identity"]["world_size"] = run.info.world_size
        _write_atomic(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        if keep > 0:
            _rotate(root, step, keep)
    _barrier(run.device, held)
    return path


def _rotate(root: Path, newest: int, keep: int) -> None:
    """Delete the ``step_N`` below `newest` beyond the ``keep - 1`` newest complete ones (incomplete ones too)."""
    kept = 1
    for step, path in sorted(_steps(root), reverse=True):
        if step >= newest:
            continue
        if kept < keep and (path / MANIFEST).is_file():
            kept += 1
        else:
            shutil.rmtree(path, ignore_errors=True)


def _steps(root: Path) -> list[tuple[int, Path]]:
    return [(step, p) for p in root.glob("step_*") if (step := _step_of(p)) is not None and p.is_dir()]


def _step_of(path: Path) -> int | None:
    """N of a ``step_N`` directory; None for any other name (``step_²``, ``step_٣``: not ASCII digits)."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isascii() and digits.isdigit() else None


def _barrier(device: torch.device, held: tuple[Callable[[], None], Callable[[], None]] | None = None) -> None:
    """Every rank of the default group here (its wait watched: `sdp_train.parallel.dist.wait`; `held`: run before
    the wait and after it, tests only)."""
    if dist.is_initialized():
        work = dist.barrier(async_op=True)
        if held is not None:
            held[0]()
        wait(work, device)
        if held is not None:
            held[1]()


_warned: set[str] = set()


def _warn(message: str) -> None:
    """A warning on stderr, once per job (rank 0 of a launched job, or the launching process) and
    once per process: ``sdp train`` prepares a run (and walks its checkpoints) before it trains it."""
    if get_dist_info().is_main and message not in _warned:
        _warned.add(message)
        print(f"sdp: warning: {message}", file=sys.stderr, flush=True)


def check_out_shared(out: str | Path, world_size: int) -> None:
    """Refuse, on every rank, an ``--out`` that is not one directory for all ranks; collective.

    Checkpoints need one: rank 0 creates each ``step_N``, every rank writes its file into it, and
    a restarted rank reads them all. On several nodes that takes a filesystem they share; on
    separate disks the other nodes' ranks would fail with ENOENT at the first checkpoint. The
    test: every rank must read the lock file that rank 0's run holds (`sdp_train.trainer.rundir.OutLock`,
    whose text names its holder). Without that lock (a run not started by ``sdp train``) nothing
    is checked.
    """
    if world_size == 1:
        return
    lock = Path(out) / LOCK_NAME
    try:
        mine = lock.read_text(encoding="utf-8") if lock.is_file() else None
    except OSError:
        mine = None
    seen: list[str | None] = [None] * world_size
    dist.all_gather_object(seen, mine)
    unshared = [rank for rank, text in enumerate(seen) if text != seen[0]]
    if seen[0] is not None and unshared:
        raise ConfigError(f"out={str(out)!r} is not the same directory for every rank: rank(s) "
                          f"{', '.join(map(str, unshared))} do not see the {LOCK_NAME} that rank 0 holds there; "
                          f"checkpoints of a run on several nodes need --out on a filesystem all nodes share")


def load_checkpoint(run: RunState, batches: Batches, path: Path) -> int:
    """Restore this rank's state from checkpoint ``path``; return the step to continue from.

    Everything is checked before the first tensor is copied (`_check_rank_state`), so a refused
    file leaves the model, optimizer and RNG as they were. Collective under a process group: a
    file refused on one rank is refused on every rank, with the error of the lowest such rank, so
    none goes on to wait in a collective for a rank that has left.
    """
    file = path / f"rank{run.info.rank}.pt"
    state, schedule, own = None, None, None
    try:
        state = _read_rank_file(file, run.device)
        schedule = _schedule_of(file, state)
    except ConfigError as exc:
        own = exc
    # the round comes first: under a forward-masked schedule it fixes which blocks this worker holds,
    # and every rank enters it together (holder-set groups are made there), so it must be one round
    schedules = _raise_first_on_every_rank(own, schedule)
    if (differs := next((r for r, theirs in enumerate(schedules) if theirs != schedules[0]), None)) is not None:
        raise ConfigError(f"checkpoint {path}: rank{differs}.pt holds schedule state {schedules[differs]!r}, "
                          f"rank0.pt {schedules[0]!r}: rank files of different checkpoints")
    try:
        run.load_schedule_state(schedule)
    except ConfigError as exc:  # the same on every rank: one state, one mask
        raise ConfigError(f"checkpoint {file}: {exc}") from None
    own = None
    try:
        _check_rank_state(file, state, run.model.state_dict(), run)
        try:  # checks the stream's seed, rank and world size, and changes it only when they match
            batches.load_state_dict(state["data"])
        except ConfigError as exc:
            raise ConfigError(f"checkpoint file {file}: data: {exc}") from None
    except ConfigError as exc:
        own = exc
    _raise_first_on_every_rank(own)
    local = run.model.state_dict()
    with torch.no_grad():
        for name, tensor in local.items():
            _local(tensor).copy_(state["model"][name])
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    for index, values in state["optimizer"]["state"].items():
        param = params[int(index)]
        if is_dtensor(param):  # FSDP: the saved local shards become DTensors like the parameter
            from torch.distributed.tensor import DTensor  # imported already: `param` is one

            values.update({k: DTensor.from_local(v, param.device_mesh, param.placements, shape=param.shape,
                                                 stride=param.stride(), run_check=False)
                           for k, v in values.items() if v.shape == _local(param).shape and v.dim() > 0})
    run.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"], run.device)
    return int(state["step"])


def _raise_first_on_every_rank(own: ConfigError | None, shared: Any = None) -> list[Any]:
    """Every rank's `shared`, in rank order, unless a rank has an error (`own`: this rank's): then
    raise, on every rank, that of the lowest such rank. A collective under a process group."""
    mine = (None if own is None else str(own), shared)
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [mine] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    first = next((error for error, _ in every if error is not None), None)
    if first is not None:
        raise own if own is not None and str(own) == first else ConfigError(first)
    return [value for _, value in every]


def _schedule_of(file: Path, state: Any) -> dict[str, int]:
    """The schedule position a rank file holds (`RunState.schedule_state`): step counts by name."""
    schedule = state.get("schedule", {}) if isinstance(state, dict) else {}
    if not isinstance(schedule, dict) or not all(isinstance(k, str) and type(v) is int for k, v in schedule.items()):
        raise ConfigError(f"checkpoint file {file}: schedule: {schedule!r} is not a dict of step counts")
    return schedule


def _read_rank_file(file: Path, device: torch.device) -> Any:
    """What rank file `file` holds, read by torch's weights-only unpickler; ConfigError naming `file` else.

    Only tensors, numbers and plain containers are read, so nothing in the file runs. torch's own
    message for anything else advises loading it with ``weights_only=False``, that is, running the
    file's code: it is replaced by one line that names the file.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes about the file's pickle protocol: the error says it
            return torch.load(file, weights_only=True, map_location=device)
    except pickle.UnpicklingError:
        raise ConfigError(f"checkpoint file {file}: holds objects other than tensors, numbers and plain containers, "
                          "or its pickle is damaged: refused, nothing in it was run (a rank file holds only those)"
                          ) from None
    except OSError as exc:
        raise ConfigError(f"checkpoint file {file}: cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # RuntimeError, EOFError, ...: whatever torch makes of bytes it did not write
        raise ConfigError(f"checkpoint file {file}: is not a complete torch.save archive ({type(exc).__name__}: "
                          "truncated, or written by something else)") from None


def _rng_problem(state: torch.Tensor, device: torch.device) -> str | None:
    """Why `state` is not an RNG state of `device`'s generator (torch's reason), or None.

    Set and restored at once: the first line of torch's error is the only complete check of a state.
    """
    get, put = ((torch.get_rng_state, torch.set_rng_state) if device.type != "cuda" else
                (lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    current = get()
    try:
        put(state)
    except RuntimeError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        put(current)
    return None


def _check_rank_state(file: Path, state: Any, local: dict[str, torch.Tensor], run: RunState) -> None:
    """ConfigError naming `file` and the field unless `state` fits this rank's model and the manifest.

    Shapes and dtypes are compared before any tensor is copied (``copy_`` would broadcast a scalar
    into a 128 x 128 weight), the step against the manifest's, the data position by type, the RNG
    state by setting it (and restoring the current one), the optimizer's groups by their sizes.
    """
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"checkpoint file {file}: {field}: {why}")

    if not isinstance(state, dict) or not {"step", "model", "optimizer", "data", "rng"} <= set(state):
        raise bad("keys", f"expected step, model, optimizer, data and rng, found "
                          f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    manifest = json.loads((file.parent / MANIFEST).read_text(encoding="utf-8"))
    if state["step"] != manifest["step"]:
        raise bad("step", f"{state['step']!r}, but the manifest says {manifest['step']} (rank files of different "
                          f"checkpoints, or swapped)")
    data = state["data"]
    if not isinstance(data, dict) or data.get("step") != manifest["step"]:  # one batch per training step
        raise bad("data.step", f"{data.get('step') if isinstance(data, dict) else data!r}, but the checkpoint is "
                               f"at step {manifest['step']}")
    model = state["model"]
    if not isinstance(model, dict) or set(model) != set(local):
        names = sorted(model)[:5] if isinstance(model, dict) else type(model).__name__
        raise bad("model", f"holds tensors {names}..., this rank's model {sorted(local)[:5]}...; they must be the "
                           f"same (a rank file of another rank?)")
    for name, tensor in local.items():
        saved, want = model[name], _local(tensor)
        if not isinstance(saved, torch.Tensor) or saved.shape != want.shape or saved.dtype != want.dtype:
            got = (f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor)
                   else type(saved).__name__)
            raise bad(f"model.{name}", f"{got}, this rank's model has {tuple(want.shape)} {want.dtype}")
    rng = state["rng"] if isinstance(state["rng"], dict) else {}
    for key in ("torch", "cuda") if "cuda" in rng else ("torch",):  # cuda: saved on a GPU
        saved = rng.get(key)
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8:
            raise bad(f"rng.{key}", "not a torch RNG state (a uint8 tensor)")
        device = torch.device("cpu") if key == "torch" else run.device
        if (key == "torch" or device.type == "cuda") and (why := _rng_problem(saved, device)) is not None:
            raise bad(f"rng.{key}", f"not a torch RNG state ({why})")
    optimizer = state["optimizer"]
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) \
            or not isinstance(optimizer.get("param_groups"), list):
        raise bad("optimizer", "not an optimizer state dict (state, param_groups)")
    groups = [len(group["params"]) for group in run.optimizer.param_groups]
    saved_groups = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
                    for g in optimizer["param_groups"]]
    if saved_groups != groups:
        raise bad("optimizer.param_groups", f"groups of {saved_groups} parameters, this rank's optimizer {groups}")
    params = [_local(p) for group in run.optimizer.param_groups for p in group["params"]]
    for index, values in optimizer["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(values, dict):
            raise bad(f"optimizer.state[{index!r}]", f"no such parameter (this rank has {len(params)})")
        for key, value in values.items():
            if key != "step" and (not isinstance(value, torch.Tensor) or value.shape != params[index].shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise bad(f"optimizer.state[{index}].{key}", f"{got}, the parameter is {tuple(params[index].shape)}")



def _to_local(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _write_atomic(path: Path, write) -> dict[str, Any]:
    """Write `path` whole through masklab's atomic writer (fsynced file and directory, never
    through a link); return its size and sha256."""
    written: dict[str, Any] = {}

    def fill(name: str) -> None:
        with os.fdopen(os.open(name, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)), "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)
        written.update(size=hashing.size, sha256=hashing.sha256.hexdigest())

    atomic_write(path, fill)
    return written


class _HashingWriter:
    """A write-only stream that hashes what passes through it (torch.save writes sequentially)."""

    def __init__(self, f) -> None:
        self.f, self.size, self.sha256 = f, 0, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()
