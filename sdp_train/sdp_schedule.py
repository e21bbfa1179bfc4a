"""Stepwise SDP under a mask schedule: what moves when the mask changes (docs/api.md, "Schedules").

With backward masking every worker holds every parameter's value (the holders' values reach the
others after each step), so at a mask change only the *optimizer state* moves: for every tensor a
worker starts to hold, its state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``; whatever the
optimizer keeps) comes from the tensor's lowest-ranked holder of the round that ends, bit for bit,
and a worker that stops holding a tensor frees its state and gradient. Every rank walks the
parameters in one global order and takes part in one broadcast over the world group per sender
and dtype, of the state tensors it sends packed into one buffer (no process group is made for a
change); the bytes are counted
apart from gradient traffic (`move_optimizer_state`'s counter). The world's broadcast, not
point-to-point sends to the new holders only: every rank receives what only some need, but NCCL
would create a communicator for every sender-receiver pair (hundreds of MiB each, docs/design.md
§5), where the world's exists already.

Not here: forward masking, where a change would also move the blocks' parameters and rebuild each
worker's subnetwork (`SubnetworkDataParallel` refuses a schedule there), and overlap averaging
(`sdp_train.overlap`), whose workers keep their own state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models.blocks import SliceSpec
from sdp_train.wire import ByteCount


@torch.no_grad()
def move_optimizer_state(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module, names: Sequence[str],
                         old_held: Sequence[Mapping[str, SliceSpec]], new_held: Sequence[Mapping[str, SliceSpec]],
                         rank: int, counter: ByteCount) -> None:
    """Give every new holder of a parameter its state from the lowest-ranked old holder; free the
    state of the parameters this rank no longer holds. A collective: every rank calls it with the
    same arguments but `rank`.

    Parameters
    ----------
    optimizers : sequence of Optimizer
        Those that step this module's parameters (each parameter in at most one of them).
    names : sequence of str
        The parameters, in the one order every rank walks.
    old_held, new_held : sequence of mapping
        Per rank, the tensors it holds in the round that ends and in the round that starts.
    """
    params = dict(module.named_parameters())
    owner = {p: opt for opt in optimizers for group in opt.param_groups for p in group["params"]}
    world = len(new_held)
    moves = plan_moves(names, old_held, new_held)
    if not moves:
        layouts: dict[int, dict[str, tuple]] = {}
    else:  # what each moving tensor's state holds (keys, shapes, dtypes), from its senders: one gather
        unowned = [name for name, src, receivers in moves
                   if (rank == src or rank in receivers) and params[name] not in owner]
        mine = {i: _state_layout(owner[params[name]], params[name]) for i, (name, src, _) in enumerate(moves)
                if src == rank and params[name] in owner}
        gathered: list[tuple[dict[int, dict[str, tuple]], list[str]]] = [({}, [])] * world
        dist.all_gather_object(gathered, (mine, unowned))
        missing = {r: names_ for r, (_, names_) in enumerate(gathered) if names_}
        if missing:  # every rank raises, none is left waiting in a collective
            raise ConfigError(f"at a mask change, parameters move to new holders whose registered optimizer does not "
                              f"step them (rank: parameters) {missing}: under a schedule build the optimizer over "
                              "all of model.parameters()")
        layouts = {i: layout for part, _ in gathered for i, layout in part.items()}
    # one flat buffer per sender and dtype, in one order on every rank: a few broadcasts per change
    packs: dict[tuple[int, str], list[tuple[int, str, tuple, torch.dtype, bool]]] = {}
    for i, (_, src, _) in enumerate(moves):
        for key, (shape, dtype, on_param_device) in layouts[i].items():
            packs.setdefault((src, str(dtype)), []).append((i, key, shape, dtype, on_param_device))
    for (src, _), entries in sorted(packs.items()):
        device = params[moves[entries[0][0]][0]].device  # sent from the parameters' device (NCCL sends no CPU tensor)
        sizes = [math.prod(shape) for _, _, shape, _, _ in entries]
        if rank == src:
            buffer = torch.cat([owner[params[moves[i][0]]].state[params[moves[i][0]]][key].reshape(-1).to(device)
                                for i, key, _, _, _ in entries])
        else:
            buffer = torch.empty(sum(sizes), dtype=entries[0][3], device=device)
        dist.broadcast(buffer, src=src)
        counter.add("broadcast", buffer.numel() * buffer.element_size(), world)
        for (i, key, shape, _, on_param_device), part in zip(entries, buffer.split(sizes)):
            name, _, receivers = moves[i]
            if rank in receivers:  # its own memory, where the sender keeps it
                value = part.view(shape).clone()
                owner[params[name]].state[params[name]][key] = value if on_param_device else value.cpu()
    for name in names:  # a tensor this rank no longer holds: its state and gradient go
        if name in old_held[rank] and name not in new_held[rank]:
            param = params[name]
            if param in owner:
                owner[param].state.pop(param, None)
            param.grad = None


def plan_moves(names: Sequence[str], old_held: Sequence[Mapping[str, SliceSpec]],
               new_held: Sequence[Mapping[str, SliceSpec]]) -> list[tuple[str, int, list[int]]]:
    """``(name, sender, receivers)`` for every tensor that some worker starts to hold, in the order
    of `names`: the sender is its lowest-ranked old holder, the receivers its new holders that did
    not hold it (a tensor nobody held before has nothing to send and is left out).

    >>> plan_moves(["a", "b"], [{"a": 0}, {"b": 0}, {}], [{"b": 0}, {"a": 0}, {"a": 0, "b": 0}])
    [('a', 0, [1, 2]), ('b', 1, [0, 2])]
    """
    world = len(new_held)
    moves = []
    for name in names:
        old = [r for r in range(world) if name in old_held[r]]
        receivers = [r for r in range(world) if name in new_held[r] and r not in old]
        if receivers and old:
            moves.append((name, old[0], receivers))
    return moves


def _state_layout(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, tuple]:
    """``{key: (shape, dtype, on the parameter's device)}`` of `param`'s tensor state."""
    state = optimizer.state.get(param, {})
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"optimizer state {key!r} of a moving parameter is a {type(value).__name__}, not a "
                              "tensor: only tensor state can move at a mask change")
        out[key] = (tuple(value.shape), value.dtype, value.device == param.device)
    return out
