"""Model registry: named configs, model construction with the shared seeded init, block maps.

>>> from sdp_train.models import get_model_config, block_map
>>> config = get_model_config("llama-debug", n_layers=2)
>>> block_map(config).block_names("block")
('layers.0', 'layers.1')

Each model family (`llama`, `resnet`, `vit`) provides ``num_params``, ``block_map`` and
``subnet_kwargs``; this module dispatches on the config type. Building a worker's subnetwork from
a mask row is `sdp_train.subnet`.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models import llama, resnet, vit
from sdp_train.models.blocks import LEVELS, Block, BlockMap, SliceSpec, SubnetModule
from sdp_train.models.llama import Llama, LlamaConfig
from sdp_train.models.resnet import ResNet, ResNetConfig
from sdp_train.models.vit import ViT, ViTConfig

ModelConfig = LlamaConfig | ResNetConfig | ViTConfig

_FAMILIES: dict[type, tuple[type[nn.Module], ModuleType]] = {
    LlamaConfig: (Llama, llama),
    ResNetConfig: (ResNet, resnet),
    ViTConfig: (ViT, vit),
}

__all__ = [
    "LEVELS", "Block", "BlockMap", "Llama", "LlamaConfig", "ModelConfig", "ResNet", "ResNetConfig",
    "SliceSpec", "SubnetModule", "block_map", "build_model", "get_model_config", "model_class",
    "model_names", "num_params", "subnet_kwargs", "ViT", "ViTConfig",
]


def _named_configs() -> dict[str, ModelConfig]:
    return {**llama.llama_configs(), **resnet.resnet_configs(), **vit.vit_configs()}


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
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(configs))}")
    base = configs[name]
    fields = {f.name for f in dataclasses.fields(base)} - {"name"}  # the name says which shape it is
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"{name}: unknown config fields {unknown}; fields are {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


def _family(config: ModelConfig) -> tuple[type[nn.Module], ModuleType]:
    if type(config) not in _FAMILIES:
        raise ConfigError(f"not a model config: {type(config).__name__}; expected LlamaConfig, ResNetConfig or ViTConfig")
    return _FAMILIES[type(config)]


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The module class for ``config`` (`Llama` or `ResNet`)."""
    return _family(config)[0]


def num_params(config: ModelConfig) -> int:
    """Parameter count of the full model, computed from the config (nothing is allocated)."""
    return _family(config)[1].num_params(config)


def block_map(config: ModelConfig) -> BlockMap:
    """The model's maskable blocks at both levels (built on the meta device: cheap for any size).

    Maps are immutable and cached per config value: building one constructs the model on the meta
    device, and a run asks for the same map many times.
    """
    key = (type(config), repr(config))
    if key not in _BLOCK_MAPS:
        _BLOCK_MAPS[key] = _family(config)[1].block_map(config)
    return _BLOCK_MAPS[key]


_BLOCK_MAPS: dict[tuple[type, str], BlockMap] = {}


def subnet_kwargs(config: ModelConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """Constructor arguments of the worker model holding the blocks where ``held`` is True.

    ``held`` must already have length ``block_map(config).num_blocks(level)``; `sdp_train.subnet`
    validates it.
    """
    return _family(config)[1].subnet_kwargs(config, held, level)


def build_model(
    config: ModelConfig, *, seed: int, device: torch.device | str = "cpu", **structure: Any
) -> nn.Module:
    """Build the model (or, with ``structure``, a subnetwork of it) with the seeded initialisation.

    The module is created on the meta device and materialised on ``device``, so nothing is
    initialised twice; every tensor holds its part of the full model that the same ``seed`` gives.

    Parameters
    ----------
    config : LlamaConfig or ResNetConfig
        Shape of the full model.
    seed : int
        Initialisation seed; the same seed gives the same full model on every process.
    device : torch.device or str
        Where the parameters live.
    **structure
        Subnetwork arguments of the model class (``layer_ids``/``mlp_index`` for `Llama`,
        ``block_ids``/``inner_index`` for `ResNet`); see `subnet_kwargs`.
    """
    with torch.device("meta"):
        model = model_class(config)(config, **structure)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
