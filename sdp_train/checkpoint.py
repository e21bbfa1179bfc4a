"""Per-rank checkpoints: what each rank holds, so that a resumed run continues the same trajectory.

A checkpoint is a directory ``step_N`` with one ``rank{r}.pt`` per rank and a ``manifest.json``.
A rank file holds plain tensors and dicts only (``torch.load(weights_only=True)`` reads it): the
rank's held parameters and buffers (its local shards under FSDP), its optimizer state, its data
stream position and its RNG state. The manifest holds what the run must match to resume (model
config, mode, world size, mask matrix, FSDP) and the full TrainConfig. Every file is written to a
temporary name, fsynced and renamed; the manifest is written last, after every rank's file, so
its presence means the checkpoint is complete.

Not here: converting a checkpoint between masks or world sizes (refused), or assembling the
full model (``Run.full_state`` does that).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sdp_train.errors import ConfigError

if TYPE_CHECKING:
    from masklab import Mask
    from sdp_train.config import TrainConfig
    from sdp_train.data.batches import Batches
    from sdp_train.models import ModelConfig
    from sdp_train.train import Run

MANIFEST = "manifest.json"


def identity(cfg: TrainConfig, model_config: ModelConfig, mask: Mask | None) -> dict[str, Any]:
    """What a checkpoint and the run resuming from it must agree on (JSON-normalised)."""
    ident = {"model_config": asdict(model_config), "mode": cfg.mode, "world_size": cfg.workers,
             "fsdp": cfg.fsdp, "mask": None if mask is None else mask.matrix.astype(int).tolist()}
    return json.loads(json.dumps(ident))


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it holds a manifest, else its latest complete ``step_N`` subdirectory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    steps = sorted((int(p.name.removeprefix("step_")), p) for p in path.glob("step_*")
                   if p.name.removeprefix("step_").isdigit() and (p / MANIFEST).is_file())
    if not steps:
        raise ConfigError(f"resume={str(path)!r}: no complete checkpoint ({MANIFEST}) in it or in a step_N below it")
    return steps[-1][1]


def check_resumable(path: Path, cfg: TrainConfig, model_config: ModelConfig, mask: Mask | None) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; ConfigError naming every field that differs from this run."""
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    current = identity(cfg, model_config, mask)
    diffs = [f"{key}: checkpoint {manifest['identity'][key]!r}, this run {value!r}"
             for key, value in current.items() if manifest["identity"][key] != value]
    if diffs:
        raise ConfigError(f"cannot resume from {path}: it was written by a different run; " + "; ".join(diffs))
    if manifest["step"] >= cfg.steps:
        raise ConfigError(f"cannot resume from {path}: it is at step {manifest['step']} and the run has "
                          f"steps={cfg.steps}; nothing is left to train")
    return manifest


def save_checkpoint(run: Run, batches: Batches, step: int, root: Path) -> Path:
    """Write every rank's state after ``step`` steps to ``root/step_{step}``; collective."""
    path = root / f"step_{step}"
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": {n: _local(t).detach().clone() for n, t in run.model.state_dict().items()},
        "optimizer": _to_local(run.optimizer.state_dict()),
        "data": batches.state_dict(),
        "rng": _rng_state(run.device),
    }
    _write_atomic(path / f"rank{run.info.rank}.pt", lambda f: torch.save(state, f))
    if dist.is_initialized():
        dist.barrier()
    if run.info.is_main:
        manifest = {"step": step, "identity": identity(run.cfg, run.model_config, run.mask),
                    "config": run.cfg.to_dict()}
        _write_atomic(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(run: Run, batches: Batches, path: Path) -> int:
    """Restore this rank's state from checkpoint ``path``; return the step to continue from."""
    state = torch.load(path / f"rank{run.info.rank}.pt", weights_only=True, map_location=run.device)
    local = run.model.state_dict()
    if set(state["model"]) != set(local):
        raise ConfigError(f"checkpoint {path} rank {run.info.rank} holds tensors {sorted(state['model'])[:5]}..., "
                          f"this rank's model {sorted(local)[:5]}...; they must be the same")
    with torch.no_grad():
        for name, tensor in local.items():
            _local(tensor).copy_(state["model"][name])
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    for index, values in state["optimizer"]["state"].items():
        param = params[int(index)]
        if isinstance(param, DTensor):  # FSDP: the saved local shards become DTensors like the parameter
            values.update({k: DTensor.from_local(v, param.device_mesh, param.placements, shape=param.shape,
                                                 stride=param.stride(), run_check=False)
                           for k, v in values.items() if v.shape == param.to_local().shape and v.dim() > 0})
    run.optimizer.load_state_dict(state["optimizer"])
    batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"], run.device)
    return int(state["step"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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


def _write_atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
