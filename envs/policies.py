"""Softmax policies over the vocabulary: a frozen "pretrained" prior plus a trainable part.

logits(obs) = prior[state(obs)] + delta(obs), with prior [S, n] a buffer (the Zipf-like
pretrained model) and delta either a table (``TabularPolicy``) or a small shared network
(``NeuralPolicy``). In the neural policy one gradient step on one token moves the logits of every
token in every state through the shared weights — the coupling that the per-token first-order
argument of SPEC §3 ignores, so the audit can measure it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

POLICY_KINDS = ("tabular", "neural")


class TabularPolicy(nn.Module):
    """logits = prior[s] + table[s]; ``table`` [S, n] starts at zero.

    Args:
        encoder: maps observations to state indices (``encoders.*Encoder``).
        prior: [S, n] float32 initial logits.
    """

    def __init__(self, encoder, prior: Tensor):
        super().__init__()
        self.encoder = encoder
        self.register_buffer("prior", prior.clone().float())
        self.table = nn.Parameter(torch.zeros_like(self.prior))

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] float32 logits."""
        s = self.encoder.state_index(obs)
        return self.prior[s] + self.table[s]


class NeuralPolicy(nn.Module):
    """logits = prior[s] + W₂ tanh(W₁ x + b₁) + b₂, x = encoder features.

    Args:
        encoder: maps observations to features and state indices.
        prior: [S, n] float32 initial logits.
        hidden: width of the hidden layer.
        generator: seeded generator for the initial weights.
        init_scale: std of the output layer's initial weights (small: starts near the prior).
    """

    def __init__(self, encoder, prior: Tensor, *, hidden: int = 64,
                 generator: torch.Generator | None = None, init_scale: float = 0.01):
        super().__init__()
        self.encoder = encoder
        self.register_buffer("prior", prior.clone().float())
        n = prior.shape[1]
        f = encoder.feature_dim
        self.w1 = nn.Parameter(torch.randn(f, hidden, generator=generator) / f ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, n, generator=generator) * init_scale)
        self.b2 = nn.Parameter(torch.zeros(n))

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] float32 logits."""
        h = torch.tanh(self.encoder.features(obs).to(self.w1.dtype) @ self.w1 + self.b1)
        return self.prior[self.encoder.state_index(obs)] + h @ self.w2 + self.b2


def make_policy(kind: str, encoder, prior: Tensor, *, seed: int = 0, hidden: int = 64) -> nn.Module:
    """Build a policy by name (``tabular`` or ``neural``)."""
    if kind == "tabular":
        return TabularPolicy(encoder, prior)
    if kind == "neural":
        gen = torch.Generator().manual_seed(seed)
        return NeuralPolicy(encoder, prior, hidden=hidden, generator=gen)
    raise ValueError(f"policy: unknown {kind!r}; valid: {', '.join(POLICY_KINDS)}")
