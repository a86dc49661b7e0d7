"""π on the support, from the trainer's logits: the train-side half of SPEC §2–3.

``policy_on_support`` returns log π_i on S (differentiable), log π_T and log Σ_{i∉S} π_i² (for
the ``topk`` estimator) in one pass over the vocabulary, chunked over tokens so that no float32
[N, V] log-softmax is ever materialised, forward or backward. ``policy_on_support_reference`` is
the naive equivalent (``log_softmax(logits / T).gather(...)``) that tests and the bench compare to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import PDMInputError, check_logp, check_same, check_tensor, raise_at
from .numerics import masked_logsumexp

#: Elements of one float32 chunk of logits (4 MiB): a few such temporaries bound peak memory.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class PolicyOnSupport:
    """π on the support.

    Attributes:
        logp: [N, m] log π_i on the support ids, −inf at padding; differentiable w.r.t. logits.
        tail_logp: [N] log π_T (no grad).
        tail_log_sumsq: [N] log Σ_{i∉S} π_i² (no grad).
    """

    logp: Tensor
    tail_logp: Tensor
    tail_log_sumsq: Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are promoted to float32; float64 stays float64 (math tests).
    return torch.promote_types(dtype, torch.float32)


def _chunk_rows(n_rows: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise PDMInputError(f"chunk_size: must be ≥ 1, got {chunk_size}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _in_support(ids: Tensor, vocab: int) -> Tensor:
    """[c, V] bool membership; padding (−1) is redirected to a real id of the row, never 0."""
    fill = ids.max(dim=1, keepdim=True).values.clamp(min=0)
    member = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
    return member.scatter_(1, torch.where(ids >= 0, ids, fill), True)


class _SupportLogProb(torch.autograd.Function):
    """log π on support ids; backward recomputes softmax chunk by chunk (nothing [N, V] is saved)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, rows: int):
        n, vocab = logits.shape
        out_dtype = _compute_dtype(logits.dtype)
        logp = torch.empty(ids.shape, dtype=out_dtype, device=logits.device)
        tail = torch.empty(n, dtype=out_dtype, device=logits.device)
        sumsq = torch.empty(n, dtype=out_dtype, device=logits.device)
        lse = torch.empty(n, dtype=out_dtype, device=logits.device)
        safe_ids = ids.clamp(min=0)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            z = logits[lo:hi].to(out_dtype) / temperature  # the chunk's only [c, V] float buffer
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[lo:hi, None])  # now log π
            logp[lo:hi] = z.gather(1, safe_ids[lo:hi])
            z.masked_fill_(_in_support(ids[lo:hi], vocab), float("-inf"))  # keep the tail only
            tail[lo:hi] = torch.logsumexp(z, dim=-1)
            sumsq[lo:hi] = torch.logsumexp(z.mul_(2.0), dim=-1)
        logp = logp.masked_fill(ids < 0, float("-inf"))
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(tail, sumsq)
        return logp, tail, sumsq

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_tail: Tensor, _grad_sumsq: Tensor):
        logits, ids, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        g = grad_logp.masked_fill(ids < 0, 0.0)
        safe_ids = ids.clamp(min=0)
        for lo in range(0, logits.shape[0], ctx.rows):
            hi = min(lo + ctx.rows, logits.shape[0])
            probs = torch.exp(logits[lo:hi].to(lse.dtype) / ctx.temperature - lse[lo:hi, None])
            # d log π_j / dz = (e_j − π) / T, summed over the support slots j with weights g
            grad = -g[lo:hi].sum(dim=1, keepdim=True) * probs
            grad.scatter_add_(1, safe_ids[lo:hi], g[lo:hi].to(grad.dtype))
            grad_logits[lo:hi] = (grad / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None


def _check_inputs(logits: Tensor, support_ids: Tensor, temperature: float) -> None:
    check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("support_ids", support_ids, ndim=2, integer=True)
    check_same(("logits", "support_ids"), logits, support_ids, dims=(0,))
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise PDMInputError(f"temperature: must be a positive number, got {temperature!r}")
    with torch.no_grad():
        raise_at("logits", torch.isnan(logits), "NaN logit")
        raise_at("logits", logits == float("inf"), "+inf logit")
        raise_at("support_ids", (support_ids < -1) | (support_ids >= logits.shape[1]),
                 f"id out of range [0, {logits.shape[1]}) (−1 pads)", support_ids)


def policy_on_support(logits: Tensor, support_ids: Tensor, *, temperature: float = 1.0,
                      chunk_size: int | None = None) -> PolicyOnSupport:
    """π = softmax(logits / T) on the support, its tail log-mass and tail sum of squares.

    Args:
        logits: [N, V] trainer logits (any float dtype; log-probabilities work too, since
            softmax(log p) = p). Divided by the rollout temperature T (SPEC §1).
        support_ids: [N, m] int64 support ids (``Support.ids``), −1 at padding.
        temperature: T > 0.
        chunk_size: rows per chunk (default: about 4 MiB of float32 per chunk).

    Returns:
        PolicyOnSupport in float32 (float64 for float64 logits). Only ``logp`` carries grad.

    Same as ``policy_on_support_reference`` up to rounding, with peak extra memory of a few
    chunks instead of [N, V].
    """
    _check_inputs(logits, support_ids, temperature)
    rows = _chunk_rows(logits.shape[0], logits.shape[1], chunk_size)
    logp, tail, sumsq = _SupportLogProb.apply(logits, support_ids.long(), float(temperature), rows)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq)


def policy_on_support_reference(logits: Tensor, support_ids: Tensor, *,
                                temperature: float = 1.0) -> PolicyOnSupport:
    """Naive reference: a full [N, V] log-softmax, then gathers. For tests and the bench."""
    _check_inputs(logits, support_ids, temperature)
    ids = support_ids.long()
    lp = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)) / temperature, dim=-1)
    logp = lp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf"))
    outside = ~_in_support(ids, logits.shape[1])
    tail = masked_logsumexp(lp.detach(), outside)
    sumsq = masked_logsumexp(2.0 * lp.detach(), outside)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq)


def exact_tail_term(mu_logp_full: Tensor, pi_logp_full: Tensor, support_ids: Tensor) -> Tensor:
    """Σ_{i∉S} π_i(μ_i − π_i) from full distributions: the tail of the exact Ḋ (toys, oracle).

    Args:
        mu_logp_full, pi_logp_full: [N, n] full log-probabilities.
        support_ids: [N, m] support ids, −1 at padding.

    Returns:
        [N] tail term, no grad.
    """
    check_tensor("mu_logp_full", mu_logp_full, ndim=2, floating=True)
    check_tensor("pi_logp_full", pi_logp_full, ndim=2, floating=True)
    check_same(("mu_logp_full", "pi_logp_full"), mu_logp_full, pi_logp_full)
    check_same(("mu_logp_full", "support_ids"), mu_logp_full, support_ids, dims=(0,))
    with torch.no_grad():
        check_logp("pi_logp_full", pi_logp_full)
        outside = ~_in_support(support_ids.long(), mu_logp_full.shape[1])
        pi = torch.exp(pi_logp_full)
        term = pi * (torch.exp(mu_logp_full) - pi)
        return (term * outside).sum(dim=1)
