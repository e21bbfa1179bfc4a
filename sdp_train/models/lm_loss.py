"""A language model's head and cross-entropy computed a chunk of tokens at a time, never the full logits.

`chunked_cross_entropy(hidden, weight, targets, chunks)` is ``F.cross_entropy(hidden @ weight.T,
targets)`` (the mean over the targets that are not ``ignore_index``) with the same gradients, to
float32 rounding, but holds one chunk's logits (tokens x vocabulary) at a time instead of the whole
batch's, its log-softmax and their gradients. As Liger-Kernel's fused linear cross-entropy does,
forward computes each chunk's logits, its loss and at once its gradients: the chunk's rows of the
hidden states' gradient and its part of the weight's, both tensors forward then keeps for backward,
which only scales them by the loss's gradient. So nothing is recomputed and the head costs the
FLOPs it costs without chunking; forward holds, besides the gradients, one chunk's logits, turned
into their gradient in place. The built-in language models call it from ``forward(tokens,
targets, loss_chunks=N)`` (`sdp_train.models.llama`), so that DDP, FSDP and the SDP wrappers see
one forward that returns the loss, and the trainer uses it for every mode alike (``loss_chunks``).

Not here: the bytes `sdp plan` counts for it (the llama family's ``activations``), a fused kernel.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from sdp_train.errors import ConfigError

IGNORE_INDEX = -100
"""Targets with this value take no part in the loss, as in ``torch.nn.functional.cross_entropy``."""


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int, *,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T``, computed ``chunks`` token chunks at a time.

    Parameters
    ----------
    hidden : Tensor (..., D)
        The final hidden states (after the final norm), any leading shape (N tokens in all).
    weight : Tensor (V, D)
        The output layer's weight (bias-free; a tied embedding's weight works alike).
    targets : int64 Tensor (...)
        The leading shape of `hidden`; ``ignore_index`` marks tokens without a target.
    chunks : int
        Number of chunks the N tokens are cut into (sizes differ by at most one; a chunk holds
        ``ceil(N / chunks)`` tokens at most); more than N leaves some empty.

    Returns
    -------
    Tensor
        The scalar mean loss over the tokens with a target, float32 (float64 for float64 inputs);
        NaN when no token has a target, as torch's. Its backward gives `hidden` and `weight` their gradients; double backward is
        not supported.

    Examples
    --------
    >>> import torch.nn.functional as F
    >>> g = torch.Generator().manual_seed(0)
    >>> h, w = torch.randn(2, 5, 4, generator=g), torch.randn(7, 4, generator=g)
    >>> t = torch.randint(0, 7, (2, 5), generator=g)
    >>> torch.allclose(chunked_cross_entropy(h, w, t, 3), F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten()))
    True
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks={chunks!r} must be an integer >= 1")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ConfigError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not multiply: "
                          f"weight must be (vocab, {hidden.shape[-1]})")
    if targets.shape != hidden.shape[:-1]:
        raise ConfigError(f"targets {tuple(targets.shape)} must have the leading shape of hidden "
                          f"{tuple(hidden.shape)}, {tuple(hidden.shape[:-1])}")
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(flat_hidden, weight, flat_targets, chunks, ignore_index)
    return _chunks_pass(flat_hidden, weight, flat_targets, chunks, ignore_index, None, None)[0]


def _chunks_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int, ignore_index: int,
                 grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss and the number of targets; fills `grad_hidden` and adds into `grad_weight` when given."""
    valid = targets != ignore_index
    count = valid.sum()
    device = hidden.device.type
    # the matmuls in the dtype torch would use for them (autocast's, inside autocast), the softmax in float32
    # at least, as torch's cross-entropy under autocast
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else torch.promote_types(hidden.dtype, weight.dtype))
    softmax_dtype = torch.promote_types(dtype, torch.float32)
    total = torch.zeros((), dtype=softmax_dtype, device=hidden.device)
    n = hidden.shape[0]
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)
        for c in range(chunks):
            start, stop = n * c // chunks, n * (c + 1) // chunks
            if start == stop:
                continue
            h, t, v = hidden[start:stop].to(dtype), targets[start:stop], valid[start:stop]
            t = t.masked_fill(~v, 0)
            logits = (h @ w.T).to(softmax_dtype)  # (m, V): the only chunk-sized tensor
            picked = logits.gather(1, t[:, None]).squeeze(1)
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: no second (m, V) tensor
            sums = probs.sum(dim=1, keepdim=True)
            total += ((top.squeeze(1) + sums.squeeze(1).log() - picked) * v).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(mean loss)/d(logits) = (softmax - onehot(target)) / count, rows without a target zero
            grad_logits = probs.div_(sums)
            grad_logits[torch.arange(stop - start, device=t.device), t] -= 1.0
            grad_logits = grad_logits.mul_((v.to(softmax_dtype) / count)[:, None]).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ w
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T.to(grad_weight.dtype), h.to(grad_weight.dtype))
    return total / count, count


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                ignore_index: int) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        loss, _ = _chunks_pass(hidden, weight, targets, chunks, ignore_index, grad_hidden, grad_weight)
        ctx.grads = (grad_hidden, grad_weight)  # neither an input nor an output: kept on ctx
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("backward through chunked_cross_entropy ran twice: it keeps its gradients for one "
                               "backward (retain_graph is not supported)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # released as soon as autograd has taken them
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_loss.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None
