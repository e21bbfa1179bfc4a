"""The full model of a `SubnetworkDataParallel`: assembled from every worker, saved, loaded.

`FullModelMixin` gives the wrapper ``full_state_dict``, ``save_full`` and ``load_full_state_dict``
over its ``module``, ``layout``, ``local_index``, ``held_by_rank`` and ``sync`` (mid-round values
under local steps). Not here: the assembly and the file format (`sdp_train.parallel.export`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from sdp_train.errors import ConfigError
from sdp_train.parallel.export import assemble, save_safetensors


class FullModelMixin:
    """The full model's state dict of a `SubnetworkDataParallel` (the wrapper's attributes, docs/api.md)."""

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full model's state dict (CPU tensors), assembled from every worker. Every rank must call it.

        With ``rank0_only`` rank 0 receives it and the others get ``{}``. With local steps in the
        middle of a round (holders not yet averaged), each tensor is its holders' average, computed
        on copies: the workers' own values are left as they are.
        """
        state = self.module.state_dict()
        self.sync.export_values(state, self.module, self.steps)
        return assemble(state, self.local_index, self.layout.tensors, self.held_by_rank,
                        self.rank, rank0_only=rank0_only, device=self.device, aliases=self.layout.aliases)

    def save_full(self, path: str | os.PathLike) -> None:
        """Write the full model as safetensors (a ``.safetensors`` file, or a directory with its
        ``config.json`` for a Hugging Face model). Every rank must call it; rank 0 writes."""
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0:
            save_safetensors(state, path, config=getattr(self.module, "config", None))
        if self.world_size > 1:
            dist.barrier()

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this worker's part of every tensor of a full-model state dict. A tied tensor may come
        under any of its names (a Hugging Face checkpoint keeps one)."""
        aliases = self.layout.aliases
        names = {n: [n, *(a for a, first in aliases.items() if first == n)] for n in self.layout.tensors
                 if n not in aliases}
        found = {n: next((state[m] for m in named if m in state), None) for n, named in names.items()}
        missing = [n for n, value in found.items() if value is None]
        if missing:
            raise ConfigError(f"the full state dict lacks {len(missing)} tensor(s) of the model: {missing[:5]}")
        for name, local in self.module.state_dict(keep_vars=True).items():
            if name in aliases:  # the same tensor as its first name's
                continue
            shape = self.layout.tensors[name][0]
            if tuple(found[name].shape) != shape:
                raise ConfigError(f"tensor {name!r}: the full state dict has shape {tuple(found[name].shape)}, "
                                  f"the model {shape}")
            local.copy_(self.local_index[name].take(found[name].to(local.device)))
