"""``torch.compile`` of a model one residual block at a time, as torchtitan compiles each transformer block.

Each block's forward and backward become one compiled graph; the parameters' AccumulateGrad nodes stay
outside it, so their post-accumulate-grad hooks (the sync engine's, DDP's) still fire as each block's
backward ends, and the holder-set collectives overlap the backward of the blocks before it. Compiling
the whole model would give one backward graph whose gradients all arrive at its end: no overlap.
``Module.compile`` compiles in place, so state-dict names (``layers.0.attention.wq.weight``) stay.
What compiles and what is refused: docs/api.md ("torch.compile"). Not here: choosing the blocks
(`sdp_train.parallel.discovery`), and anything outside the blocks (embedding, head, loss run eagerly).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from sdp_train.errors import ConfigError


def compile_backend(compile: bool | str) -> str | None:
    """The ``torch.compile`` backend an option names: None for False, ``"inductor"`` for True, else the name."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile:
        import torch._dynamo

        if compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise ConfigError(f"compile={compile!r} is not a torch.compile backend; known: "
                              f"{sorted(torch._dynamo.list_backends(exclude_tags=()))}")
        return compile
    raise ConfigError(f"compile must be True, False or a torch.compile backend name, got {compile!r}")


def compile_blocks(model: nn.Module, blocks: Sequence[str], *, backend: str = "inductor",
                   fullgraph: bool = False) -> None:
    """Compile each named block of ``model`` in place (``block.compile``), with static shapes.

    Blocks of one class share their compiled graphs (a block of another shape, as N-SDP's sliced
    MLPs, compiles its own). Call it after the model is cut to this worker's part and before its
    gradient hooks matter; `SubnetworkDataParallel` does so with ``compile=True``.

    Parameters
    ----------
    model : nn.Module
        The model or a worker's subnetwork.
    blocks : sequence of str
        Names of its residual blocks (``model.get_submodule(name)``).
    backend : str
        The ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces without generating code).
    fullgraph : bool
        Raise on a graph break inside a block instead of running its pieces.
    """
    modules = [(name, model.get_submodule(name)) for name in blocks]
    for name, block in modules:
        if "forward" in vars(block):  # as activation checkpointing (`apply_checkpointing`) replaces it
            raise ConfigError(f"block {name!r}: its forward was replaced on the instance (activation checkpointing "
                              "does so, and torch.compile captures nothing under the checkpoint's context); "
                              "compile the block before wrapping its forward, or without activation checkpointing")
    for _, block in modules:
        block.compile(backend=backend, dynamic=False, fullgraph=fullgraph)
