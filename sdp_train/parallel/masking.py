"""Turning any model into one worker's subnetwork: which tensors a mask row holds, and the cuts.

`ModelLayout` records, once, the full model's tensors (names, shapes, dtypes), its blocks and,
at neuron level, which rows/columns of which tensors are each block's hidden neurons. From it,
``layout.held(row)`` says what a worker holds (full-model name -> `SliceSpec`) for every rank
without touching a module, which is what the sync plan and the full-model assembly need.

The cuts change the model in place: `drop_blocks` replaces each non-held block by a `PassThrough`
(`sdp_train.parallel.blockmap`; the block's parameters are moved to the meta device, so nothing is
allocated for them, except its shared children, such as a downsampling block's shortcut, which
every worker holds), `slice_neurons` cuts each MLP to the held hidden neurons, `freeze_blocks` is
backward masking. `Cut` decodes the ``masking`` and ``level`` options once into what differs
between them: which cut, which blocks run backward, what a mask change moves.
State-dict names stay the full model's. Not here: gradients (the sync engine) and the public
wrapper (`sdp_train.parallel.wrapper`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import WHOLE, PassThrough, SliceSpec, shared_children
from sdp_train.parallel.discovery import MLPSpec, find_mlp, is_conv1d

NeuronTensor = tuple[str, int]  # (full-model tensor name, dimension of the hidden neurons)


@dataclass(frozen=True, eq=False)
class ModelLayout:
    """The full model as SDP sees it: tensors, blocks, mask columns (identical on every rank)."""

    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    """Every full-model state-dict tensor -> (shape, dtype), in state-dict order."""
    parameter_names: tuple[str, ...]
    """Trainable parameters in registration order (tied parameters once)."""
    blocks: tuple[str, ...]
    """Residual blocks (dotted module names) in forward order."""
    level: str
    """``"block"`` (a mask column per block) or ``"neuron"`` (per block and neuron group)."""
    neuron_groups: int = 1
    """Neuron groups per block at level ``"neuron"``."""
    mlps: Mapping[str, MLPSpec] | None = None
    """Block -> its MLP (level ``"neuron"``)."""
    neuron_tensors: Mapping[str, tuple[NeuronTensor, ...]] | None = None
    """Block -> tensors sliced along their hidden-neuron dimension (level ``"neuron"``)."""
    hidden: Mapping[str, int] | None = None
    """Block -> number of hidden neurons of its MLP (level ``"neuron"``)."""
    shared_inside: tuple[str, ...] = ()
    """Submodules inside blocks that every worker holds (`shared_children`, e.g. ``layer2.0.downsample``):
    their tensors belong to no block."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Tied tensors: every later state-dict name of a tensor -> its first name (``lm_head.weight`` ->
    ``transformer.wte.weight``). A tied tensor is held, averaged and counted once, under its first name;
    the full model carries it under every name."""

    @property
    def buffer_names(self) -> list[str]:
        """The floating-point buffers (BatchNorm statistics): averaged among holders, not trained."""
        params = set(self.parameter_names)
        return [n for n, (_, dtype) in self.tensors.items()
                if dtype.is_floating_point and n not in params and n not in self.aliases]

    @property
    def columns(self) -> tuple[str, ...]:
        """Mask column names: the blocks, or ``"<block>.g<i>"`` per neuron group."""
        if self.level == "block":
            return self.blocks
        return tuple(f"{b}.g{g}" for b in self.blocks for g in range(self.neuron_groups))

    def block_tensors(self, block: str) -> list[str]:
        """The tensors `block` owns: those under its name but its shared children's."""
        shared = tuple(f"{s}." for s in self.shared_inside if s.startswith(block + "."))
        return [n for n in self.tensors if n.startswith(block + ".") and not n.startswith(shared)]

    def owning_block(self, name: str) -> str | None:
        """The block that owns tensor `name`, None for a shared tensor."""
        if name.startswith(tuple(f"{s}." for s in self.shared_inside)):
            return None
        return next((b for b in self.blocks if name.startswith(b + ".")), None)

    def group_index(self, block: str, groups: Sequence[int]) -> tuple[int, ...]:
        """Hidden-neuron positions of ``groups`` of ``block`` (contiguous groups, as even as possible)."""
        parts = np.array_split(np.arange(self.hidden[block]), self.neuron_groups)
        return tuple(int(i) for g in sorted(groups) for i in parts[g])

    def held(self, row: np.ndarray) -> dict[str, SliceSpec]:
        """Full-model tensor name -> the part a worker with mask ``row`` holds."""
        row = np.asarray(row).astype(bool)
        if self.level == "block":
            dropped = {n for b, keep in zip(self.blocks, row) if not keep for n in self.block_tensors(b)}
            return {n: WHOLE for n in self.tensors if n not in dropped}
        held = {n: WHOLE for n in self.tensors}
        for j, (block, groups) in enumerate(zip(self.blocks, row.reshape(len(self.blocks), self.neuron_groups))):
            kept = [int(g) for g in np.flatnonzero(groups)]
            if not kept:
                raise ConfigError(f"mask row holds no neuron group of block {j} ({block!r}); at level 'neuron' "
                                  "every worker keeps at least one group of every block")
            if len(kept) < self.neuron_groups:
                index = self.group_index(block, kept)
                for name, dim in self.neuron_tensors[block]:
                    held[name] = SliceSpec(dim, index, self.hidden[block])
        return held


def describe(model: nn.Module, blocks: Sequence[str], level: str, *, neuron_groups: int = 1,
             mlp: MLPSpec | None = None) -> ModelLayout:
    """The `ModelLayout` of the full ``model`` (which may live on the meta device)."""
    state = model.state_dict(keep_vars=True)
    tensors = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    params = tuple(n for n, _ in model.named_parameters())
    shared = shared_inside(model, blocks)
    aliases = tied_names(state)
    if level == "block":
        skip = tuple(f"{s}." for s in shared)
        for b in blocks:
            if not any(n.startswith(b + ".") and not n.startswith(skip) for n in params):
                raise ConfigError(f"block {b!r} has no parameters; a maskable block must own some")
        return _checked_ties(ModelLayout(tensors, params, tuple(blocks), level, shared_inside=shared, aliases=aliases))
    if isinstance(neuron_groups, bool) or not isinstance(neuron_groups, int) or neuron_groups < 1:
        raise ConfigError(f"neuron_groups must be a positive int, got {neuron_groups!r}")
    modules = dict(model.named_modules())
    mlps, sliced, hidden = {}, {}, {}
    for b in blocks:
        spec = find_mlp(modules[b], b, mlp)
        mlps[b], sliced[b], hidden[b] = spec, *_neuron_tensors(modules[b], b, spec)
        if hidden[b] < neuron_groups:
            raise ConfigError(f"block {b!r}: its MLP has {hidden[b]} hidden neurons, fewer than "
                              f"neuron_groups={neuron_groups}")
    return _checked_ties(ModelLayout(tensors, params, tuple(blocks), level, neuron_groups, mlps, sliced, hidden,
                                     shared, aliases))


def tied_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Alias -> first name, for every tensor of ``state`` (a ``state_dict(keep_vars=True)``) that appears
    under several names: tied weights, such as a language model's embedding and output layer."""
    first: dict[int, str] = {}
    return {n: first[id(t)] for n, t in state.items() if first.setdefault(id(t), n) != n}


def _checked_ties(layout: ModelLayout) -> ModelLayout:
    """Refuse a tie the masks cannot keep: a worker holds or drops a block whole (so a tie must stay in
    one block or among the shared tensors), and N-SDP slices an MLP's tensors by neuron."""
    sliced = {n for tensors in (layout.neuron_tensors or {}).values() for n, _ in tensors}
    for alias, name in layout.aliases.items():
        where = [layout.owning_block(n) for n in (name, alias)]
        if where[0] != where[1]:
            said = [f"block {b!r}" if b is not None else "the shared tensors" for b in where]
            raise ConfigError(f"tensors {name!r} and {alias!r} are one tied tensor in {said[0]} and {said[1]}: a "
                              "worker holds or drops each block whole, so a tie must stay inside one block or "
                              "among the shared tensors; untie them, or name blocks= that keep both on one side")
        if name in sliced or alias in sliced:
            raise ConfigError(f"tensors {name!r} and {alias!r} are one tied tensor, and N-SDP slices it by hidden "
                              "neuron (an MLP projection): untie them, or train at level 'block'")
    return layout


def shared_inside(model: nn.Module, blocks: Sequence[str]) -> tuple[str, ...]:
    """Full names of the `shared_children` of ``model``'s ``blocks`` (the blocks or their `PassThrough`s)."""
    return tuple(f"{b}.{c}" for b in blocks for c in shared_children(model.get_submodule(b)))


def _neuron_tensors(block: nn.Module, name: str, spec: MLPSpec) -> tuple[tuple[NeuronTensor, ...], int]:
    modules = dict(block.named_modules())
    found: list[NeuronTensor] = []
    widths = {}
    for rel in spec.inputs:
        m = modules[rel]
        dim = 1 if is_conv1d(m) else 0
        widths[rel] = m.weight.shape[dim]
        found.append((f"{name}.{rel}.weight", dim))
        if m.bias is not None:
            found.append((f"{name}.{rel}.bias", 0))
    out = modules[spec.output]
    dim = 0 if is_conv1d(out) else 1
    widths[spec.output] = out.weight.shape[dim]
    found.append((f"{name}.{spec.output}.weight", dim))
    if len(set(widths.values())) != 1:
        raise ConfigError(f"block {name!r}: the MLP's projections disagree on the hidden width: {widths}")
    return tuple(found), widths[spec.output]


def drop_blocks(model: nn.Module, blocks: Sequence[str], row: np.ndarray) -> list[str]:
    """Replace every block whose ``row`` entry is 0 by a `PassThrough`; returns the dropped names."""
    dropped = [b for b, keep in zip(blocks, np.asarray(row).astype(bool)) if not keep]
    for name in dropped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, PassThrough(getattr(parent, child), name))
    return dropped


def slice_neurons(model: nn.Module, layout: ModelLayout, row: np.ndarray) -> None:
    """Cut every block's MLP to the hidden neurons of the groups ``row`` holds (in place)."""
    held = layout.held(row)
    for block in layout.blocks:
        spec = layout.mlps[block]
        for rel in (*spec.inputs, spec.output):
            module = model.get_submodule(f"{block}.{rel}")
            for pname, dim in ((n.rpartition(".")[2], d) for n, d in layout.neuron_tensors[block]
                               if n.startswith(f"{block}.{rel}.")):
                part = held[f"{block}.{rel}.{pname}"]
                if not part.is_whole:
                    _replace_parameter(module, pname, part.take(getattr(module, pname).detach()))
            fix_features(module, rel in spec.inputs)


def _replace_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.clone(), requires_grad=old.requires_grad))


def fix_features(module: nn.Module, is_input: bool) -> None:
    """Set a cut projection's feature count from its weight (an input projection's outputs are the
    hidden neurons, the output projection's inputs)."""
    if is_conv1d(module):
        if is_input:
            module.nf = module.weight.shape[1]
    elif is_input:
        module.out_features = module.weight.shape[0]
    else:
        module.in_features = module.weight.shape[1]


def freeze_blocks(model: nn.Module, layout: ModelLayout, row: np.ndarray) -> None:
    """Backward masking: the parameters of non-held blocks stop requiring gradients."""
    held = layout.held(row)
    for name, param in model.named_parameters():
        if name not in held:
            param.requires_grad_(False)


MASKINGS = ("forward", "backward")


@dataclass(frozen=True)
class Cut:
    """How a worker's part is cut from the model: the only reading of ``masking`` and ``level``.

    Forward masking removes what a worker does not hold: whole blocks (level ``"block"``, B-SDP) or
    hidden neurons (level ``"neuron"``, N-SDP). Backward masking (Bb-SDP, block level) keeps the
    whole model on every worker and freezes the blocks it does not hold.
    """

    masking: str
    level: str

    def __post_init__(self) -> None:
        if self.level not in ("block", "neuron"):
            raise ConfigError(f"level must be 'block' or 'neuron', got {self.level!r}")
        if self.masking not in MASKINGS:
            raise ConfigError(f"masking must be one of {MASKINGS}, got {self.masking!r}")
        if self.keeps_whole_model and self.level != "block":
            raise ConfigError(f"backward masking works at level 'block' only, got level={self.level!r}")

    @property
    def keeps_whole_model(self) -> bool:
        """Backward masking: every worker keeps every block (and runs its backward)."""
        return self.masking == "backward"

    @property
    def moves_blocks(self) -> bool:
        """Forward masking at block level: a worker's blocks come and go with the mask."""
        return not self.keeps_whole_model and self.level == "block"

    @property
    def slices_neurons(self) -> bool:
        """Forward masking at neuron level: a worker's slices are re-cut when the mask changes."""
        return not self.keeps_whole_model and self.level == "neuron"

    def held_blocks(self, blocks: Sequence[str], row: np.ndarray) -> tuple[str, ...]:
        """The blocks a worker with mask row `row` holds (at neuron level, a slice of every block)."""
        return tuple(b for j, b in enumerate(blocks) if self.level == "neuron" or row[j])

    def running_blocks(self, blocks: Sequence[str], held: Sequence[str]) -> tuple[str, ...]:
        """The blocks whose forward and backward run on a worker that holds `held`."""
        return tuple(blocks if self.keeps_whole_model else held)

    def apply(self, model: nn.Module, layout: ModelLayout, row: np.ndarray) -> dict[str, SliceSpec]:
        """Cut `model` in place to row `row`'s part; returns each kept tensor's slice of the full one."""
        if self.keeps_whole_model:
            freeze_blocks(model, layout, row)
            return {n: WHOLE for n in layout.tensors}
        if self.level == "block":
            drop_blocks(model, layout.blocks, row)
        else:
            slice_neurons(model, layout, row)
        return dict(layout.held(row))
