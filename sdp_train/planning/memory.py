"""Predicted peak memory per rank of DDP, FSDP and the SDP modes, from the model's structure.

`predict` builds each worker's model on the meta device (the same subnetwork ``sdp train`` builds
from the same designed mask: `design_for_model`, seed 0) and adds up, in bytes:

- persistent state: the parameters the worker holds, the gradients of those it trains, AdamW's two
  moments of those plus a float32 step counter per tensor; under FSDP2 every tensor is a dim-0
  shard, padded to ``ceil(rows / mesh size)`` rows;
- communication buffers: DDP's reducer buckets (one gradient copy), the SDP sync engine's flat
  buckets (one copy of the held gradients), Bb-SDP's broadcast buffers (every block not held by
  all workers);
- activations, from `sdp_train.planning.activations`;
- on CUDA, the NCCL communicators of the process groups the rank belongs to (the world's and one
  per holder-set group it is in, `sdp_train.planning.comm.process_group_holder_sets`), at an estimated
  `NCCL_COMMUNICATOR_BYTES` each (``SDP_NCCL_COMMUNICATOR_BYTES`` overrides it), or with split
  communicators sharing resources (the runtime's default) the world's and the new ring neighbours'
  connections (`sdp_train.planning.communicators`); gloo's are host memory and count 0;
- FSDP2's transient state: the root's parameters stay unsharded from forward to the end of
  backward and its head gradients are unsharded until then (a model with its own embedding and
  head units, `outer_units`, keeps the head's gathered until its backward, reduce-scatters its
  gradients before any block's and the embedding's last); a block is gathered again for its
  backward while the next one is prefetched (with holder-set meshes nothing is prefetched:
  `sdp_parts.without_backward_prefetch`); the previous block's reduce-scatter input lives until the
  next reduce-scatter; the block's first weight gradient is unsharded.

The peak is the largest of these moments: the start of backward (every saved activation, the loss
gradients), each block's backward peak (activations of the blocks below it, the block's own,
its gradient temporaries and FSDP's buffers), each block's FSDP reduce-scatter, the head's unit's
before them, the root's (or the embedding's unit's) at the end of backward, and the optimizer step (AdamW's foreach temporary of the largest parameter group).
The CPU tracker (`sdp_train.trainer.memory`) counts the same tensors; `tests/distributed/test_plan_vs_measured.py` checks
the totals against it, and docs/plan.md lists the formulas.

Not here: the CUDA context, cuBLAS workspaces and allocator fragmentation (a GPU needs headroom
beyond the prediction), mixed precision, and tuning anything to fit a budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from masklab import Mask, load_mask
from sdp_train.errors import ConfigError
from sdp_train.models import ModelConfig, block_map, data_kind, get_model_config, model_class, subnet_kwargs
from sdp_train.models.subnet import check_held, held_tensors, residual_blocks
from sdp_train.parallel.blockmap import on_meta, outer_units
from sdp_train.parallel.dist import split_resources_shared
from sdp_train.parallel.masking import shared_inside
from sdp_train.planning.activations import ActivationModel, activation_model
from sdp_train.planning.comm import predict_comm, process_group_holder_sets
from sdp_train.planning.communicators import NCCL_PEER_BYTES, PEER_BYTES_ENV, rank_communicators
from sdp_train.trainer.config import LEVEL_OF_MODE, TrainConfig

PLANNED_MODES = ("ddp", "fsdp", "bsdp", "nsdp", "bbsdp")  # sdp train's modes but overlap averaging
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEVICES = ("cpu", "cuda")
NCCL_COMMUNICATOR_BYTES = 688 * 2**20
"""Device memory of one NCCL communicator, an estimate. NCCL allocates per-channel buffers when a
communicator connects (the runtime's groups connect eagerly: `sdp_train.trainer.launch.init_distributed`
binds the device), outside PyTorch's caching allocator, and the size grows with the channel count
and topology: 544 MiB for 2-rank and 688 MiB for 3- and 4-rank groups on 4 A100s with NVLink
(NVIDIA/nccl#964), about 390 MiB for a 1-rank group on an RTX 3060 (sgl-project/sglang#35538).
Groups split from the default one share its buffers only with NCCL_COMM_SPLIT_SHARE_RESOURCES=1, the
runtime's default (docs/design.md §5), and then cost `sdp_train.planning.communicators.NCCL_PEER_BYTES`
per new ring neighbour instead. Set ``SDP_NCCL_COMMUNICATOR_BYTES`` to what a machine measures."""
COMMUNICATOR_BYTES_ENV = "SDP_NCCL_COMMUNICATOR_BYTES"
STEP_BYTES = 4  # AdamW's per-tensor step counter (float32 scalar)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """A memory size: plain bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB.

    >>> parse_bytes("24GiB"), parse_bytes("80GB"), parse_bytes("1.5 MiB"), parse_bytes(4096)
    (25769803776, 80000000000, 1572864, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"memory size {text!r} is not a size: give bytes (e.g. 25769803776) or a number "
                              "with a unit KB/MB/GB/TB or KiB/MiB/GiB/TiB (e.g. 24GiB, 80GB)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"memory size {text!r} must be positive")
    return value


def communicator_bytes(device: str) -> int:
    """Device memory `predict` counts per process-group communicator on ``device`` (with sharing,
    the world's only: `sdp_train.planning.communicators`).

    0 on ``"cpu"`` (gloo's state is host memory); on ``"cuda"`` ``SDP_NCCL_COMMUNICATOR_BYTES``
    (a size as `parse_bytes` reads it, or 0) if set, else `NCCL_COMMUNICATOR_BYTES`.

    >>> communicator_bytes("cpu")
    0
    """
    return _device_bytes(device, COMMUNICATOR_BYTES_ENV, NCCL_COMMUNICATOR_BYTES)


def peer_bytes(device: str) -> int:
    """Device memory `predict` counts, with split communicators sharing resources, per ring neighbour
    a rank's groups add to the world's: 0 on ``"cpu"``, else ``SDP_NCCL_PEER_BYTES`` if set, else
    `sdp_train.planning.communicators.NCCL_PEER_BYTES`.

    >>> peer_bytes("cpu"), peer_bytes("cuda") == NCCL_PEER_BYTES
    (0, True)
    """
    return _device_bytes(device, PEER_BYTES_ENV, NCCL_PEER_BYTES)


def _device_bytes(device: str, env: str, default: int) -> int:
    if device not in DEVICES:
        raise ConfigError(f"device {device!r} is not one of {DEVICES}")
    text = os.environ.get(env)
    if device == "cpu":
        return 0
    if text is None:
        return default
    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise ConfigError(f"{env}: {exc}") from None


@dataclass(frozen=True)
class _Worker:
    model: nn.Module  # on the meta device
    trained: frozenset[str]
    frozen_blocks: frozenset[str]
    meshes: dict[str, int] | None  # FSDP: residual block -> mesh size (root: "")


def predict(model: str | ModelConfig, *, mode: str, workers: int, active: float | None = 0.5, ac: bool = False,
            fsdp: bool = False, batch_size: int = 8, seq_len: int = 64, dtype: str = "float32",
            mask: Mask | str | Path | None = None, model_overrides: Mapping[str, Any] | None = None,
            image_size: int = 8, seed: int = 0, device: str = "cpu",
            loss_chunks: int = TrainConfig.loss_chunks, construction: str = "auto") -> dict[str, Any]:
    """Predicted peak memory of the largest rank, in bytes, with its breakdown.

    Parameters
    ----------
    model : str or ModelConfig
        A named model (``sdp_train.models``) or a config.
    mode : {"ddp", "fsdp", "bsdp", "nsdp", "bbsdp"}
    workers : int
        K ranks.
    active : float, optional
        C of the designed mask (``sdp train --active``); ignored for ddp/fsdp or when `mask` is given.
    ac, fsdp : bool
        ``sdp train --ac`` / ``--fsdp`` (B-SDP only).
    batch_size, seq_len : int
        Per worker, as ``sdp train`` takes them.
    dtype : {"float32", "bfloat16", "float16"}
        Element type of parameters, gradients, optimizer state and activations (the runtime
        trains float32; the others estimate pure low-precision training).
    mask : Mask or path, optional
        Use this mask instead of designing one.
    model_overrides : mapping, optional
        Config fields to change (``sdp train``'s ``model_overrides``).
    image_size : int
        Image side for vision models (8: the digits ``sdp train`` uses by default; 32: CIFAR).
    seed : int
        Seed of the mask design.
    construction : str
        The mask design's construction (``sdp train --construction``; `masklab.design`): ``cyclic``
        gives holder sets of consecutive ranks, whose rings add the fewest neighbours to the world's
        (at most 2 per rank here), so the fewest communicator bytes on ``cuda``.
    device : {"cpu", "cuda"}
        Where the ranks run: on ``"cuda"`` each rank's NCCL communicators are counted
        (`communicator_bytes` each), on ``"cpu"`` gloo's are not.
    loss_chunks : int
        ``sdp train --loss-chunks``: a language model computes its head and loss this many chunks
        of tokens at a time (`sdp_train.models.lm_loss`); 0: over the full logits.

    Returns
    -------
    dict
        ``parameters``, ``gradients``, ``optimizer`` (at the peak; FSDP's unsharded parameters and
        gradients included), ``activations`` (the largest set of saved activations, which may be
        reached at another moment), ``other`` (communication buffers and backward temporaries at
        the peak), ``communicators`` (``communicator_count`` communicators of the largest rank, at
        ``communicator_bytes`` each; 0 on cpu), ``total``, ``persistent`` (parameters / gradients /
        optimizer between steps),
        ``peak_at``, ``rank`` (the largest rank) and ``per_rank`` totals; ``comm_bytes_per_step``
        and ``wire_bytes_per_step``: buffer and wire bytes per step of the rank that sends most
        (`sdp_train.planning.comm`); ``process_groups``: the process groups the run creates besides
        the world's (one per distinct holder set, `plan_comm.process_group_holder_sets`);
        ``eval_peak``: rank 0's peak during validation, which assembles the full model on rank 0 only;
        ``unmaskable``: the part of the largest rank's memory that no mask removes, the parameters
        outside every block (embedding, final norm, head; sharded over all ranks under FSDP) with
        their gradients, optimizer state and bucket copies, and at the start of backward the root
        unsharded (FSDP), the stem's and head's activations and the loss gradients.
    """
    config = _model_config(model, model_overrides, image_size)
    if mode not in PLANNED_MODES:
        raise ConfigError(f"mode {mode!r} is not one of {PLANNED_MODES}"
                          + (": overlap averaging is not planned; each worker keeps the full model and, once a schedule "
                             "has moved every block to it, AdamW state for all of it, like ddp"
                             if mode == "overlap" else ""))
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    # the same checks as `sdp train` (the mask itself is checked against the model below)
    TrainConfig(model=config.name, mode=mode, workers=workers, active=active if mask is None else None,
                mask=None if mask is None else "given", batch_size=batch_size, seq_len=seq_len, fsdp=fsdp,
                activation_checkpointing=ac, seed=seed, loss_chunks=loss_chunks, construction=construction)
    if hasattr(config, "max_seq_len") and seq_len > config.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds {config.name}'s max_seq_len={config.max_seq_len}")
    per_communicator = communicator_bytes(device)
    matrix = None if mode in ("ddp", "fsdp") else _mask_matrix(config, mode, workers, active, mask, seed,
                                                               construction)
    elem = DTYPE_BYTES[dtype]
    held = _held(config, mode, matrix, workers)
    groups = process_group_holder_sets(config, mode, held, workers, fsdp=fsdp)
    results = [_predict_rank(_worker(config, mode, matrix, r, workers, fsdp), config, mode, matrix, workers, ac,
                             elem, batch_size, seq_len, image_size, loss_chunks)
               for r in range(workers if matrix is not None else 1)]
    shared = split_resources_shared()
    for r, result in enumerate(results):  # the world's communicator, and one per holder-set group it is in
        own = rank_communicators(r, workers, groups, per_communicator=per_communicator,
                                 per_peer=peer_bytes(device), shared=shared)
        result |= {"communicator_count": own.count, "communicators": own.bytes,
                   "communicator_peers": own.new_peers, "communicators_shared": shared}
        result["total"] += result["communicators"]
    rank = max(range(len(results)), key=lambda r: results[r]["total"])
    totals = [r["total"] for r in results] if matrix is not None else [results[0]["total"]] * workers
    comm = predict_comm(config, mode, held, workers, fsdp=fsdp, elem=elem)
    busiest = max(range(workers), key=lambda r: comm[r].wire)
    return {**results[rank], "rank": rank, "per_rank": totals, "device": device, "process_groups": len(groups),
            "communicator_bytes": per_communicator,
            "comm_bytes_per_step": comm[busiest].buffer, "wire_bytes_per_step": comm[busiest].wire,
            "eval_peak": _eval_peak(config, mode, workers, fsdp, results[0], elem, batch_size, seq_len, image_size,
                                    loss_chunks)}


def _held(config: ModelConfig, mode: str, matrix: np.ndarray | None, workers: int):
    """Each rank's held tensors (``subnet.held_tensors``) under this run's mask; None for the baselines."""
    if matrix is None:
        return None
    level = LEVEL_OF_MODE[mode]
    with _no_init():
        return [held_tensors(config, matrix[r], level) for r in range(workers)]


def _eval_peak(config: ModelConfig, mode: str, workers: int, fsdp: bool, rank0: dict[str, Any], elem: int,
               batch_size: int, seq_len: int, image_size: int, loss_chunks: int) -> int:
    """Rank 0's peak during validation: its training state and communicators, the assembled full
    model (unless it already holds it: DDP or one rank) and a no-grad forward (one block's
    activations, the logits, or with `loss_chunks` one chunk's, and the loss's temporaries of one
    batch), an upper estimate."""
    full = _meta_model(config, None, None)
    acts = activation_model(full, frozenset(), batch_size=batch_size, seq_len=seq_len, image_size=image_size,
                            elem=elem, loss_chunks=loss_chunks)
    forward = acts.stem + max((b.saved for b in acts.blocks), default=0) + acts.head + acts.loss_backward
    holds_full = (mode == "ddp" or workers == 1) and not fsdp
    assembled = 0 if holds_full else sum(t.numel() * elem for t in full.state_dict().values())
    return sum(rank0["persistent"].values()) + rank0["buffers"] + rank0["communicators"] + assembled + forward


DEFAULT_ACTIVE: tuple[float, ...] = (0.25, 0.375, 0.5, 0.69, 1.0)
"""The paper's active fractions; `meaningful_actives` keeps those a K-worker mask can realise."""
_SYSTEMS = (("B-SDP", "bsdp"), ("N-SDP", "nsdp"), ("Bb-SDP", "bbsdp"))


def meaningful_actives(workers: int, candidates: tuple[float, ...] = DEFAULT_ACTIVE) -> list[float]:
    """The distinct active fractions c/K that ``sdp train --active C`` realises for ``workers`` ranks.

    A designed mask gives every block c = round(C K) holders, so C is realised as c/K; candidates
    that round to the same c are one configuration.

    >>> meaningful_actives(4), meaningful_actives(8)
    ([0.25, 0.5, 0.75, 1.0], [0.25, 0.375, 0.5, 0.75, 1.0])
    """
    from masklab.design import coverage_from_active

    return sorted({coverage_from_active(workers, c) / workers for c in candidates})


def plan_systems(model: str | ModelConfig, *, workers: int, memory_per_device: int, ac: bool = False,
                 fsdp: bool = False, actives: tuple[float, ...] = DEFAULT_ACTIVE, **kwargs: Any) -> list[dict[str, Any]]:
    """One row per system: DDP, FSDP, then B-SDP / N-SDP / Bb-SDP (and B-SDP+FSDP with ``fsdp``) at
    every meaningful C; each row is `predict`'s dict plus ``system``, ``active`` and ``fits`` (both
    the training peak and rank 0's validation peak within `memory_per_device`), and for the SDP
    rows `communicator_share`'s keys against the DDP row.

    A system whose mask cannot be designed at some C (too few blocks or neuron groups for K) gets
    a row with ``total`` None and the reason in ``error``.
    """
    from masklab import DesignError

    suffix = "+AC" if ac else ""
    specs = [("DDP", "ddp", None, False), ("FSDP", "fsdp", None, False)]
    for c in meaningful_actives(workers, actives):
        specs += [(label, mode, c, False) for label, mode in _SYSTEMS]
        specs += [("B-SDP+FSDP", "bsdp", c, True)] if fsdp else []
    rows = []
    for label, mode, c, with_fsdp in specs:
        row: dict[str, Any] = {"system": label + suffix, "mode": mode, "active": 1.0 if c is None else c}
        try:
            row |= predict(model, mode=mode, workers=workers, active=c, ac=ac, fsdp=with_fsdp, **kwargs)
        except (ConfigError, DesignError) as exc:
            if c is None:  # the baselines need no mask: the input itself is wrong
                raise
            rows.append(row | {"total": None, "fits": False, "error": str(exc)})
            continue
        rows.append(row | {"fits": max(row["total"], row["eval_peak"]) <= memory_per_device})
    ddp = rows[0]
    for row in rows[2:]:
        if row["total"] is not None:
            row |= communicator_share(row, ddp)
    return rows


def communicator_share(row: Mapping[str, Any], ddp: Mapping[str, Any]) -> dict[str, Any]:
    """What an SDP plan saves against DDP's and what its communicators take of it: ``saved_vs_ddp``,
    DDP's total less the row's, communicators left out of both (so the saving SDP's masks make);
    ``communicator_extra``, the row's communicators less DDP's (its process groups' cost);
    ``communicator_share``, extra / saved (None when nothing is saved).

    >>> communicator_share({"total": 10, "communicators": 3}, {"total": 20, "communicators": 1})
    {'saved_vs_ddp': 12, 'communicator_extra': 2, 'communicator_share': 0.16666666666666666}
    """
    saved = (ddp["total"] - ddp["communicators"]) - (row["total"] - row["communicators"])
    extra = row["communicators"] - ddp["communicators"]
    return {"saved_vs_ddp": saved, "communicator_extra": extra, "communicator_share": extra / saved if saved > 0 else None}


def _model_config(model: str | ModelConfig, overrides: Mapping[str, Any] | None, image_size: int) -> ModelConfig:
    """The config ``sdp train`` would run: vision models take 1 channel for the 8 x 8 digits, else 3, and
    a model built for one image side (Swin) takes ``image_size``."""
    overrides = dict(overrides or {})
    base = get_model_config(model) if isinstance(model, str) else model
    if not isinstance(model, str):
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(model)})
        if unknown:
            raise ConfigError(f"{model.name}: unknown config fields {unknown}")
    data: dict[str, Any] = {}
    if data_kind(base) == "images":
        data["in_channels"] = 1 if image_size == 8 else 3
        if hasattr(base, "image_size"):
            data["image_size"] = image_size
    changes = {**{k: v for k, v in data.items() if k not in overrides}, **overrides}
    if isinstance(model, str):
        return get_model_config(model, **changes)
    return dataclasses.replace(model, **changes) if changes else model


def _mask_matrix(config: ModelConfig, mode: str, workers: int, active: float | None, mask, seed: int,
                 construction: str = "auto") -> np.ndarray:
    from sdp_train.trainer.prepare import design_for_model

    level = LEVEL_OF_MODE[mode]
    if mask is None:
        cfg = TrainConfig(model=config.name, mode=mode, workers=workers, active=active, seed=seed,
                          construction=construction)
        with _no_init():
            mask = design_for_model(cfg, config)
    elif not isinstance(mask, Mask):
        mask = load_mask(mask)
    blocks = _block_map(config).num_blocks(level)
    if mask.workers != workers or mask.blocks != blocks:
        raise ConfigError(f"the mask is {mask.workers} x {mask.blocks} but {config.name} with {workers} workers "
                          f"needs {workers} x {blocks} (level {level!r})")
    return mask.matrix.astype(bool)


def _worker(config: ModelConfig, mode: str, matrix: np.ndarray | None, rank: int, workers: int,
            fsdp: bool) -> _Worker:
    level = LEVEL_OF_MODE.get(mode)
    bmap = _block_map(config)
    forward_masked = mode in ("bsdp", "nsdp")
    model = _meta_model(config, level if forward_masked else None, matrix[rank] if forward_masked else None)
    trained, frozen_blocks = frozenset(n for n, _ in model.named_parameters()), frozenset()
    if mode == "bbsdp":
        names = bmap.block_names("block")
        frozen_blocks = frozenset(n for n, held in zip(names, matrix[rank]) if not held)
        frozen = {n for j in np.flatnonzero(~matrix[rank]) for n, _ in bmap.owned("block", int(j))}
        trained = trained - frozen
    meshes = None
    if mode == "fsdp":
        meshes = {name: workers for name, _ in residual_blocks(model)} | {"": workers}
    elif fsdp:
        coverage = dict(zip(bmap.block_names("block"), matrix.sum(axis=0).tolist()))
        meshes = {name: int(coverage.get(name, workers)) for name, _ in residual_blocks(model)} | {"": workers}
    return _Worker(model, trained, frozen_blocks, meshes)


@contextmanager
def _no_init() -> Iterator[None]:
    """Skip torch.nn.init while building meta-device models: there is nothing to initialise, and
    meta-device random init costs ~0.1 s per layer (llama-1b: 6 s per model instead of 0.04 s)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


_CACHE: dict[tuple[str, Any], Any] = {}


def _block_map(config: ModelConfig):
    key = (repr(config), "block_map")
    if key not in _CACHE:
        with _no_init():
            _CACHE[key] = block_map(config)
    return _CACHE[key]


def _meta_model(config: ModelConfig, level: str | None, row: np.ndarray | None) -> nn.Module:
    """The full model (``level`` None) or the forward-masked subnetwork of mask row ``row``, on the
    meta device; cached, since workers and systems share structures."""
    key = (repr(config), level, None if level is None else row.tobytes())
    if key not in _CACHE:
        if len(_CACHE) > 256:
            _CACHE.clear()
        with _no_init():
            structure = {} if level is None else subnet_kwargs(config, check_held(config, row, level), level)
            with on_meta():
                _CACHE[key] = model_class(config)(config, **structure)
    return _CACHE[key]


def _sharded(shape: tuple[int, ...], mesh: int) -> tuple[int, int]:
    """(local shard, padded unsharded) elements of a tensor under FSDP2 on ``mesh`` ranks."""
    rest = math.prod(shape[1:])
    rows = -(-shape[0] // mesh)
    return rows * rest, rows * mesh * rest


def _predict_rank(w: _Worker, config: ModelConfig, mode: str, matrix: np.ndarray | None, workers: int, ac: bool,
                  elem: int, batch_size: int, seq_len: int, image_size: int, loss_chunks: int) -> dict[str, Any]:
    acts = activation_model(w.model, w.frozen_blocks, batch_size=batch_size, seq_len=seq_len,
                            image_size=image_size, elem=elem, loss_chunks=loss_chunks)
    block_of = {name: block for name, block in residual_blocks(w.model)}
    # SDP+FSDP shards a block's shared children (a shortcut) over every rank: counted with the root
    shared = tuple(f"{n}." for n in shared_inside(w.model, list(block_of))) if mode != "fsdp" else ()
    # FSDP's units of their own outside the blocks (embedding; final norm with head), the last kept gathered
    outer = {"+".join(g): tuple(f"{n}." for n in g) for g in outer_units(w.model)} if w.meshes is not None else {}
    head_unit = list(outer)[-1] if outer else None
    unit_of = {}  # parameter -> FSDP unit ("" = root)
    for pname, _ in w.model.named_parameters():
        block = next((b for b in block_of if pname.startswith(b + ".")), "")
        unit = "" if pname.startswith(shared) else block
        unit_of[pname] = unit or next((u for u, prefixes in outer.items() if pname.startswith(prefixes)), "")
    local: dict[str, int] = {}
    full: dict[str, int] = {}
    for pname, p in w.model.named_parameters():
        if w.meshes is None:
            local[pname] = full[pname] = p.numel()
        else:
            local[pname], full[pname] = _sharded(tuple(p.shape), w.meshes.get(unit_of[pname], w.meshes[""]))
    trained = [n for n in local if n in w.trained]
    params_b = sum(local.values()) * elem
    grads_b = sum(local[n] for n in trained) * elem
    opt_b = 2 * grads_b + STEP_BYTES * len(trained)
    buffers_b = sum(b.numel() * b.element_size() for b in w.model.buffers())
    # a copy of every gradient: DDP's reducer buckets (gradient_as_bucket_view=False), the sync engine's
    bucketed = (mode == "ddp" and workers > 1) or (mode in ("bsdp", "nsdp", "bbsdp") and w.meshes is None)
    comm = buffers_b + (grads_b if bucketed else 0)
    if mode == "bbsdp" and bucketed and workers > 1:
        comm += _broadcast_bytes(config, matrix) * elem
    decay = sum(local[n] for n in trained if len(w.model.get_parameter(n).shape) >= 2)
    foreach = max(decay, sum(local[n] for n in trained) - decay) * elem

    unit_full = {u: sum(full[n] for n in local if unit_of[n] == u) * elem for u in set(unit_of.values())}
    head_grads = sum(full[n] for n in trained if unit_of[n] == "" and n.startswith(acts.head_prefixes)) * elem
    head_kept = unit_full.get(head_unit, 0)  # the head's unit, gathered from its forward to its backward
    stem_unit = sum(unit_full.get(u, 0) for u in outer if u != head_unit)
    moments = _moments(acts, ac, mode == "fsdp", unit_full if w.meshes is not None else None, w.meshes or {},
                       head_grads, elem, head=head_kept, stem=stem_unit)
    if w.meshes is not None and workers > 1:
        if head_unit is not None:  # the head's reduce-scatter, when its backward ends, before any block's
            grads = sum(full[n] for n in trained if unit_of[n] == head_unit) * elem
            shard = grads // w.meshes[""]
            # FSDP over the world has prefetched the last block at the head's backward
            last = unit_full.get(acts.blocks[-1].name, 0) if mode == "fsdp" and acts.blocks else 0
            moments.insert(1, _Moment("reduce-scatter of the head", acts.forward_bytes(ac) - acts.head,
                                      grads + 2 * shard, last, grads))
        # the last reduce-scatter ends backward (the root's and the embedding's unit's, whose input needs
        # no gradient): parameters resharded, gradients unsharded (with the head in the root, the head's
        # since the loss), copied into the reduce-scatter input, the shard out and gloo's copy of it
        root_grads = sum(full[n] for n in trained if unit_of[n] in ("", *outer) and unit_of[n] != head_unit) * elem
        shard = root_grads // w.meshes[""]
        label = "reduce-scatter of the embedding" if outer else "reduce-scatter of the root"
        moments.append(_Moment(label, acts.constant, root_grads + 2 * shard, 0, root_grads))
    moments.append(_Moment("optimizer step", 0, foreach, 0, 0))
    state = params_b + grads_b + opt_b + comm
    # what no mask removes: the root (embedding, final norm, head; FSDP: sharded over all ranks) with its
    # gradients, AdamW state and bucket copies, and at backward start the root unsharded (FSDP), the
    # stem's and head's activations (the logits' log-softmax), the constants and the loss gradients
    root = [n for n in local if unit_of[n] in ("", *outer)]
    root_trained = [n for n in root if n in w.trained]
    unmaskable = ((sum(local[n] for n in root) + (4 if bucketed else 3) * sum(local[n] for n in root_trained)) * elem
                  + STEP_BYTES * len(root_trained) + acts.stem + acts.constant + acts.head + acts.loss_backward
                  + (unit_full.get("", 0) + head_kept if w.meshes is not None else 0))
    peak = max(moments, key=lambda m: m.activations + m.temporaries + m.parameters + m.gradients)
    total = state + peak.activations + peak.temporaries + peak.parameters + peak.gradients
    optimizer = opt_b + (foreach if peak.label == "optimizer step" else 0)
    parameters, gradients = params_b + peak.parameters, grads_b + peak.gradients
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer, "buffers": comm,
            "activations": max(m.activations for m in moments),
            "other": total - parameters - gradients - optimizer - peak.activations, "total": total,
            "unmaskable": unmaskable,
            "persistent": {"parameters": params_b, "gradients": grads_b, "optimizer": opt_b}, "peak_at": peak.label}


@dataclass(frozen=True)
class _Moment:
    """Bytes live at one candidate peak, on top of the persistent state and communication buffers."""

    label: str
    activations: int
    temporaries: int  # gradient temporaries, FSDP's prefetch / reduce-scatter buffers, foreach temporaries
    parameters: int  # FSDP: unsharded parameters
    gradients: int  # FSDP: unsharded gradients


def _moments(acts: ActivationModel, ac: bool, prefetch: bool, unit_full: dict[str, int] | None,
             mesh_of: dict[str, int], head_grads: int, elem: int, *, head: int = 0, stem: int = 0) -> list[_Moment]:
    """The start of backward, then each block's backward peak, last block first.

    With FSDP (`unit_full` given) every block reshards after forward and is gathered again for its
    backward; with `prefetch` (FSDP over the world) the next unit in backward order is gathered
    too (after the first block the embedding's, `stem` bytes), holder-set meshes prefetch nothing.
    `head`: the bytes of the head's own unit, unsharded at the start of backward.
    """
    fsdp = unit_full is not None
    units = [unit_full.get(b.name, 0) if fsdp else 0 for b in acts.blocks]
    meshes = [mesh_of.get(b.name, 1) for b in acts.blocks]
    root = unit_full.get("", 0) if fsdp else 0
    out = [_Moment("backward start", acts.forward_bytes(ac), acts.loss_backward, root + (head if fsdp else 0), 0)]
    below = acts.stem + acts.constant  # activations of the blocks below block k
    for k, block in enumerate(acts.blocks):
        temps, unsharded, grads = block.backward, root, 0
        if fsdp:
            unsharded += units[k]  # block k gathered (and with prefetch the next one in backward order)
            temps += (units[k - 1] if k > 0 else stem) if prefetch else 0
            temps += units[k + 1] if k + 1 < len(units) else 0  # the previous block's reduce-scatter input
            grads = head_grads + block.first_grad * elem
        out.append(_Moment(f"backward of {block.name}", below + block.saved, temps, unsharded, grads))
        if fsdp:  # its reduce-scatter: gradients copied into the input buffer; the shard out (gloo: a copy in)
            unsharded = root + ((units[k - 1] if k > 0 else stem) if prefetch else 0)
            temps = block.output + 2 * units[k] + (units[k] // meshes[k] if meshes[k] > 1 else 0)
            out.append(_Moment(f"reduce-scatter of {block.name}", below, temps, unsharded, head_grads))
        below += (0 if ac else block.saved) + block.output
    return out


def _broadcast_bytes(config: ModelConfig, matrix: np.ndarray) -> int:
    """Elements of Bb-SDP's broadcast buffers: every block held by fewer than all workers."""
    bmap = _block_map(config)
    shapes = bmap.shapes
    coverage = matrix.sum(axis=0)
    return sum(math.prod(shapes[n]) for j, block in enumerate(bmap.blocks["block"]) if coverage[j] < matrix.shape[0]
               for n, _ in block.tensors if n in bmap.parameter_names)
