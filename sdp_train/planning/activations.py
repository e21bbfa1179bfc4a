"""Analytic activation memory of one worker's forward and backward, looked up per model family.

For every tensor that autograd keeps for backward (eager PyTorch, the training run's code path),
a formula from the model's shapes; nothing is allocated and nothing is fitted. Each family's
formulas live in its own file (``activations`` of `sdp_train.models.llama`, ``.vit``,
``.resnet``, ``.swin``, registered in its `ModelFamily`). A worker's activations are split the way
backward releases them:

- ``stem``: the embedding / patch-embedding / stem output, the first block's input;
- per residual block the worker runs (forward order): ``saved`` (what the block keeps, its input
  and output excluded), ``output`` (kept by the next block, or by what lies between it and the
  next block, or by the head), and ``backward``: the bytes its backward adds on top of ``saved``
  at its own peak (gradient temporaries minus saved tensors already released);
- ``head``: what the final norm, classifier and loss keep, and ``loss_backward``: the gradient
  temporaries when backward starts;
- ``constant``: tensors alive through the step (input batch, RoPE tables).

With activation checkpointing a block keeps only its input during forward; its ``saved`` set is
recomputed at the start of its backward, so the block's backward peak is unchanged.

Not modelled: allocator rounding and fragmentation (CUDA caching allocator), cuDNN / oneDNN
workspaces, the math SDPA fallback (which would keep the T x T attention matrix), mixed precision.
"""

from __future__ import annotations

from torch import nn

from sdp_train.models import ActivationModel, BlockActivations, family_of_model

__all__ = ["ActivationModel", "BlockActivations", "activation_model"]


def activation_model(model: nn.Module, frozen: frozenset[str], *, batch_size: int, seq_len: int,
                     image_size: int, elem: int, loss_chunks: int = 0) -> ActivationModel:
    """The activation model of ``model`` (a worker's model, built on the meta device).

    Parameters
    ----------
    model : nn.Module
        A registered family's model (`Llama`, `ViT`, `ResNet`, ...), full or a worker's subnetwork.
    frozen : frozenset of str
        Names of residual blocks whose parameters take no gradient (Bb-SDP).
    batch_size, seq_len, image_size : int
        Sequences (images) per worker, tokens per sequence, image side in pixels.
    elem : int
        Bytes per activation element.
    loss_chunks : int
        ``sdp train --loss-chunks``: a family with a chunked loss (``ModelFamily.chunked_loss``)
        computes its head that many chunks of tokens at a time; 0, and the other families, hold
        the full logits.

    Raises
    ------
    ConfigError
        ``model`` belongs to no registered family.
    """
    family = family_of_model(model)
    chunks = {"loss_chunks": loss_chunks} if family.chunked_loss else {}
    return family.activations(model, frozen, batch_size=batch_size, seq_len=seq_len, image_size=image_size,
                              elem=elem, **chunks)
