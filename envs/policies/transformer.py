"""A toy-sized causal transformer policy: the logit kernel of an LLM inside the token MDP (SPEC §6d).

logits(obs) = prior[row(obs)] + W h(obs) + b, where h is the final hidden state of a pre-norm
causal transformer read at the last position of the context window, and W [n, d] the
unembedding, tied to the token embedding (``transformer_tied``) or its own matrix
(``transformer``). Every token's logits move through the shared hidden state and W, so the
empirical kernel K = J Jᵀ of a step is the transformer's kind: the head's own part ‖h‖²·I (+1 for
the bias) plus W K_h Wᵀ through h — not the tabular K = I the direction tests assume.

The context is the observation: the prompt (hashed into ``PROMPT_BUCKETS`` embedding rows) and the
last ``WINDOW`` written tokens, right-aligned, padding masked out of the attention (a bandit's
observation is the prompt alone). Width d is the config's ``hidden``; ``LAYERS`` blocks of
``HEADS``-head attention and a 4d tanh-GELU MLP, RMSNorm before each and at the end.

The engine's hooks are the neural policy's: ``activation_round`` rounds the hidden activations and
the logits (``*_engine`` mismatch kinds; no weight is stored in e4m3, ``FP8_WEIGHTS`` is empty),
``output_error(h)`` adds the engine's output-layer error (``outlier``); ``w2`` is Wᵀ [d, n].
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pdm_lab.envs.policies.base import Rounding, prior_rows

TRANSFORMER_KINDS = ("transformer", "transformer_tied")
WINDOW = 8
"""written tokens the policy reads (the most recent), beside the prompt."""
LAYERS = 2
HEADS = 2
PROMPT_BUCKETS = 1024


def _rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * weight


def context_window(obs: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """[B, D] int64 token-MDP observations over n tokens → ([B, 1 + WINDOW] int64 embedding rows,
    [B, 1 + WINDOW] bool real (not pad)): the prompt (row n + 1 + its bucket) then the last
    ``WINDOW`` written tokens, right-aligned; pads are row n."""
    b = obs.shape[0]
    prompt = n + 1 + obs[:, 0] % PROMPT_BUCKETS
    written = obs[:, 1:]
    count = (written != n).sum(dim=1) if written.shape[1] else torch.zeros(b, dtype=torch.long)
    slot = torch.arange(WINDOW)
    take = count[:, None] - WINDOW + slot  # index into written; < 0 before the first token
    real = take >= 0
    tokens = torch.full((b, WINDOW), n, dtype=torch.long)
    if written.shape[1]:
        tokens = torch.where(real, written.gather(1, take.clamp(min=0, max=written.shape[1] - 1)), tokens)
    first = (WINDOW - count.clamp(max=WINDOW))[:, None]  # the prompt's position
    position = torch.arange(WINDOW + 1)
    after = torch.cat([torch.full((b, 1), n, dtype=torch.long), tokens], dim=1)  # slot p − 1 at p
    ids = torch.where(position == first, prompt[:, None], torch.where(position > first, after, n))
    return ids, position >= first


class TransformerPolicy(Rounding, nn.Module):
    """logits = prior[s] + W h + b with h a causal transformer's last hidden state.

    Args:
        encoder: the problem's encoder (rows of the prior: ``encoder.prior_index``).
        prior: [R, n] float32 initial logits.
        hidden: d, the model width (a multiple of ``HEADS``).
        tied: W is the token embedding's first n rows (as in tied-embedding LLMs).
        generator: seeded generator for the initial weights.
        init_scale: std of W's rows (untied) or of the embedding (tied): small, so π starts near
            the prior.
    """

    FP8_WEIGHTS: tuple[str, ...] = ()

    def __init__(self, encoder, prior: Tensor, *, hidden: int = 64, tied: bool = False,
                 generator: torch.Generator | None = None, init_scale: float = 0.01):
        super().__init__()
        if hidden % HEADS:
            raise ValueError(f"hidden: the transformer's width must be a multiple of {HEADS} heads, got {hidden}")
        self.encoder = encoder
        self.tied = tied
        self.register_buffer("prior", prior.clone().float())
        n, d = prior.shape[1], hidden
        self.vocab = n

        def randn(*shape, std):
            return nn.Parameter(torch.randn(*shape, generator=generator) * std)

        # rows: n tokens, the pad, then the prompt buckets
        self.embed = randn(n + 1 + PROMPT_BUCKETS, d, std=init_scale if tied else 1.0)
        self.pos = randn(WINDOW + 1, d, std=1.0)
        self.qkv = nn.ParameterList([randn(d, 3 * d, std=1 / math.sqrt(d)) for _ in range(LAYERS)])
        self.proj = nn.ParameterList([randn(d, d, std=1 / math.sqrt(d)) for _ in range(LAYERS)])
        self.mlp_in = nn.ParameterList([randn(d, 4 * d, std=1 / math.sqrt(d)) for _ in range(LAYERS)])
        self.mlp_out = nn.ParameterList([randn(4 * d, d, std=1 / math.sqrt(4 * d)) for _ in range(LAYERS)])
        self.norms = nn.Parameter(torch.ones(2 * LAYERS + 1, d))
        self.head = None if tied else randn(n, d, std=init_scale)
        self.bias = nn.Parameter(torch.zeros(n))

    def unembedding(self) -> Tensor:
        """W [n, d]: the rows the final hidden state is read out with."""
        return self.embed[: self.vocab] if self.tied else self.head

    @property
    def w2(self) -> Tensor:
        """Wᵀ [d, n] (the shape the ``outlier`` mismatch reads)."""
        return self.unembedding().T

    def context(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """``context_window`` over this policy's vocabulary."""
        return context_window(obs, self.vocab)

    def hidden_state(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, d] the final normed hidden state at the last position."""
        ids, real = self.context(obs)
        x = self.embed[ids] + self.pos
        b, t, d = x.shape
        hd = d // HEADS
        # causal, pads masked as keys; a pad query reads itself (never a real one), so no row is empty
        eye = torch.eye(t, dtype=torch.bool)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (real[:, None, :] | eye)  # [B, t, t]
        for layer in range(LAYERS):
            q, k, v = (_rms_norm(x, self.norms[2 * layer]) @ self.qkv[layer]).split(d, dim=-1)
            q, k, v = (y.view(b, t, HEADS, hd).transpose(1, 2) for y in (q, k, v))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            att = torch.softmax(scores, dim=-1)
            x = x + self._act((att @ v).transpose(1, 2).reshape(b, t, d)) @ self.proj[layer]
            inner = self._act(nn.functional.gelu(_rms_norm(x, self.norms[2 * layer + 1]) @ self.mlp_in[layer],
                                                 approximate="tanh"))
            x = x + inner @ self.mlp_out[layer]
        return self._act(_rms_norm(x[:, -1], self.norms[-1]))

    def trainable_logits(self, obs: Tensor) -> Tensor:
        """[B, D] int64 → [B, n] W h + b (plus the engine's ``output_error(h)`` in its copy)."""
        h = self.hidden_state(obs)
        out = h @ self.unembedding().T + self.bias
        return out if self.output_error is None else out + self.output_error(h)

    def forward(self, obs: Tensor) -> Tensor:
        """[B, D] int64 observations → [B, n] logits (the parameters' dtype)."""
        return self._act(self.prior[prior_rows(self.encoder, obs)] + self.trainable_logits(obs), logits=True)
