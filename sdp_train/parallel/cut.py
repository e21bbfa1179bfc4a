"""This worker's subnetwork of a full model: its blocks found, the mask resolved, the model cut.

`cut_subnetwork` is steps 1 to 3 of `SubnetworkDataParallel`'s constructor (docs/api.md, "What
the wrapper does, in order"); `SubnetworkDataParallel.from_subnetwork` wraps what it returns, as it
wraps a part a model family built itself. Not here: how blocks are found
(`sdp_train.parallel.discovery`) and cut (`sdp_train.parallel.masking`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from masklab import Mask
from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.discovery import MLPSpec, find_blocks
from sdp_train.parallel.dist import rank_and_world
from sdp_train.parallel.masking import Cut, ModelLayout, describe
from sdp_train.parallel.parts import resolve_mask


class Subnetwork(NamedTuple):
    """One worker's part of a full model, as `SubnetworkDataParallel.from_subnetwork` takes it."""

    module: nn.Module
    layout: ModelLayout
    mask: Mask
    held_by_rank: list[dict[str, SliceSpec]]
    local_index: dict[str, SliceSpec]
    device: torch.device


def cut_subnetwork(module: nn.Module, *, mask: Mask | str | os.PathLike | None = None, active: float | None = None,
                   blocks: str | Sequence[str | nn.Module] | None = None, level: str = "block",
                   masking: str = "forward", neuron_groups: int = 4, mlp: MLPSpec | None = None, seed: int = 0,
                   init: Callable[[nn.Module], None] | None = None, device: torch.device | str | None = None,
                   has_init_state: bool = False, schedules: bool = True) -> Subnetwork:
    """Cut `module` in place to this rank's part of the mask's first round; arguments as
    `SubnetworkDataParallel`'s (``has_init_state``: a full state dict will fill a meta model;
    ``schedules``: a mask with a schedule is accepted)."""
    rank, world_size = rank_and_world()
    cut = Cut(masking, level)
    # 1. blocks, the full model's layout and the mask (identical on every rank)
    block_names = find_blocks(module, blocks)
    layout = describe(module, block_names, level, neuron_groups=neuron_groups, mlp=mlp)
    mask = resolve_mask(mask, active, world_size, layout, seed=seed, schedules=schedules)
    matrix = mask.round_matrix(0, seed=seed)  # a schedule's first round
    held_by_rank = [layout.held(matrix[r]) for r in range(world_size)]
    row = matrix[rank]
    # 2. this worker's subnetwork (state-dict names stay the full model's)
    local_index = cut.apply(module, layout, row)
    # 3. values: materialise a meta model (the wrapper then takes init_state's part, or agrees among holders)
    device = _materialise(module, device, init, has_init_state)
    return Subnetwork(module, layout, mask, held_by_rank, local_index, device)


def _materialise(module: nn.Module, device, init, has_init_state: bool) -> torch.device:
    tensors = list(module.parameters()) + list(module.buffers())
    on_meta = any(t.is_meta for t in tensors)
    if device is None:
        if on_meta or not tensors:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        else:
            device = tensors[0].device
    device = torch.device(device)
    if on_meta:
        if init is None and not has_init_state:
            raise ConfigError("the model is on the meta device: pass init_state= (a full state dict) or init= "
                              "(a function that initialises its parameters and buffers)")
        unsaved = sorted(set(dict(module.named_buffers())) - set(module.state_dict()))
        if init is None and unsaved:  # e.g. Hugging Face's rotary inv_freq: no state dict carries them
            raise ConfigError(f"the meta-device model has non-persistent buffers {unsaved[:3]} that init_state= "
                              "cannot fill: pass init= to compute them, or build the model on a real device")
        module.to_empty(device=device)
        if init is not None:
            init(module)
    else:
        module.to(device)
        if init is not None:
            init(module)
    return device
