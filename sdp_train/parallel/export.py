"""Assembling the full model from the workers' subnetworks, and writing it as safetensors.

Every slice of every full-model tensor has one *owner*: its lowest-ranked holder. `assemble`
builds each full tensor from zeros, writes the owned slices, and sums over ranks (``all_reduce``,
or ``reduce`` to rank 0), tensor by tensor in state-dict order, so every rank takes part in every
collective in the same order and none can wait on a broadcast another skipped. Not here: which
worker holds what (`sdp_train.parallel.masking`), loading a full model back into a worker
(`sdp_train.parallel.wrapper`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from masklab.io import atomic_write
from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.grads import is_dtensor


def owned_positions(name: str, held_by_rank: Sequence[Mapping[str, SliceSpec]],
                    rank: int) -> tuple[int | None, tuple[int, ...]] | None:
    """The part of tensor ``name`` whose lowest-ranked holder is ``rank``.

    Returns None (no part), ``(None, ())`` (the whole tensor) or ``(dim, full positions)``.
    """
    holders = [r for r, held in enumerate(held_by_rank) if name in held]
    if rank not in holders:
        return None
    sliced = [held_by_rank[r][name] for r in holders if not held_by_rank[r][name].is_whole]
    if not sliced:
        return (None, ()) if holders[0] == rank else None
    dim, full_size = sliced[0].dim, sliced[0].full_size
    owner: dict[int, int] = {}
    for r in holders:
        spec = held_by_rank[r][name]
        for i in range(full_size) if spec.is_whole else spec.index:
            owner.setdefault(i, r)
    mine = tuple(i for i in sorted(owner) if owner[i] == rank)
    return (dim, mine) if mine else None


@torch.no_grad()
def assemble(local_state: Mapping[str, torch.Tensor], local_index: Mapping[str, SliceSpec],
             tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
             held_by_rank: Sequence[Mapping[str, SliceSpec]], rank: int, *, rank0_only: bool,
             device: torch.device, aliases: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The full state dict (CPU tensors), from every rank's local state; collective when distributed.

    Returns it on every rank, or on rank 0 only (others get ``{}``) with ``rank0_only``. A tied
    tensor (`aliases`: alias -> first name, `ModelLayout.aliases`) is assembled once and appears
    under each of its names as one tensor, so loading the dict keeps the tie.
    """
    aliases = aliases or {}
    distributed = dist.is_available() and dist.is_initialized() and len(held_by_rank) > 1
    full_state: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in tensors.items():
        if name in aliases:
            continue
        full = torch.zeros(shape, dtype=dtype, device=device)
        owned = owned_positions(name, held_by_rank, rank)
        value = local_state.get(name)
        if is_dtensor(value):  # FSDP: gathered over the block's holders, in this same order
            value = value.full_tensor()
        if owned is not None:
            dim, positions = owned
            if dim is None:
                full.copy_(value)
            else:
                spec = local_index[name]
                local_of = {f: i for i, f in enumerate(spec.index)}  # a whole local tensor: identity
                local_pos = torch.tensor([local_of[f] for f in positions] if not spec.is_whole else positions,
                                         dtype=torch.int64, device=device)
                full_pos = torch.tensor(positions, dtype=torch.int64, device=device)
                full.index_copy_(dim, full_pos, value.index_select(dim, local_pos).to(dtype))
        if distributed:
            if rank0_only:
                dist.reduce(full, dst=0)
            else:
                dist.all_reduce(full)
        if not rank0_only or rank == 0:
            full_state[name] = full.cpu()
    if not full_state:
        return full_state
    return {n: full_state[aliases.get(n, n)] for n in tensors}


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *,
                     config: object | None = None) -> Path:
    """Write ``state`` to ``path``: a ``.safetensors`` file, or a directory holding ``model.safetensors``.

    For a directory and a Hugging Face ``config`` (anything with ``save_pretrained``), ``config.json``
    is written beside it, so ``from_pretrained(path)`` loads the model. Returns the file written.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError("saving the full model needs the safetensors package: pip install safetensors") from exc
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
        path = path / "model.safetensors"
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tensors, storages = {}, set()
    for n, t in state.items():  # tied weights (one tensor under two names) are written twice, as safetensors wants
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[n] = t
    metadata = {"format": "pt", "writer": json.dumps("sdp_train")}
    return atomic_write(path, lambda name: save_file(tensors, name, metadata=metadata))
