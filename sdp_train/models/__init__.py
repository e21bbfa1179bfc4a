"""Model registry: named configs, model construction with the shared seeded init, block maps.

>>> from sdp_train.models import get_model_config, block_map
>>> config = get_model_config("llama-debug", n_layers=2)
>>> block_map(config).block_names("block")
('layers.0', 'layers.1')

Every module of this package that defines ``FAMILY`` (a `ModelFamily`: ``llama``, ``resnet``,
``vit``, ``swin``) is registered on import, and the functions here look the family up by the
config's type; `register_family` adds one defined elsewhere. Building a worker's subnetwork from a
mask row is `sdp_train.models.subnet`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models.family import (
    DATA_KINDS,
    ActivationModel,
    BlockActivations,
    ModelFamily,
    families,
    family_of,
    family_of_model,
    register_family,
    unregister_family,
)
from sdp_train.models.llama import Llama, LlamaConfig
from sdp_train.models.resnet import ResNet, ResNetConfig
from sdp_train.models.swin import Swin, SwinConfig
from sdp_train.models.vit import ViT, ViTConfig
from sdp_train.parallel.blockmap import LEVELS, Block, BlockMap, SliceSpec, SubnetModule, on_meta


class ModelConfig(Protocol):
    """The config of any registered family: a dataclass with a ``name`` (see `ModelFamily`)."""

    name: str


_NOT_FAMILIES = {"family", "subnet"}  # the contract and the built-in families' subnetwork cut


def _register_package_families() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_FAMILIES:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FAMILY", None), ModelFamily):
            register_family(module.FAMILY)


_register_package_families()

__all__ = [
    "DATA_KINDS", "LEVELS", "ActivationModel", "Block", "BlockActivations", "BlockMap", "Llama", "LlamaConfig",
    "ModelConfig", "ModelFamily", "ResNet", "ResNetConfig", "SliceSpec", "SubnetModule", "Swin", "SwinConfig",
    "ViT", "ViTConfig",
    "block_map", "build_model", "data_kind", "families", "family_of", "family_of_model", "get_model_config",
    "model_class", "model_names", "num_params", "register_family", "subnet_kwargs", "unregister_family",
]


def _named_configs() -> dict[str, ModelConfig]:
    return {name: config for family in families() for name, config in family.presets().items()}


def model_names() -> tuple[str, ...]:
    """Names accepted by `get_model_config`, sorted."""
    return tuple(sorted(_named_configs()))


def get_model_config(name: str, /, **overrides: Any) -> ModelConfig:
    """The named config with ``overrides`` applied (validated again).

    Raises
    ------
    ConfigError
        Unknown name (the message lists the known ones) or unknown / invalid override.
    """
    configs = _named_configs()
    if name not in configs:
        if name.rpartition(":")[0].endswith(".py") or name.endswith(".py"):  # sdp_train.trainer.user_model's syntax
            raise ConfigError(f"model {name!r} is your own (FILE.py:FACTORY): sdp train takes it, but this command "
                              f"needs a built-in model's declared shapes; built-in models: {', '.join(sorted(configs))}")
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(configs))}")
    base = configs[name]
    fields = {f.name for f in dataclasses.fields(base)} - {"name"}  # the name says which shape it is
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"{name}: unknown config fields {unknown}; fields are {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The module class for ``config`` (`Llama`, `ResNet`, `ViT`, `Swin`, ...)."""
    return family_of(config).model_class


def data_kind(config: ModelConfig) -> str:
    """``"text"`` or ``"images"``: what the model of ``config`` takes as input."""
    return family_of(config).data


def num_params(config: ModelConfig) -> int:
    """Parameter count of the full model, computed from the config (nothing is allocated)."""
    return family_of(config).num_params(config)


def block_map(config: ModelConfig) -> BlockMap:
    """The model's maskable blocks at both levels (built on the meta device: cheap for any size).

    Maps are immutable and cached per config value: building one constructs the model on the meta
    device, and a run asks for the same map many times.
    """
    family = family_of(config)
    key = (type(config), repr(config))
    if key not in _BLOCK_MAPS:
        _BLOCK_MAPS[key] = family.block_map(config)
    return _BLOCK_MAPS[key]


_BLOCK_MAPS: dict[tuple[type, str], BlockMap] = {}


def subnet_kwargs(config: ModelConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """Constructor arguments of the worker model holding the blocks where ``held`` is True.

    ``held`` must already have length ``block_map(config).num_blocks(level)``; `sdp_train.models.subnet`
    validates it.
    """
    return family_of(config).subnet_kwargs(config, held, level)


def build_model(
    config: ModelConfig, *, seed: int, device: torch.device | str = "cpu", **structure: Any
) -> nn.Module:
    """Build the model (or, with ``structure``, a subnetwork of it) with the seeded initialisation.

    The module is created on the meta device and materialised on ``device``, so nothing is
    initialised twice; every tensor holds its part of the full model that the same ``seed`` gives.

    Parameters
    ----------
    config : ModelConfig
        Shape of the full model (a registered family's config).
    seed : int
        Initialisation seed; the same seed gives the same full model on every process.
    device : torch.device or str
        Where the parameters live.
    **structure
        Subnetwork arguments of the model class (``layer_ids``/``mlp_index`` for `Llama`,
        ``block_ids``/``inner_index`` for `ResNet`); see `subnet_kwargs`.
    """
    with on_meta():
        model = model_class(config)(config, **structure)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
