"""A plain Vision Transformer ("simple ViT": fixed 2-D sin-cos positions, mean pooling) for SDP.

The model can be built as a worker's subnetwork: ``layer_ids`` keeps only some transformer
blocks (B-SDP; the others are skipped), ``mlp_index`` keeps only some MLP hidden neurons per
layer (N-SDP; a layer with none has no MLP and no MLP norm). Module names are the full model's
(``layers`` is an ``nn.ModuleDict`` keyed by the full layer index), as in `sdp_train.models.llama`.
Positions are computed from the patch grid, so the same model takes 8x8 digits and 32x32 CIFAR
images. Not here: class tokens, dropout, learned position embeddings.
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
    SliceSpec,
    check_config_fields,
    check_level,
    check_model_size,
    init_from_seed,
    names_by_prefix,
    on_meta,
    state_shapes,
)

MLP_ROWS: tuple[str, ...] = ("mlp.fc1.weight", "mlp.fc1.bias")
MLP_COLS: tuple[str, ...] = ("mlp.fc2.weight",)


@dataclass(kw_only=True)
class ViTConfig:
    """Shape of a ViT. Defaults are ``vit-tiny`` (ViT-Ti/4: d=192, 12 blocks, 3 heads, 5.35M parameters)."""

    name: str = "vit-tiny"
    """Registry name, used in error messages and checkpoints."""
    in_channels: int = 3
    """Input image channels (3 for CIFAR, 1 for digits)."""
    num_classes: int = 10
    """Output classes."""
    patch_size: int = 4
    """Side of the square patches; must divide the image side."""
    dim: int = 192
    """Model width d."""
    n_layers: int = 12
    """Transformer blocks (the B of B-SDP)."""
    n_heads: int = 3
    """Attention heads; must divide ``dim``."""
    hidden_dim: int = 768
    """MLP hidden width per layer."""
    neuron_groups: int = 8
    """N-SDP neuron groups per layer; must divide ``hidden_dim``."""

    def __post_init__(self) -> None:
        check_config_fields(self, ints=("in_channels", "num_classes", "patch_size", "dim", "n_layers", "n_heads",
                                        "hidden_dim", "neuron_groups"))
        if self.dim % self.n_heads or self.dim % 4:
            raise ConfigError(f"{self.name}: dim must be divisible by n_heads and by 4 (2-D sin-cos positions), "
                              f"got dim={self.dim}, n_heads={self.n_heads}")
        if self.hidden_dim % self.neuron_groups:
            raise ConfigError(f"{self.name}: neuron_groups must divide hidden_dim, got hidden_dim={self.hidden_dim}, "
                              f"neuron_groups={self.neuron_groups}")
        check_model_size(self.name, params=num_params(self), layers=self.n_layers,
                         neuron_blocks=self.n_layers * self.neuron_groups)


def vit_configs() -> dict[str, ViTConfig]:
    """The named ViT shapes: ``vit-tiny``."""
    return {"vit-tiny": ViTConfig()}


def num_params(config: ViTConfig) -> int:
    """Parameter count of the full model, from the config alone (no allocation)."""
    d, h = config.dim, config.hidden_dim
    per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    patch = config.in_channels * config.patch_size**2 * d + d
    return patch + config.n_layers * per_layer + 2 * d + d * config.num_classes + config.num_classes


def neuron_group(config: ViTConfig, g: int) -> range:
    """Hidden-neuron indices of group ``g`` (contiguous)."""
    width = config.hidden_dim // config.neuron_groups
    return range(g * width, (g + 1) * width)


def sincos_positions(grid_h: int, grid_w: int, dim: int, device: torch.device) -> torch.Tensor:
    """(grid_h * grid_w, dim) fixed 2-D sin-cos position embedding, row-major patch order."""
    y, x = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, device=device, dtype=torch.float32) / max(1, dim // 4 - 1))
    y = y.flatten()[:, None].float() * omega[None, :]
    x = x.flatten()[:, None].float() * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm block; ``mlp_hidden == 0`` builds no MLP (and no MLP norm)."""

    def __init__(self, config: ViTConfig, mlp_hidden: int) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.attention_norm = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.mlp_norm = nn.LayerNorm(config.dim) if mlp_hidden else None
        self.mlp = MLP(config.dim, mlp_hidden) if mlp_hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, n, dim = x.shape  # (B, N patches, D)
        q, k, v = self.qkv(self.attention_norm(x)).view(bsz, n, 3, self.n_heads, dim // self.n_heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(out.transpose(1, 2).reshape(bsz, n, dim))
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x


class ViT(nn.Module):
    """ViT, full or a worker's subnetwork (``layer_ids`` / ``mlp_index`` as in `Llama`)."""

    def __init__(self, config: ViTConfig, *, layer_ids: Iterable[int] | None = None,
                 mlp_index: Mapping[int, Sequence[int]] | None = None) -> None:
        super().__init__()
        self.config = config
        ids = sorted(set(range(config.n_layers) if layer_ids is None else layer_ids))
        if ids and not (0 <= ids[0] and ids[-1] < config.n_layers):
            raise ConfigError(f"{config.name}: layer_ids must lie in [0, {config.n_layers}), got {ids}")
        self.mlp_index = {i: tuple(int(n) for n in idx) for i, idx in (mlp_index or {}).items()}
        p = config.patch_size
        self.patch_embed = nn.Conv2d(config.in_channels, config.dim, p, stride=p)
        self.layers = nn.ModuleDict(
            {str(i): EncoderBlock(config, len(self.mlp_index.get(i, range(config.hidden_dim)))) for i in ids}
        )
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes) for images (N, in_channels, H, W); H and W multiples of patch_size."""
        if images.shape[-1] % self.config.patch_size or images.shape[-2] % self.config.patch_size:
            raise ConfigError(f"{self.config.name}: image size {tuple(images.shape[-2:])} is not a multiple of "
                              f"patch_size={self.config.patch_size}")
        x = self.patch_embed(images)  # (N, D, H/p, W/p)
        pos = sincos_positions(x.shape[2], x.shape[3], self.config.dim, x.device)
        x = x.flatten(2).transpose(1, 2) + pos.to(x.dtype)  # (N, patches, D)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))

    def full_index(self) -> dict[str, SliceSpec]:
        """State-dict name -> part of the same-named full-model tensor this module holds."""
        index = {name: WHOLE for name in self.state_dict(keep_vars=True)}
        hidden = self.config.hidden_dim
        for i, idx in self.mlp_index.items():
            if str(i) not in self.layers or not idx or idx == tuple(range(hidden)):
                continue
            for t in MLP_ROWS:
                index[f"layers.{i}.{t}"] = SliceSpec(dim=0, index=idx, full_size=hidden)
            for t in MLP_COLS:
                index[f"layers.{i}.{t}"] = SliceSpec(dim=1, index=idx, full_size=hidden)
        return index

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation; equal on every worker for the tensors (or slices) they share."""
        init_from_seed(self, seed, lambda name, shape, gen: init_tensor(self.config, name, shape, gen))


def init_tensor(config: ViTConfig, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The full-model tensor ``name`` at initialisation: weights N(0, 0.02^2), LayerNorm weights 1,
    biases 0."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def block_map(config: ViTConfig) -> BlockMap:
    """Blocks: ``layers.i`` (block level); ``layers.i.mlp.g{g}`` = rows of fc1, columns of fc2 (neuron level)."""
    with on_meta():
        shapes, params = state_shapes(ViT(config))
    by_layer = names_by_prefix(shapes)
    layer_blocks = tuple(Block(f"layers.{i}", tuple((n, WHOLE) for n in by_layer[f"layers.{i}"]))
                         for i in range(config.n_layers))
    neuron_blocks = []
    for i in range(config.n_layers):
        for g in range(config.neuron_groups):
            idx = tuple(neuron_group(config, g))
            tensors = [(f"layers.{i}.{t}", SliceSpec(dim=0, index=idx, full_size=config.hidden_dim)) for t in MLP_ROWS]
            tensors += [(f"layers.{i}.{t}", SliceSpec(dim=1, index=idx, full_size=config.hidden_dim)) for t in MLP_COLS]
            neuron_blocks.append(Block(f"layers.{i}.mlp.g{g}", tuple(tensors)))
    return BlockMap(model=config.name, shapes=shapes, parameter_names=params,
                    blocks={"block": layer_blocks, "neuron": tuple(neuron_blocks)})


def subnet_kwargs(config: ViTConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """`ViT` constructor arguments for a worker holding the blocks where ``held`` (validated) is True."""
    check_level(level)
    if level == "block":
        return {"layer_ids": [i for i in range(config.n_layers) if held[i]]}
    groups = held.reshape(config.n_layers, config.neuron_groups)
    return {"mlp_index": {i: [n for g in range(config.neuron_groups) if groups[i, g] for n in neuron_group(config, g)]
                          for i in range(config.n_layers)}}


def activations(model: ViT, frozen: frozenset[str], *, batch_size: int, seq_len: int, image_size: int,
                elem: int) -> ActivationModel:
    """Activation bytes of a (worker) `ViT` on ``batch_size`` images of side ``image_size``.

    Per patch position, in elements (d width, h the block's MLP width, H heads): a block saves
    7d + 2h + 4 + H (LayerNorm outputs and statistics, the fused qkv output 3d, attention output,
    attention residual, fc1 and GELU outputs; SDPA's log-sum-exp) and outputs d; frozen
    5d + h + 4 + H; without MLP 5d + 2 + H. Backward +h + d (frozen +2h + d, without MLP +5d).
    Head: the final LayerNorm's statistics, 2 per position, the pooled features and log-softmax per
    image; the input batch is constant.
    """
    c = model.config
    if image_size % c.patch_size:
        raise ConfigError(f"{c.name}: image size {image_size} is not a multiple of patch_size={c.patch_size}")
    images = batch_size
    n = images * (image_size // c.patch_size) ** 2  # patch positions
    d, heads = c.dim, c.n_heads
    blocks = []
    for i, block in model.layers.items():
        name = f"layers.{i}"
        h = block.mlp.fc1.out_features if block.mlp is not None else 0
        if h == 0:
            saved, backward, grad = 5 * d + 2 + heads - (d if name in frozen else 0), 5 * d, d * d + d
        elif name in frozen:
            saved, backward, grad = 5 * d + h + 4 + heads, 2 * h + d, 0
        else:
            saved, backward, grad = 7 * d + 2 * h + 4 + heads, h + d, d * h + d
        blocks.append(BlockActivations(name, n * saved * elem, n * d * elem, n * backward * elem, grad))
    k = c.num_classes
    head = (2 * n + images * (d + k)) * elem
    batch = images * c.in_channels * image_size**2 * elem + images * 8
    return ActivationModel(stem=n * d * elem, blocks=tuple(blocks), head=head, loss_backward=2 * images * k * elem,
                           constant=batch, head_prefixes=("norm.", "head."))


FAMILY = ModelFamily(name="vit", config_class=ViTConfig, model_class=ViT, presets=vit_configs,
                     num_params=num_params, block_map=block_map, subnet_kwargs=subnet_kwargs, data="images",
                     activations=activations)
