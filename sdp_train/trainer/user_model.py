"""A model the user brings to ``sdp train``: ``--model path/to/file.py:factory``.

The factory is a function defined in that file (imported by path, like a script; its directory
joins ``sys.path`` so it can import its neighbours) that returns an ``nn.Module``. The run's
``model_overrides`` become its keyword arguments. Such a model trains through the library API,
`sdp_train.SubnetworkDataParallel` (docs/api.md), with ``--blocks`` naming its maskable blocks
when discovery cannot; the baselines wrap it in torch DDP or shard it with FSDP2.

What the model must accept and return depends on the data (docs/api.md, "sdp train with your
own model"): with text data (``--data stdlib`` or ``bin:DIR``) it takes token ids ``(batch,
seq_len)`` and returns next-token logits ``(batch, seq_len, vocab)``; with images (``digits``,
``cifar:DIR``) it takes ``(batch, channels, side, side)`` and returns class logits ``(batch,
classes)``. A Hugging Face output (``.logits``), a dict with ``"logits"`` or a tuple whose first
element is the logits are accepted too. ``--data auto`` picks text for a model that has an
``nn.Embedding``, images otherwise.

>>> is_user_model("examples/my_model.py:build"), is_user_model("llama-debug")
(True, False)
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.parallel.discovery import MLPSpec
from sdp_train.parallel.blockmap import on_meta

NEURON_GROUPS = 4
"""Neuron groups per MLP of a user model at N-SDP (the library API's default)."""


def is_user_model(name: str) -> bool:
    """True for ``FILE.py:FACTORY`` (or a bare ``FILE.py``, refused later with the fix)."""
    return name.rpartition(":")[0].endswith(".py") or name.endswith(".py")


@dataclass(frozen=True)
class UserModel:
    """A user's model as a run records it: where it comes from and what its tensors are.

    `tensors` (every state-dict entry's shape and dtype, as text) is what a checkpoint and the
    run resuming from it must agree on; editing the file without changing the model's tensors
    keeps its checkpoints usable.
    """

    name: str
    """``FILE.py:FACTORY`` as given."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory."""
    data: str = "images"
    """``"text"`` (the model has an ``nn.Embedding``) or ``"images"``: what ``--data auto`` gives it."""
    vocab_size: int | None = None
    """Rows of its first ``nn.Embedding`` (text models): the token ids it accepts."""
    tensors: Mapping[str, str] = field(default_factory=dict)

    def build(self, device: torch.device | str | None = None) -> nn.Module:
        """A new instance of the model, its tensors on ``device`` (the factory's choice when None)."""
        return build_user_model(self.name, self.overrides, device)


def describe_user_model(name: str, overrides: Mapping[str, Any], model: nn.Module) -> UserModel:
    """The `UserModel` of ``model``, an instance (on the meta device) of ``build_user_model(name, overrides)``."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    tensors = {n: f"{tuple(t.shape)} {t.dtype}" for n, t in model.state_dict(keep_vars=True).items()}
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"--model {name!r}: the model has no parameters to train")
    return UserModel(name=name, overrides=dict(overrides), data="text" if embeddings else "images",
                     vocab_size=embeddings[0].num_embeddings if embeddings else None, tensors=tensors)


def build_user_model(name: str, overrides: Mapping[str, Any], device: torch.device | str | None = None) -> nn.Module:
    """Call the factory of ``FILE.py:FACTORY`` with ``overrides`` under ``torch.device(device)``.

    Raises
    ------
    ConfigError
        The file or the factory is missing, importing the file or calling the factory fails, or
        the factory does not return an ``nn.Module``; the message names which, and where.
    """
    factory = load_factory(name)
    call = f"{name.rpartition(':')[2]}(**{dict(overrides)!r})" if overrides else f"{name.rpartition(':')[2]}()"
    try:
        if device is None:
            model = factory(**overrides)
        else:
            with on_meta(device):  # torch.device(device), skipping random initialisers on meta
                model = factory(**overrides)
    except Exception as exc:  # the user's code: report what failed where, not a traceback per rank
        raise ConfigError(f"--model {name!r}: {call} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name!r}: {call} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_factory(name: str) -> Callable[..., Any]:
    """The function ``FACTORY`` of ``FILE.py:FACTORY``, the file imported once per process."""
    path_text, sep, attr = name.rpartition(":")
    if not sep or not path_text.endswith(".py"):
        raise ConfigError(f"--model {name!r}: name the function that builds the model, as FILE.py:FACTORY "
                          f"(e.g. {name.rpartition(':')[0] or name}:build_model)")
    if not attr.isidentifier():
        raise ConfigError(f"--model {name!r}: {attr!r} is not a Python function name")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"--model {name!r}: {path_text} is not a file")
    module = _import_file(path, name)
    factory = getattr(module, attr, None)
    if factory is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"--model {name!r}: {path_text} defines no {attr!r}; its functions and classes: "
                          f"{', '.join(defined) or 'none'}")
    if not callable(factory):
        raise ConfigError(f"--model {name!r}: {attr} in {path_text} is a {type(factory).__name__}, not a function")
    return factory


def _import_file(path: Path, name: str):
    module_name = "sdp_user_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--model {name!r}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # as `python FILE.py` would: its neighbours import
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a file that fails, or exits, at import
        del sys.modules[module_name]
        raise ConfigError(f"--model {name!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, ``.logits`` (Hugging Face), ``["logits"]`` or ``[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}; sdp train needs logits: a tensor, an "
                    "object with .logits, a dict with 'logits' or a tuple whose first element is the logits")


def user_blocks(cfg) -> str | list[str] | None:
    """``--blocks`` (`TrainConfig.blocks`) as `find_blocks` takes it: a pattern, or the names of a
    comma-separated list."""
    if cfg.blocks is None or "," not in cfg.blocks:
        return cfg.blocks
    return [name.strip() for name in cfg.blocks.split(",") if name.strip()]


def parse_mlp(text: str) -> MLPSpec:
    """``--mlp IN[,IN...]:OUT`` (`TrainConfig.mlp`) as an `MLPSpec`, names relative to each block.

    >>> parse_mlp("mlp.w1, mlp.w3:mlp.w2")
    MLPSpec(inputs=('mlp.w1', 'mlp.w3'), output='mlp.w2')
    """
    inputs, colon, output = text.partition(":")
    names = tuple(n.strip() for n in inputs.split(","))
    if not colon or not output.strip() or not all(names) or ":" in output:
        raise ConfigError(f"mlp={text!r} (--mlp): expected the projections into the hidden layer, then the one "
                          "out of it, relative to each block: IN[,IN...]:OUT, e.g. 'mlp.w1,mlp.w3:mlp.w2'")
    return MLPSpec(names, output.strip())


def user_mlp(cfg) -> MLPSpec | None:
    """``--mlp`` (`TrainConfig.mlp`) as `SubnetworkDataParallel` takes it; None: found."""
    return None if cfg.mlp is None else parse_mlp(cfg.mlp)
