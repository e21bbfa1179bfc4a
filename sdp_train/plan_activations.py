"""Analytic activation memory of one worker's forward and backward, per model family.

For every tensor that autograd keeps for backward (eager PyTorch, the training run's code path),
a formula from the model's shapes; nothing is allocated and nothing is fitted. A worker's
activations are split the way backward releases them:

- ``stem``: the embedding / patch-embedding / stem output, the first block's input;
- per residual block the worker runs (forward order): ``saved`` (what the block keeps, its input
  and output excluded), ``output`` (kept by the next block or the head), and ``backward``: the
  bytes its backward adds on top of ``saved`` at its own peak (gradient temporaries minus saved
  tensors already released);
- ``head``: what the final norm, classifier and loss keep, and ``loss_backward``: the gradient
  temporaries when backward starts;
- ``constant``: tensors alive through the step (input batch, RoPE tables).

Per token (language models; N = batch x seq_len tokens) or per image position (vision), in
elements, with d the width, h a block's MLP hidden width, H the heads, V the vocabulary:

- LLaMA block: saved 9d + 4h + 2 + H (two RMSNorms: x*rsqrt and its scaled output, 2d each plus
  rsqrt; RoPE'd q, k, v and the attention output, 4d; the attention residual, d; SwiGLU
  gate, silu, up and their product, 4h; SDPA's log-sum-exp, H); output d. A frozen block
  (Bb-SDP) keeps no input of a frozen weight: 5d + 3h + 2 + H. A block without MLP (N-SDP,
  every group dropped): 6d + 1 + H. Backward peak (inside the MLP): +2h + d (the gradients of
  the product, silu and up outputs while the product input is already freed, plus the
  block's output gradient); frozen +3h + d; without MLP +5d (SDPA's q, k, v gradients).
  Head 2d + 1 + V (final norm, log-softmax), loss backward 2V.
- ViT block: saved 7d + 2h + 4 + H (LayerNorm outputs and statistics, the fused qkv output 3d,
  attention output, attention residual, fc1 and GELU outputs); frozen 5d + h + 4 + H; backward
  +h + d (frozen +2h + d). Head: final LayerNorm statistics 2 per position, the pooled features
  and log-softmax per image.
- ResNet BasicBlock (A output positions, c_i inner, c_o output channels): saved
  2 c_i A + c_o A (+ c_o A with a downsampling shortcut) + BatchNorm statistics; output c_o A;
  backward +(c_i + c_o) A. BatchNorm needs its input for the input gradient, so a frozen
  block keeps the same.

With activation checkpointing a block keeps only its input during forward; its ``saved`` set is
recomputed at the start of its backward, so the block's backward peak is unchanged.

Not modelled: allocator rounding and fragmentation (CUDA caching allocator), cuDNN / oneDNN
workspaces, the math SDPA fallback (which would keep the T x T attention matrix), mixed precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.models import Llama, ResNet, ViT


@dataclass(frozen=True)
class BlockActivations:
    """One residual block's activation bytes (see the module docstring)."""

    name: str
    saved: int
    output: int
    backward: int
    first_grad: int
    """Elements of the first weight gradients its backward produces (unsharded under FSDP until
    the block's reduce-scatter)."""


@dataclass(frozen=True)
class ActivationModel:
    """A worker's activation bytes, split as backward releases them."""

    stem: int
    blocks: tuple[BlockActivations, ...]
    head: int
    loss_backward: int
    constant: int
    head_prefixes: tuple[str, ...]
    """Parameter-name prefixes of the head, whose gradients backward produces before any block's."""

    def forward_bytes(self, ac: bool) -> int:
        """Bytes kept at the end of forward: everything, or with checkpointing the block inputs."""
        blocks = sum((0 if ac else b.saved) + b.output for b in self.blocks)
        return self.stem + blocks + self.head + self.constant


def activation_model(model: nn.Module, frozen: frozenset[str], *, batch_size: int, seq_len: int,
                     image_size: int, elem: int) -> ActivationModel:
    """The activation model of ``model`` (a worker's model, built on the meta device).

    Parameters
    ----------
    model : nn.Module
        `Llama`, `ViT` or `ResNet`, full or a worker's subnetwork.
    frozen : frozenset of str
        Names of residual blocks whose parameters take no gradient (Bb-SDP).
    batch_size, seq_len, image_size : int
        Sequences (images) per worker, tokens per sequence, image side in pixels.
    elem : int
        Bytes per activation element.
    """
    if isinstance(model, Llama):
        return _llama(model, frozen, batch_size * seq_len, seq_len, elem)
    if isinstance(model, ViT):
        return _vit(model, frozen, batch_size, image_size, elem)
    if isinstance(model, ResNet):
        return _resnet(model, batch_size, image_size, elem)
    raise ConfigError(f"no activation model for {type(model).__name__}")


def _llama(model: Llama, frozen: frozenset[str], n: int, seq_len: int, elem: int) -> ActivationModel:
    c = model.config
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
    return ActivationModel(stem=n * d * elem, blocks=tuple(blocks), head=n * (2 * d + 1 + v) * elem,
                           loss_backward=2 * n * v * elem, constant=rope + batch, head_prefixes=("norm.", "output."))


def _vit(model: ViT, frozen: frozenset[str], images: int, image_size: int, elem: int) -> ActivationModel:
    c = model.config
    if image_size % c.patch_size:
        raise ConfigError(f"{c.name}: image size {image_size} is not a multiple of patch_size={c.patch_size}")
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


def _resnet(model: ResNet, images: int, image_size: int, elem: int) -> ActivationModel:
    c = model.config
    side = image_size
    stem = (2 * c.channels[0] * side * side * images + 2 * c.channels[0]) * elem
    blocks = []
    for stage in model.stages:
        for j, block in getattr(model, stage).items():
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
