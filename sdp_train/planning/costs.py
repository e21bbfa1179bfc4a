"""What holding each block costs a B-SDP worker, and a mask whose predicted peaks fit given devices.

`block_costs` turns `sdp_train.planning.memory`'s memory model into a masklab `BlockCosts`: block j's bytes
are what a worker saves by not holding it, its parameters with their gradients, AdamW's two
moments and the sync engine's bucket copy (5 elements each, and AdamW's step per tensor), its
buffers, and the forward activations that the worker keeps with the block and not without it
(`sdp_train.planning.activations`: for a downsampling ResNet block, less the shortcut's output that
its pass-through keeps). The fixed bytes are the rest of a worker that holds every block, so that
fixed + the sum of the blocks' bytes is that worker.

`plan_for_budgets` designs a B-SDP mask for one memory budget per worker (``sdp plan
--budgets``): `masklab.design_for_costs` balances those costs, then `plan.predict` gives each
rank's peak under the mask. What the costs leave out comes on top at the peak and depends on the
blocks a worker holds (backward's temporaries, AdamW's foreach buffer, on CUDA a communicator per
holder-set group), so each worker's shortfall is added to its fixed bytes and the mask designed
again, until every rank's predicted peak fits. Not here: N-SDP and Bb-SDP masks, FSDP among the
holders, or schedules (one static mask).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from masklab import BlockCosts, DesignError, Mask, design_for_costs
from masklab.costs import per_worker, worker_bytes
from sdp_train.errors import ConfigError
from sdp_train.models import ModelConfig
from sdp_train.planning.activations import activation_model
from sdp_train.planning.memory import DTYPE_BYTES, STEP_BYTES, _block_map, _meta_model, _model_config, predict
from sdp_train.trainer.config import TrainConfig

STATE_ELEMENTS = 5  # parameter, gradient, two AdamW moments, the sync engine's bucket copy
DESIGN_ROUNDS = 6


def block_costs(model: str | ModelConfig, *, batch_size: int = 8, seq_len: int = 64, image_size: int = 8,
                ac: bool = False, dtype: str = "float32", model_overrides: Mapping[str, Any] | None = None,
                loss_chunks: int = TrainConfig.loss_chunks) -> BlockCosts:
    """Bytes that holding each residual block costs a B-SDP worker, and the bytes no mask removes.

    Parameters are `plan.predict`'s; with `ac` a block's activations are its input only.

    Examples
    --------
    >>> costs = block_costs("llama-debug", batch_size=2, seq_len=16)
    >>> costs.blocks, costs.block_names[0], len(set(costs.block_bytes))
    (4, 'layers.0', 1)
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    config = _model_config(model, model_overrides, image_size)
    elem = DTYPE_BYTES[dtype]
    bmap = _block_map(config)
    every = np.ones(bmap.num_blocks("block"), dtype=bool)

    def forward_bytes(row: np.ndarray) -> int:
        acts = activation_model(_meta_model(config, "block", row), frozenset(), batch_size=batch_size,
                                seq_len=seq_len, image_size=image_size, elem=elem, loss_chunks=loss_chunks)
        return acts.forward_bytes(ac=ac)

    buffers = {n: b.numel() * b.element_size() for n, b in _meta_model(config, None, None).named_buffers()}

    def state(names: Sequence[str]) -> int:  # buffers as predict counts them (BatchNorm's counter: int64)
        return sum(STATE_ELEMENTS * elem * math.prod(bmap.shapes[n]) + STEP_BYTES if n in bmap.parameter_names
                   else buffers.get(n, elem * math.prod(bmap.shapes[n])) for n in names)

    full_acts = forward_bytes(every)
    costs = []
    for j, block in enumerate(bmap.blocks["block"]):
        without = every.copy()
        without[j] = False
        costs.append(state([n for n, _ in block.tensors]) + full_acts - forward_bytes(without))
    total = state(list(bmap.shapes)) + full_acts
    return BlockCosts(costs, block_names=bmap.block_names("block"), fixed_bytes=total - sum(costs),
                      source=f"sdp plan {config.name} bsdp batch {batch_size} seq {seq_len} image {image_size} "
                             f"{dtype}{' ac' if ac else ''}")


@dataclass(frozen=True)
class BudgetPlan:
    """A B-SDP mask for per-worker budgets and what `plan.predict` says of each rank under it."""

    mask: Mask
    costs: BlockCosts
    budgets: tuple[int, ...]
    peaks: tuple[int, ...]
    """Each rank's predicted training peak (`predict`'s ``per_rank``)."""
    prediction: dict[str, Any]
    """`predict`'s dict for the mask (largest rank, rank 0's ``eval_peak``, ...)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row per worker: ``worker``, ``budget``, ``peak``, ``blocks`` (held), ``fits``."""
        held = self.mask.matrix.sum(axis=1).tolist()
        return [{"worker": k, "budget": b, "peak": p, "blocks": int(h), "fits": p <= b}
                for k, (b, p, h) in enumerate(zip(self.budgets, self.peaks, held))]


def plan_for_budgets(model: str | ModelConfig, *, budgets: Sequence[int], min_coverage: int = 2,
                     seed: int = 0, ac: bool = False, batch_size: int = 8, seq_len: int = 64,
                     dtype: str = "float32", image_size: int = 8, device: str = "cpu",
                     model_overrides: Mapping[str, Any] | None = None,
                     loss_chunks: int = TrainConfig.loss_chunks) -> BudgetPlan:
    """A B-SDP mask with every block held `min_coverage` times whose predicted peak fits each budget.

    Parameters
    ----------
    budgets : sequence of int
        One memory budget in bytes per worker (K = its length).
    min_coverage : int
        Holders per block, in [1, K].
    seed : int
        Seed of `masklab.design_for_costs`.

    Other parameters are `plan.predict`'s.

    Raises
    ------
    DesignError
        No mask found fits: the message names the worker most over its budget.

    Examples
    --------
    >>> plan = plan_for_budgets("llama-debug", budgets=[40 * 2**20] * 2 + [20 * 2**20] * 2)
    >>> [(row["blocks"], row["fits"]) for row in plan.rows], plan.mask.coverage.tolist()
    ([(3, True), (3, True), (1, True), (1, True)], [2, 2, 2, 2])
    """
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, Sequence) or not budgets:
        raise DesignError(f"budgets {budgets!r}: give one memory budget in bytes per worker")
    K = len(budgets)
    budgets = tuple(per_worker("budgets", budgets, K, minimum=1))
    config = _model_config(model, model_overrides, image_size)
    costs = block_costs(config, batch_size=batch_size, seq_len=seq_len, image_size=image_size, ac=ac, dtype=dtype,
                        loss_chunks=loss_chunks)
    kwargs = dict(mode="bsdp", workers=K, ac=ac, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                  image_size=image_size, device=device, loss_chunks=loss_chunks)
    slack = [0] * K  # what each rank's peak adds to its costs, learnt from the predictions
    for _ in range(DESIGN_ROUNDS):
        fixed = [costs.fixed_bytes + s for s in slack]
        mask = design_for_costs(costs, K, min_coverage=min_coverage, budgets=budgets, fixed_bytes=fixed, seed=seed)
        prediction = predict(config, mask=mask, **kwargs)
        peaks = tuple(int(p) for p in prediction["per_rank"])
        if all(p <= b for p, b in zip(peaks, budgets)):
            return BudgetPlan(mask, costs, budgets, peaks, prediction)
        modeled = worker_bytes(mask, costs)
        learnt = [max(s, p - m) for s, p, m in zip(slack, peaks, modeled)]
        if learnt == slack:  # the same mask again
            break
        slack = learnt
    k = max(range(K), key=lambda i: peaks[i] - budgets[i])
    raise DesignError(f"worker {k}: predicted peak {peaks[k]} bytes exceeds its budget {budgets[k]} ; no mask "
                      "designed for the budgets with each rank's predicted overhead on top of its costs fits")
