"""Your own models under ``sdp train``: each function here builds an ``nn.Module`` for ``--model FILE.py:FUNCTION``.

    sdp train --model examples/sdp_train_models.py:byte_lm --mode bsdp --active 0.5 --workers 2 --steps 20
    sdp train --model examples/sdp_train_models.py:digits_classifier --mode nsdp --active 0.5 --workers 2
    sdp train --model examples/sdp_train_models.py:hf_llama --blocks "model.layers.*" --workers 2

Keyword arguments come from ``model_overrides`` in a ``--config`` file (``{"depth": 8}``). A text
model takes token ids ``(batch, seq_len)`` and returns logits ``(batch, seq_len, vocab)``; an
image model takes ``(batch, channels, side, side)`` and returns ``(batch, classes)`` (docs/api.md,
"sdp train with your own model").
"""

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block: what SDP masks (drops, or cuts to some of its neurons)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ByteLM(nn.Module):
    """Next-byte prediction from a causal running mean of the byte embeddings, then residual MLP blocks."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        steps = torch.arange(1, tokens.shape[1] + 1, device=h.device, dtype=h.dtype)
        h = h + h.cumsum(dim=1) / steps[:, None]  # each position sees itself and the mean of its past
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class DigitsClassifier(nn.Module):
    """An MLP over 8x8 one-channel images (``--data digits``, the default for image models)."""

    def __init__(self, width: int, depth: int, channels: int, side: int) -> None:
        super().__init__()
        self.embed = nn.Linear(channels * side * side, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.embed(images.flatten(1))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def byte_lm(width: int = 64, depth: int = 4) -> nn.Module:
    return ByteLM(256, width, depth)


def digits_classifier(width: int = 64, depth: int = 4, channels: int = 1, side: int = 8) -> nn.Module:
    return DigitsClassifier(width, depth, channels, side)


def hf_llama(hidden_size: int = 64, layers: int = 4) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` from a small config (no download; needs transformers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config)
