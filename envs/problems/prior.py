"""LLM-like initial logits: a Zipf law over ranks, randomly permuted per state.

An LLM's next-token distribution is close to Zipf: the i-th most likely token has probability
∝ i^(−1/τ). The temperature τ sets the tail mass: with n = 1000 and K = 20 the mass outside the
top 20 is ~52% at τ = 1, ~15% at τ = 2/3 and ~3% at τ = 1/2.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def zipf_logits(num_states: int, n: int, *, temperature: float | Tensor, generator: torch.Generator,
                fixed_top: int | None = None) -> Tensor:
    """Zipf-shaped logits, one independently permuted row per state.

    Args:
        num_states: P, rows to make.
        n: vocabulary size.
        temperature: τ > 0, or [P] one per state; logits are −log(rank)/τ.
        generator: seeded torch.Generator for the permutations.
        fixed_top: if given, this token id is forced to rank 1 in every row (an EOS-like token
            the "pretrained" model likes).

    Returns:
        [P, n] float32 logits (log-probabilities up to a constant).
    """
    tau = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1, 1)
    if (tau <= 0).any():
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    base = (-torch.log(ranks)[None, :] / tau).to(torch.float32).expand(num_states, n)
    order = torch.argsort(torch.rand(num_states, n, generator=generator), dim=1)
    if fixed_top is not None:
        # move `fixed_top` to rank position 0 by swapping it with whatever held that position
        pos = (order == fixed_top).to(torch.int8).argmax(dim=1)
        first = order[:, 0].clone()
        rows = torch.arange(num_states)
        order[rows, pos] = first
        order[:, 0] = fixed_top
    logits = torch.empty(num_states, n, dtype=torch.float32)  # the dtype of `base`, whatever the default
    logits.scatter_(1, order, base)
    return logits


def zipf_tail_mass(n: int, k: int, temperature: float) -> float:
    """Mass outside the top-k of the Zipf law ∝ rank^(−1/τ) over n tokens."""
    weights = [math.pow(i, -1.0 / temperature) for i in range(1, n + 1)]
    return sum(weights[k:]) / sum(weights)
