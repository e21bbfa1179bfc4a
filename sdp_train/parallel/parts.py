"""The steps `SubnetworkDataParallel` takes that are not about cutting the model.

`resolve_mask` turns ``mask=`` / ``active=`` into a validated `Mask` for a model's layout;
`broadcast_from_holders` makes every holder of a block start from its lowest-ranked holder's
values (as DDP starts from rank 0's); `apply_checkpointing` and `apply_holder_fsdp` compose SDP
with activation checkpointing and FSDP2 the way `sdp_train.parallel.parallelize` does for the built-in
models: checkpoint inside each block, then shard each block among exactly its holders.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from masklab import Mask, design, load_mask, neuron_design
from masklab.design import exact_coverage
from masklab.errors import DesignError
from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import SliceSpec, outer_units, shared_children
from sdp_train.parallel.masking import ModelLayout
from sdp_train.parallel.sync import BucketPlan


def resolve_mask(mask: Mask | str | os.PathLike | None, active: float | None, workers: int,
                 layout: ModelLayout, *, seed: int, construction: str = "auto", schedules: bool = False) -> Mask:
    """The mask for ``layout`` on ``workers`` ranks: given, read from a file, or designed for ``active``
    (``masklab.design`` with ``construction`` and ``seed``; at neuron level ``masklab.neuron_design``).
    A schedule other than static is refused unless `schedules` (everything but FSDP trains them).

    Raises
    ------
    ConfigError
        Neither or both of ``mask`` / ``active``, an ``active`` that is no c/K of the ``workers``
        (`masklab.design.exact_coverage`: refused naming the K that would realise it, not rounded),
        a shape that does not fit, a dynamic schedule, or a row that breaks the model's rules (at
        level ``"neuron"``: a block with no neurons).
    """
    if (mask is None) == (active is None):
        raise ConfigError(f"pass exactly one of mask= and active=, got mask={mask!r}, active={active!r}")
    columns = layout.columns
    if active is not None:
        try:
            exact_coverage(workers, active)
        except DesignError as exc:
            raise ConfigError(f"active={active!r}: {exc}") from None
        if layout.level == "block":
            result = design(workers, len(columns), active=active, construction=construction,
                            seed=seed).replace(block_names=columns)
        else:
            result = neuron_design(workers, len(layout.blocks), layout.neuron_groups, active=active,
                                   construction=construction, seed=seed).replace(block_names=columns)
    elif isinstance(mask, Mask):
        result = mask
    elif isinstance(mask, (str, os.PathLike)):
        result = load_mask(mask)
    else:
        raise ConfigError(f"mask must be a masklab.Mask or a mask file path, got {type(mask).__name__}")
    if result.workers != workers:
        raise ConfigError(f"the mask has {result.workers} workers (rows) but the job has {workers} ranks")
    if result.blocks != len(columns):
        raise ConfigError(f"the mask has {result.blocks} columns but the model has {len(columns)} maskable "
                          f"blocks at level {layout.level!r} ({columns[0]} ... {columns[-1]})")
    if not result.schedule.is_static and not schedules:
        raise ConfigError(f"SubnetworkDataParallel trains schedules without fsdp only (FSDP's holder meshes are "
                          f"fixed at construction); this mask has a {result.schedule.kind!r} schedule")
    for r, matrix in enumerate(result.matrices):
        for k in range(workers):
            try:
                layout.held(matrix[k])
            except ConfigError as exc:
                where = f" of sequence round {r}" if result.rounds is not None else ""
                raise ConfigError(f"mask row {k} (worker {k}){where}: {exc}") from None
    return result


@torch.no_grad()
def broadcast_from_holders(module: nn.Module, plans: Sequence[BucketPlan], local_index: Mapping[str, SliceSpec],
                           groups: Mapping[tuple[int, ...], dist.ProcessGroup | None], rank: int) -> None:
    """Copy every held slice from its lowest-ranked holder to the other holders, bucket by bucket.

    Buckets are visited in the plans' global order, so collectives on overlapping groups are
    issued in one order on every rank.
    """
    params = dict(module.named_parameters())
    for plan in plans:
        if rank not in plan.holders or groups[plan.holders] is None:
            continue
        parts = [_part(params[a.name].data, a.dim, a.index, local_index[a.name]) for a in plan.atoms]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ConfigError(f"the parameters of one bucket have different dtypes {sorted(map(str, dtypes))}: "
                              f"{[a.name for a in plan.atoms][:4]}")
        buffer = torch.cat([p.reshape(-1) for p in parts])
        dist.broadcast(buffer, src=plan.holders[0], group=groups[plan.holders])
        offset = 0
        for atom, part in zip(plan.atoms, parts):
            value = buffer[offset:offset + part.numel()].view(part.shape)
            offset += part.numel()
            target = params[atom.name].data
            if atom.dim is None:
                target.copy_(value)
            else:
                target.index_copy_(atom.dim, _positions(atom.index, local_index[atom.name], target.device), value)


def _positions(full_index: tuple[int, ...], local: SliceSpec, device: torch.device) -> torch.Tensor:
    if local.is_whole:
        return torch.tensor(full_index, dtype=torch.int64, device=device)
    where = {f: i for i, f in enumerate(local.index)}
    return torch.tensor([where[f] for f in full_index], dtype=torch.int64, device=device)


def _part(tensor: torch.Tensor, dim: int | None, full_index: tuple[int, ...], local: SliceSpec) -> torch.Tensor:
    if dim is None:
        return tensor
    return tensor.index_select(dim, _positions(full_index, local, tensor.device))


def apply_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in backward (non-reentrant ``torch.utils.checkpoint``).

    Keyword arguments (Hugging Face's ``attention_mask``, ``position_embeddings``) pass through;
    buffers are restored after the recomputation, so BatchNorm statistics move once per step.
    """
    for block in blocks:
        context = functools.partial(_recompute_contexts, block)
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context)


def _recompute_contexts(block: nn.Module) -> tuple:
    return nullcontext(), _buffers_kept(block)


@contextmanager
def _buffers_kept(block: nn.Module) -> Iterator[None]:
    saved = [b.detach().clone() for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(block.buffers(), saved):
                buffer.copy_(value)


def apply_holder_fsdp(module: nn.Module, mask: Mask, block_names: Sequence[str], rank: int,
                      device: torch.device, groups: Mapping[tuple[int, ...], dist.ProcessGroup]) -> None:
    """FSDP2 ``fully_shard`` of each held block over its holders, then of the root over every rank.

    ``groups`` holds every block's holder-set group, single holders included (`holder_set_groups`
    with ``singletons=True``). Each block reshards after its forward and is gathered again at the
    start of its backward, so a rank keeps one held block unsharded at a time; no module prefetches
    (`without_backward_prefetch`), so every rank issues, per held block in reverse model order, the
    block's all-gather then its reduce-scatter: a subsequence of one global order, which cannot
    deadlock across overlapping holder sets (docs/design.md §5). The embedding and the final norm with
    the head are units over every rank where the model declares them (`shard_outer_units`). A
    block's shared children (a downsampling block's shortcut, which a worker without the block keeps
    in its pass-through) are units of their own over every rank, gathered and reduced inside their
    block's window.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("fsdp=True needs torch.distributed: run under torchrun")
    world = DeviceMesh.from_group(dist.group.WORLD, device.type)
    # a shared child (a shortcut) runs on every rank, in its block or its pass-through: a unit over the
    # world, so that every rank's root holds the same parameters
    built = dict(module.named_modules())  # a block a worker skips may be absent
    for block in (built[name] for name in block_names if name in built):
        for child in shared_children(block):
            fully_shard(block.get_submodule(child), mesh=world)
            without_backward_prefetch(block.get_submodule(child))
    for j, name in enumerate(block_names):
        holders = tuple(int(k) for k in mask.holder_set(j))
        if rank in holders:
            block = module.get_submodule(name)
            group = groups[holders]
            if group is None and dist.get_world_size() == 1:  # a one-rank world makes no groups: its own
                group = dist.group.WORLD
            fully_shard(block, mesh=DeviceMesh.from_group(group, device.type))
            without_backward_prefetch(block)
    shard_outer_units(module, world, prefetch=False)
    fully_shard(module, mesh=world)
    without_backward_prefetch(module)


def shard_outer_units(module: nn.Module, mesh, *, prefetch: bool) -> None:
    """``fully_shard`` each of the model's `outer_units` (its embedding; its final norm with the head)
    over ``mesh``, before the root: each unit's gradients are reduce-scattered and freed when its
    own backward ends, instead of all at once at the end of backward in the root's.

    The last unit runs last in forward and first in backward, so it keeps its parameters gathered
    from its forward to its backward (as torchtitan's head): no second all-gather. Without
    ``prefetch`` no unit prefetches in backward (`without_backward_prefetch`).
    """
    from torch.distributed.fsdp import fully_shard

    units = outer_units(module)
    for i, group in enumerate(units):
        members = [module.get_submodule(name) for name in group]
        fully_shard(members if len(members) > 1 else members[0], mesh=mesh,
                    reshard_after_forward=i < len(units) - 1)
        if not prefetch:
            without_backward_prefetch(members[0])


def without_backward_prefetch(module: nn.Module) -> None:
    """Stop FSDP2 from all-gathering another module early in backward; ``module`` gathers only itself.

    By default FSDP2 prefetches, at a module's backward, the module this rank ran before it in
    forward. With holder-set meshes that module differs from rank to rank, so two ranks sharing two
    groups could issue one group's all-gather and the other's reduce-scatter in opposite orders and
    wait for each other forever. An empty prefetch list means the default to FSDP2, so the module
    lists itself: by the time its list runs it is gathered already, and gathering it is a no-op.
    """
    module.set_modules_to_backward_prefetch([module])
