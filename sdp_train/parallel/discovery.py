"""Finding the maskable blocks of any ``nn.Module``: residual blocks by name or pattern, and their MLPs.

`find_blocks` turns what a user says (nothing, a pattern such as ``"model.layers.*"``, a list of
names or of submodules) into the dotted names of the model's residual blocks, in forward order.
Without a declaration it looks at the layouts people use: Hugging Face LLaMA-style
(``model.layers``), GPT-2 (``transformer.h``), ViT (``vit.layers``, ``*.encoder.layer``), then any
``ModuleList`` of same-class modules (the one holding most parameters). `find_mlp` locates, inside
one block, the MLP's input projections (whose output neurons are N-SDP's neurons) and output
projection. Both raise `ConfigError` naming what was looked for and what the model has.

This module only names modules; removing or slicing them is `sdp_train.parallel.masking`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from sdp_train.errors import ConfigError

KNOWN_BLOCK_LISTS: tuple[str, ...] = ("model.layers", "transformer.h", "vit.layers", "vit.encoder.layer",
                                      "encoder.layer", "model.decoder.layers", "layers", "blocks", "h")
"""Container paths tried first by automatic discovery, in this order."""


@dataclass(frozen=True)
class MLPSpec:
    """Where a block's MLP is, relative to the block: N-SDP slices its hidden neurons.

    The hidden neurons are the outputs of every module in ``inputs`` (``nn.Linear`` rows, or the
    columns of a Hugging Face ``Conv1D``) and the inputs of ``output``.
    """

    inputs: tuple[str, ...]
    """Names, relative to the block, of the projections into the hidden layer (``("mlp.gate_proj", "mlp.up_proj")``)."""
    output: str
    """Name (relative to the block) of the projection out of the hidden layer, e.g. ``"mlp.down_proj"``."""

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            object.__setattr__(self, "inputs", (self.inputs,))
        if not self.inputs or not all(isinstance(n, str) and n for n in self.inputs):
            raise ConfigError(f"MLPSpec.inputs must be one or more module names, got {self.inputs!r}")
        if not isinstance(self.output, str) or not self.output:
            raise ConfigError(f"MLPSpec.output must be a module name, got {self.output!r}")


KNOWN_MLPS: tuple[MLPSpec, ...] = (
    MLPSpec(("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),  # LLaMA, Mistral, Qwen
    MLPSpec(("mlp.c_fc",), "mlp.c_proj"),  # GPT-2
    MLPSpec(("intermediate.dense",), "output.dense"),  # ViT, BERT
    MLPSpec(("mlp.fc1",), "mlp.fc2"),  # timm ViT, CLIP
    MLPSpec(("mlp.up",), "mlp.down"),
    MLPSpec(("mlp.0",), "mlp.2"),  # nn.Sequential(Linear, activation, Linear)
    MLPSpec(("ffn.0",), "ffn.2"),
)
"""MLP layouts tried, in this order, when no `MLPSpec` is given."""


def find_blocks(model: nn.Module, blocks: str | Sequence[str | nn.Module] | None = None) -> list[str]:
    """Dotted names of the model's maskable residual blocks, in registration (forward) order.

    Parameters
    ----------
    model : nn.Module
    blocks : str, sequence of str or nn.Module, optional
        A pattern whose ``*`` matches one dotted component (``"model.layers.*"``), a list of module
        names or of the submodules themselves. None: automatic discovery (module docstring).

    Raises
    ------
    ConfigError
        Nothing matches, a name is not a submodule, blocks nest, or discovery is ambiguous.
    """
    modules = dict(model.named_modules())
    if blocks is None:
        names = _discover(model, modules)
    elif isinstance(blocks, str):
        names = [n for n in modules if n and _matches(blocks, n)]
        if not names:
            raise ConfigError(f"blocks={blocks!r} matches no submodule of {type(model).__name__}; "
                              f"{_candidates(modules)}")
    else:
        names = [_name_of(b, modules, model) for b in blocks]
    order = {n: i for i, n in enumerate(modules)}
    names = sorted(dict.fromkeys(names), key=order.__getitem__)
    if len(names) < 2:
        raise ConfigError(f"SDP needs at least 2 maskable blocks; {blocks!r} gives {names} in {type(model).__name__}")
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "."):
            raise ConfigError(f"block {b!r} lies inside block {a!r}: blocks must not nest")
    return names


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def _name_of(block: str | nn.Module, modules: dict[str, nn.Module], model: nn.Module) -> str:
    if isinstance(block, str):
        if block not in modules or not block:
            raise ConfigError(f"blocks: {block!r} is not a submodule of {type(model).__name__}; "
                              f"{_candidates(modules)}")
        return block
    if isinstance(block, nn.Module):
        for name, module in modules.items():
            if module is block and name:
                return name
        raise ConfigError(f"blocks: a {type(block).__name__} that is not a submodule of {type(model).__name__}")
    raise ConfigError(f"blocks must be a pattern, names or submodules, got an element {block!r}")


def _block_lists(modules: dict[str, nn.Module]) -> list[tuple[str, nn.ModuleList]]:
    """Every ModuleList of at least 2 modules of one class, in registration order."""
    return [(n, m) for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) >= 2
            and len({type(c) for c in m}) == 1]


def _discover(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    lists = dict(_block_lists(modules))
    for path in KNOWN_BLOCK_LISTS:
        if path in lists:
            return [f"{path}.{i}" for i in range(len(lists[path]))]
    if not lists:
        raise ConfigError(f"found no maskable blocks in {type(model).__name__}: it has no ModuleList of "
                          "same-class modules; pass blocks= (a pattern such as 'layers.*' or a list of submodules)")
    size = {n: sum(p.numel() for p in m.parameters()) for n, m in lists.items()}
    best = max(size.values())
    top = [n for n in lists if size[n] == best]
    if len(top) > 1:
        raise ConfigError(f"{type(model).__name__} has several equally large block lists {top}; "
                          "pass blocks= to say which one SDP masks")
    return [f"{top[0]}.{i}" for i in range(len(lists[top[0]]))]


def _candidates(modules: dict[str, nn.Module]) -> str:
    lists = _block_lists(modules)
    if not lists:
        return "it has no ModuleList of same-class modules"
    shown = ", ".join(f"{n}.* ({len(m)} x {type(m[0]).__name__})" for n, m in lists[:5])
    return f"its block lists are: {shown}"


def find_mlp(block: nn.Module, block_name: str, mlp: MLPSpec | None = None) -> MLPSpec:
    """The `MLPSpec` of one block: ``mlp`` checked against the block, or the first `KNOWN_MLPS` that fits.

    Raises
    ------
    ConfigError
        A named projection is missing or is not a Linear/Conv1D, or no known layout fits.
    """
    modules = dict(block.named_modules())
    if mlp is not None:
        for name in (*mlp.inputs, mlp.output):
            if name not in modules:
                raise ConfigError(f"block {block_name!r} has no submodule {name!r} (from the MLPSpec); it has "
                                  f"{[n for n, m in modules.items() if is_projection(m)][:12]}")
            if not is_projection(modules[name]):
                raise ConfigError(f"{block_name}.{name} is a {type(modules[name]).__name__}; N-SDP slices "
                                  "nn.Linear or Hugging Face Conv1D projections")
        return mlp
    for spec in KNOWN_MLPS:
        if all(n in modules and is_projection(modules[n]) for n in (*spec.inputs, spec.output)):
            return spec
    raise ConfigError(f"found no MLP in block {block_name!r} ({type(block).__name__}); tried "
                      f"{[(s.inputs, s.output) for s in KNOWN_MLPS]}; its projections are "
                      f"{[n for n, m in modules.items() if is_projection(m)][:12]}; "
                      "pass mlp=MLPSpec(inputs=..., output=...)")


def is_projection(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and Hugging Face's ``Conv1D`` (a Linear with a transposed weight)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: weight of shape (in, out), attribute ``nf`` = out features."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")
