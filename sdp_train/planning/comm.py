"""Predicted bytes per training step per rank of DDP, FSDP and the SDP modes: buffer and wire bytes.

The same collectives the runtime issues, from the model's structure and the mask (nothing is
allocated): DDP all-reduces every gradient; FSDP2 all-gathers every unit in forward, every
residual block and the embedding's unit again in backward (the root and the head's unit stay
unsharded: `sdp_train.parallel.parts.shard_outer_units`), and reduce-scatters every gradient,
each over padded dim-0 shards; the SDP sync engine all-reduces each bucket of `plan_buckets`
among its holders (with ``--fsdp``, each held block is gathered in forward, again in backward,
and reduce-scattered over its holders instead; a block with one holder sends nothing); Bb-SDP
broadcasts every bucket not held by all workers to every rank; ResNets average their BatchNorm
statistics among holders (`sdp_train.parallel.sync.BufferAverager`); every mode all-reduces the step's
[loss, gradient norm^2]. Wire bytes follow `sdp_train.parallel.wire`'s model.
`process_group_holder_sets` lists the process groups those collectives run on (besides the world's).

Not here: memory (`sdp_train.planning.memory`), or timing: the bytes say nothing about overlap or latency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from sdp_train.models import ModelConfig, block_map, model_class
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.sync import BucketPlan, plan_buckets
from sdp_train.parallel.wire import ByteCount

STATS_BYTES = 8  # the per-step [loss, grad-norm^2] all-reduce (two float32)


def predict_comm(config: ModelConfig, mode: str, held_by_rank: Sequence[Mapping[str, SliceSpec]] | None,
                 workers: int, *, fsdp: bool = False, elem: int = 4) -> list[ByteCount]:
    """Buffer and wire bytes per step of every rank, in rank order.

    Parameters
    ----------
    config : ModelConfig
    mode : {"ddp", "fsdp", "bsdp", "nsdp", "bbsdp"}
    held_by_rank : sequence of mapping, optional
        SDP: each rank's held tensors (``subnet.held_tensors``); None for the baselines.
    workers : int
    fsdp : bool
        B-SDP composed with FSDP2 over each block's holders.
    elem : int
        Bytes per gradient / parameter element.
    """
    bmap = block_map(config)
    shapes = bmap.shapes
    params = [n for n in shapes if n in bmap.parameter_names]
    counts = [ByteCount() for _ in range(workers)]
    if workers == 1:
        return counts
    for count in counts:
        count.add("all_reduce", STATS_BYTES, workers)
    blocks = {b.name: [n for n, _ in b.tensors if n in bmap.parameter_names] for b in bmap.blocks["block"]}
    in_block = {n: b for b, names in blocks.items() for n in names}
    # gathered again in backward: the blocks and every FSDP unit outside them but the last (the head's)
    units = tuple(getattr(model_class(config), "fsdp_units", ()))
    again = set(in_block) | {n for n in params if n.startswith(tuple(f"{m}." for g in units[:-1] for m in g))}
    if mode == "ddp":
        for count in counts:
            count.add("all_reduce", sum(math.prod(shapes[n]) for n in params) * elem, workers)
    elif mode == "fsdp":
        for count in counts:
            for n in params:  # forward gather, backward gather of block tensors, reduce-scatter
                padded = _padded(shapes[n], workers) * elem
                for collective in ("all_gather", "reduce_scatter") + (("all_gather",) if n in again else ()):
                    count.add(collective, padded, workers)
    elif fsdp:
        for r, count in enumerate(counts):
            for n in params:
                c = sum(n in h for h in held_by_rank)
                if n not in held_by_rank[r] or c == 1:  # FSDP2 on one rank copies, it calls no collective
                    continue
                padded = _padded(shapes[n], c) * elem
                for collective in ("all_gather", "reduce_scatter") + (("all_gather",) if n in again else ()):
                    count.add(collective, padded, c)
    else:
        _bucket_bytes(plan_buckets(held_by_rank, params, shapes=shapes), shapes, counts, elem)
        if mode == "bbsdp":
            plans = plan_buckets(held_by_rank, params, shapes=shapes)
            total = sum(_plan_numel(p, shapes) for p in plans if len(p.holders) < workers) * elem
            for count in counts:  # in ``broadcast``, every rank takes part in every bucket's broadcast
                count.add("broadcast", total, workers)
    if mode in ("bsdp", "nsdp", "bbsdp"):
        _bucket_bytes(_buffer_plans(config, held_by_rank), shapes, counts, 4)
    return counts


def process_group_holder_sets(config: ModelConfig, mode: str, held_by_rank: Sequence[Mapping[str, SliceSpec]] | None,
                              workers: int, *, fsdp: bool = False) -> tuple[tuple[int, ...], ...]:
    """The holder sets the runtime creates a process group for, sorted (the world's group aside).

    The sync engine (and the BatchNorm averager) needs one per distinct holder set of its buckets
    held by 2 to K-1 ranks (`sdp_train.parallel.sync.create_groups`); with `fsdp`, every held block is
    sharded over a mesh of its holders, single holders included. DDP and FSDP use the world's
    group only. For a mask whose columns are the model's maskable units these are
    `masklab.analysis.process_group_holder_sets` of the mask (a test holds the two equal, and both
    to the groups a run creates).

    Parameters
    ----------
    config : ModelConfig
    mode : {"ddp", "fsdp", "bsdp", "nsdp", "bbsdp"}
    held_by_rank : sequence of mapping, optional
        SDP: each rank's held tensors (``subnet.held_tensors``); None for the baselines.
    workers : int
    fsdp : bool
        B-SDP composed with FSDP2 over each block's holders.
    """
    if held_by_rank is None or mode in ("ddp", "fsdp") or workers == 1:
        return ()
    bmap = block_map(config)
    if fsdp:
        firsts = [next(n for n, _ in b.tensors if n in bmap.parameter_names) for b in bmap.blocks["block"]]
        sets = {tuple(r for r, held in enumerate(held_by_rank) if name in held) for name in firsts}
    else:
        params = [n for n in bmap.shapes if n in bmap.parameter_names]
        sets = {p.holders for p in plan_buckets(held_by_rank, params, shapes=bmap.shapes)}
    sets |= {p.holders for p in _buffer_plans(config, held_by_rank) if len(p.holders) > 1}
    smallest = 1 if fsdp else 2
    return tuple(sorted(s for s in sets if smallest <= len(s) < workers))


def _buffer_plans(config: ModelConfig, held_by_rank: Sequence[Mapping[str, SliceSpec]]) -> list[BucketPlan]:
    """The BatchNorm averager's buckets (`sdp_train.parallel.sync.BufferAverager`): one per holder set."""
    bmap = block_map(config)
    shapes = bmap.shapes
    buffers = [n for n in shapes if n not in bmap.parameter_names and n.endswith(("running_mean", "running_var"))]
    return plan_buckets(held_by_rank, buffers, shapes=shapes, layers_per_bucket=len(buffers) + 1)


def _bucket_bytes(plans: list[BucketPlan], shapes: Mapping[str, tuple[int, ...]], counts: list[ByteCount],
                  elem: int) -> None:
    for plan in plans:
        if len(plan.holders) > 1:
            numel = _plan_numel(plan, shapes)
            for r in plan.holders:
                counts[r].add("all_reduce", numel * elem, len(plan.holders))


def _plan_numel(plan: BucketPlan, shapes: Mapping[str, tuple[int, ...]]) -> int:
    total = 0
    for atom in plan.atoms:
        numel = math.prod(shapes[atom.name])
        total += numel if atom.dim is None else numel // shapes[atom.name][atom.dim] * len(atom.index)
    return total


def _padded(shape: tuple[int, ...], mesh: int) -> int:
    """Unsharded elements of a tensor under FSDP2 on ``mesh`` ranks (dim 0 padded to a multiple)."""
    return -(-shape[0] // mesh) * mesh * int(np.prod(shape[1:], dtype=np.int64))
