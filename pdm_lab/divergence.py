"""Proximity measures between μ and π (SPEC §2): top-K KL/TV, binary KL/TV, full KL.

Inputs are log-probabilities; every function is elementwise over tokens, [N, m] → [N]. The
probabilities μ = exp(log μ), π = exp(log π) on S may be passed too when the caller has them,
to save the exponentials on a hot path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.numerics import log1mexp, xlogy_ratio


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
            mu: Tensor | None = None, pi: Tensor | None = None, diff: Tensor | None = None) -> Tensor:
    """½(Σ_{i∈S}|μ_i − π_i| + |μ_T − π_T|). diff: μ − π on S when the caller has it."""
    if diff is None:
        mu = torch.exp(mu_logp) if mu is None else mu
        pi = torch.exp(pi_logp) if pi is None else pi
        diff = mu - pi
    head = diff.abs().sum(dim=-1)
    return 0.5 * (head + (torch.exp(mu_tail_logp) - torch.exp(pi_tail_logp)).abs())


def binary_tv(mu_logp_k: Tensor, pi_logp_k: Tensor) -> Tensor:
    """DPPO's binary TV on the sampled token: |π_k − μ_k|."""
    return (torch.exp(pi_logp_k) - torch.exp(mu_logp_k)).abs()


def binary_kl(mu_logp_k: Tensor, pi_logp_k: Tensor, *, mu_rest_logp: Tensor | None = None,
              pi_rest_logp: Tensor | None = None) -> Tensor:
    """DPPO's binary KL: KL(Bernoulli(μ_k) ‖ Bernoulli(π_k)).

    The complements log(1 − μ_k), log(1 − π_k) come from ``rest_logmass`` (a log-sum-exp over
    the rest of the distribution, SPEC §8) when given, else from log1mexp: with π_k within 1e-8
    of 1, log π_k rounds to 0 in float32 and log1mexp(0) = −inf would make the KL +inf.
    """
    mu_rest = log1mexp(mu_logp_k) if mu_rest_logp is None else mu_rest_logp
    pi_rest = log1mexp(pi_logp_k) if pi_rest_logp is None else pi_rest_logp
    kl = xlogy_ratio(mu_logp_k, pi_logp_k) + xlogy_ratio(mu_rest, pi_rest)
    return kl.clamp(min=0.0)


def full_kl(mu_logp_full: Tensor, pi_logp_full: Tensor) -> Tensor:
    """KL(μ ‖ π) over the whole vocabulary, [N, n] → [N]."""
    return xlogy_ratio(mu_logp_full, pi_logp_full).sum(dim=-1).clamp(min=0.0)
