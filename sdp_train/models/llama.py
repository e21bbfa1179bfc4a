"""LLaMA-style decoder (RMSNorm, RoPE, SwiGLU MLP, causal SDPA, untied embeddings) for SDP.

The model can be built as the full model or as one worker's subnetwork: ``layer_ids`` keeps only
some transformer blocks (B-SDP; the others are skipped, i.e. identity residual), ``mlp_index``
keeps only some MLP hidden neurons per layer (N-SDP; a layer with none has no MLP). Module names
are the full model's (``layers`` is an ``nn.ModuleDict`` keyed by the full layer index), so a
worker's state-dict names are full-model names and `Llama.full_index` says which rows/columns
they hold. Not here: grouped-query attention, KV caches, weight tying, dropout.
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
from sdp_train.models.lm_loss import chunked_cross_entropy
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
from sdp_train.parallel.discovery import MLPSpec

MLP_ROW_WEIGHTS: tuple[str, ...] = ("w_gate", "w_up")
MLP_COL_WEIGHTS: tuple[str, ...] = ("w_down",)


@dataclass(kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA-style decoder. Defaults are ``llama-debug`` (~0.92M parameters)."""

    name: str = "llama-debug"
    """Registry name, used in error messages and checkpoints."""
    dim: int = 128
    """Model width d."""
    n_layers: int = 4
    """Number of transformer blocks (the B of B-SDP)."""
    n_heads: int = 4
    """Attention heads; ``dim / n_heads`` must be an even head dimension (RoPE rotates pairs)."""
    hidden_dim: int = 384
    """SwiGLU hidden width per layer (rows of w_gate/w_up, columns of w_down)."""
    vocab_size: int = 256
    """Vocabulary size (256 = raw bytes)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    neuron_groups: int = 8
    """N-SDP neuron groups per layer; must divide ``hidden_dim``."""

    def __post_init__(self) -> None:
        check_config_fields(self, ints=("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size", "max_seq_len",
                                        "neuron_groups"), numbers=("rope_theta", "norm_eps"))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"{self.name}: dim / n_heads must be an even integer, got dim={self.dim}, n_heads={self.n_heads}"
            )
        if self.hidden_dim % self.neuron_groups:
            raise ConfigError(
                f"{self.name}: neuron_groups must divide hidden_dim, got hidden_dim={self.hidden_dim}, "
                f"neuron_groups={self.neuron_groups}"
            )
        check_model_size(self.name, params=num_params(self), layers=self.n_layers,
                         neuron_blocks=self.n_layers * self.neuron_groups)

    @property
    def head_dim(self) -> int:
        """Per-head width ``dim // n_heads``."""
        return self.dim // self.n_heads


def llama_configs() -> dict[str, LlamaConfig]:
    """The named LLaMA shapes.

    ``llama-debug`` is for CPU tests (bytes vocabulary). The others follow the SDP paper's model
    sizes with a 32000-token vocabulary, untied embeddings, head dimension 64 and the usual SwiGLU
    width (8/3 d rounded up to a multiple of 256) unless noted:

    - ``llama-134m``: d=768, 12 layers, 12 heads, hidden 2048 -> 134.1M parameters.
    - ``llama-500m``: d=1280, 24 layers, 20 heads, hidden 3072 -> 522.4M. 24 layers as in the
      paper's block count; hidden 3072 (2.4 d) instead of 3584 keeps the total near 500M.
    - ``llama-1b``: d=2048, 18 layers, 16 heads, hidden 5632 -> 1.056B. 24 layers at this width
      would be 1.36B; 18 keeps the standard width and the name honest.
    """
    return {
        "llama-debug": LlamaConfig(),
        "llama-134m": LlamaConfig(
            name="llama-134m", dim=768, n_layers=12, n_heads=12, hidden_dim=2048, vocab_size=32000, max_seq_len=2048
        ),
        "llama-500m": LlamaConfig(
            name="llama-500m", dim=1280, n_layers=24, n_heads=20, hidden_dim=3072, vocab_size=32000, max_seq_len=2048
        ),
        "llama-1b": LlamaConfig(
            name="llama-1b", dim=2048, n_layers=18, n_heads=16, hidden_dim=5632, vocab_size=32000, max_seq_len=2048
        ),
    }


def num_params(config: LlamaConfig) -> int:
    """Parameter count of the full model, from the config alone (no allocation)."""
    d, h = config.dim, config.hidden_dim
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # wq wk wv wo, w_gate w_up w_down, two RMSNorms
    return config.n_layers * per_layer + 2 * config.vocab_size * d + d


def neuron_group(config: LlamaConfig, g: int) -> range:
    """Hidden-neuron indices of group ``g`` (contiguous, ``hidden_dim / neuron_groups`` wide)."""
    width = config.hidden_dim // config.neuron_groups
    return range(g * width, (g + 1) * width)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, head_dim) for the rotate-half RoPE convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, hd) by position; cos/sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape  # (B, T, D)
        q, k, v = (
            w(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, H, T, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, dim))


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), with ``hidden`` (possibly sliced) neurons."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TransformerBlock(nn.Module):
    """Pre-norm block; ``mlp_hidden == 0`` builds no MLP (and no MLP norm): the MLP adds zero."""

    def __init__(self, config: LlamaConfig, mlp_hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps) if mlp_hidden else None
        self.mlp = MLP(config.dim, mlp_hidden) if mlp_hidden else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(nn.Module):
    """LLaMA-style decoder, full or a worker's subnetwork.

    Parameters
    ----------
    config : LlamaConfig
        Shape of the full model.
    layer_ids : iterable of int, optional
        Transformer blocks to build (B-SDP); default all. Absent blocks are skipped.
    mlp_index : mapping int -> sequence of int, optional
        Per layer, the full-model hidden neurons to keep, increasing (N-SDP); layers not in the
        mapping keep all, an empty sequence removes the layer's MLP.

    Parameters are left as torch's defaults; call `init_weights` (or build through
    ``sdp_train.models.build_model``) for the seeded initialisation shared by all workers.
    """

    fsdp_units = (("tok_embeddings",), ("norm", "output"))
    """FSDP2 units besides the blocks (`sdp_train.parallel.blockmap.outer_units`), as torchtitan shards them."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        layer_ids: Iterable[int] | None = None,
        mlp_index: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        ids = sorted(set(range(config.n_layers) if layer_ids is None else layer_ids))
        if ids and not (0 <= ids[0] and ids[-1] < config.n_layers):
            raise ConfigError(f"{config.name}: layer_ids must lie in [0, {config.n_layers}), got {ids}")
        self.mlp_index = {i: tuple(int(n) for n in idx) for i, idx in (mlp_index or {}).items()}
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, len(self.mlp_index.get(i, range(config.hidden_dim)))) for i in ids}
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, loss_chunks: int = 1) -> torch.Tensor:
        """Logits (B, T, vocab_size) for int64 tokens (B, T); position t sees tokens <= t only.

        With ``targets`` (B, T) instead the mean next-token cross-entropy, the head computed
        ``loss_chunks`` chunks of tokens at a time without ever holding the full logits
        (`sdp_train.models.lm_loss.chunked_cross_entropy`).
        """
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ConfigError(f"{self.config.name}: sequence length {seq_len} > max_seq_len {self.config.max_seq_len}")
        cos, sin = rope_cos_sin(seq_len, self.config.head_dim, self.config.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if targets is not None:
            return chunked_cross_entropy(self.norm(h), self.output.weight, targets, loss_chunks)
        return self.output(self.norm(h))

    def full_index(self) -> dict[str, SliceSpec]:
        """State-dict name -> part of the same-named full-model tensor this module holds."""
        index = {name: WHOLE for name in self.state_dict(keep_vars=True)}
        hidden = self.config.hidden_dim
        for i, idx in self.mlp_index.items():
            if str(i) not in self.layers or not idx or idx == tuple(range(hidden)):
                continue
            for w in MLP_ROW_WEIGHTS:
                index[f"layers.{i}.mlp.{w}.weight"] = SliceSpec(dim=0, index=idx, full_size=hidden)
            for w in MLP_COL_WEIGHTS:
                index[f"layers.{i}.mlp.{w}.weight"] = SliceSpec(dim=1, index=idx, full_size=hidden)
        return index

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation; equal on every worker for the tensors (or slices) they share."""
        init_from_seed(self, seed, lambda name, shape, gen: init_tensor(self.config, name, shape, gen))


def init_tensor(config: LlamaConfig, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The full-model tensor ``name`` at initialisation (CPU, float32).

    Embeddings N(0, 1); output N(0, 1/d); wq/wk/wv/w_gate N(0, 0.02^2); the projections back into
    the residual stream (wo, w_up, w_down) N(0, (0.02 / sqrt(2 n_layers))^2), as in torchtitan;
    RMSNorm weights 1.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "tok_embeddings.weight":
        std = 1.0
    elif name == "output.weight":
        std = config.dim**-0.5
    elif name.endswith(("wo.weight", "w_up.weight", "w_down.weight")):
        std = 0.02 / (2 * config.n_layers) ** 0.5
    else:
        std = 0.02
    return torch.randn(shape, generator=generator) * std


def block_map(config: LlamaConfig) -> BlockMap:
    """Blocks: ``layers.i`` (block level); ``layers.i.mlp.g{g}`` = rows of w_gate/w_up, columns of w_down."""
    with on_meta():
        shapes, params = state_shapes(Llama(config))
    by_layer = names_by_prefix(shapes)
    layer_blocks = tuple(
        Block(f"layers.{i}", tuple((n, WHOLE) for n in by_layer[f"layers.{i}"])) for i in range(config.n_layers)
    )
    neuron_blocks = []
    for i in range(config.n_layers):
        for g in range(config.neuron_groups):
            idx = tuple(neuron_group(config, g))
            rows = SliceSpec(dim=0, index=idx, full_size=config.hidden_dim)
            cols = SliceSpec(dim=1, index=idx, full_size=config.hidden_dim)
            tensors = [(f"layers.{i}.mlp.{w}.weight", rows) for w in MLP_ROW_WEIGHTS]
            tensors += [(f"layers.{i}.mlp.{w}.weight", cols) for w in MLP_COL_WEIGHTS]
            neuron_blocks.append(Block(f"layers.{i}.mlp.g{g}", tuple(tensors)))
    return BlockMap(
        model=config.name, shapes=shapes, parameter_names=params,
        blocks={"block": layer_blocks, "neuron": tuple(neuron_blocks)},
    )


def subnet_kwargs(config: LlamaConfig, held: np.ndarray, level: str) -> dict[str, object]:
    """`Llama` constructor arguments for a worker holding the blocks where ``held`` (validated) is True."""
    check_level(level)
    if level == "block":
        return {"layer_ids": [i for i in range(config.n_layers) if held[i]]}
    held_groups = held.reshape(config.n_layers, config.neuron_groups)
    return {
        "mlp_index": {
            i: [n for g in range(config.neuron_groups) if held_groups[i, g] for n in neuron_group(config, g)]
            for i in range(config.n_layers)
        }
    }


def activations(model: Llama, frozen: frozenset[str], *, batch_size: int, seq_len: int, image_size: int,
                elem: int, loss_chunks: int = 0) -> ActivationModel:
    """Activation bytes of a (worker) `Llama` over ``batch_size`` x ``seq_len`` tokens (N tokens).

    Per token, in elements (d width, h the block's MLP width, H heads, V vocabulary): a block saves
    9d + 4h + 2 + H (two RMSNorms: x*rsqrt and its scaled output, 2d each plus rsqrt; RoPE'd q, k,
    v and the attention output, 4d; the attention residual, d; SwiGLU gate, silu, up and their
    product, 4h; SDPA's log-sum-exp, H) and outputs d. A frozen block (Bb-SDP) keeps no input of a
    frozen weight: 5d + 3h + 2 + H. A block without MLP (N-SDP, every group dropped): 6d + 1 + H.
    Backward peak (inside the MLP): +2h + d (the gradients of the product, silu and up outputs while
    the product input is already freed, plus the block's output gradient); frozen +3h + d; without
    MLP +5d (SDPA's q, k, v gradients). Head 2d + 1 + V (final norm, log-softmax), loss backward 2V;
    the RoPE tables and the int64 batch are constant.

    With ``loss_chunks`` = c >= 1 (`sdp_train.models.lm_loss`), chunks of m = ceil(N / c) tokens: the
    head keeps d + 1 per token of the final norm and the gradient of its output, d, which the loss
    computes in forward, and the head weight's gradient, V d in all; while the loss runs, the norm's
    output (N d) and one chunk's logits (m V) are alive besides: counted as the loss's backward.
    """
    c = model.config
    n = batch_size * seq_len
    d, heads, v = c.dim, c.n_heads, c.vocab_size
    blocks = []
    for i, block in model.layers.items():
        name = f"layers.{i}"
        h = block.mlp.w_gate.out_features if block.mlp is not None else 0
        if h == 0:
            saved, backward, grad = 6 * d + 1 + heads - (2 * d if name in frozen else 0), 5 * d, d * d
        elif name in frozen:
            saved, backward, grad = 5 * d + 3 * h + 2 + heads, 3 * h + d, 0
        else:
            saved, backward, grad = 9 * d + 4 * h + 2 + heads, 2 * h + d, d * h
        blocks.append(BlockActivations(name, n * saved * elem, n * d * elem, n * backward * elem, grad))
    rope = 2 * seq_len * c.head_dim * 4  # cos, sin: float32 (T, head_dim)
    batch = 2 * n * 8  # int64 tokens and targets
    if loss_chunks:
        head = (n * (2 * d + 1) + v * d) * elem
        loss_backward = (n * d + -(-n // loss_chunks) * v) * elem
    else:
        head, loss_backward = n * (2 * d + 1 + v) * elem, 2 * n * v * elem
    return ActivationModel(stem=n * d * elem, blocks=tuple(blocks), head=head, loss_backward=loss_backward,
                           constant=rope + batch, head_prefixes=("norm.", "output."))


FAMILY = ModelFamily(name="llama", config_class=LlamaConfig, model_class=Llama, presets=llama_configs,
                     num_params=num_params, block_map=block_map, subnet_kwargs=subnet_kwargs, data="text",
                     activations=activations, mlp=MLPSpec(("mlp.w_gate", "mlp.w_up"), "mlp.w_down"),
                     chunked_loss=True)
