"""How a batch pads what it does not have: the fills every caller uses, written once.

Rollout side (a position's top-K, a position past a response's end):

    PAD_ID = −1            a slot holding no token: never aliases a real id (SPEC §8)
    PAD_LOGP = −inf        its log μ: zero mass, so the head's log-mass and μ_T are the real slots'
    PAD_SAMPLED = 0        the sampled id of a position past the end (outside the response mask)
    PAD_SAMPLED_LOGP = 0.0 its log μ_k: finite, as ``support_from_topk`` requires of every row

A position past the end is outside the response mask; ``support_from_topk(row_mask=...)``
replaces its row by a trivial one (id 0 at log-prob 0, so μ_T = 0).

Trainer side: a row with no logits (padding) takes π := μ (``policy_with_padding_rows``): zero
divergence, a zero ratio step, and the tail sum of squares at its bound π_T² (SPEC §3: Q ≤ π_T²).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.support import Support

PAD_ID = -1
PAD_LOGP = float("-inf")
PAD_SAMPLED = 0
PAD_SAMPLED_LOGP = 0.0


def pad_to_length(x: Tensor, length: int, fill: float | int) -> Tensor:
    """[T', …] → [length, …]: cut after `length` rows, or filled with `fill` after row T'."""
    out = torch.full((length, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    rows = min(length, x.shape[0])
    out[:rows] = x[:rows]
    return out


def policy_with_padding_rows(support: Support, rows: Tensor, pi_rows: PolicyOnSupport) -> PolicyOnSupport:
    """π on every row of `support` from π on some of them.

    Args:
        support: μ's support, N rows.
        rows: [R] int64, the rows π was computed for (the ones with logits).
        pi_rows: π on ``support.ids[rows]``; ``logp`` carries the gradient.

    Every other row takes π := μ: log π = log μ on the support, log π_T = log μ_T, and
    log Σ_{i∉S} π_i² = 2·log μ_T.
    """
    dtype = pi_rows.logp.dtype
    logp = support.mu_logp.to(dtype).index_put((rows,), pi_rows.logp)
    tail = support.mu_tail_logp.to(pi_rows.tail_logp.dtype).index_put((rows,), pi_rows.tail_logp)
    sumsq = (2 * support.mu_tail_logp.to(pi_rows.tail_log_sumsq.dtype)).index_put((rows,), pi_rows.tail_log_sumsq)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq)


__all__ = ["PAD_ID", "PAD_LOGP", "PAD_SAMPLED", "PAD_SAMPLED_LOGP", "pad_to_length", "policy_with_padding_rows"]
