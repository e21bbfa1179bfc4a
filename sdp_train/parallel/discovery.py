"""Finding the maskable blocks of any ``nn.Module``: residual blocks by name or pattern, and their MLPs.

`find_blocks` turns what a user says (nothing, a pattern such as ``"model.layers.*"``, a list of
names or of submodules) into the dotted names of the model's residual blocks, in forward order.
Without a declaration it looks at the block lists the model has: every ``ModuleList`` of
same-class modules, with the lists of one place in repeated parents taken together (Swin's
``swin.encoder.layers.*.blocks``). A block a worker drops returns its input, so discovery checks
what it picks: it runs the model once on an example input (given, or built from a Hugging Face
config; on the meta device for a meta model) and keeps only the lists whose every module returns a
tensor of its input's shape (a stage that ends in a width-changing downsample does not), then the
outermost of them. Among those it prefers the layouts people use (Hugging Face LLaMA-style
``model.layers``, GPT-2 ``transformer.h``, ViT ``vit.layers``, ``*.encoder.layer``), else the
one holding most parameters. `find_mlp` locates, inside one block, the MLP's input projections
(whose output neurons are N-SDP's neurons) and output projection. Both raise `ConfigError` naming
what was looked for and what the model has.

This module only names modules; removing or slicing them is `sdp_train.parallel.masking`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
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


def find_blocks(model: nn.Module, blocks: str | Sequence[str | nn.Module] | None = None, *,
                example: Any = None) -> list[str]:
    """Dotted names of the model's maskable residual blocks, in registration (forward) order.

    Parameters
    ----------
    model : nn.Module
    blocks : str, sequence of str or nn.Module, optional
        A pattern whose ``*`` matches one dotted component (``"model.layers.*"``), a list of module
        names or of the submodules themselves. None: automatic discovery (module docstring).
    example : tensor, tuple or dict, optional
        An input of ``model`` (one tensor, positional arguments or keyword arguments) on the model's
        device, for discovery to check which lists are residual. None: built from a Hugging Face
        model's config (``input_ids`` or ``pixel_values``); for other models discovery then goes
        unchecked.

    Raises
    ------
    ConfigError
        Nothing matches, a name is not a submodule, blocks nest, discovery finds no residual list
        (naming each list and why), or several qualify equally (naming them).
    """
    modules = dict(model.named_modules())
    if blocks is None:
        names = _discover(model, modules, _hf_example(model) if example is None else example)
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


def _block_lists(modules: dict[str, nn.Module]) -> dict[str, list[str]]:
    """Block lists, in registration order: list path -> its modules' names. The ModuleLists of one
    place in repeated parents (``stages.0.blocks``, ``stages.1.blocks``) form one list, under the path
    with the parents' indices as ``*`` (``stages.*.blocks``); its modules must be of one class, at
    least 2 in all."""
    grouped: dict[str, list[str]] = {}
    for name, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module):
            grouped.setdefault(re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name), []).extend(
                f"{name}.{i}" for i in range(len(module)))
    return {path: names for path, names in grouped.items()
            if len(names) >= 2 and len({type(modules[n]) for n in names}) == 1}


def _discover(model: nn.Module, modules: dict[str, nn.Module], example: Any) -> list[str]:
    lists = _block_lists(modules)
    if not lists:
        raise ConfigError(f"found no maskable blocks in {type(model).__name__}: it has no ModuleList of "
                          "same-class modules; pass blocks= (a pattern such as 'layers.*' or a list of submodules)")
    not_residual = _not_residual(model, lists, modules, example)
    if not_residual is not None:
        refused = {path: not_residual[path] for path in lists if not_residual[path] is not None}
        lists = {path: names for path, names in lists.items() if path not in refused}
        if not lists:
            reasons = "; ".join(f"{path}.* {why}" for path, why in refused.items())
            raise ConfigError(f"found no residual block list in {type(model).__name__}: a block a worker drops "
                              f"returns its input, and {reasons}; pass blocks= (a pattern or a list of submodules)")
        # a list inside another one's modules (layers inside residual stages) is not what a worker drops whole
        lists = {path: names for path, names in lists.items()
                 if not any(n.startswith(f"{o}.") for other in lists.values() if other is not names
                            for o in other for n in names[:1])}
    for path in KNOWN_BLOCK_LISTS:
        if path in lists:
            return lists[path]
    size = {path: sum(p.numel() for n in names for p in modules[n].parameters()) for path, names in lists.items()}
    best = max(size.values())
    top = [path for path in lists if size[path] == best]
    if len(top) > 1:
        raise ConfigError(f"{type(model).__name__} has several equally large block lists {top}; "
                          "pass blocks= to say which one SDP masks")
    return lists[top[0]]


@torch.no_grad()
def _not_residual(model: nn.Module, lists: dict[str, list[str]], modules: dict[str, nn.Module],
                  example: Any) -> dict[str, str | None] | None:
    """Per list, why its modules are not residual blocks (None: they are), from one forward pass on
    `example` that records each module's input and output; None when there is no example or the
    model does not run on it (then nothing is checked)."""
    if example is None:
        return None
    seen: dict[str, tuple[Any, Any]] = {}

    def record(name: str):
        def hook(_module, args, kwargs, output) -> None:
            seen.setdefault(name, (_hidden(args, kwargs), output))
        return hook

    names = {n for block_names in lists.values() for n in block_names}
    handles = [modules[n].register_forward_hook(record(n), with_kwargs=True) for n in names]
    training = model.training
    try:
        model.eval()
        if isinstance(example, dict):
            model(**example)
        else:
            model(*(example if isinstance(example, tuple) else (example,)))
    except Exception:  # a model the example does not fit, or one that cannot run on the meta device
        return None
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return {path: _why_not_residual(block_names, seen) for path, block_names in lists.items()}


def _why_not_residual(names: list[str], seen: dict[str, tuple[Any, Any]]) -> str | None:
    if not any(n in seen for n in names):
        return "is not run by the model's forward"
    for name in (n for n in names if n in seen):
        hidden, output = seen[name]
        if isinstance(output, (tuple, list)) and output:
            output = output[0]
        if not isinstance(hidden, torch.Tensor):
            return f"cannot be skipped: {name} takes no tensor first"
        if not isinstance(output, torch.Tensor):
            return f"cannot be skipped: {name} returns a {type(output).__name__}, not a tensor or a tuple of one"
        if output.shape != hidden.shape:
            return f"changes the shape: {name} maps {tuple(hidden.shape)} to {tuple(output.shape)}"
    return None


def _hidden(args: tuple, kwargs: dict) -> Any:
    """A block's hidden states, as a pass-through takes them: the first positional argument, else
    ``hidden_states``, else the first keyword argument."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    return next(iter(kwargs.values()), None)


def _hf_example(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """An input of a Hugging Face model built from its config (token ids or an image of the configured
    size), on its parameters' device; None for other models."""
    config, key = getattr(model, "config", None), getattr(model, "main_input_name", None)
    param = next(model.parameters(), None)
    if config is None or param is None:
        return None
    if key == "input_ids":
        return {key: torch.zeros(1, 4, dtype=torch.long, device=param.device)}
    size = getattr(config, "image_size", None)
    if key == "pixel_values" and size is not None:
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return {key: torch.zeros(1, getattr(config, "num_channels", 3), height, width, dtype=param.dtype,
                                 device=param.device)}
    return None


def _candidates(modules: dict[str, nn.Module]) -> str:
    lists = _block_lists(modules)
    if not lists:
        return "it has no ModuleList of same-class modules"
    shown = ", ".join(f"{path}.* ({len(names)} x {type(modules[names[0]]).__name__})"
                      for path, names in list(lists.items())[:5])
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
                      "pass mlp=MLPSpec(inputs=..., output=...) (sdp train: --mlp IN[,IN...]:OUT)")


def is_projection(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and Hugging Face's ``Conv1D`` (a Linear with a transposed weight)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: weight of shape (in, out), attribute ``nf`` = out features."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")
