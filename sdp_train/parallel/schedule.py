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

With forward masking (B-SDP) a worker holds only its blocks, so at a change the *blocks* move as
well (`move_blocks`): a worker that gains a block builds it empty from the meta-device copy its
pass-through keeps, receives its parameters and buffers from the block's lowest-ranked old holder
(packed broadcasts, as the state), and adds its parameters to the optimizer parameter group their
name belongs to (`OptimizerPlaces`); then the state moves; then a worker that no longer holds a
block frees it (parameters, gradients, optimizer state) and puts a pass-through in its place. A
block's shared children (a downsampling block's shortcut, `sdp_train.parallel.blockmap.owned_state`)
never move: every worker holds them, in the pass-through or the block. At the peak a worker holds
its old subnetwork plus the blocks it gains (and one packed buffer).

N-SDP (forward masking at neuron level) moves no block: every worker holds a slice of every MLP
tensor, so at a change each tensor whose groups change is re-cut (`recut_neurons`): the groups
kept stay, each gained group's values and optimizer state come from its lowest-ranked old holder
(packed broadcasts), and a new parameter takes the old one's place in the module, the optimizer
group and the state.

A worker that joins a run in progress (a lost worker's replacement) holds nothing yet: each part of
its tensors, a whole tensor or N-SDP's neuron slice, and its optimizer state come from the part's
lowest-ranked holder (`send_parts`), packed as above.

Not here: overlap averaging (`sdp_train.parallel.overlap`), whose workers keep their own state, and FSDP,
whose holder meshes are fixed when it is built (refused).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import SliceSpec, owned_state
from sdp_train.parallel.dist import wait
from sdp_train.parallel.masking import fix_features
from sdp_train.parallel.wire import ByteCount


@torch.no_grad()
def move_optimizer_state(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module, names: Sequence[str],
                         old_held: Sequence[Mapping[str, SliceSpec]], new_held: Sequence[Mapping[str, SliceSpec]],
                         rank: int, counter: ByteCount, *, free: bool = True) -> None:
    """Give every new holder of a parameter its state from the lowest-ranked old holder; free the
    state of the parameters this rank no longer holds (`free`; else call `free_optimizer_state` later).
    A collective: every rank calls it with the same arguments but `rank`.

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
    entries = [(i, key, shape, dtype, on_param_device) for i in range(len(moves))
               for key, (shape, dtype, on_param_device) in layouts[i].items()]

    def read(entry):
        name = moves[entry[0]][0]
        return owner[params[name]].state[params[name]][entry[1]]

    def write(entry, value):
        name = moves[entry[0]][0]
        owner[params[name]].state[params[name]][entry[1]] = value.clone() if entry[4] else value.cpu()

    device = next(iter(params.values())).device  # this rank's (a rank may hold none of the moving tensors)
    broadcast_packed([(moves[e[0]][1], moves[e[0]][2], e[2], e[3], e) for e in entries], read, write, rank,
                     device, counter)
    if free:
        free_optimizer_state(optimizers, module, names, old_held, new_held, rank)


def free_optimizer_state(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module, names: Sequence[str],
                         old_held: Sequence[Mapping[str, SliceSpec]], new_held: Sequence[Mapping[str, SliceSpec]],
                         rank: int) -> None:
    """The state and gradient of every parameter this rank holds under `old_held` and not `new_held` go."""
    params = dict(module.named_parameters())
    owner = {p: opt for opt in optimizers for group in opt.param_groups for p in group["params"]}
    for name in names:
        if name in old_held[rank] and name not in new_held[rank]:
            param = params[name]
            if param in owner:
                owner[param].state.pop(param, None)
            param.grad = None


class ReceivingUndo:
    """What a worker needs to be back at its state from before it began to receive a move (to restore
    coverage) that did not complete: the values of its tensors `names` that the move overwrites, and
    `optimizer`'s parameter groups and which parameters had state. Take it before the move; `undo` after."""

    @torch.no_grad()
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, names: Sequence[str]) -> None:
        state = module.state_dict(keep_vars=True)
        self.module, self.optimizer = module, optimizer
        self.values = {n: state[n].detach().clone() for n in names if n in state}
        self.groups = [list(g["params"]) for g in optimizer.param_groups]
        self.had_state = {id(p) for p in optimizer.state}

    @torch.no_grad()
    def undo(self) -> None:
        """The values back, the groups as they were, the state of each parameter that had none gone."""
        state = self.module.state_dict(keep_vars=True)
        for name, value in self.values.items():
            state[name].copy_(value)
        for group, params in zip(self.optimizer.param_groups, self.groups):
            group["params"] = params
        for param in [p for p in self.optimizer.state if id(p) not in self.had_state]:
            del self.optimizer.state[param]


def broadcast_packed(items: Sequence[tuple[int, Sequence[int], tuple, torch.dtype, Any]],
                     read: Callable[[Any], torch.Tensor], write: Callable[[Any, torch.Tensor], None], rank: int,
                     device: torch.device, counter: ByteCount) -> None:
    """Send each item's tensor from its sender to its receivers: one flat buffer per sender and dtype,
    broadcast over the world group, in one order on every rank (a collective: every rank passes the
    same items, each ``(sender, receivers, shape, dtype, key)``). The sender's tensor is
    ``read(key)``; each receiver gets ``write(key, view)``, a view of the received buffer (copy it).
    The buffers live on ``device``, this rank's parameters' (NCCL sends no CPU tensor)."""
    packs: dict[tuple[int, str], list[tuple[Sequence[int], tuple, torch.dtype, Any]]] = {}
    for src, receivers, shape, dtype, key in items:
        packs.setdefault((src, str(dtype)), []).append((receivers, shape, dtype, key))
    for (src, _), entries in sorted(packs.items(), key=lambda kv: kv[0]):
        sizes = [math.prod(shape) for _, shape, _, _ in entries]
        if rank == src:
            buffer = torch.cat([read(key).reshape(-1).to(device) for _, _, _, key in entries])
        else:
            buffer = torch.empty(sum(sizes), dtype=entries[0][2], device=device)
        wait(dist.broadcast(buffer, src=src, async_op=True), device)  # given up when a loss began (watch_waits)
        counter.add("broadcast", buffer.numel() * buffer.element_size(), dist.get_world_size())
        for (receivers, shape, _, key), part in zip(entries, buffer.split(sizes)):
            if rank in receivers:
                write(key, part.view(shape))


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


class OptimizerPlaces:
    """The optimizer and parameter group of every full-model parameter, by name, agreed by every rank.

    Forward masking under a schedule: a worker that gains a block puts its parameters where the
    block's holders keep them (``weight_decay`` groups and the like stay as the user built them),
    and every group lists its parameters in the module's order, whatever the history of changes,
    so an optimizer state dict saved in round r loads into a worker rebuilt for round r.
    """

    def __init__(self) -> None:
        self.optimizers: list[Callable[[], torch.optim.Optimizer | None]] = []
        self.place: dict[str, tuple[int, int]] = {}

    def add(self, optimizer: torch.optim.Optimizer, module: nn.Module, world_size: int) -> None:
        """Learn where `optimizer` keeps each parameter (a collective: every rank registers its optimizers
        in one order)."""
        name_of = {id(p): n for n, p in module.named_parameters()}
        mine = {name_of[id(p)]: g for g, group in enumerate(optimizer.param_groups) for p in group["params"]
                if id(p) in name_of}
        parts = [mine]
        if world_size > 1:
            parts = [{}] * world_size
            dist.all_gather_object(parts, mine)
        index = len(self.optimizers)
        clashes = {}
        for rank, part in enumerate(parts):
            for name, group in part.items():
                if self.place.setdefault(name, (index, group)) != (index, group):
                    clashes[name] = (rank, self.place[name], (index, group))
        if clashes:  # every rank sees the same gathered parts: every rank raises
            name, (rank, first, other) = next(iter(clashes.items()))
            raise ConfigError(f"parameter {name!r} sits in (optimizer, group) {other} on rank {rank} but in {first} "
                              f"on another rank ({len(clashes)} such): under a schedule every holder must put a "
                              "parameter in the same optimizer and parameter group")
        self.optimizers.append(weakref.ref(optimizer))
        self.canonical(module)

    def insert(self, params: Mapping[str, nn.Parameter], module: nn.Module) -> None:
        """Add a gained block's parameters to their optimizer's group (with no state yet), each once: a
        parameter already there (backward masking keeps a dropped block's parameters in the group,
        without state, so regaining it must not add them again, or the optimizer steps them twice) stays."""
        for name, param in params.items():
            where = self.place.get(name)
            optimizer = self.optimizers[where[0]]() if where is not None else None
            group = optimizer.param_groups[where[1]]["params"] if optimizer is not None else None
            if group is not None and not any(p is param for p in group):
                group.append(param)
        self.canonical(module)

    def remove(self, params: Sequence[nn.Parameter]) -> None:
        """Take freed parameters out of every optimizer, with their state."""
        gone = {id(p) for p in params}
        for optimizer in (ref() for ref in self.optimizers):
            if optimizer is None:
                continue
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in gone]
            for param in params:
                optimizer.state.pop(param, None)

    def canonical(self, module: nn.Module) -> None:
        order = {id(p): k for k, p in enumerate(module.parameters())}
        for optimizer in (ref() for ref in self.optimizers):
            for group in optimizer.param_groups if optimizer is not None else ():
                group["params"].sort(key=lambda p: order.get(id(p), len(order)))


def block_of(module: nn.Module, name: str) -> nn.Module:
    """Block `name` of `module`, or the meta-device copy its pass-through keeps (same tensor names)."""
    block = module.get_submodule(name)
    return getattr(block, "shape_only", block)


@torch.no_grad()
def send_blocks(module: nn.Module, blocks: Sequence[str], old_rows: np.ndarray, new_rows: np.ndarray, rank: int,
                device: torch.device, counter: ByteCount) -> None:
    """Every block's parameters and buffers, from its lowest-ranked holder under `old_rows` to the
    workers that hold it under `new_rows` only (built, empty, beforehand: `gain_block`). A collective."""
    items = []
    for j, name in enumerate(blocks):
        old = [int(r) for r in np.flatnonzero(old_rows[:, j])]
        receivers = [int(r) for r in np.flatnonzero(new_rows[:, j] & ~old_rows[:, j])]
        if not old or not receivers:
            continue
        for tensor_name, tensor in owned_state(block_of(module, name)):  # every worker holds shared children
            items.append((old[0], receivers, tuple(tensor.shape), tensor.dtype, (name, tensor_name)))

    def tensor(key) -> torch.Tensor:
        return dict(owned_state(module.get_submodule(key[0])))[key[1]]

    def write(key, value: torch.Tensor) -> None:
        tensor(key).copy_(value)

    broadcast_packed(items, tensor, write, rank, device, counter)


@torch.no_grad()
def send_parts(module: nn.Module, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
               old_held: Sequence[Mapping[str, SliceSpec]], new_held: Sequence[Mapping[str, SliceSpec]],
               optimizers: Sequence[torch.optim.Optimizer], rank: int, device: torch.device,
               counter: ByteCount) -> None:
    """Every part of every tensor of `tensors` (full-model name -> shape, dtype: parameters and buffers)
    that a rank holds under `new_held` only, from the lowest-ranked holder of that part under
    `old_held`, into the tensor its module already has (a joining worker's, built from the seed), and
    for a parameter its optimizer state: each state tensor of the parameter's shape cut as the
    parameter is, any other (AdamW's ``step``) whole. A part is the whole tensor or (N-SDP) the
    positions along the tensor's sliced dim that one old holder is the lowest to hold. A collective:
    every rank passes the same arguments but `rank`."""
    state = module.state_dict(keep_vars=True)
    owner = {id(p): opt for opt in optimizers for group in opt.param_groups for p in group["params"]}
    parts = _parts(tensors, old_held, new_held)
    mine = {n: _cut_layout(owner[id(state[n])], state[n]) for n, src, _, _, _ in parts
            if src == rank and isinstance(state[n], nn.Parameter) and id(state[n]) in owner}
    layouts = [mine]
    if len(new_held) > 1:
        layouts = [{}] * len(new_held)
        dist.all_gather_object(layouts, mine)
    keys = {}  # each moving parameter's state keys, from its first sender: key -> (shape, dtype, on device, cut)
    for name, src, _, _, _ in parts:
        keys.setdefault(name, layouts[src].get(name, {}))
    items, whole_sent = [], set()
    for name, src, r, dim, positions in parts:
        shape = list(tensors[name][0])
        if dim is not None:
            shape[dim] = len(positions)
        items.append((src, [r], tuple(shape), tensors[name][1], (name, None, dim, positions, src, r)))
        for key, (key_shape, dtype, _, cut) in keys[name].items():
            if cut:
                items.append((src, [r], tuple(shape), dtype, (name, key, dim, positions, src, r)))
            elif (name, key, r) not in whole_sent:
                whole_sent.add((name, key, r))
                items.append((src, [r], tuple(key_shape), dtype, (name, key, None, None, src, r)))

    def local(name: str, key: str | None) -> torch.Tensor:
        return state[name] if key is None else owner[id(state[name])].state[state[name]][key]

    def read(entry) -> torch.Tensor:
        name, key, dim, positions, src, _ = entry
        value = local(name, key)
        cut = key is None or keys[name][key][3]
        if dim is None or not cut:
            return value
        return value.index_select(dim, torch.tensor(old_held[src][name].local_positions(positions),
                                                    dtype=torch.int64, device=value.device))

    def write(entry, value: torch.Tensor) -> None:
        name, key, dim, positions, _, r = entry
        if key is not None:
            param = state[name]
            _, dtype, on_device, cut = keys[name][key]
            slots = owner[id(param)].state[param]
            if not cut:
                slots[key] = value.clone() if on_device else value.cpu()
                return
            if key not in slots:
                slots[key] = torch.zeros(param.shape, dtype=dtype, device=param.device if on_device else "cpu")
        target = local(name, key)
        if dim is None:
            target.copy_(value)
        else:
            index = torch.tensor(new_held[r][name].local_positions(positions), dtype=torch.int64, device=target.device)
            target.index_copy_(dim, index, value.to(target.device))

    broadcast_packed(items, read, write, rank, device, counter)


def _parts(tensors: Mapping[str, Any], old_held: Sequence[Mapping[str, SliceSpec]],
           new_held: Sequence[Mapping[str, SliceSpec]]) -> list[tuple[str, int, int, int | None, list[int] | None]]:
    """``(name, sender, receiver, dim, full positions)`` of every part a receiver newly holds (positions
    None: the whole tensor), the sender the lowest-ranked old holder of those positions."""
    parts = []
    for name in tensors:
        specs = [held.get(name) for held in old_held]
        sliced = [sp for sp in (*specs, *(held.get(name) for held in new_held)) if sp is not None and not sp.is_whole]
        dim, size = (sliced[0].dim, sliced[0].full_size) if sliced else (None, 0)
        for r, held in enumerate(new_held):
            if name not in held or specs[r] == held[name]:
                continue
            if dim is None:
                src = next((s for s, sp in enumerate(specs) if sp is not None), None)
                if src is not None:
                    parts.append((name, src, r, None, None))
                continue
            positions = [set(range(size) if sp.is_whole else sp.index) if sp is not None else set() for sp in specs]
            senders: dict[int, list[int]] = {}
            for i in (range(size) if held[name].is_whole else held[name].index):
                src = next((s for s, there in enumerate(positions) if i in there), None)
                if i not in positions[r] and src is not None:
                    senders.setdefault(src, []).append(i)
            parts += [(name, src, r, dim, part) for src, part in sorted(senders.items())]
    return parts


def _cut_layout(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, tuple]:
    """`_state_layout` of `param`, each key with whether it has the parameter's shape (cut as it is)."""
    return {key: (*layout, layout[0] == tuple(param.shape) and param.dim() > 0)
            for key, layout in _state_layout(optimizer, param).items()}


def gain_block(module: nn.Module, name: str, device: torch.device) -> nn.Module:
    """Put an empty copy of dropped block `name` (built from its pass-through's meta copy) on `device`
    in its place, with the pass-through's shared children, values and all; returns it."""
    skipped = module.get_submodule(name)
    block = copy.deepcopy(skipped.shape_only).to_empty(device=device)
    for shared in skipped.shared_children:
        setattr(block, shared, getattr(skipped, shared))
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent), child, block)
    return block


@torch.no_grad()
def recut_neurons(module: nn.Module, layout: Any, old_rows: np.ndarray, new_rows: np.ndarray, rank: int,
                  optimizers: Sequence[torch.optim.Optimizer], counter: ByteCount, *, send: bool = True,
                  gate: Callable[[], None] | None = None) -> list[nn.Parameter]:
    """N-SDP at a mask change: re-cut every MLP tensor to the neuron groups this worker holds now.

    A group this worker keeps keeps its rows (or columns); a group it gains comes, with the slices of
    the optimizer state of the tensor's shape (AdamW's ``exp_avg``, ``exp_avg_sq``), from the
    group's lowest-ranked old holder, packed as `broadcast_packed` does; a group it drops is freed
    with the old tensor. Each re-cut tensor becomes a new parameter in the old one's place (module,
    optimizer group, state; a per-tensor ``step`` stays this worker's, as every worker steps every
    MLP tensor). Returns the parameters replaced. A collective; every rank holds some group of every
    block (`ModelLayout.held`), so every rank walks the same tensors. Without `send` nothing is
    communicated and gained groups are left uninitialised (a resume, whose loaded state fills them).
    `gate`: called once every gained group has come, before anything is re-cut; what it raises leaves
    this worker's tensors as they were (a move to restore coverage that not every survivor received).
    """
    groups = layout.neuron_groups
    old_held = [layout.held(r) for r in old_rows]
    new_held = [layout.held(r) for r in new_rows]
    owner = {id(p): opt for opt in optimizers for group in opt.param_groups for p in group["params"]}
    items, keys_of = [], {}
    for b, block in enumerate(layout.blocks):
        for name, dim in layout.neuron_tensors[block]:
            tensor = module.get_parameter(name)
            opt = owner.get(id(tensor))
            state = opt.state.get(tensor, {}) if opt is not None else {}
            keys_of[name] = ["value", *sorted(k for k, v in state.items()
                                              if isinstance(v, torch.Tensor) and v.shape == tensor.shape)]
            for g in range(groups):
                col = b * groups + g
                old = [int(r) for r in np.flatnonzero(old_rows[:, col])]
                receivers = [int(r) for r in np.flatnonzero(new_rows[:, col] & ~old_rows[:, col])]
                if not old or not receivers:
                    continue
                shape = list(tensor.shape)
                shape[dim] = len(layout.group_index(block, [g]))
                for key in keys_of[name]:
                    items.append((old[0], receivers, tuple(shape), tensor.dtype, (block, name, dim, g, key)))

    def old_slice(block: str, name: str, dim: int, g: int, key: str) -> torch.Tensor:
        """Group g of this worker's current `name` (its value, or optimizer state `key`)."""
        tensor = module.get_parameter(name)
        src = tensor if key == "value" else owner[id(tensor)].state[tensor][key]
        positions = old_held[rank][name].local_positions(layout.group_index(block, [g]))
        return src.index_select(dim, torch.tensor(positions, device=src.device))

    received: dict[tuple, torch.Tensor] = {}
    device = next(module.parameters()).device
    if send:
        broadcast_packed(items, lambda k: old_slice(*k), lambda k, v: received.__setitem__(k, v.clone()), rank,
                         device, counter)
    else:
        received = {key: torch.empty(shape, dtype=dtype, device=device) for _, receivers, shape, dtype, key in items
                    if rank in receivers}
    if gate is not None:
        gate()
    replaced = []
    for b, block in enumerate(layout.blocks):
        for name, dim in layout.neuron_tensors[block]:
            old_spec, new_spec = old_held[rank][name], new_held[rank][name]
            if old_spec == new_spec:
                continue
            kept = [g for g in range(groups) if new_rows[rank, b * groups + g]]
            parts = {}
            for key in keys_of[name]:
                pieces = []
                for g in kept:  # groups are contiguous and increasing: concatenation is the local order
                    kept_here = old_rows[rank, b * groups + g]
                    pieces.append(old_slice(block, name, dim, g, key) if kept_here
                                  else received[(block, name, dim, g, key)])
                parts[key] = torch.cat(pieces, dim=dim)
            rel = name[len(block) + 1:].rpartition(".")[0]
            replaced.append(_replace(module, name, parts, owner, rel in layout.mlps[block].inputs))
    return replaced


def _replace(module: nn.Module, name: str, parts: dict[str, torch.Tensor], owner: dict, is_input: bool
             ) -> nn.Parameter:
    """Put a new parameter with value ``parts["value"]`` in place of `name` (module, optimizer, state)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name)
    old = getattr(parent, leaf)
    new = nn.Parameter(parts.pop("value"), requires_grad=old.requires_grad)
    setattr(parent, leaf, new)
    if leaf == "weight":
        fix_features(parent, is_input)
    opt = owner.get(id(old))
    if opt is not None:
        for group in opt.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        state = opt.state.pop(old, {})
        opt.state[new] = {**state, **parts}
    old.grad = None
    old.data = torch.empty(0, dtype=old.dtype, device=old.device)  # freed even where still referenced
    return old
