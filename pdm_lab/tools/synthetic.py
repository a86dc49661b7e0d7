"""Synthetic LLM-like next-token distributions for demos, benches and tests.

Real next-token logits are heavy-headed: a few tokens hold most of the mass and a long Zipf-like
tail holds the rest. ``llm_like_logits`` draws such rows with a per-row peakedness, so one batch
spans peaked positions (tail mass below 1%) and high-entropy ones.
"""
from __future__ import annotations

import torch
from torch import Tensor


def llm_like_logits(n_tokens: int, vocab: int, *, generator: torch.Generator | None = None,
                    zipf: float = 1.1, peak_range: tuple[float, float] = (0.5, 4.0),
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """[N, n] logits: −s·zipf·log(rank) over a random permutation of ids, plus Gaussian jitter.

    s ~ U(peak_range) per row sets the peakedness (larger s: smaller tail mass).
    """
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    base = -zipf * torch.log(ranks)
    scale = torch.empty(n_tokens, 1, dtype=torch.float64).uniform_(*peak_range, generator=generator)
    jitter = torch.randn(n_tokens, vocab, generator=generator, dtype=torch.float64) * 0.5
    by_rank = scale * base + jitter
    # token id of each rank: one random permutation, cyclically shifted per row (cheap, and rows
    # do not share their favourite tokens)
    perm = torch.randperm(vocab, generator=generator)
    shift = torch.randint(0, vocab, (n_tokens, 1), generator=generator)
    ids = (perm[None, :] + shift) % vocab
    logits = torch.empty_like(by_rank).scatter_(1, ids, by_rank)
    return logits.to(dtype)


def perturb_logits(logits: Tensor, *, noise: float, generator: torch.Generator | None = None) -> Tensor:
    """Behaviour-side copy: logits + σ·ε, ε ~ N(0, 1) i.i.d. (the simplest precision mismatch)."""
    eps = torch.randn(logits.shape, generator=generator, dtype=torch.float64).to(logits.dtype)
    return logits + noise * eps


def sample_tokens(logp: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    """[N] int64 samples from rows of log-probabilities by Gumbel-max (no torch.multinomial)."""
    u = torch.rand(logp.shape, generator=generator, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return torch.argmax(logp.double() + gumbel, dim=1)


def synthetic_batch(n_tokens: int, vocab: int, *, noise: float, seed: int = 0,
                    dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """μ, π (full log-probs), tokens sampled from μ and ±1 advantages: one mismatch batch."""
    gen = torch.Generator().manual_seed(seed)
    pi_logits = llm_like_logits(n_tokens, vocab, generator=gen, dtype=dtype)
    mu_logits = perturb_logits(pi_logits, noise=noise, generator=gen)
    mu_logp = torch.log_softmax(mu_logits, dim=-1)
    pi_logp = torch.log_softmax(pi_logits, dim=-1)
    sampled = sample_tokens(mu_logp, generator=gen)
    advantages = torch.where(torch.rand(n_tokens, generator=gen) < 0.5, -1.0, 1.0).to(dtype)
    return {"mu_logp": mu_logp, "pi_logp": pi_logp, "sampled": sampled, "advantages": advantages}
