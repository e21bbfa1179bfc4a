"""One worker's subnetwork, built from its row of the mask matrix.

Forward masking (docs/design.md §2): at level ``"block"`` (B-SDP) the worker's model contains only the
held transformer blocks / identity BasicBlocks, the rest are never allocated and are skipped in
the forward pass; at level ``"neuron"`` (N-SDP) each MLP (each maskable BasicBlock's inner conv)
is physically sliced to the held neuron (channel) groups. State-dict names are always the full
model's, and ``worker.full_index()`` maps every local tensor to the rows/columns of the full one
(`SliceSpec`), which is what the sync engine packs and what `load_from_full` / `scatter_to_full`
use. Backward masking (Bb-SDP) keeps the full model and freezes the parameters of non-held
blocks (`backward_mask`, `apply_backward_mask`).

A shared tensor that only feeds a removed part is not allocated either: a LLaMA layer whose
neuron groups are all dropped has neither MLP nor MLP norm. So the set of tensors a worker holds
is ``held_tensors(config, row, level)``, not "owned blocks + shared"; the sync engine should group
holder sets from it. Mask-level rules (every column covered, ...) are checked in masklab, not here.

>>> import numpy as np
>>> from sdp_train.models import get_model_config
>>> config = get_model_config("llama-debug")
>>> worker = build_worker_model(config, np.array([1, 0, 1, 0]), "block", seed=0)
>>> list(worker.layers)
['0', '2']
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np
import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models import ModelConfig, ResNet, block_map, build_model, model_class, subnet_kwargs
from sdp_train.parallel.blockmap import PassThrough, SliceSpec, check_level, on_meta


def check_held(config: ModelConfig, held: np.ndarray, level: str) -> np.ndarray:
    """Validate one mask row and return it as a boolean array of length B.

    Raises
    ------
    ConfigError
        ``held`` is not 1-D 0/1, its length is not the model's number of blocks at ``level``, or
        it holds no block.
    """
    check_level(level)
    row = np.asarray(held)
    if row.ndim != 1:
        raise ConfigError(f"a mask row must be 1-D, got shape {row.shape}")
    if row.dtype != bool and not (np.issubdtype(row.dtype, np.integer) and np.isin(row, (0, 1)).all()):
        raise ConfigError(f"a mask row must be boolean or 0/1 integers, got dtype {row.dtype} with values {row}")
    expected = block_map(config).num_blocks(level)
    if row.shape[0] != expected:
        raise ConfigError(
            f"model {config.name!r} has {expected} blocks at level {level!r}; the mask row has length {row.shape[0]}"
        )
    if not row.any():
        raise ConfigError(f"the mask row holds no block of model {config.name!r} at level {level!r}; "
                          "every worker must hold at least one")
    return row.astype(bool)


def build_worker_model(
    config: ModelConfig,
    held: np.ndarray,
    level: str,
    *,
    seed: int | None = None,
    init_state: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The worker's forward-masked subnetwork, initialised from the shared full model.

    Parameters
    ----------
    config : LlamaConfig or ResNetConfig
        Shape of the full model.
    held : numpy.ndarray, shape (B,)
        The worker's mask row (bool or 0/1).
    level : {"block", "neuron"}
        B-SDP or N-SDP.
    seed : int, optional
        Initialise as the full model built with this seed would be, then slice; only held tensors
        are generated, so no full model is allocated.
    init_state : mapping of str to Tensor, optional
        A full-model state dict to slice from instead (e.g. a checkpoint). Exactly one of
        ``seed`` / ``init_state``.
    device : torch.device or str
        Where the worker's parameters live.

    Returns
    -------
    torch.nn.Module
        A `Llama` / `ResNet` whose ``full_index()`` maps its tensors into the full model.
    """
    if (seed is None) == (init_state is None):
        raise ConfigError("pass exactly one of seed= and init_state=")
    structure = subnet_kwargs(config, check_held(config, held, level), level)
    if seed is not None:
        return build_model(config, seed=seed, device=device, **structure)
    with on_meta():
        model = model_class(config)(config, **structure)
    model.to_empty(device=device)
    load_from_full(model, init_state)
    return model


def held_tensors(config: ModelConfig, held: np.ndarray, level: str) -> dict[str, SliceSpec]:
    """Full-model tensor name -> part a worker with mask row ``held`` holds (nothing allocated)."""
    with on_meta():
        model = model_class(config)(config, **subnet_kwargs(config, check_held(config, held, level), level))
    return model.full_index()


def load_from_full(worker: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy each worker tensor's part of ``full_state`` (a full-model state dict) into the worker."""
    index = worker.full_index()
    with torch.no_grad():
        for name, local in worker.state_dict(keep_vars=True).items():
            if name not in full_state:
                raise ConfigError(f"the full state dict has no tensor {name!r}")
            spec = index[name]
            _check_full_shape(name, spec, local, full_state[name])
            local.copy_(spec.take(full_state[name]))


def scatter_to_full(worker: nn.Module, full_state: MutableMapping[str, torch.Tensor]) -> None:
    """Write the worker's tensors into their places in ``full_state``, in place; other entries are kept."""
    index = worker.full_index()
    for name, local in worker.state_dict(keep_vars=True).items():
        if name not in full_state:
            raise ConfigError(f"the full state dict has no tensor {name!r}")
        _check_full_shape(name, index[name], local, full_state[name])
        index[name].put(full_state[name], local.detach())


def _check_full_shape(name: str, spec: SliceSpec, local: torch.Tensor, full: torch.Tensor) -> None:
    expected = spec.full_shape(local.shape)
    if tuple(full.shape) != expected:
        raise ConfigError(f"tensor {name!r}: the full state dict has shape {tuple(full.shape)}, expected {expected}")


def backward_mask(
    config: ModelConfig, held: np.ndarray, level: str = "block"
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Bb-SDP: (held, frozen) full-model parameter names for a worker with mask row ``held``.

    Held parameters are the shared ones and those of held blocks; they get gradients and optimizer
    state. Only block level is supported: a neuron group owns rows of a tensor, which
    ``requires_grad`` cannot express.
    """
    if level != "block":
        raise ConfigError(f"backward masking supports level 'block' only, got {level!r}")
    row = check_held(config, held, level)
    bmap = block_map(config)
    frozen = {name for j in np.flatnonzero(~row) for name, _ in bmap.owned(level, int(j))}
    params = [name for name in bmap.shapes if name in bmap.parameter_names]
    return tuple(n for n in params if n not in frozen), tuple(n for n in params if n in frozen)


def apply_backward_mask(model: nn.Module, config: ModelConfig, held: np.ndarray) -> None:
    """Set ``requires_grad`` on the full ``model``: True for held parameters, False for frozen ones."""
    held_names, frozen_names = backward_mask(config, held)
    params = dict(model.named_parameters())
    missing = sorted(set(held_names + frozen_names) - set(params))
    if missing:
        raise ConfigError(f"backward masking needs the full model; it lacks {missing[:5]} ({len(missing)} in all)")
    for name in held_names:
        params[name].requires_grad_(True)
    for name in frozen_names:
        params[name].requires_grad_(False)


def residual_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every residual block the model has built, in forward order (a pass-through's
    shared shortcut is not a block's: it goes with the root, held by every worker)."""
    if isinstance(model, ResNet):
        return [(f"{stage}.{j}", block) for stage in model.stages for j, block in getattr(model, stage).items()
                if not isinstance(block, PassThrough)]
    return [(f"layers.{i}", block) for i, block in model.layers.items()]
