"""A small GPT-style model (torch.nn only) and synthetic data, for `memtide run` and the tests."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks with causal
    self-attention (nn.TransformerEncoderLayer and a causal mask), final LayerNorm, and an output
    head tied to the token embedding."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"TinyGPT: d_model ({d_model}) must be a multiple of heads ({heads})")
        self.seq = seq
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's scale: with N(0, 1) tied embeddings the first logits are huge and the loss
        # starts far above log(vocab).
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"TinyGPT: sequence of {t} tokens, the model was built for at most {self.seq}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        # True above the diagonal: a token may not attend to later ones.
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def arithmetic_batch(generator: torch.Generator, batch: int, seq: int, vocab: int,
                     device: torch.device = torch.device("cpu")) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequences x_t = (x_0 + t * d) mod vocab with random x_0 and d: learnable from two tokens on,
    so the loss visibly falls within a few steps. Returns (inputs, next-token targets)."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, max(2, min(vocab, 8)), (batch, 1), generator=generator)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    seqs = seqs.to(device)
    return seqs[:, :-1], seqs[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
