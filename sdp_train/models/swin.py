"""A Swin-style Transformer (shifted window attention, patch merging, relative position bias) for SDP.

Stages of pre-norm blocks attend inside non-overlapping ``window x window`` token windows; every
odd block of a stage shifts the windows by half a window (cyclically, with the attention mask that
keeps tokens from attending across the wrapped edge). Between stages a patch merging concatenates
each 2 x 2 token neighbourhood and projects it to twice the width. As in Swin, a stage whose token
map is no larger than the window attends over the whole map, unshifted.

Every Swin block is a maskable block (B-SDP: ``layer_ids``, the others are skipped, which is the
identity since the blocks are residual); its MLP hidden units form the neuron groups (N-SDP:
``mlp_index``, a block with none has no MLP and no MLP norm). The patch embedding, the patch
mergings, the final norm and the head are shared. Module names are the full model's (``layers`` is
an ``nn.ModuleDict`` keyed by the block's index over all stages), as in `sdp_train.models.vit`.
The model is built for one image side (``image_size``: `sdp train` sets it from the data, like
``in_channels``). Not here: padding to window multiples, dropout, stochastic depth, absolute
position embeddings.

``swin-tiny`` is Swin-T (width 96, stages of 2, 2, 6, 2 blocks with 3, 6, 12, 24 heads, MLP ratio
4; 27.5M parameters with 10 classes) adapted to 32 x 32 images: 2 x 2 patches instead of 4 x 4 and
4 x 4 windows instead of 7 x 7, so that its four stages see 16 x 16, 8 x 8, 4 x 4 (one window,
unshifted) and 2 x 2 token maps, as Swin-T's see 56 to 7 at 224 x 224. It needs 32 x 32 inputs
(CIFAR); ``swin-debug`` (two stages of two blocks, 135,126 parameters) is the small one for tests
and the 8 x 8 digits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models.family import ActivationModel, BlockActivations, ModelFamily
from sdp_train.models.vit import MLP, MLP_COLS, MLP_ROWS
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


@dataclass(kw_only=True)
class SwinConfig:
    """Shape of a Swin-style model. Defaults are ``swin-debug`` (two stages of two blocks, 135,126 parameters)."""

    name: str = "swin-debug"
    """Registry name, used in error messages and checkpoints."""
    in_channels: int = 3
    """Input image channels (3 for CIFAR, 1 for digits)."""
    num_classes: int = 10
    """Output classes."""
    image_size: int = 8
    """Side of the square input images (8 for digits, 32 for CIFAR; `sdp train` sets it from the data)."""
    patch_size: int = 2
    """Side of the square patches (tokens); must divide ``image_size``."""
    dim: int = 32
    """Width of the first stage; each patch merging doubles it."""
    depths: tuple[int, ...] = (2, 2)
    """Swin blocks per stage (all of them are the B of B-SDP)."""
    heads: tuple[int, ...] = (2, 4)
    """Attention heads per stage; each must divide its stage's width."""
    window: int = 2
    """Side of the attention windows, in tokens; must divide every stage's token map larger than it."""
    mlp_ratio: int = 4
    """MLP hidden width per block, as a multiple of the stage's width."""
    neuron_groups: int = 4
    """N-SDP neuron groups per block; must divide the first stage's MLP width (hence every stage's)."""

    def __post_init__(self) -> None:
        check_config_fields(self, ints=("in_channels", "num_classes", "image_size", "patch_size", "dim", "window",
                                        "mlp_ratio", "neuron_groups"))
        for field in ("depths", "heads"):
            value = getattr(self, field)
            if (not isinstance(value, (list, tuple)) or not value
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value)):
                raise ConfigError(f"{self.name}: {field} must be a non-empty list of positive ints, got {value!r}")
            setattr(self, field, tuple(value))
        if len(self.heads) != len(self.depths):
            raise ConfigError(f"{self.name}: heads needs one entry per stage, got heads={self.heads} for "
                              f"depths={self.depths}")
        check_model_size(self.name, layers=sum(self.depths))  # before anything walks the blocks
        if self.image_size % self.patch_size:
            raise ConfigError(f"{self.name}: patch_size={self.patch_size} must divide image_size={self.image_size}")
        side = self.image_size // self.patch_size
        for s in range(len(self.depths)):
            width = self.dim * 2**s
            if width % self.heads[s]:
                raise ConfigError(f"{self.name}: heads[{s}]={self.heads[s]} must divide the stage's width {width}")
            if side > self.window and side % self.window:
                raise ConfigError(f"{self.name}: window={self.window} must divide stage {s}'s {side} x {side} "
                                  f"token map (image_size={self.image_size}, patch_size={self.patch_size})")
            if s + 1 < len(self.depths):
                if side % 2:
                    raise ConfigError(f"{self.name}: patch merging after stage {s} needs an even token map, got "
                                      f"{side} x {side} (image_size={self.image_size}, patch_size={self.patch_size})")
                side //= 2
        if (self.mlp_ratio * self.dim) % self.neuron_groups:
            raise ConfigError(f"{self.name}: neuron_groups={self.neuron_groups} must divide the MLP width "
                              f"mlp_ratio * dim = {self.mlp_ratio * self.dim}")
        check_model_size(self.name, params=num_params(self), neuron_blocks=sum(self.depths) * self.neuron_groups)


def swin_configs() -> dict[str, SwinConfig]:
    """The named Swin shapes: ``swin-debug`` (digits 8 x 8 by default; CIFAR with ``image_size=32``) and
    ``swin-tiny``, Swin-T for 32 x 32 images (module doc)."""
    return {"swin-debug": SwinConfig(),
            "swin-tiny": SwinConfig(name="swin-tiny", image_size=32, patch_size=2, dim=96, depths=(2, 2, 6, 2),
                                    heads=(3, 6, 12, 24), window=4)}


@dataclass(frozen=True)
class BlockShape:
    """Where one Swin block sits and the shapes it works on."""

    stage: int
    dim: int
    heads: int
    side: int
    """Side of the stage's token map."""
    window: int
    """Side of its attention windows (the whole map when the map is no larger than ``window``)."""
    shift: int
    """Cyclic shift of its windows (half a window on odd blocks of a stage with several windows)."""
    hidden: int
    """Full MLP hidden width."""


def block_shapes(config: SwinConfig) -> tuple[BlockShape, ...]:
    """The shape of every block of the full model, in forward order (index = block index)."""
    shapes = []
    side = config.image_size // config.patch_size
    for s, depth in enumerate(config.depths):
        window = min(config.window, side)
        for j in range(depth):
            shift = window // 2 if j % 2 and side > window else 0
            dim = config.dim * 2**s
            shapes.append(BlockShape(s, dim, config.heads[s], side, window, shift, config.mlp_ratio * dim))
        side //= 2
    return tuple(shapes)


def num_params(config: SwinConfig) -> int:
    """Parameter count of the full model, from the config alone (no allocation)."""
    total = config.in_channels * config.patch_size**2 * config.dim + config.dim
    for b in block_shapes(config):
        d, h, table = b.dim, b.hidden, (2 * b.window - 1) ** 2 * b.heads
        total += 4 * d + (3 * d * d + 3 * d) + (d * d + d) + table + (d * h + h) + (h * d + d)
    for s in range(len(config.depths) - 1):
        d = config.dim * 2**s
        total += 8 * d + 4 * d * 2 * d
    d = config.dim * 2 ** (len(config.depths) - 1)
    return total + 2 * d + d * config.num_classes + config.num_classes


def neuron_group(config: SwinConfig, block: int, g: int) -> range:
    """Hidden-neuron indices of group ``g`` of block ``block`` (contiguous)."""
    width = block_shapes(config)[block].hidden // config.neuron_groups
    return range(g * width, (g + 1) * width)


def relative_position_index(window: int, device: torch.device) -> torch.Tensor:
    """(window**2 * window**2,) row of the relative-position table for every (query, key) pair of a window."""
    y, x = torch.meshgrid(torch.arange(window, device=device), torch.arange(window, device=device), indexing="ij")
    y, x = y.flatten(), x.flatten()
    dy, dx = y[:, None] - y[None, :] + window - 1, x[:, None] - x[None, :] + window - 1
    return (dy * (2 * window - 1) + dx).flatten()


def shift_mask(side: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """(windows, window**2, window**2) additive mask of shifted windows: 0 within a region, -inf across.

    After the cyclic shift a window at the map's edge holds tokens from opposite edges; tokens
    attend only to those that were neighbours before the shift (Swin's mask).
    """
    region = torch.zeros(side, side, dtype=torch.int64, device=device)
    cuts = (slice(0, side - window), slice(side - window, side - shift), slice(side - shift, side))
    for i, rows in enumerate(cuts):
        for j, cols in enumerate(cuts):
            region[rows, cols] = 3 * i + j
    ids = window_partition(region[None, :, :, None], window).squeeze(-1)  # (windows, window**2)
    mask = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1], device=device)
    return mask.masked_fill(ids[:, :, None] != ids[:, None, :], float("-inf"))


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * H/window * W/window, window**2, C), windows in row-major order."""
    b, h, w, c = x.shape
    return x.view(b, h // window, window, w // window, window, c).transpose(2, 3).reshape(-1, window * window, c)


def window_reverse(windows: torch.Tensor, window: int, b: int, h: int, w: int) -> torch.Tensor:
    """Inverse of `window_partition`: (B * windows, window**2, C) -> (B, H, W, C)."""
    c = windows.shape[-1]
    return windows.view(b, h // window, w // window, window, window, c).transpose(2, 3).reshape(b, h, w, c)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside (shifted) windows, with a learned relative position bias."""

    def __init__(self, shape: BlockShape) -> None:
        super().__init__()
        self.heads, self.window, self.shift = shape.heads, shape.window, shape.shift
        self.scale = (shape.dim // shape.heads) ** -0.5
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim)
        self.proj = nn.Linear(shape.dim, shape.dim)
        self.relative_position_table = nn.Parameter(torch.zeros((2 * shape.window - 1) ** 2, shape.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape  # (B, H, W, C), normalised
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        windows = window_partition(x, self.window)  # (B * nW, N, C)
        bn, n, _ = windows.shape
        q, k, v = self.qkv(windows).view(bn, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).contiguous()
        bias = self.relative_position_table[relative_position_index(self.window, x.device)]
        scores = (q @ k.transpose(-2, -1)) * self.scale + bias.view(n, n, self.heads).permute(2, 0, 1)
        if self.shift:
            mask = shift_mask(h, self.window, self.shift, x.device).to(scores.dtype)  # (nW, N, N)
            scores = (scores.view(b, -1, self.heads, n, n) + mask[None, :, None]).view(bn, self.heads, n, n)
        out = scores.softmax(dim=-1) @ v  # (B * nW, heads, N, C / heads)
        x = window_reverse(self.proj(out.transpose(1, 2).reshape(bn, n, c)), self.window, b, h, w)
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), (1, 2))
        return x


class SwinBlock(nn.Module):
    """Pre-norm residual block: window attention, then MLP; ``mlp_hidden == 0`` builds no MLP (and no MLP norm)."""

    def __init__(self, shape: BlockShape, mlp_hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(shape.dim)
        self.attention = WindowAttention(shape)
        self.mlp_norm = nn.LayerNorm(shape.dim) if mlp_hidden else None
        self.mlp = MLP(shape.dim, mlp_hidden) if mlp_hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))  # (B, H, W, C)
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x


class PatchMerging(nn.Module):
    """Each 2 x 2 token neighbourhood -> one token of twice the width (halves H and W)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        # Swin's concatenation order, (row, column) parities (0,0), (1,0), (0,1), (1,1), as one copy:
        # strided slices would each take a full-size zero gradient in backward
        x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.reduce(self.norm(x))  # (B, H/2, W/2, 2C)


class Swin(nn.Module):
    """Swin-style model, full or a worker's subnetwork (``layer_ids`` / ``mlp_index`` as in `ViT`)."""

    def __init__(self, config: SwinConfig, *, layer_ids: Iterable[int] | None = None,
                 mlp_index: Mapping[int, Sequence[int]] | None = None) -> None:
        super().__init__()
        self.config = config
        shapes = block_shapes(config)
        ids = sorted(set(range(len(shapes)) if layer_ids is None else layer_ids))
        if ids and not (0 <= ids[0] and ids[-1] < len(shapes)):
            raise ConfigError(f"{config.name}: layer_ids must lie in [0, {len(shapes)}), got {ids}")
        self.mlp_index = {i: tuple(int(n) for n in idx) for i, idx in (mlp_index or {}).items()}
        self.stage_of = tuple(b.stage for b in shapes)
        p = config.patch_size
        self.patch_embed = nn.Conv2d(config.in_channels, config.dim, p, stride=p)
        self.layers = nn.ModuleDict(
            {str(i): SwinBlock(shapes[i], len(self.mlp_index.get(i, range(shapes[i].hidden)))) for i in ids}
        )
        self.merges = nn.ModuleDict({str(s): PatchMerging(config.dim * 2**s) for s in range(len(config.depths) - 1)})
        width = config.dim * 2 ** (len(config.depths) - 1)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes) for images (N, in_channels, image_size, image_size)."""
        side = self.config.image_size
        if tuple(images.shape[-2:]) != (side, side):
            raise ConfigError(f"{self.config.name}: image size {tuple(images.shape[-2:])} is not the "
                              f"image_size={side} the model is built for")
        x = self.patch_embed(images).permute(0, 2, 3, 1)  # (N, H/p, W/p, D)
        stage = 0
        for i, layer in self.layers.items():
            for s in range(stage, self.stage_of[int(i)]):
                x = self.merges[str(s)](x)
            stage = self.stage_of[int(i)]
            x = layer(x)
        for s in range(stage, len(self.config.depths) - 1):
            x = self.merges[str(s)](x)
        return self.head(self.norm(x).mean(dim=(1, 2)))

    def full_index(self) -> dict[str, SliceSpec]:
        """State-dict name -> part of the same-named full-model tensor this module holds."""
        index = {name: WHOLE for name in self.state_dict(keep_vars=True)}
        for i, idx in self.mlp_index.items():
            layer = self.layers[str(i)] if str(i) in self.layers else None
            hidden = block_shapes(self.config)[i].hidden
            if layer is None or not idx or idx == tuple(range(hidden)):
                continue
            for t in MLP_ROWS:
                index[f"layers.{i}.{t}"] = SliceSpec(dim=0, index=idx, full_size=hidden)
            for t in MLP_COLS:
                index[f"layers.{i}.{t}"] = SliceSpec(dim=1, index=idx, full_size=hidden)
        return index

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation; equal on every worker for the tensors (or slices) they share."""
        init_from_seed(self, seed, init_tensor)


def init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The full-model tensor ``name`` at initialisation, as in `sdp_train.models.vit`: weights and the
    relative position tables N(0, 0.02^2), LayerNorm weights 1, biases 0."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def block_map(config: SwinConfig) -> BlockMap:
    """Blocks: ``layers.i`` (block level); ``layers.i.mlp.g{g}`` = rows of fc1, columns of fc2 (neuron level)."""
    with on_meta():
        shapes, params = state_shapes(Swin(config))
    by_layer = names_by_prefix(shapes)
    n_blocks = sum(config.depths)
    layer_blocks = tuple(Block(f"layers.{i}", tuple((n, WHOLE) for n in by_layer[f"layers.{i}"]))
                         for i in range(n_blocks))
    neuron_blocks = []
    for i, b in enumerate(block_shapes(config)):
        for g in range(config.neuron_groups):
            idx = tuple(neuron_group(config, i, g))
            tensors = [(f"layers.{i}.{t}", SliceSpec(dim=0, index=idx, full_size=b.hidden)) for t in MLP_ROWS]
            tensors += [(f"layers.{i}.{t}", SliceSpec(dim=1, index=idx, full_size=b.hidden)) for t in MLP_COLS]
            neuron_blocks.append(Block(f"layers.{i}.mlp.g{g}", tuple(tensors)))
    return BlockMap(model=config.name, shapes=shapes, parameter_names=params,
                    blocks={"block": layer_blocks, "neuron": tuple(neuron_blocks)})


def subnet_kwargs(config: SwinConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """`Swin` constructor arguments for a worker holding the blocks where ``held`` (validated) is True."""
    check_level(level)
    n_blocks = sum(config.depths)
    if level == "block":
        return {"layer_ids": [i for i in range(n_blocks) if held[i]]}
    groups = held.reshape(n_blocks, config.neuron_groups)
    return {"mlp_index": {i: [n for g in range(config.neuron_groups) if groups[i, g]
                              for n in neuron_group(config, i, g)] for i in range(n_blocks)}}


def activations(model: Swin, frozen: frozenset[str], *, batch_size: int, seq_len: int, image_size: int,
                elem: int) -> ActivationModel:
    """Activation bytes of a (worker) `Swin` on ``batch_size`` images of side ``image_size``.

    Per token of a block's stage, in elements (d width, h the block's MLP width, H heads, N = w^2
    tokens per window): a block saves 7d + 2h + 4 + HN (LayerNorm statistics, the windows fed to
    qkv, the qkv output 3d, the attention probabilities HN of its window, the attention output fed
    to proj, the attention residual, the MLP's input, fc1 and GELU outputs) plus the N^2 int64
    relative-position indices; frozen 4d + h + 4 + HN (no indices); without MLP 5d + 2 + HN
    (frozen 3d + 2 + HN). A block's input is kept by its first LayerNorm; the patch merging keeps
    its concatenated input and LayerNorm output (d each per input token) and statistics (2 per
    output token) but not its input: those bytes count as the output of the block before it (the
    stem's when the worker holds no block before it). Head: the final LayerNorm's statistics, 2
    per token, the pooled features and log-softmax per image; the input batch is constant.
    These forward formulas are exact (tests/unit/test_plan.py compares them with what autograd
    saves). ``backward`` is an estimate: the larger of the MLP's gradient temporaries (h + d as in
    `sdp_train.models.vit`; frozen 2h + d; without MLP 5d) and the attention's, the gradients of
    the probabilities and of the scores (2HN) with those of the attention output and input (2d).
    """
    c = model.config
    if image_size != c.image_size:
        raise ConfigError(f"{c.name}: image size {image_size} is not the image_size={c.image_size} the model is "
                          "built for")
    images = batch_size
    shapes = block_shapes(c)
    side = c.image_size // c.patch_size
    kept = [0]  # bytes alive from the stem (kept[0]) or the k-th block run (kept[k + 1]) until the next block
    rows = []  # (name, saved bytes, backward bytes, first gradient elements) of the blocks run, in order
    last = c.dim * side**2 * images  # elements of the tensor the next module takes
    stage = 0
    for i, layer in model.layers.items():
        b = shapes[int(i)]
        for s in range(stage, b.stage):  # patch mergings before this block
            merged, last = _merge_bytes(c.dim * 2**s, images * (side // 2**s) ** 2, elem)
            kept[-1] += merged
        stage = b.stage
        kept[-1] += last * elem  # the block's first LayerNorm keeps its input
        n, d, hn = images * b.side**2, b.dim, b.heads * b.window**2
        h = layer.mlp.fc1.out_features if layer.mlp is not None else 0
        name = f"layers.{i}"
        is_frozen = name in frozen
        if h == 0:
            saved, backward, grad = 5 * d + 2 + hn - (2 * d if is_frozen else 0), max(5 * d, 2 * hn + 2 * d), d * d + d
        elif is_frozen:
            saved, backward, grad = 4 * d + h + 4 + hn, max(2 * h + d, 2 * hn + 2 * d), 0
        else:
            saved, backward, grad = 7 * d + 2 * h + 4 + hn, max(h + d, 2 * hn + 2 * d), d * h + d
        indices = 0 if is_frozen else 8 * b.window**4
        rows.append((name, n * saved * elem + indices, n * backward * elem, grad))
        kept.append(0)
        last = n * d
    for s in range(stage, len(c.depths) - 1):
        merged, last = _merge_bytes(c.dim * 2**s, images * (side // 2**s) ** 2, elem)
        kept[-1] += merged
    kept[-1] += last * elem  # the final LayerNorm keeps it
    d, k = c.dim * 2 ** (len(c.depths) - 1), c.num_classes
    n = images * (side // 2 ** (len(c.depths) - 1)) ** 2
    head = (2 * n + images * (d + k)) * elem
    batch = images * c.in_channels * c.image_size**2 * elem + images * 8
    blocks = tuple(BlockActivations(name, saved, output, backward, grad)
                   for (name, saved, backward, grad), output in zip(rows, kept[1:]))
    return ActivationModel(stem=kept[0], blocks=blocks, head=head, loss_backward=2 * images * k * elem,
                           constant=batch, head_prefixes=("norm.", "head."))


def _merge_bytes(dim: int, tokens: int, elem: int) -> tuple[int, int]:
    """(bytes a patch merging of ``tokens`` tokens of width ``dim`` keeps, elements of its output)."""
    return (2 * dim * tokens + 2 * (tokens // 4)) * elem, tokens // 4 * 2 * dim


FAMILY = ModelFamily(name="swin", config_class=SwinConfig, model_class=Swin, presets=swin_configs,
                     num_params=num_params, block_map=block_map, subnet_kwargs=subnet_kwargs, data="images",
                     activations=activations)
