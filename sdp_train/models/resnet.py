"""CIFAR-style ResNet-18 (3x3 stem, four stages of BasicBlocks) for SDP.

Every BasicBlock is maskable. A block a worker does not hold contributes a zero residual branch:
its output is relu(shortcut(x)). For a block with an identity shortcut that is x itself (every
block input is a ReLU output), so the block is skipped; a stage entry keeps its downsampling
shortcut (1x1 convolution + BatchNorm), which is *shared* like the stem and the classifier: every
worker holds and averages it, and a worker without the block keeps it in the block's `PassThrough`
under the full model's names (``layer2.0.downsample.*``). The model can be built as a worker's
subnetwork: ``block_ids`` keeps only some BasicBlocks (B-SDP), ``inner_index`` keeps only some
inner channels (conv1 outputs) of BasicBlocks (N-SDP; at least one per block, since an empty
residual branch would still add bn2's bias). Module names are the full model's (stages are
``nn.ModuleDict``s keyed by the block's index in its stage). Not here: bottleneck blocks, ImageNet
stems.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models.family import ActivationModel, BlockActivations, ModelFamily
from sdp_train.parallel.blockmap import (
    WHOLE,
    Block,
    BlockMap,
    PassThrough,
    SliceSpec,
    check_config_fields,
    check_level,
    check_model_size,
    init_from_seed,
    names_by_prefix,
    on_meta,
    state_shapes,
)

BASE_CHANNELS: tuple[int, ...] = (64, 128, 256, 512)
STAGE_STRIDES: tuple[int, ...] = (1, 2, 2, 2)
INNER_ROWS: tuple[str, ...] = ("conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var")
INNER_COLS: tuple[str, ...] = ("conv2.weight",)


@dataclass(kw_only=True)
class ResNetConfig:
    """Shape of a CIFAR-style ResNet. Defaults are ``resnet18-cifar`` (11.17M parameters)."""

    name: str = "resnet18-cifar"
    """Registry name, used in error messages and checkpoints."""
    in_channels: int = 3
    """Input image channels (3 for CIFAR, 1 for digits)."""
    num_classes: int = 10
    """Output classes."""
    width_multiplier: float = 1.0
    """Scales the stage widths 64-128-256-512 (rounded, at least 1); tests use small values."""
    blocks_per_stage: tuple[int, ...] = (2, 2, 2, 2)
    """BasicBlocks per stage (ResNet-18: 2 each); one entry per stage, at most four stages."""
    neuron_groups: int = 4
    """N-SDP channel groups per maskable BasicBlock; must divide the width of every stage."""

    def __post_init__(self) -> None:
        check_config_fields(self, ints=("in_channels", "num_classes", "neuron_groups"), numbers=("width_multiplier",))
        if not isinstance(self.blocks_per_stage, (list, tuple)):
            raise ConfigError(f"{self.name}: blocks_per_stage must be a list of ints, got {self.blocks_per_stage!r}")
        self.blocks_per_stage = tuple(self.blocks_per_stage)
        if (not 1 <= len(self.blocks_per_stage) <= len(BASE_CHANNELS)
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.blocks_per_stage)):
            raise ConfigError(
                f"{self.name}: blocks_per_stage needs 1 to {len(BASE_CHANNELS)} positive int entries, "
                f"got {self.blocks_per_stage}"
            )
        bad = [c for c in self.channels if c % self.neuron_groups]
        if bad:
            raise ConfigError(
                f"{self.name}: neuron_groups={self.neuron_groups} must divide every stage width, "
                f"widths are {self.channels}"
            )
        check_model_size(self.name, layers=sum(self.blocks_per_stage))  # before anything walks the blocks
        check_model_size(self.name, params=num_params(self),
                         neuron_blocks=len(maskable_blocks(self)) * self.neuron_groups)

    @property
    def channels(self) -> tuple[int, ...]:
        """Width of each stage after the multiplier."""
        return tuple(max(1, round(c * self.width_multiplier)) for c in BASE_CHANNELS[: len(self.blocks_per_stage)])


def resnet_configs() -> dict[str, ResNetConfig]:
    """The named ResNet shapes (3x32x32 in, 10 classes): ``resnet18-cifar`` (11.17M parameters) and
    ``wideresnet18-cifar``, ResNet-18 of width 2 (stages of 128-256-512-1024 channels, WRN-18-2 in
    the wide-ResNet naming; 44.66M parameters)."""
    return {"resnet18-cifar": ResNetConfig(),
            "wideresnet18-cifar": ResNetConfig(name="wideresnet18-cifar", width_multiplier=2.0)}


def block_layout(config: ResNetConfig) -> list[tuple[str, int, int, int]]:
    """(name, in_channels, out_channels, stride) of every BasicBlock, in forward order."""
    layout, prev = [], config.channels[0]
    for s, (n_blocks, out) in enumerate(zip(config.blocks_per_stage, config.channels)):
        for j in range(n_blocks):
            stride = STAGE_STRIDES[s] if j == 0 else 1
            layout.append((f"layer{s + 1}.{j}", prev, out, stride))
            prev = out
    return layout


def maskable_blocks(config: ResNetConfig) -> list[str]:
    """Names of the BasicBlocks, in forward order: every one is maskable."""
    return [name for name, _, _, _ in block_layout(config)]


def num_params(config: ResNetConfig) -> int:
    """Parameter count of the full model, from the config alone (no allocation)."""
    total = config.in_channels * config.channels[0] * 9 + 2 * config.channels[0]
    for _, cin, cout, stride in block_layout(config):
        total += cin * cout * 9 + cout * cout * 9 + 4 * cout
        if stride != 1 or cin != cout:
            total += cin * cout + 2 * cout
    return total + config.channels[-1] * config.num_classes + config.num_classes


def channel_group(config: ResNetConfig, block: str, g: int) -> range:
    """Inner-channel indices of group ``g`` of maskable block ``block`` (contiguous)."""
    width = dict((name, cout) for name, _, cout, _ in block_layout(config))[block] // config.neuron_groups
    return range(g * width, (g + 1) * width)


def projection(cin: int, cout: int, stride: int) -> nn.Sequential:
    """The downsampling shortcut: 1x1 convolution with ``stride``, then BatchNorm."""
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x)) with ``inner`` conv1 output channels."""

    def __init__(self, cin: int, cout: int, stride: int, inner: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, inner, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = projection(cin, cout, stride) if stride != 1 or cin != cout else None
        # every worker holds the shortcut, with the block or in its PassThrough (`forward_skipped`)
        self.shared_children = ("downsample",) if self.downsample is not None else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))

    @staticmethod
    def forward_skipped(x: torch.Tensor, downsample: nn.Module) -> torch.Tensor:
        """The output of a downsampling block with a zero residual branch: relu(downsample(x))."""
        return F.relu(downsample(x))


def skipped_block(name: str, cin: int, cout: int, stride: int) -> PassThrough:
    """Downsampling block ``name`` on a worker that does not hold it: its `PassThrough`, with a real
    shortcut (built where the model is) and the rest on the meta device."""
    with on_meta():
        block = BasicBlock(cin, cout, stride, cout)
    block.downsample = projection(cin, cout, stride)
    return PassThrough(block, name)


class ResNet(nn.Module):
    """CIFAR-style ResNet, full or a worker's subnetwork.

    Parameters
    ----------
    config : ResNetConfig
        Shape of the full model.
    block_ids : iterable of str, optional
        BasicBlocks to build (B-SDP), e.g. ``"layer2.1"``; default all. An absent block with an
        identity shortcut is skipped; one with a downsampling shortcut becomes a `PassThrough`
        that keeps the shortcut: relu(downsample(x)).
    inner_index : mapping str -> sequence of int, optional
        Per block, the full-model inner channels to keep, increasing and non-empty (N-SDP);
        blocks not in the mapping keep all.
    """

    def __init__(
        self,
        config: ResNetConfig,
        *,
        block_ids: Iterable[str] | None = None,
        inner_index: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        maskable = maskable_blocks(config)
        keep = set(maskable if block_ids is None else block_ids)
        self.inner_index = {name: tuple(int(c) for c in idx) for name, idx in (inner_index or {}).items()}
        unknown = sorted((keep | set(self.inner_index)) - set(maskable))
        if unknown:
            raise ConfigError(f"{config.name}: {unknown} are not maskable blocks; maskable are {maskable}")
        empty = sorted(name for name, idx in self.inner_index.items() if not idx)
        if empty:
            raise ConfigError(f"{config.name}: blocks {empty} keep no inner channel; keep at least one group each")
        self.conv1 = nn.Conv2d(config.in_channels, config.channels[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(config.channels[0])
        stages: dict[str, nn.ModuleDict] = {}
        for name, cin, cout, stride in block_layout(config):
            stage, j = name.split(".")
            blocks = stages.setdefault(stage, nn.ModuleDict())
            if name in keep:
                blocks[j] = BasicBlock(cin, cout, stride, len(self.inner_index.get(name, range(cout))))
            elif stride != 1 or cin != cout:
                blocks[j] = skipped_block(name, cin, cout, stride)
        for stage, blocks in stages.items():
            self.add_module(stage, blocks)
        self.stages = list(stages)
        self.fc = nn.Linear(config.channels[-1], config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes) for images (N, in_channels, H, W)."""
        x = F.relu(self.bn1(self.conv1(x)))
        for stage in self.stages:
            for block in getattr(self, stage).values():
                x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # (N, C) -> (N, classes)

    def full_index(self) -> dict[str, SliceSpec]:
        """State-dict name -> part of the same-named full-model tensor this module holds."""
        index = {name: WHOLE for name in self.state_dict(keep_vars=True)}
        widths = {name: cout for name, _, cout, _ in block_layout(self.config)}
        for name, idx in self.inner_index.items():
            stage, j = name.split(".")
            blocks = getattr(self, stage)
            if j not in blocks or not isinstance(blocks[j], BasicBlock) or idx == tuple(range(widths[name])):
                continue
            for t in INNER_ROWS:
                index[f"{name}.{t}"] = SliceSpec(dim=0, index=idx, full_size=widths[name])
            for t in INNER_COLS:
                index[f"{name}.{t}"] = SliceSpec(dim=1, index=idx, full_size=widths[name])
        return index

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation; equal on every worker for the tensors (or slices) they share."""
        init_from_seed(self, seed, lambda name, shape, gen: init_tensor(self.config, name, shape, gen))


def init_tensor(config: ResNetConfig, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The full-model tensor ``name`` at initialisation (CPU).

    Convolutions: Kaiming normal, fan-out, ReLU gain (as torchvision). BatchNorm: weight 1, bias 0,
    running mean 0, running variance 1. Classifier: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (torch's
    ``nn.Linear`` default) for weight and bias.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "num_batches_tracked":
        return torch.zeros(shape, dtype=torch.int64)
    if name.startswith("fc."):
        bound = config.channels[-1] ** -0.5
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    if len(shape) == 4:
        fan_out = shape[0] * shape[2] * shape[3]
        return torch.randn(shape, generator=generator) * (2.0 / fan_out) ** 0.5
    return torch.ones(shape) if leaf in ("weight", "running_var") else torch.zeros(shape)


def block_map(config: ResNetConfig) -> BlockMap:
    """Blocks: every BasicBlock but its downsampling shortcut (block level); ``<block>.g{g}`` = inner-channel
    groups (neuron level)."""
    with on_meta():
        shapes, params = state_shapes(ResNet(config))
    maskable = maskable_blocks(config)
    widths = {name: cout for name, _, cout, _ in block_layout(config)}
    by_block = names_by_prefix(shapes)
    whole_blocks = tuple(Block(name, tuple((n, WHOLE) for n in by_block[name]
                                           if not n.startswith(f"{name}.downsample.")))  # shared
                         for name in maskable)
    neuron_blocks = []
    for name in maskable:
        for g in range(config.neuron_groups):
            idx = tuple(channel_group(config, name, g))
            rows = SliceSpec(dim=0, index=idx, full_size=widths[name])
            cols = SliceSpec(dim=1, index=idx, full_size=widths[name])
            tensors = [(f"{name}.{t}", rows) for t in INNER_ROWS] + [(f"{name}.{t}", cols) for t in INNER_COLS]
            neuron_blocks.append(Block(f"{name}.g{g}", tuple(tensors)))
    return BlockMap(
        model=config.name, shapes=shapes, parameter_names=params,
        blocks={"block": whole_blocks, "neuron": tuple(neuron_blocks)},
    )


def subnet_kwargs(config: ResNetConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """`ResNet` constructor arguments for a worker holding the blocks where ``held`` (validated) is True."""
    check_level(level)
    maskable = maskable_blocks(config)
    if level == "block":
        return {"block_ids": [name for name, h in zip(maskable, held) if h]}
    held_groups = held.reshape(len(maskable), config.neuron_groups)
    inner = {
        name: [c for g in range(config.neuron_groups) if held_groups[b, g] for c in channel_group(config, name, g)]
        for b, name in enumerate(maskable)
    }
    empty = [name for name, idx in inner.items() if not idx]
    if empty:
        raise ConfigError(
            f"{config.name}: at level 'neuron' a worker must hold at least one channel group of every "
            f"maskable block; this mask row holds none of {empty}"
        )
    return {"inner_index": inner}


def activations(model: ResNet, frozen: frozenset[str], *, batch_size: int, seq_len: int, image_size: int,
                elem: int) -> ActivationModel:
    """Activation bytes of a (worker) `ResNet` on ``batch_size`` images of side ``image_size``.

    A BasicBlock with A output positions, c_i inner and c_o output channels saves 2 c_i A + c_o A
    (+ c_o A with a downsampling shortcut) + the BatchNorm statistics and outputs c_o A; backward
    +(c_i + c_o) A. BatchNorm needs its input for the input gradient, so a frozen block keeps the
    same. A skipped downsampling block, relu(bn(conv1x1 x)), keeps its BatchNorm input c_o A and
    statistics and its output c_o A, all counted as output since activation checkpointing does not
    recompute a pass-through; backward +3 c_o A (its BatchNorm input, still held, and two
    gradients). The stem keeps its conv output and BatchNorm output and statistics; the head the
    pooled features and log-softmax per image.
    """
    c = model.config
    images = batch_size
    side = image_size
    stem = (2 * c.channels[0] * side * side * images + 2 * c.channels[0]) * elem
    blocks = []
    for stage in model.stages:
        for j, block in getattr(model, stage).items():
            if isinstance(block, PassThrough):
                conv = block.downsample[0]
                side = (side - 1) // conv.stride[0] + 1
                area, out = images * side * side, conv.out_channels
                blocks.append(BlockActivations(f"{stage}.{j}", 0, (2 * out * area + 2 * out) * elem,
                                               3 * out * area * elem, out * conv.in_channels))
                continue
            stride = block.conv1.stride[0]
            side = (side - 1) // stride + 1
            area = images * side * side
            inner, out = block.conv1.out_channels, block.conv2.out_channels
            saved = 2 * inner * area + out * area + 2 * inner + 2 * out
            if block.downsample is not None:
                saved += out * area + 2 * out
            blocks.append(BlockActivations(f"{stage}.{j}", saved * elem, out * area * elem,
                                           (inner + out) * area * elem, out * inner * 9))
    k = c.num_classes
    head = images * (c.channels[-1] + k) * elem
    batch = images * c.in_channels * image_size**2 * elem + images * 8
    return ActivationModel(stem=stem, blocks=tuple(blocks), head=head, loss_backward=2 * images * k * elem,
                           constant=batch, head_prefixes=("fc.",))


FAMILY = ModelFamily(name="resnet", config_class=ResNetConfig, model_class=ResNet, presets=resnet_configs,
                     num_params=num_params, block_map=block_map, subnet_kwargs=subnet_kwargs, data="images",
                     activations=activations)
