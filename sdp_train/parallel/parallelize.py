"""Activation checkpointing and FSDP2 applied to a (sub)model in place, in torchtitan's order.

`parallelize` calls the parallelisms in a fixed order: activation checkpointing first (inside
each residual block, so FSDP's hooks on the block run outside the checkpointed region and the
recomputation sees unsharded parameters), then FSDP2 (every residual block, the embedding and the
final norm with the head where the model declares them, then the root). DDP
and the SDP sync engine are set up by `sdp_train.trainer.run.Run`, since they need its byte counters.

With SDP (``--fsdp``) each held block is sharded among exactly its holders: its mesh is built
from the block's holder-set process group, so FSDP's reduce-scatter computes the holder-set
average that the sync engine would, and SDP's and FSDP's savings multiply. Every block's input
requires grad (it is the output of a trained embedding/stem), so FSDP launches each block's
reduce-scatter from the block's own backward; with holder-set meshes `apply_fsdp` turns FSDP's
backward prefetch off, so every rank gathers and reduces each block it holds in reverse block
order (docs/design.md §5).

Not here: tensor or pipeline parallelism, mixed precision, CPU offload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sdp_train.parallel.parts import apply_checkpointing, shard_outer_units, without_backward_prefetch


def parallelize(model: nn.Module, *, activation_checkpointing: bool,
                block_meshes: Mapping[str, DeviceMesh] | None, root_mesh: DeviceMesh | None,
                blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """Apply activation checkpointing and FSDP2 to ``model`` in place.

    Parameters
    ----------
    model : nn.Module
        The full model or a worker's subnetwork.
    activation_checkpointing : bool
        Recompute each residual block's activations in backward instead of keeping them.
    block_meshes : mapping of str to DeviceMesh, optional
        With FSDP: the mesh each residual block (by its name in ``blocks``) is sharded over.
    root_mesh : DeviceMesh, optional
        With FSDP: the mesh of the parameters outside the blocks (held by every worker).
    blocks : sequence of (name, module)
        The residual blocks in forward order (the built-in families': `sdp_train.models.subnet.residual_blocks`).
    """
    blocks = list(blocks)
    # 1. activation checkpointing, inside each block
    if activation_checkpointing:
        apply_checkpointing([block for _, block in blocks])
    # 2. FSDP2: blocks, then the root (which takes every parameter the blocks did not)
    if root_mesh is not None:
        apply_fsdp(model, block_meshes or {}, root_mesh, blocks)


def apply_fsdp(model: nn.Module, block_meshes: Mapping[str, DeviceMesh], root_mesh: DeviceMesh,
               blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """``fully_shard`` each residual block on its mesh (default the root's), the model's embedding and
    head units on the root's (`shard_outer_units`), then the root.

    Blocks reshard after forward and are gathered again in backward. With holder-set meshes
    (``block_meshes`` given) no module prefetches in backward (`without_backward_prefetch`): FSDP's
    default prefetch of the previous block *this rank* ran would put collectives on a shared group
    in different orders on different ranks. Between steps every block is sharded.
    """
    from torch.distributed.fsdp import fully_shard

    for name, block in blocks:
        fully_shard(block, mesh=block_meshes.get(name, root_mesh))
        if block_meshes:
            without_backward_prefetch(block)
    shard_outer_units(model, root_mesh, prefetch=not block_meshes)
    fully_shard(model, mesh=root_mesh)
    if block_meshes:
        without_backward_prefetch(model)
