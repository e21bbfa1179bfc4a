"""Model-level SDP checks for a user's own ``torch.nn.Module``, block map and subnetwork builder.

The property-testing kit's model half (docs/testing.md), beside `masklab.testing` (masks and
their invariants) and `theory.testing` (problem constants); it lives here because a check of a
model is the runtime's business, and masklab imports nothing above itself. The protocol has three
parts, all plain Python:

- ``blocks``: a sequence with one entry per mask column; entry j lists the parts block j owns as
  ``(tensor name, dim, index)``: the whole state-dict tensor when ``dim`` is None, else the
  positions ``index`` along ``dim`` (rows of a weight, entries of a bias, ...). Everything no block
  owns is shared.
- ``subnetwork(model, held) -> nn.Module``: worker's physical subnetwork for the boolean mask
  row ``held``, initialised from ``model``'s current values, with the full model's tensor names.
  A sliced tensor is declared by a ``full_index()`` method on the returned module mapping its name
  to ``(dim, index)`` (or an object with ``.dim`` and ``.index``, such as `SliceSpec`);
  undeclared tensors are whole.
- the reference: the full model with every part of the non-held blocks zeroed (`zero_blocks`).
  Zeroing is removal whenever a block's output is a product with its owned weights: a hidden
  neuron whose in- and out-weights are zero adds nothing, and a residual branch whose output
  projection is zero is the identity. Pass ``reference=`` where that does not hold.

torch is imported inside the functions, so ``import sdp_train.testing`` stays as light as
``import sdp_train``. Not here: strategies (hypothesis), which need no model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from masklab.mask import Mask
from sdp_train.errors import BlockMapError

Part = tuple[str, int | None, tuple[int, ...]]
BlockParts = Sequence[Sequence[Part]]
SubnetworkFn = Callable[[Any, np.ndarray], Any]

__all__ = [
    "BlockMapError", "assert_holder_average", "assert_subnetwork_consistent", "block_parts", "from_sdp_train",
    "zero_blocks",
]


def block_parts(block_map: Any, level: str) -> tuple[tuple[Part, ...], ...]:
    """The ``blocks`` protocol for an ``sdp_train.models.BlockMap`` at ``level`` ("block"/"neuron")."""
    return tuple(
        tuple((name, spec.dim, spec.index) for name, spec in block_map.owned(level, j))
        for j in range(block_map.num_blocks(level))
    )


def from_sdp_train(config: Any, level: str, *, seed: int = 0) -> tuple[Any, tuple[tuple[Part, ...], ...], SubnetworkFn]:
    """``(model, blocks, subnetwork)`` for one of sdp_train's models (e.g. ``llama-debug``) at ``level``.

    The subnetwork is `sdp_train.models.subnet.build_worker_model` sliced from the model's current state.
    """
    from sdp_train.models import block_map, build_model
    from sdp_train.models.subnet import build_worker_model

    def subnetwork(model: Any, held: np.ndarray) -> Any:
        return build_worker_model(config, held, level, init_state=model.state_dict())

    return build_model(config, seed=seed), block_parts(block_map(config), level), subnetwork


def zero_blocks(model: Any, blocks: BlockParts, held: np.ndarray) -> Any:
    """A deep copy of ``model`` with every part owned by a block where ``held`` is False set to 0."""
    import torch

    held = _held_row(held, blocks)
    ref = copy.deepcopy(model)
    state = ref.state_dict(keep_vars=True)
    with torch.no_grad():
        for j in np.flatnonzero(~held):
            for name, dim, index in blocks[j]:
                tensor = _tensor(state, name, j)
                if dim is None:
                    tensor.zero_()
                else:
                    tensor.index_fill_(dim, torch.tensor(index, dtype=torch.int64), 0)
    return ref


def assert_subnetwork_consistent(
    model: Any,
    mask: Mask,
    worker: int,
    *,
    blocks: BlockParts,
    subnetwork: SubnetworkFn,
    inputs: Any,
    reference: SubnetworkFn | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Assert that worker ``worker``'s subnetwork computes what the full model without its other blocks does.

    Parameters
    ----------
    model : torch.nn.Module
        The full model (not modified).
    mask : Mask
        Its columns are the entries of ``blocks``; row ``worker`` of ``mask.matrix`` is used.
    blocks, subnetwork
        The protocol of this module's docstring.
    inputs : Tensor or tuple
        Arguments of the forward pass (a tuple is unpacked).
    reference : callable, optional
        ``reference(model, held) -> nn.Module`` computing the full model with the non-held blocks
        removed; default `zero_blocks`.
    rtol, atol : float
        Tolerances of ``torch.testing.assert_close`` on the outputs.
    """
    import torch

    held = _worker_row(mask, worker, blocks)
    ref = reference(model, held) if reference is not None else zero_blocks(model, blocks, held)
    sub = subnetwork(model, held)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.no_grad():
        expected, actual = ref(*args), sub(*args)
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(
            f"worker {worker}'s subnetwork (holds blocks {np.flatnonzero(held).tolist()} of {held.size}) "
            f"differs from the full model with blocks {np.flatnonzero(~held).tolist()} removed: {exc}"
        ) from None


def assert_holder_average(
    model: Any,
    mask: Mask,
    batches: Sequence[Any],
    *,
    blocks: BlockParts,
    subnetwork: SubnetworkFn,
    loss: Callable[[Any, Any], Any],
    lr: float = 0.1,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> dict[str, Any]:
    """Assert that one simulated SDP step updates every block by the mean of its holders' gradients.

    The simulation builds every worker's subnetwork, takes ``loss(subnetwork, batches[k])``'s
    gradient, scatters it into full-model coordinates with ``full_index()`` and averages each entry
    over the workers whose subnetwork has it, then takes an SGD step with ``lr``. The independent
    computation differentiates the zeroed full model (`zero_blocks`) per worker and updates block
    j by ``sum_k M[k, j] / c_j * g_k`` (an einsum over the holder weights), and each shared tensor
    by the mean over the workers whose subnetwork has it.

    Returns
    -------
    dict of str to Tensor
        The full model's parameters after the step.
    """
    import torch

    if len(batches) != mask.workers:
        raise BlockMapError(f"got {len(batches)} batches for K={mask.workers} workers; pass one per worker")
    if not lr > 0:
        raise BlockMapError(f"lr={lr!r} must be > 0")
    rows = [_worker_row(mask, k, blocks) for k in range(mask.workers)]
    subs = [subnetwork(model, row) for row in rows]
    simulated = _simulated_update(model, subs, batches, loss)
    expected = _per_block_update(model, mask, rows, subs, batches, blocks, loss)
    params = dict(model.named_parameters())
    for name, update in expected.items():
        try:
            torch.testing.assert_close(simulated[name], update, rtol=rtol, atol=atol)
        except AssertionError as exc:
            owners = [j for j, parts in enumerate(blocks) if any(p[0] == name for p in parts)]
            raise AssertionError(
                f"parameter {name!r} (owned by blocks {owners}, coverage "
                f"{mask.coverage[owners].tolist() if owners else 'shared'}, K={mask.workers}): the simulated SDP "
                f"step's averaged gradient differs from the per-block holder mean: {exc}"
            ) from None
    with torch.no_grad():
        return {name: p.detach() - lr * simulated[name] for name, p in params.items()}


# -- internals ---------------------------------------------------------------------------------
def _average_over_holders(grad_sum: Any, holders: Any) -> Any:
    """Entry-wise mean over the workers that hold the entry (entries nobody holds stay 0)."""
    return grad_sum / holders.clamp(min=1)


def _simulated_update(model: Any, subs: list[Any], batches: Sequence[Any], loss: Callable) -> dict[str, Any]:
    import torch

    params = dict(model.named_parameters())
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    holders = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for k, sub in enumerate(subs):
        sub.zero_grad(set_to_none=True)
        loss(sub, batches[k]).backward()
        index = _full_index(sub)
        for name, p in sub.named_parameters():
            if name not in params:
                raise BlockMapError(f"worker {k}'s subnetwork has parameter {name!r}, which the full model lacks")
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            dim, idx = index.get(name, (None, ()))
            _scatter_add(sums[name], dim, idx, grad.double())
            _scatter_add(holders[name], dim, idx, torch.ones_like(grad, dtype=torch.float64))
    return {n: _average_over_holders(sums[n], holders[n]).to(params[n].dtype) for n in params}


def _per_block_update(
    model: Any, mask: Mask, rows: list[np.ndarray], subs: list[Any], batches: Sequence[Any],
    blocks: BlockParts, loss: Callable,
) -> dict[str, Any]:
    import torch

    params = dict(model.named_parameters())
    grads = []
    for k, row in enumerate(rows):
        ref = zero_blocks(model, blocks, row)
        loss(ref, batches[k]).backward()
        grads.append({n: (torch.zeros_like(p) if p.grad is None else p.grad).double()
                      for n, p in ref.named_parameters()})
    weights = torch.tensor(mask.matrix / mask.coverage, dtype=torch.float64)  # (K, B): M[k, j] / c_j
    update = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    owned = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in params.items()}
    for j, parts in enumerate(blocks):
        for name, dim, index in parts:
            if name not in params:
                continue  # a buffer (e.g. BatchNorm statistics) gets no gradient step
            stacked = torch.stack([_take(g[name], dim, index) for g in grads])  # (K, *part shape)
            _put(update[name], dim, index, torch.einsum("k,k...->...", weights[:, j], stacked))
            if dim is None:
                owned[name].fill_(True)
            else:
                owned[name].index_fill_(dim, torch.tensor(index, dtype=torch.int64), True)
    for name in params:
        holders = [k for k, sub in enumerate(subs) if name in dict(sub.named_parameters())]
        shared_mean = sum(grads[k][name] for k in holders) / max(len(holders), 1)
        update[name] = torch.where(owned[name], update[name], shared_mean).to(params[name].dtype)
    return update


def _full_index(sub: Any) -> dict[str, tuple[int | None, tuple[int, ...]]]:
    if not hasattr(sub, "full_index"):
        return {}
    out = {}
    for name, spec in sub.full_index().items():
        dim, index = (spec.dim, spec.index) if hasattr(spec, "dim") else spec
        out[name] = (dim, tuple(index))
    return out


def _take(tensor: Any, dim: int | None, index: Sequence[int]) -> Any:
    import torch

    return tensor if dim is None else tensor.index_select(dim, torch.tensor(index, dtype=torch.int64))


def _put(full: Any, dim: int | None, index: Sequence[int], part: Any) -> None:
    import torch

    if dim is None:
        full.copy_(part)
    else:
        full.index_copy_(dim, torch.tensor(index, dtype=torch.int64), part)


def _scatter_add(full: Any, dim: int | None, index: Sequence[int], part: Any) -> None:
    import torch

    if dim is None:
        full.add_(part)
    else:
        full.index_add_(dim, torch.tensor(index, dtype=torch.int64), part)


def _held_row(held: np.ndarray, blocks: BlockParts) -> np.ndarray:
    row = np.asarray(held).astype(bool)
    if row.shape != (len(blocks),):
        raise BlockMapError(f"mask row has shape {row.shape} but the block map has {len(blocks)} blocks")
    return row


def _worker_row(mask: Mask, worker: int, blocks: BlockParts) -> np.ndarray:
    if mask.blocks != len(blocks):
        raise BlockMapError(f"the mask has B={mask.blocks} columns but the block map has {len(blocks)} blocks")
    if not 0 <= worker < mask.workers:
        raise BlockMapError(f"worker {worker} is out of range [0, {mask.workers})")
    return mask.matrix[worker].astype(bool)


def _tensor(state: Mapping[str, Any], name: str, block: int) -> Any:
    if name not in state:
        raise BlockMapError(f"block {block} owns {name!r}, which is not a tensor of the model "
                            f"(state-dict names: {list(state)[:8]}...)")
    return state[name]
