"""Log-space primitives. Tails are computed here and nowhere else (SPEC §8)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

_LOG_HALF = -math.log(2.0)


def exp_per_use() -> bool:
    """Whether a function should exponentiate its log-probs afresh at each use rather than share
    one ``exp``: True under ``torch.compile``. On CPU, inductor writes an ``exp`` with several users
    to memory as its own [N, m] buffer (a fresh allocation and a pass each call), while an ``exp``
    per use fuses into the consuming reduction and is computed once per entry in registers (the
    kernel's own CSE): measured on [10⁶, 21] float32, 2 threads, three row sums of μ and π:
    88 ms shared, 26 ms per use. Eagerly, sharing saves whole passes over memory."""
    return torch.compiler.is_compiling()


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate at both ends (Mächler 2012).

    Naive equivalent: ``torch.log(1 - torch.exp(x))``, which returns −inf for x > −1e-8 in float32
    and loses every digit when exp(x) is close to 1. Returns −inf at x = 0 and 0 at x = −inf.
    """
    x = torch.clamp(x, max=0.0)
    return torch.where(x > _LOG_HALF, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def xlogy_ratio(logp: Tensor, logq: Tensor, p: Tensor | None = None) -> Tensor:
    """p·log(p/q) from log p and log q, with 0·log 0 = 0 (p = 0 gives 0 whatever q is).

    `p` = exp(logp) may be passed when the caller already has it.
    """
    # p = 0 would give 0·(−inf − log q) = NaN; where p > 0 and q = 0 the +inf is the true value
    if exp_per_use() and p is None:  # one exp per use (see there)
        return torch.where(torch.exp(logp) > 0, torch.exp(logp) * (logp - logq), 0.0)
    p = torch.exp(logp) if p is None else p
    if torch.compiler.is_compiling() or p.requires_grad:  # (mul_ would lose what p's gradient needs)
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    term = logp - logq  # eagerly: one temporary, multiplied in place (same values)
    return torch.where(p > 0, term.mul_(p), 0.0)


def masked_logsumexp(x: Tensor, keep: Tensor, dim: int = -1) -> Tensor:
    """log Σ exp(x) over the entries where `keep` is True; −inf where none is kept."""
    return torch.logsumexp(x.masked_fill(~keep, float("-inf")), dim=dim)



def rest_logmass(logp: Tensor, tail_logp: Tensor, k_index: Tensor) -> Tensor:
    """log(1 − p_k) from what is visible: [N, m] log p on S, [N] log p_T, [N] index of k in S.

    Where p_k > ½ (log1mexp's weak side once log p_k has rounded toward 0) it is the
    log-sum-exp over S∖{k} and the tail (SPEC §8: the rest of the distribution, not 1 − p_k);
    elsewhere log1mexp(log p_k), which is exact there and keeps tiny binary KLs accurate.
    Naive equivalent: ``torch.log(1 - p_k)``.
    """
    logp_k = logp.gather(1, k_index[:, None])[:, 0]
    weak = logp_k > _LOG_HALF
    out = log1mexp(logp_k)
    if torch.compiler.is_compiling():  # fused: the log-sum-exp costs little beside the rest
        return torch.where(weak, _rest_logsumexp(logp, tail_logp, k_index), out)
    rows = weak.nonzero()[:, 0]  # eagerly only the rows that need it (the same values)
    if rows.numel() > 0:
        out[rows] = _rest_logsumexp(logp[rows], tail_logp[rows], k_index[rows])
    return out


def rest_logmass_from_probs(logp_k: Tensor, p: Tensor, tail: Tensor, k_index: Tensor) -> tuple[Tensor, Tensor]:
    """``rest_logmass`` from the probabilities at hand (the stats have p = exp(log p) on S and
    p_T): where p_k > ½ the rest is the plain sum log(Σ_{i∈S∖{k}} p_i + p_T), one pass and no
    exponential per entry; elsewhere log1mexp(log p_k), as there. [N, m] p, [N] log p_k, p_T.

    Returns the values and [N] bool `rescue`: rows whose sum fell within 2²⁴ of the dtype's
    smallest normal number, where its small terms lost digits or underflowed (log → −inf);
    ``rest_logmass`` gives those rows exactly, and the caller recomputes them (the rare path,
    eager: compiled code cannot branch per row).
    """
    weak = logp_k > _LOG_HALF
    col = torch.arange(p.shape[1], device=p.device)
    rest = torch.where(col[None, :] == k_index[:, None], 0.0, p).sum(dim=-1) + tail
    rescue = weak & (rest < torch.finfo(p.dtype).tiny * 2.0**24)
    return torch.where(weak, torch.log(rest), log1mexp(logp_k)), rescue


def _rest_logsumexp(logp: Tensor, tail_logp: Tensor, k_index: Tensor) -> Tensor:
    """log(Σ_{i∈S∖{k}} p_i + p_T) as a log-sum-exp, [N]."""
    if torch.compiler.is_compiling():  # a select fuses; inductor writes a scatter's copy first
        col = torch.arange(logp.shape[1], device=logp.device)
        others = torch.where(col[None, :] == k_index[:, None], float("-inf"), logp)
    else:
        others = logp.scatter(1, k_index[:, None], float("-inf"))
    return torch.logaddexp(torch.logsumexp(others, dim=-1), tail_logp)
