"""The theorems' algorithm in one process: plain-SGD backward-masked SDP with stepwise averaging.

docs/theory.md's Theorems 1 and 2' bound x_{t+1} = x_t - eta G_t, G_{t,j} the mean over block j's
holders (the mask in force at step t) of the workers' gradients of the full model at x_t, the
shared parameters (held by all K workers) averaged over all of them. `StepwiseSGD` runs exactly
that on ``sdp train``'s data streams (worker k's batch t at step t), all K workers simulated in
this process: ``sdp estimate`` measures its constants along such a run, and tests check the bound
``sdp verify`` prints against the same run. Not here: AdamW, warm-up, clipping (no theorem covers
them), several processes, the measurement itself (`sdp_train.planning.constants`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from masklab import Mask
from sdp_train.data import Batches
from sdp_train.models import SliceSpec
from sdp_train.trainer.run import loss_fn

Parts = tuple[tuple[str, SliceSpec], ...]


def column_ids(model: nn.Module, groups: Sequence[Parts]) -> dict[str, torch.Tensor]:
    """For every parameter, a tensor of its shape holding the group (mask column) of each coordinate.

    The groups must cover every coordinate exactly once (the mask columns and, last, the shared
    parameters); an uncovered coordinate keeps -1 and is refused.
    """
    ids = {n: torch.full(p.shape, -1, dtype=torch.long, device=p.device) for n, p in model.named_parameters()}
    for g, parts in enumerate(groups):
        for name, spec in parts:
            if spec.is_whole:
                ids[name].fill_(g)
            else:
                ids[name].index_fill_(spec.dim, spec.index_tensor(ids[name].device), g)
    uncovered = [n for n, t in ids.items() if bool((t < 0).any())]
    assert not uncovered, f"coordinates of {uncovered[:3]} belong to no mask column and are not shared"
    return ids


class StepwiseSGD:
    """Plain-SGD backward-masked SDP, stepwise averaging, on one model shared by K simulated workers.

    ``groups`` are the mask columns' parameter parts, then (if any) the shared parameters' parts;
    ``streams[k]`` is worker k's batch stream. `step` moves the model in place.
    """

    def __init__(self, model: nn.Module, groups: Sequence[Parts], mask: Mask, streams: Sequence[Batches], *,
                 seed: int, device: str = "cpu") -> None:
        if len(streams) != mask.workers:
            raise ValueError(f"{len(streams)} data streams for a mask of {mask.workers} workers")
        self.model, self.mask, self.streams, self.seed, self.device = model, mask, streams, seed, device
        self.shared = len(groups) > mask.blocks
        self.ids = column_ids(model, groups)

    def weights(self, step: int) -> np.ndarray:
        """(K, groups) averaging weights at ``step``: M[k, j] / c_j, and 1/K on the shared parameters."""
        m = self.mask.round_matrix(step, seed=self.seed).astype(float)
        if self.shared:
            m = np.concatenate([m, np.ones((m.shape[0], 1))], axis=1)
        return m / m.sum(axis=0)

    def step(self, step: int, eta: float) -> float:
        """One update with every worker's batch ``step``; returns the workers' mean loss at the old point."""
        named = dict(self.model.named_parameters())
        weights = torch.as_tensor(self.weights(step), dtype=torch.float32, device=self.device)
        update = {n: torch.zeros_like(p) for n, p in named.items()}
        losses = []
        for k, stream in enumerate(self.streams):
            inputs, targets = stream.batch(step)
            loss = loss_fn(self.model(inputs.to(self.device)), targets.to(self.device))
            grads = torch.autograd.grad(loss, list(named.values()))
            losses.append(float(loss.detach()))
            for (n, g) in zip(named, grads):
                update[n] += weights[k][self.ids[n]] * g
        with torch.no_grad():
            for n, p in named.items():
                p -= eta * update[n]
        return float(np.mean(losses))
