"""Maskable blocks of a model: which full-model tensors (or rows/columns of them) each block owns.

A *block* (docs/design.md §2) is the unit a mask column switches on or off. At block level (B-SDP) it
is a whole transformer block or identity-shortcut BasicBlock and owns whole tensors; at neuron
level (N-SDP) it is a group of MLP hidden neurons / inner conv channels and owns index sets along
one dimension of a few tensors. Everything no block owns is *shared*. The same `SliceSpec` also
says, for a worker's (sliced) model, where each of its tensors lives inside the full model.

A block a worker does not hold becomes a `PassThrough` (defined here, below the model families,
so that a family can build one for a worker's subnetwork). This module only describes structure
and deterministic initialisation; building worker models from a mask row is `sdp_train.models.subnet`,
moving gradients is the sync engine's job.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from sdp_train.errors import ConfigError

LEVELS: tuple[str, ...] = ("block", "neuron")
MAX_PARAMS = 2**36
"""Largest model accepted (~68.7e9 parameters): every rank assembles the full model to validate it,
so a larger one cannot run anywhere, and refusing it early avoids asking for terabytes."""
MAX_LAYERS = 256
"""Most residual blocks (transformer layers / BasicBlocks) a model may have."""
MAX_NEURON_BLOCKS = 2**14
"""Most neuron-level blocks (layers x neuron_groups), i.e. mask columns of N-SDP."""


def check_config_fields(config: object, *, ints: Sequence[str] = (), numbers: Sequence[str] = ()) -> None:
    """Raise `ConfigError` unless ``config.name`` is a string, each of ``ints`` a positive int and
    each of ``numbers`` a finite positive number (booleans are refused for both)."""
    name = config.name  # type: ignore[attr-defined]
    if not isinstance(name, str):
        raise ConfigError(f"model config name must be a string, got {name!r}")
    for field in ints:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: {field} must be a positive int, got {value!r}")
    for field in numbers:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= sys.float_info.max:
            raise ConfigError(f"{name}: {field} must be a finite number > 0, got {value!r}")


def check_model_size(name: str, *, params: int = 0, layers: int = 0, neuron_blocks: int = 0) -> None:
    """Raise `ConfigError` when a model is larger than `MAX_PARAMS` / `MAX_LAYERS` / `MAX_NEURON_BLOCKS`."""
    for what, value, limit in (("parameters", params, MAX_PARAMS), ("residual blocks", layers, MAX_LAYERS),
                               ("neuron blocks (layers x neuron_groups)", neuron_blocks, MAX_NEURON_BLOCKS)):
        if value > limit:
            raise ConfigError(f"{name}: {value} {what} exceed the supported maximum of {limit}")


def names_by_prefix(names: Iterable[str], depth: int = 2) -> dict[str, list[str]]:
    """State-dict names grouped by their first ``depth`` dotted parts (``"layers.3"``), in order.

    One pass over the names, so block maps of deep models cost time linear in the model size.
    """
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(".".join(n.split(".")[:depth]), []).append(n)
    return groups


def check_level(level: str) -> None:
    """Raise `ConfigError` unless ``level`` is ``"block"`` (B-SDP) or ``"neuron"`` (N-SDP)."""
    if level not in LEVELS:
        raise ConfigError(f"level must be one of {LEVELS}, got {level!r}")


@dataclass(frozen=True)
class SliceSpec:
    """The part of one full-model tensor that a block owns or a worker's tensor holds.

    ``dim is None`` means the whole tensor. Otherwise the part is ``full.index_select(dim, index)``:
    local position ``i`` along ``dim`` is full position ``index[i]``.
    """

    dim: int | None = None
    """Dimension along which the tensor is sliced; None for the whole tensor."""
    index: tuple[int, ...] = ()
    """Full-model positions along ``dim``, in local order (strictly increasing)."""
    full_size: int = 0
    """Length of the full tensor along ``dim`` (0 for the whole tensor)."""

    def __post_init__(self) -> None:
        if self.dim is None:
            if self.index or self.full_size:
                raise ConfigError(f"a whole-tensor SliceSpec takes no index/full_size, got {self}")
            return
        if self.dim < 0:
            raise ConfigError(f"SliceSpec.dim must be >= 0, got {self.dim}")
        if any(b <= a for a, b in zip(self.index, self.index[1:])):
            raise ConfigError(f"SliceSpec.index must be strictly increasing, got {self.index}")
        if self.index and not (0 <= self.index[0] and self.index[-1] < self.full_size):
            raise ConfigError(
                f"SliceSpec.index must lie in [0, {self.full_size}), got {self.index[0]}..{self.index[-1]}"
            )

    @property
    def is_whole(self) -> bool:
        """True when the spec covers the whole tensor."""
        return self.dim is None

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the full tensor, given the shape of the local (sliced) one."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] = self.full_size
        return tuple(shape)

    def local_positions(self, full_positions: Sequence[int]) -> tuple[int, ...]:
        """Local positions along ``dim`` of the given full positions (themselves, for a whole tensor).

        Raises
        ------
        ConfigError
            A position is not part of this spec.
        """
        if self.dim is None:
            return tuple(full_positions)
        local_of = {full: i for i, full in enumerate(self.index)}
        missing = [i for i in full_positions if i not in local_of]
        if missing:
            raise ConfigError(f"full position {missing[0]} is not held by this part (dim {self.dim}, "
                              f"{len(self.index)} of {self.full_size} positions held)")
        return tuple(local_of[i] for i in full_positions)

    def index_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``index`` as an int64 tensor (for ``index_select`` / ``index_copy_`` / kernels)."""
        return torch.tensor(self.index, dtype=torch.int64, device=device)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The local part of ``full`` (a copy when sliced, ``full`` itself when whole)."""
        if self.dim is None:
            return full
        return full.index_select(self.dim, self.index_tensor(full.device))

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` into its place in ``full``, in place."""
        with torch.no_grad():
            if self.dim is None:
                full.copy_(local)
            else:
                full.index_copy_(self.dim, self.index_tensor(full.device), local.to(full.device, full.dtype))


WHOLE = SliceSpec()


@dataclass(frozen=True)
class Block:
    """One maskable block: its name (e.g. ``"layers.3"``, ``"layers.3.mlp.g1"``) and owned parts."""

    name: str
    """Dotted name of the block, a prefix of (or group inside) the module it removes."""
    tensors: tuple[tuple[str, SliceSpec], ...]
    """(full-model state-dict name, part owned) pairs."""


@dataclass(frozen=True, eq=False)
class BlockMap:
    """The maskable blocks of one model at both levels, and the full model's tensor shapes.

    Mask column ``j`` at a level is ``blocks[level][j]``. Tensors include persistent buffers (BN
    statistics); ``parameter_names`` says which ones are trainable parameters.
    """

    model: str
    """Name of the model config the map describes (for error messages)."""
    shapes: Mapping[str, tuple[int, ...]]
    """Shape of every full-model state-dict tensor, in state-dict order."""
    parameter_names: frozenset[str]
    """The subset of ``shapes`` that are ``nn.Parameter``s."""
    blocks: Mapping[str, tuple[Block, ...]]
    """Level (``"block"`` / ``"neuron"``) -> blocks in mask-column order."""

    def __post_init__(self) -> None:  # read-only views: `block_map` shares one map per config
        object.__setattr__(self, "shapes", MappingProxyType(dict(self.shapes)))
        object.__setattr__(self, "blocks", MappingProxyType({k: tuple(v) for k, v in self.blocks.items()}))

    def num_blocks(self, level: str) -> int:
        """Number of mask columns B at ``level``."""
        check_level(level)
        return len(self.blocks[level])

    def block_names(self, level: str) -> tuple[str, ...]:
        """Names of the blocks at ``level``, in mask-column order."""
        check_level(level)
        return tuple(block.name for block in self.blocks[level])

    def owned(self, level: str, j: int) -> tuple[tuple[str, SliceSpec], ...]:
        """The (tensor name, part) pairs owned by block ``j`` at ``level``."""
        check_level(level)
        blocks = self.blocks[level]
        if not 0 <= j < len(blocks):
            raise ConfigError(f"{self.model} has {len(blocks)} blocks at level {level!r}, got index {j}")
        return blocks[j].tensors

    def shared(self, level: str) -> tuple[str, ...]:
        """Names of the tensors no block at ``level`` owns any part of (held by every worker)."""
        check_level(level)
        owned = {name for block in self.blocks[level] for name, _ in block.tensors}
        return tuple(name for name in self.shapes if name not in owned)


class SubnetModule(Protocol):
    """A model that knows where its tensors sit in the full model (full models and worker models)."""

    def full_index(self) -> dict[str, SliceSpec]:
        """State-dict name -> part of the full-model tensor of the same name that it holds."""
        ...


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, tensor name), stable across processes and Python runs.

    Initialising every full-model tensor from its own generator lets a worker initialise only the
    tensors it holds and still match the full model built from the same seed.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


InitTensor = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


def init_from_seed(module: nn.Module, seed: int, init_tensor: InitTensor) -> None:
    """Fill every state-dict tensor of ``module`` with its part of the seeded full-model tensor.

    ``module`` must provide ``full_index()`` (see `SubnetModule`); ``init_tensor(name, full_shape,
    generator)`` returns the full tensor on CPU. Works on modules created on the meta device and
    moved with ``to_empty``.
    """
    index = module.full_index()  # type: ignore[operator]
    with torch.no_grad():
        for name, local in module.state_dict(keep_vars=True).items():
            spec = index[name]
            full = init_tensor(name, spec.full_shape(local.shape), tensor_generator(seed, name))
            local.copy_(spec.take(full))


class _NoInitOnMeta(TorchFunctionMode):
    """Skips the random in-place initialisers of meta tensors, which have no data to fill. On meta,
    ``normal_`` and ``exponential_`` run a decomposition that imports dynamo (with sympy): seconds of
    every process that builds a model's shapes, for nothing."""

    SKIPPED = frozenset({torch.Tensor.normal_, torch.Tensor.exponential_, nn.init.normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta(device: torch.device | str = "meta") -> Iterator[None]:
    """``with torch.device(device):``, and on the meta device without running random initialisers."""
    with torch.device(device):
        if torch.device(device).type != "meta":
            yield
            return
        with _NoInitOnMeta():
            yield


def state_shapes(module: nn.Module) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """(state-dict name -> shape, parameter names) of ``module`` (typically built on meta)."""
    shapes = {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}
    return shapes, frozenset(name for name, _ in module.named_parameters())


def shared_children(block: nn.Module) -> tuple[str, ...]:
    """Names of the submodules of a residual block that every worker holds, whether it holds the
    block or not (a downsampling ResNet block's projection shortcut); ``()`` for most blocks.

    A block declares them as ``block.shared_children`` and provides
    ``block.forward_skipped(x, **children)``, its output with a zero residual branch.
    """
    return tuple(getattr(block, "shared_children", ()))


def outer_units(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of submodule names outside the residual blocks that FSDP shards as units of their own,
    in forward order (the built-in LLaMA's ``[("tok_embeddings",), ("norm", "output")]``); ``[]``
    leaves them to the root unit.

    A model declares them as ``model.fsdp_units``. A parameter shared with anything outside its group
    (a head tied to the embedding) must stay in one unit: then every group stays in the root.
    """
    units = [tuple(group) for group in getattr(model, "fsdp_units", ())]
    units = [group for group in units if all(_has_submodule(model, name) for name in group)]
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    for group in units:
        prefixes = tuple(f"{name}." for name in group)
        for name, p in model.named_parameters():
            if name.startswith(prefixes) and not all(n.startswith(prefixes) for n in names[id(p)]):
                return []
    return units


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def owned_parameters(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name relative to the block, parameter) of the parameters that only the block's holders
    keep: all of them but its shared children's."""
    skip = tuple(f"{c}." for c in shared_children(block))
    return [(n, p) for n, p in block.named_parameters() if not n.startswith(skip)]


def owned_state(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`owned_parameters`, then the buffers that only the block's holders keep."""
    skip = tuple(f"{c}." for c in shared_children(block))
    return [*owned_parameters(block), *((n, b) for n, b in block.named_buffers() if not n.startswith(skip))]


class PassThrough(nn.Module):
    """What a residual block becomes on a worker that does not hold it.

    The block's residual branch contributes nothing: a block without `shared_children` returns
    its hidden states and holds no parameters; a block with some (a downsampling ResNet block)
    keeps them here, as real submodules under their own names (so state-dict names stay the full
    model's, ``layer2.0.downsample.0.weight``), and returns ``block.forward_skipped``. The rest of
    the block is kept on the meta device (no memory) as ``shape_only``, from which a worker that
    gains the block rebuilds it.

    Accepts the block's call signature (positional or keyword hidden states, any other keyword
    arguments such as Hugging Face's ``attention_mask`` / ``position_embeddings``). The output has
    the block's structure: on the first call the meta copy is run on meta copies of the
    arguments; a tuple output becomes ``(hidden, None, ...)``.
    """

    def __init__(self, block: nn.Module, name: str) -> None:
        super().__init__()
        self.shared_children = shared_children(block)
        for child in self.shared_children:  # taken out first: Module.to("meta") moves tensors in place
            self.add_module(child, block._modules.pop(child))
        object.__setattr__(self, "shape_only", block.to("meta"))  # not a submodule: no state, no .to()
        self.name = name
        self.tuple_length: int | None = None
        self.probed = False

    def forward(self, *args, **kwargs):
        if args:
            hidden = args[0]
        elif "hidden_states" in kwargs:
            hidden = kwargs["hidden_states"]
        elif kwargs:
            hidden = next(iter(kwargs.values()))
        else:
            raise ConfigError(f"the pass-through of dropped block {self.name!r} was called without arguments")
        if self.shared_children:
            return self.shape_only.forward_skipped(hidden, **{c: getattr(self, c) for c in self.shared_children})
        if not self.probed:
            self.tuple_length = self._probe(args, kwargs)
            self.probed = True
        if self.tuple_length is None:
            return hidden
        return (hidden,) + (None,) * (self.tuple_length - 1)

    def _probe(self, args: tuple, kwargs: dict) -> int | None:
        def to_meta(x):
            return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
        try:
            with torch.no_grad():
                out = self.shape_only(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception as exc:
            raise ConfigError(f"cannot tell the output structure of dropped block {self.name!r} "
                              f"({type(self.shape_only).__name__}) from a meta-device run: {exc}") from exc
        if isinstance(out, torch.Tensor):
            return None
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return len(out)
        raise ConfigError(f"dropped block {self.name!r} returns a {type(out).__name__}; a pass-through can stand in "
                          "for blocks returning a tensor or a tuple whose first element is the hidden states")
