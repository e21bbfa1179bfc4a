"""The small residual MLP network the distributed schedule and local-step tests train, with the
batches each worker sees: one definition for the ranks and for the single-process references.

Block j is ``h + down(tanh(up(h)))`` with ``HIDDEN`` neurons; the references skip a block
(``held[j]`` false: forward masking at block level) or zero its neurons (``keep[j]``, a 0/1 vector
over the hidden neurons: N-SDP)."""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, HIDDEN)
        self.down = nn.Linear(HIDDEN, 8)

    def forward(self, h, keep=None):
        hidden = torch.tanh(self.up(h))
        return h + self.down(hidden if keep is None else hidden * keep)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x, held=None, keep=None):
        h = self.embed(x)
        for j, layer in enumerate(self.layers):
            if held is not None and not held[j]:
                continue
            h = layer(h) if keep is None else layer(h, keep[j])
        return self.head(h)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
