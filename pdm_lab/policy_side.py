"""π on the support, from the trainer's logits: the train-side half of SPEC §2–3.

``policy_on_support`` returns log π_i on S (differentiable), log π_T and log Σ_{i∉S} π_i² (for
the ``topk`` estimator) in one pass over the vocabulary, chunked over tokens so that no float32
[N, V] log-softmax is ever materialised, forward or backward. ``policy_on_support_reference`` is
the naive equivalent (``log_softmax(logits / T).gather(...)``) that tests and the bench compare to.

With the engine's sampling mask (``sampling=``, ``pdm_lab.sampling_mask``) π is the softmax over
the sampling set C only: z_i = −inf outside it, chunk by chunk in the forward and again in the
backward (C is recomputed, never stored as [N, V]); the tail is C ∖ S and its size is returned.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_logp, check_same, check_tensor, raise_at
from pdm_lab.fast.compiled import maybe_compiled
from pdm_lab.fast.rowops import any_duplicate
from pdm_lab.numerics import masked_logsumexp
from pdm_lab.sampling_mask import SamplingMask, forced_keep, sampling_keep
from pdm_lab.support_checks import outside, raise_duplicate_ids

#: Elements of one float32 chunk of logits (4 MiB): a few such temporaries bound peak memory.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class PolicyOnSupport:
    """π on the support.

    Attributes:
        logp: [N, m] log π_i on the support ids, −inf at padding; differentiable w.r.t. logits.
        tail_logp: [N] log π_T (no grad).
        tail_log_sumsq: [N] log Σ_{i∉S} π_i² (no grad).
        tail_count: [N] int64 t = |C ∖ S|, the tail's tokens inside the engine's sampling set C
            (``pdm_lab.sampling_mask.on_sampling_set`` puts it on the support); None without a
            sampling mask (the tail is every token outside S).
    """

    logp: Tensor
    tail_logp: Tensor
    tail_log_sumsq: Tensor
    tail_count: Tensor | None = None


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
    member = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
    return member.scatter_(1, _pads_to_real(ids), True)


def _pads_to_real(ids: Tensor) -> Tensor:
    # a pad (−1) must never alias a real token: point it at an id of its own row (SPEC §8)
    fill = ids.max(dim=1, keepdim=True).values.clamp(min=0)
    # a blend, not torch.where: inductor's AVX2 code for an int64 where (torch 2.13, CPUs without
    # AVX-512 or ATEN_CPU_CAPABILITY=avx2) returns wrong ids, and the scatter then writes out of
    # bounds (tests/test_core_policy_side.py::test_pads_to_real_compiles_to_the_same_ids)
    pad = (ids < 0).to(ids.dtype)
    return ids + pad * (fill - ids)


def _scaled(logits: Tensor, ids: Tensor, temperature: float, sampling: SamplingMask | None,
            keep_on_support: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """z = logits / T in the compute dtype, −inf outside the sampling set C, and C ([c, V] bool;
    None without a sampling mask)."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    if sampling is None:
        return z, None
    keep = forced_keep(sampling_keep(z, sampling), ids, keep_on_support)
    return z.masked_fill(~keep, float("-inf")), keep


def _tail_count(keep: Tensor, ids: Tensor) -> Tensor:
    """[c] |C ∖ S|: C's size less the support's valid ids inside C."""
    on_support = keep.gather(1, ids.clamp(min=0).long()) & (ids >= 0)
    return keep.sum(dim=1) - on_support.sum(dim=1)


def _chunk_forward(logits: Tensor, ids: Tensor, temperature: float):
    """One chunk of rows: (log π on ids [c, m], log Z [c], log π_T [c], log Σ_{i∉S} π_i² [c])."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    return _forward_from_z(z, ids)


def _forward_from_z(z: Tensor, ids: Tensor):
    lse = torch.logsumexp(z, dim=-1)
    on_support = z.gather(1, ids.clamp(min=0)) - lse[:, None]
    tail_z = z.scatter(1, _pads_to_real(ids), float("-inf"))  # c·m writes, no [c, V] mask
    tail = torch.logsumexp(tail_z, dim=-1) - lse
    sumsq = torch.logsumexp(2.0 * tail_z, dim=-1) - 2.0 * lse
    return on_support, lse, tail, sumsq


def _chunk_backward(logits: Tensor, ids: Tensor, lse: Tensor, grad: Tensor, temperature: float):
    """d/dz of Σ_j g_j log π_{s_j} = (Σ_j g_j e_{s_j} − (Σ_j g_j) π) / T for one chunk."""
    probs = torch.exp(logits.to(lse.dtype) / temperature - lse[:, None])
    return _backward_from_probs(logits, ids, probs, grad, temperature)


def _backward_from_probs(logits: Tensor, ids: Tensor, probs: Tensor, grad: Tensor, temperature: float):
    out = (-grad.sum(dim=1, keepdim=True)) * probs
    out = out.scatter_add(1, ids.clamp(min=0), grad.to(out.dtype))
    return (out / temperature).to(logits.dtype)


class _SupportLogProb(torch.autograd.Function):
    """log π on support ids; backward recomputes softmax chunk by chunk (nothing [N, V] is saved)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, rows: int, compiled: bool | None,
                sampling: SamplingMask | None = None, keep_on_support: Tensor | None = None):
        n = logits.shape[0]
        out_dtype = _compute_dtype(logits.dtype)
        logp = torch.empty(ids.shape, dtype=out_dtype, device=logits.device)
        lse, tail, sumsq = (torch.empty(n, dtype=out_dtype, device=logits.device) for _ in range(3))
        count = None if sampling is None else torch.empty(n, dtype=torch.int64, device=logits.device)
        chunk_forward = maybe_compiled(_chunk_forward, compiled)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            chunk_ids = ids[lo:hi].long()  # int64 per chunk: no [N, m] copy
            if sampling is None:
                logp[lo:hi], lse[lo:hi], tail[lo:hi], sumsq[lo:hi] = chunk_forward(
                    logits[lo:hi], chunk_ids, temperature)
                continue
            z, keep = _scaled(logits[lo:hi], chunk_ids, temperature, sampling,
                              None if keep_on_support is None else keep_on_support[lo:hi])
            logp[lo:hi], lse[lo:hi], tail[lo:hi], sumsq[lo:hi] = _forward_from_z(z, chunk_ids)
            count[lo:hi] = _tail_count(keep, chunk_ids)
            if keep_on_support is not None:
                raise_at("keep_on_support", ~keep.any(dim=1), "row that keeps no token (the sampled token is "
                         "always kept by the engine; row index)")
        _check_normalisers(logits, lse, temperature)
        logp = logp.masked_fill(ids < 0, float("-inf"))
        saved = (logits, ids, lse) if keep_on_support is None else (logits, ids, lse, keep_on_support)
        ctx.save_for_backward(*saved)
        ctx.temperature, ctx.rows, ctx.compiled, ctx.sampling = temperature, rows, compiled, sampling
        if count is None:
            count = torch.empty(0, dtype=torch.int64, device=logits.device)
        ctx.mark_non_differentiable(tail, sumsq, count)
        return logp, tail, sumsq, count

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_tail: Tensor, _grad_sumsq: Tensor, _grad_count: Tensor):
        logits, ids, lse, *rest = ctx.saved_tensors
        keep_on_support = rest[0] if rest else None
        grad_logits = torch.empty_like(logits)
        g = grad_logp.masked_fill(ids < 0, 0.0)
        chunk_backward = maybe_compiled(_chunk_backward, ctx.compiled)
        for lo in range(0, logits.shape[0], ctx.rows):
            hi = min(lo + ctx.rows, logits.shape[0])
            chunk_ids = ids[lo:hi].long()
            if ctx.sampling is None:
                grad_logits[lo:hi] = chunk_backward(logits[lo:hi], chunk_ids, lse[lo:hi], g[lo:hi], ctx.temperature)
                continue
            # C recomputed from the same logits: π = 0 off C, and a cut support slot (log π = −inf)
            # passes no gradient
            z, keep = _scaled(logits[lo:hi], chunk_ids, ctx.temperature, ctx.sampling,
                              None if keep_on_support is None else keep_on_support[lo:hi])
            g_chunk = g[lo:hi].masked_fill(~keep.gather(1, chunk_ids.clamp(min=0)), 0.0)
            probs = torch.exp(z - lse[lo:hi, None])
            grad_logits[lo:hi] = _backward_from_probs(logits[lo:hi], chunk_ids, probs, g_chunk, ctx.temperature)
        return grad_logits, None, None, None, None, None, None


def _check_inputs(logits: Tensor, support_ids: Tensor, temperature: float) -> None:
    """Types, shapes, T and the support ids (range, no id twice in a row: one ``aminmax`` and the
    pairwise compare of ``rowops.any_duplicate``, located only on failure). The logits' values
    are checked from the pass's own log-normalisers (``_check_normalisers``): no extra [N, V] read."""
    check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("support_ids", support_ids, ndim=2, integer=True)
    check_same(("logits", "support_ids"), logits, support_ids, dims=(0,))
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not (math.isfinite(temperature) and temperature > 0)):
        raise PDMInputError(f"temperature: must be a finite number > 0, got {temperature!r}")
    vocab = logits.shape[1]
    with torch.no_grad():
        if bool(outside(support_ids, -1, vocab) | any_duplicate(support_ids)):
            raise_at("support_ids", (support_ids < -1) | (support_ids >= vocab),
                     f"id out of range [0, {vocab}) (−1 pads)", support_ids)
            raise_duplicate_ids("support_ids", support_ids)
            raise AssertionError("support_ids were flagged bad but passed every check")


def _check_normalisers(logits: Tensor, lse: Tensor, temperature: float) -> None:
    """log Z = logsumexp(z / T) per row is finite iff the row is usable: NaN from a NaN logit,
    +inf from a +inf logit (or z / T past the dtype), −inf from a row with no finite logit (π
    undefined: every log π_i would be NaN). One [N] test; the rows are located only on failure."""
    if lse.numel() == 0 or bool(torch.isfinite(lse).all()):
        return
    with torch.no_grad():
        raise_at("logits", torch.isnan(logits), "NaN logit")
        raise_at("logits", logits == float("inf"), "+inf logit")
        raise_at("logits", (logits == float("-inf")).all(dim=1), "row with every logit −inf (no "
                 "probability to normalise; row index)")
        raise_at("logits", ~torch.isfinite(lse), f"logits / temperature leaves {lse.dtype}'s range "
                 f"(temperature {temperature!r}; row index)")


def policy_on_support(logits: Tensor, support_ids: Tensor, *, temperature: float = 1.0,
                      chunk_size: int | None = None, compiled: bool | None = None,
                      sampling: SamplingMask | None = None,
                      keep_on_support: Tensor | None = None) -> PolicyOnSupport:
    """π = softmax(logits / T) on the support, its tail log-mass and tail sum of squares.

    Args:
        logits: [N, V] trainer logits (any float dtype; log-probabilities work too, since
            softmax(log p) = p). Divided by the rollout temperature T (SPEC §1).
        support_ids: [N, m] integer support ids (``Support.ids``: int32 or int64), −1 at padding.
        temperature: T > 0.
        chunk_size: rows per chunk (default: about 4 MiB of float32 per chunk).
        compiled: fuse each chunk's math with ``torch.compile`` (default from
            ``PDM_LAB_COMPILE``); the same functions, tested equal to eager. Not used with a
            sampling mask (its sort runs eagerly).
        sampling: the engine's sampling mask (``pdm_lab.sampling_mask``): π is renormalised over
            the sampling set C reproduced from these parameters; None or inactive: the full softmax.
        keep_on_support: [N, m] bool, with ``sampling``: which support tokens the engine kept
            (``sampling_mask.engine_kept(support)``); None: every valid support token.

    Returns:
        PolicyOnSupport in float32 (float64 for float64 logits). Only ``logp`` carries grad.
        With an active sampling mask, ``tail_count`` = |C ∖ S| (``sampling_mask.on_sampling_set``).

    Same as ``policy_on_support_reference`` up to rounding, with peak extra memory of a few
    chunks instead of [N, V].
    """
    _check_inputs(logits, support_ids, temperature)
    sampling = _active(sampling, keep_on_support, support_ids)
    rows = _chunk_rows(logits.shape[0], logits.shape[1], chunk_size)
    if logits.shape[0] == 0 or sampling is not None:
        compiled = False
    keep = None if sampling is None or keep_on_support is None else keep_on_support.bool()
    logp, tail, sumsq, count = _SupportLogProb.apply(logits, support_ids, float(temperature), rows, compiled,
                                                     sampling, keep)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq,
                           tail_count=None if sampling is None else count)


def _active(sampling: SamplingMask | None, keep_on_support: Tensor | None, support_ids: Tensor) -> SamplingMask | None:
    """The sampling mask if it cuts (else None); checks ``keep_on_support`` against the ids."""
    if sampling is not None and not isinstance(sampling, SamplingMask):
        raise PDMInputError(f"sampling: expected a pdm_lab.sampling_mask.SamplingMask, got {type(sampling).__name__}")
    if keep_on_support is not None:
        check_tensor("keep_on_support", keep_on_support)
        check_same(("keep_on_support", "support_ids"), keep_on_support, support_ids)
    return sampling if sampling is not None and sampling.active else None


def policy_on_support_reference(logits: Tensor, support_ids: Tensor, *, temperature: float = 1.0,
                                sampling: SamplingMask | None = None,
                                keep_on_support: Tensor | None = None) -> PolicyOnSupport:
    """Naive reference: a full [N, V] log-softmax (over the sampling set C when given, as a
    whole [N, V] mask), then gathers. For tests and the bench."""
    _check_inputs(logits, support_ids, temperature)
    sampling = _active(sampling, keep_on_support, support_ids)
    ids = support_ids.long()
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    _check_normalisers(logits, torch.logsumexp(z.detach(), dim=-1), temperature)
    keep = torch.ones_like(z, dtype=torch.bool)
    if sampling is not None:
        with torch.no_grad():
            keep = forced_keep(sampling_keep(z.detach(), sampling), ids,
                               None if keep_on_support is None else keep_on_support.bool())
        z = z.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(z, dim=-1)
    logp = lp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf"))
    outside = ~_in_support(ids, logits.shape[1])
    tail = masked_logsumexp(lp.detach(), outside & keep)
    sumsq = masked_logsumexp(2.0 * lp.detach(), outside & keep)
    count = None if sampling is None else (outside & keep).sum(dim=1)
    return PolicyOnSupport(logp=logp, tail_logp=tail, tail_log_sumsq=sumsq, tail_count=count)


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
