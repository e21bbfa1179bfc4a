"""The model-family contract and its registry: what one family file declares, looked up by the rest.

A *family* (``llama``, ``resnet``, ``vit``, ``swin``) is one module of this package that defines
``FAMILY = ModelFamily(...)``: its config class, model class, named configs, parameter count,
block map, subnetwork constructor arguments, data kind and activation-memory model.
`sdp_train.models` registers every such module of the package when imported, so a new family is
one new file; a family defined elsewhere (a test, a user's package) joins with `register_family`.
docs/design.md ("Adding a model family") lists what the model class itself must provide.

Not here: the block-map machinery (`sdp_train.parallel.blockmap`), building worker models from a mask
row (`sdp_train.models.subnet`), how `sdp plan` combines activations into peaks (`sdp_train.planning.memory`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import BlockMap
from sdp_train.parallel.discovery import MLPSpec

DATA_KINDS: tuple[str, ...] = ("text", "images")


@dataclass(frozen=True)
class BlockActivations:
    """One residual block's activation bytes (see `sdp_train.planning.activations`)."""

    name: str
    saved: int
    output: int
    backward: int
    first_grad: int
    """Elements of the first weight gradients its backward produces (unsharded under FSDP until
    the block's reduce-scatter)."""


@dataclass(frozen=True)
class ActivationModel:
    """A worker's activation bytes, split as backward releases them."""

    stem: int
    blocks: tuple[BlockActivations, ...]
    head: int
    loss_backward: int
    constant: int
    head_prefixes: tuple[str, ...]
    """Parameter-name prefixes of the head, whose gradients backward produces before any block's."""

    def forward_bytes(self, ac: bool) -> int:
        """Bytes kept at the end of forward: everything, or with checkpointing the block inputs."""
        blocks = sum((0 if ac else b.saved) + b.output for b in self.blocks)
        return self.stem + blocks + self.head + self.constant


ActivationFn = Callable[..., ActivationModel]
"""``activations(model, frozen, *, batch_size, seq_len, image_size, elem) -> ActivationModel``, and
``loss_chunks`` for a family with ``chunked_loss``."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything the toolkit needs to know about one model family.

    Examples
    --------
    >>> from sdp_train.models import family_of, get_model_config
    >>> family_of(get_model_config("vit-tiny")).name
    'vit'
    """

    name: str
    """Short family name (``"vit"``), unique among registered families."""
    config_class: type
    """Keyword-only dataclass of the shape; a ``name`` field; ``__post_init__`` raises `ConfigError`."""
    model_class: type[nn.Module]
    """``model_class(config, **subnet_kwargs(...))`` builds the full model or a worker's subnetwork."""
    presets: Callable[[], Mapping[str, Any]]
    """Named configs (``{"vit-tiny": ViTConfig()}``); names are unique across families."""
    num_params: Callable[[Any], int]
    """Parameter count of the full model from the config alone."""
    block_map: Callable[[Any], BlockMap]
    """The maskable blocks at block and neuron level and the full model's tensor shapes."""
    subnet_kwargs: Callable[[Any, np.ndarray, str], dict[str, object]]
    """``(config, held, level)`` -> constructor arguments of the worker holding ``held``."""
    data: str
    """``"text"`` (token ids in, next-token logits out) or ``"images"`` (images in, class logits out)."""
    activations: ActivationFn
    """The activation-memory model `sdp plan` uses for a (worker) model of this family."""
    mlp: MLPSpec | None = None
    """Each block's MLP projections, for N-SDP cut by the library (under a schedule); None: no N-SDP there."""
    chunked_loss: bool = False
    """The model's ``forward(inputs, targets, loss_chunks=N)`` returns the mean cross-entropy, its head
    computed N chunks of tokens at a time (`sdp_train.models.lm_loss`), and `activations` takes
    ``loss_chunks`` (0: the plain loss over the full logits)."""

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS:
            raise ConfigError(f"model family {self.name!r}: data must be one of {DATA_KINDS}, got {self.data!r}")


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known to `build_model`, `block_map`, `get_model_config`, `sdp plan` and `sdp train`.

    Registering the same family object again does nothing.

    Raises
    ------
    ConfigError
        Another family already has this name, config class or a preset name.
    """
    if not isinstance(family, ModelFamily):
        raise ConfigError(f"register_family takes a ModelFamily, got {type(family).__name__}")
    if _FAMILIES.get(family.name) is family:
        return family
    if family.name in _FAMILIES:
        raise ConfigError(f"a model family named {family.name!r} is already registered")
    for other in _FAMILIES.values():
        if other.config_class is family.config_class:
            raise ConfigError(f"model family {family.name!r}: config class {family.config_class.__name__} "
                              f"already belongs to family {other.name!r}")
        clash = sorted(set(other.presets()) & set(family.presets()))
        if clash:
            raise ConfigError(f"model family {family.name!r}: model names {clash} already belong to family "
                              f"{other.name!r}")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Forget the family ``name`` (a family a test registered); unknown names raise `ConfigError`."""
    if name not in _FAMILIES:
        raise ConfigError(f"no model family named {name!r}; registered: {', '.join(sorted(_FAMILIES))}")
    del _FAMILIES[name]


def families() -> tuple[ModelFamily, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES.values())


def family_of(config: object) -> ModelFamily:
    """The family whose config class ``config`` is an instance of.

    Raises
    ------
    ConfigError
        No registered family has that config class (the message lists the known ones).
    """
    for family in _FAMILIES.values():
        if type(config) is family.config_class:
            return family
    known = ", ".join(f.config_class.__name__ for f in _FAMILIES.values())
    raise ConfigError(f"not a model config: {type(config).__name__}; expected one of {known}")


def family_of_model(model: nn.Module) -> ModelFamily:
    """The family whose model class ``model`` is an instance of (full model or worker subnetwork)."""
    for family in _FAMILIES.values():
        if isinstance(model, family.model_class):
            return family
    raise ConfigError(f"no model family has the model class {type(model).__name__}; registered: "
                      f"{', '.join(f.model_class.__name__ for f in _FAMILIES.values())}")
