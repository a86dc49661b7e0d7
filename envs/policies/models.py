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

from pdm_lab.envs.policies.base import Rounding, cached_input, encoder_key, prior_rows
from pdm_lab.envs.policies.qwen3 import Qwen3Policy
from pdm_lab.envs.policies.transformer import TransformerPolicy
from pdm_lab.envs.problems.encoders import multi_hot, ngram_index

POLICY_KINDS = ("tabular", "neural", "transformer", "transformer_tied", "qwen3", "qwen3_untied")


class TabularPolicy(Rounding, nn.Module):
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
        s = cached_input(obs, ("state", *encoder_key(self.encoder)), self.encoder.state_index)
        return self._act(self.prior[prior_rows(self.encoder, obs)] + self.table[s], logits=True)


class NeuralPolicy(Rounding, nn.Module):
    """logits = prior[s] + W₂ tanh(W₁ x + b₁) + b₂, x = encoder features (and, with
    ``context_features`` F > 0, F hashed multi-hot context features, ``encoders.ngram_features``).

    Args:
        encoder: maps observations to features and state indices.
        prior: [R, n] float32 initial logits (rows: ``encoder.prior_index``).
        hidden: width of the hidden layer.
        generator: seeded generator for the initial weights.
        init_scale: std of the output layer's initial weights (small: starts near the prior).
        context_features: F, hashed features of the context that overlap across contexts
            (token-MDP observations only; 0: the encoder's features alone).
    """

    FP8_WEIGHTS = ("w1",)
    """hidden matmul weights an FP8 engine stores in e4m3 (the output layer stays bf16)."""

    def __init__(self, encoder, prior: Tensor, *, hidden: int = 64,
                 generator: torch.Generator | None = None, init_scale: float = 0.01,
                 context_features: int = 0):
        super().__init__()
        self.encoder = encoder
        self.context_features = context_features
        self.register_buffer("prior", prior.clone().float())
        n = prior.shape[1]
        f = encoder.feature_dim + context_features
        self.w1 = nn.Parameter(torch.randn(f, hidden, generator=generator) / f ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, n, generator=generator) * init_scale)
        self.b2 = nn.Parameter(torch.zeros(n))

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] logits (the parameters' dtype)."""
        return self._act(self.prior[prior_rows(self.encoder, obs)] + self.trainable_logits(obs), logits=True)

    def active_features(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """[B, D] int64 → ([B, A] int64 the active input features, [B, A] float32 their values:
        1, or 0 for a repeat of an earlier index in the row). The input x is their multi-hot."""
        def compute(o: Tensor) -> tuple[Tensor, Tensor]:
            index = self.encoder.feature_index(o)
            if self.context_features:
                bins = ngram_index(o, self.context_features, self.encoder.task.vocab_size)
                index = torch.cat([index, self.encoder.feature_dim + bins], dim=1)
            repeat = (index[:, :, None] == index[:, None, :]).tril(diagonal=-1).any(dim=2)
            return index, (~repeat).float()
        return cached_input(obs, ("active_features", *encoder_key(self.encoder), self.context_features), compute)

    def input_key(self, obs: Tensor) -> Tensor:
        """[B, A] int64, rows equal exactly when the network's inputs are (repeats set to −1, sorted)."""
        index, value = self.active_features(obs)
        return torch.where(value > 0, index, -1).sort(dim=1).values

    def features(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, F] the network's input x (the parameters' dtype)."""
        return multi_hot(self.active_features(obs)[0], self.w1.shape[0]).to(self.w1.dtype)

    def trainable_logits(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, n] W₂ h + b₂ (plus the engine's ``output_error(h)`` in its copy).

        x is multi-hot, so W₁x is the sum of x's active rows of W₁: a few gathered rows instead of
        a [B, F] × [F, H] product (F grows with the response length). The engine's copy rounds x
        as the engine does, so it takes the dense product."""
        if self.activation_round is None:
            index, value = self.active_features(obs)
            value = value.to(self.w1.dtype)
            pre = self.b1 + sum(value[:, a, None] * self.w1[index[:, a]] for a in range(index.shape[1]))
        else:
            pre = self._act(self.features(obs)) @ self.w1 + self.b1
        h = self._act(torch.tanh(pre))
        out = h @ self.w2 + self.b2
        return out if self.output_error is None else out + self.output_error(h)


def make_policy(kind: str, encoder, prior: Tensor, *, seed: int = 0, hidden: int = 64,
                init_scale: float = 0.01, context_features: int = 0) -> nn.Module:
    """Build a policy by name (``tabular``, ``neural``, the causal ``transformer`` with an untied or
    tied unembedding, ``envs.policies.transformer``, or the loop's model family ``qwen3`` (tied) /
    ``qwen3_untied``, ``envs.policies.qwen3``, which initialises as the loop's model does and reads no
    ``init_scale``; ``context_features`` is the neural policy's)."""
    one_of("policy", kind, POLICY_KINDS)
    if kind == "tabular":
        return TabularPolicy(encoder, prior)
    if kind.startswith("qwen3"):
        return Qwen3Policy(encoder, prior, hidden=hidden, tied=kind == "qwen3", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if kind.startswith("transformer"):
        return TransformerPolicy(encoder, prior, hidden=hidden, tied=kind == "transformer_tied", generator=gen,
                                 init_scale=init_scale)
    return NeuralPolicy(encoder, prior, hidden=hidden, generator=gen, init_scale=init_scale,
                        context_features=context_features)
