"""Softmax policies over the vocabulary: a frozen "pretrained" prior plus a trainable part.

logits(obs) = prior[row(obs)] + delta(obs), with prior [R, n] a buffer (the Zipf-like
pretrained model, one row per automaton state or per hashed context: ``encoder.prior_index``)
and delta either a table over states (``TabularPolicy``) or a small shared network
(``NeuralPolicy``). A rollout engine's copy may carry ``activation_round`` (set by the
``*_engine`` mismatch kinds): then the hidden activations and the logits pass through it, as a
low-precision engine computes them. In the neural policy one gradient step on one token moves the logits of every
token in every state through the shared weights — the coupling that the per-token first-order
argument of SPEC §3 ignores, so the audit can measure it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from pdm_lab.config import one_of

POLICY_KINDS = ("tabular", "neural")


def _prior_rows(encoder, obs: Tensor) -> Tensor:
    return encoder.prior_index(obs) if hasattr(encoder, "prior_index") else encoder.state_index(obs)


class _Rounding:
    """``activation_round`` hook: None in the trainer, the engine's rounding in its copy."""

    activation_round = None

    def _act(self, x: Tensor, *, logits: bool = False) -> Tensor:
        return x if self.activation_round is None else self.activation_round(x, logits=logits)


class TabularPolicy(_Rounding, nn.Module):
    """logits = prior[s] + table[s]; ``table`` [S, n] starts at zero.

    Args:
        encoder: maps observations to state indices (``encoders.*Encoder``).
        prior: [R, n] float32 initial logits (rows: ``encoder.prior_index``).
    """

    def __init__(self, encoder, prior: Tensor):
        super().__init__()
        self.encoder = encoder
        self.register_buffer("prior", prior.clone().float())
        self.table = nn.Parameter(torch.zeros(encoder.num_states, prior.shape[1]))

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] logits (the parameters' dtype)."""
        s = self.encoder.state_index(obs)
        return self._act(self.prior[_prior_rows(self.encoder, obs)] + self.table[s], logits=True)


class NeuralPolicy(_Rounding, nn.Module):
    """logits = prior[s] + W₂ tanh(W₁ x + b₁) + b₂, x = encoder features.

    Args:
        encoder: maps observations to features and state indices.
        prior: [R, n] float32 initial logits (rows: ``encoder.prior_index``).
        hidden: width of the hidden layer.
        generator: seeded generator for the initial weights.
        init_scale: std of the output layer's initial weights (small: starts near the prior).
    """

    FP8_WEIGHTS = ("w1",)
    """hidden matmul weights an FP8 engine stores in e4m3 (the output layer stays bf16)."""

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
        """[B, D] int64 observations → [B, n] logits (the parameters' dtype)."""
        x = self._act(self.encoder.features(obs).to(self.w1.dtype))
        h = self._act(torch.tanh(x @ self.w1 + self.b1))
        return self._act(self.prior[_prior_rows(self.encoder, obs)] + h @ self.w2 + self.b2, logits=True)


def make_policy(kind: str, encoder, prior: Tensor, *, seed: int = 0, hidden: int = 64) -> nn.Module:
    """Build a policy by name (``tabular`` or ``neural``)."""
    one_of("policy", kind, POLICY_KINDS)
    if kind == "tabular":
        return TabularPolicy(encoder, prior)
    gen = torch.Generator().manual_seed(seed)
    return NeuralPolicy(encoder, prior, hidden=hidden, generator=gen)
