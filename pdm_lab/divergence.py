"""Proximity measures between μ and π (SPEC §2): top-K KL/TV, binary KL/TV, full KL.

Inputs are log-probabilities; every function is elementwise over tokens, [N, m] → [N]. The
probabilities μ = exp(log μ), π = exp(log π) on S may be passed too when the caller has them,
to save the exponentials on a hot path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .numerics import log1mexp, xlogy_ratio


def topk_kl(mu_logp: Tensor, pi_logp: Tensor, mu_tail_logp: Tensor, pi_tail_logp: Tensor, *,
            mu: Tensor | None = None) -> Tensor:
    """D = Σ_{i∈S} μ_i log(μ_i/π_i) + μ_T log(μ_T/π_T), with 0·log 0 = 0.

    Args:
        mu_logp, pi_logp: [N, m] log μ, log π on S (−inf at padding).
        mu_tail_logp, pi_tail_logp: [N] log μ_T, log π_T.
    """
    head = xlogy_ratio(mu_logp, pi_logp, mu).sum(dim=-1)
    # D ≥ 0 exactly (log-sum inequality); rounding can leave −1e-16 when π = μ
    return (head + xlogy_ratio(mu_tail_logp, pi_tail_logp)).clamp(min=0.0)


def topk_tv(mu_logp: Tensor, pi_logp: Tensor, mu_tail_logp: Tensor, pi_tail_logp: Tensor, *,
            mu: Tensor | None = None, pi: Tensor | None = None) -> Tensor:
    """½(Σ_{i∈S}|μ_i − π_i| + |μ_T − π_T|)."""
    mu = torch.exp(mu_logp) if mu is None else mu
    pi = torch.exp(pi_logp) if pi is None else pi
    head = (mu - pi).abs().sum(dim=-1)
    return 0.5 * (head + (torch.exp(mu_tail_logp) - torch.exp(pi_tail_logp)).abs())


def binary_tv(mu_logp_k: Tensor, pi_logp_k: Tensor) -> Tensor:
    """DPPO's binary TV on the sampled token: |π_k − μ_k|."""
    return (torch.exp(pi_logp_k) - torch.exp(mu_logp_k)).abs()


def binary_kl(mu_logp_k: Tensor, pi_logp_k: Tensor) -> Tensor:
    """DPPO's binary KL: KL(Bernoulli(μ_k) ‖ Bernoulli(π_k)), the complements via log1mexp."""
    kl = xlogy_ratio(mu_logp_k, pi_logp_k) + xlogy_ratio(log1mexp(mu_logp_k), log1mexp(pi_logp_k))
    return kl.clamp(min=0.0)


def full_kl(mu_logp_full: Tensor, pi_logp_full: Tensor) -> Tensor:
    """KL(μ ‖ π) over the whole vocabulary, [N, n] → [N]."""
    return xlogy_ratio(mu_logp_full, pi_logp_full).sum(dim=-1).clamp(min=0.0)
