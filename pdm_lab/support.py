"""The reduced top-K support S of SPEC §2, built from a rollout engine's output or from full μ.

Two conventions:

* ``union`` (default; the paper's TopK ∪ {k}): |S| = K, or K + 1 when the sampled token k is
  outside μ's top-K.
* ``kslot`` (DPPO's public code, Stable-RL, TRL's former DPPO trainer): always K slots; when k is
  outside the top-K it overwrites the K-th slot.

Ties at the top-K boundary break to the lower token id. Padding slots hold id −1 and log-prob
−inf and never alias a real token in a gather or scatter (SPEC §8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import PDMInputError, check_logp, check_same, check_tensor, logp_tolerance, raise_at
from .numerics import log1mexp, masked_logsumexp

CONVENTIONS = ("union", "kslot")


@dataclass(frozen=True)
class Support:
    """μ restricted to the reduced support, one row per token.

    Attributes:
        ids: [N, m] int64 token ids, −1 at padding.
        valid: [N, m] bool, False at padding.
        k_index: [N] int64, the slot of the sampled token k in ``ids``.
        mu_logp: [N, m] log μ_i on the support, −inf at padding.
        mu_tail_logp: [N] log μ_T, the log-mass of μ outside S.
        mu_kth_logp: [N] log μ_(K), the K-th largest probability of μ (certified interval, §3).
        tail_count: [N] int64, t = n − |S|, the number of tokens in the tail.
        vocab_size: n.
    """

    ids: Tensor
    valid: Tensor
    k_index: Tensor
    mu_logp: Tensor
    mu_tail_logp: Tensor
    mu_kth_logp: Tensor
    tail_count: Tensor
    vocab_size: int

    @property
    def sampled(self) -> Tensor:
        """[N] int64, the sampled token ids k."""
        return self.ids.gather(1, self.k_index[:, None])[:, 0]

    @property
    def mu_logp_k(self) -> Tensor:
        """[N] log μ_k."""
        return self.mu_logp.gather(1, self.k_index[:, None])[:, 0]

    def __len__(self) -> int:
        return self.ids.shape[0]


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise PDMInputError(f"convention: unknown {convention!r}; valid: {', '.join(CONVENTIONS)}")


def _check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PDMInputError(f"k: the top-K size must be an integer ≥ 1, got {k!r}")


def _attach_sampled(top_ids: Tensor, top_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                    convention: str) -> tuple[Tensor, Tensor]:
    """Add k to μ's top-K ids (sorted, −1 padded) by the convention's rule. Returns ids, log μ."""
    in_top = (top_ids == sampled[:, None]).any(dim=1)
    pad_id = torch.full_like(sampled, -1)
    neg_inf = torch.full_like(sampled_logp, float("-inf"))
    if convention == "union":
        extra_id = torch.where(in_top, pad_id, sampled)
        extra_lp = torch.where(in_top, neg_inf, sampled_logp)
        ids = torch.cat([top_ids, extra_id[:, None]], dim=1)
        logp = torch.cat([top_logp, extra_lp[:, None]], dim=1)
        if top_ids.shape[1] > 0 and bool(in_top.all()):
            ids, logp = ids[:, :-1], logp[:, :-1]  # no row needs the extra slot
        return ids, logp
    # kslot: overwrite the last real slot (the K-th) when k is outside the top-K.
    count = (top_ids >= 0).sum(dim=1)
    last = (count - 1).clamp(min=0)
    ids, logp = top_ids.clone(), top_logp.clone()
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids[rows, last] = torch.where(in_top, ids[rows, last], sampled)
    logp[rows, last] = torch.where(in_top, logp[rows, last], sampled_logp)
    return ids, logp


def _head_log_mass(logp: Tensor) -> Tensor:
    """log Σ_{i∈S} μ_i per row. log(Σ exp) is exact enough while the sum is far from underflow
    (a head holding μ's top token has mass ≥ 1/n); rows below that fall back to logsumexp."""
    if logp.shape[1] == 0:
        return logp.new_full((logp.shape[0],), float("-inf"))
    head = torch.log(torch.exp(logp).sum(dim=1))
    small = head < -60.0  # also catches a sum that underflowed to 0 (log → −inf)
    if bool(small.any()):
        head = torch.where(small, torch.logsumexp(logp, dim=1), head)
    return head


def support_from_slots(ids: Tensor, mu_logp: Tensor, sampled: Tensor, *, vocab_size: int,
                       mu_tail_logp: Tensor | None = None,
                       mu_kth_logp: Tensor | None = None) -> Support:
    """Validate a ready support (rows of token ids, −1 padded) and complete it.

    This is the constructor every other one ends in; call it directly when the rollout side
    already made the support (a K-slot support from DPPO-style code, say).

    Args:
        ids: [N, m] int64 support ids, −1 at padding. Each row must contain `sampled`.
        mu_logp: [N, m] log μ on those ids (ignored at padding).
        sampled: [N] int64 sampled token ids k.
        vocab_size: n.
        mu_tail_logp: [N] log μ_T if the full μ is known; else log1mexp of the head's log-mass.
        mu_kth_logp: [N] log μ_(K); default: the smallest head log-prob other than k's.
    """
    check_tensor("support ids", ids, ndim=2, integer=True)
    check_tensor("mu_logp", mu_logp, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_same(("support ids", "mu_logp"), ids, mu_logp)
    check_same(("support ids", "sampled"), ids, sampled, dims=(0,))
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise PDMInputError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
    ids = ids.long()
    sampled = sampled.long()
    n_rows = ids.shape[0]
    valid = ids >= 0
    raise_at("support ids", (ids < -1) | (ids >= vocab_size),
             f"id out of range [0, {vocab_size}) (−1 pads)", ids)
    raise_at("sampled", (sampled < 0) | (sampled >= vocab_size),
             f"id out of range [0, {vocab_size})", sampled)
    if ids.shape[1] > 1:
        narrow = ids.to(torch.int32) if vocab_size < 2**31 else ids  # half the bytes to sort
        srt = torch.sort(narrow, dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            row, col = (int(i) for i in torch.nonzero(dup)[0])
            raise PDMInputError(f"support ids: duplicate token id {int(srt[row, col + 1])} in row "
                                f"{row}; {int(dup.any(dim=1).sum())} rows affected")
    is_k = ids == sampled[:, None]
    has_k = is_k.any(dim=1)
    raise_at("support ids", ~has_k, "sampled token missing from the support (row index)")
    all_valid = bool(valid.all())
    if not all_valid:
        mu_logp = mu_logp.masked_fill(~valid, float("-inf"))
    check_logp("mu_logp", mu_logp)
    k_index = is_k.to(torch.int8).argmax(dim=1)
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    raise_at("mu_logp", mu_logp_k == float("-inf"),
             "sampled token has zero probability under μ (row index)")
    head = _head_log_mass(mu_logp)
    raise_at("mu_logp", head > logp_tolerance(mu_logp.dtype), "top-K mass above 1 (log-mass shown)", head)
    if mu_tail_logp is None:
        mu_tail_logp = log1mexp(head)
    else:
        check_tensor("mu_tail_logp", mu_tail_logp, ndim=1, floating=True)
        check_same(("mu_tail_logp", "sampled"), mu_tail_logp, sampled)
        check_logp("mu_tail_logp", mu_tail_logp)
    size = valid.sum(dim=1)
    tail_count = vocab_size - size
    raise_at("support ids", tail_count < 0, "more support ids than the vocabulary has")
    mu_tail_logp = torch.where(tail_count == 0, torch.full_like(mu_tail_logp, float("-inf")), mu_tail_logp)
    if mu_kth_logp is None:
        others = mu_logp.masked_fill(is_k | ~valid, float("inf"))
        mu_kth_logp = torch.where(size > 1, others.min(dim=1).values, mu_logp_k)
    return Support(ids=ids, valid=valid, k_index=k_index, mu_logp=mu_logp,
                   mu_tail_logp=mu_tail_logp, mu_kth_logp=mu_kth_logp,
                   tail_count=tail_count, vocab_size=vocab_size)


def _is_ordered(ids: Tensor, logp: Tensor, pad: Tensor) -> bool:
    a, b = logp[:, :-1], logp[:, 1:]
    real_next = ~pad[:, 1:]
    in_order = (a > b) | ((a == b) & (ids[:, :-1] < ids[:, 1:])) | pad[:, 1:]
    return bool((in_order & ~(pad[:, :-1] & real_next)).all())


def _sort_top(ids: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    """Order each row by log-prob descending, ties to the lower id, padding (−1) last.

    Rows a rollout engine returns are usually in that order already: then nothing is sorted.
    """
    pad = ids < 0
    if ids.shape[1] < 2 or _is_ordered(ids, logp, pad):
        return ids, logp
    by_id = torch.argsort(ids.masked_fill(pad, torch.iinfo(torch.int64).max), dim=1, stable=True)
    ids, logp = ids.gather(1, by_id), logp.gather(1, by_id)
    # a stable descending sort keeps id order among equal log-probs; pads (−inf, largest id) stay last
    by_logp = torch.argsort(logp, dim=1, descending=True, stable=True)
    return ids.gather(1, by_logp), logp.gather(1, by_logp)


def topk_lower_id_ties(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """μ's K largest entries per row, ordered by value descending, ties to the lower id.

    Same as a stable descending ``torch.sort(...)[:, :k]`` but one ``torch.topk`` plus a few
    elementwise passes: ``topk`` alone breaks ties at the boundary arbitrarily.

    Returns: ids [N, k] int64, values [N, k].
    """
    threshold = torch.topk(logp, k, dim=1).values[:, -1:]
    above = logp > threshold
    at = logp == threshold
    room = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at & (torch.cumsum(at, dim=1) <= room))
    # nonzero walks rows in order and ids ascending: exactly k per row
    ids = torch.nonzero(chosen)[:, 1].reshape(logp.shape[0], k)
    values = logp.gather(1, ids)
    order = torch.argsort(values, dim=1, descending=True, stable=True)
    return ids.gather(1, order), values.gather(1, order)


def support_from_topk(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                      *, vocab_size: int, k: int | None = None, convention: str = "union",
                      row_mask: Tensor | None = None) -> Support:
    """Support from what a rollout engine returns (vLLM: top-K log-probs plus the sampled one).

    Args:
        topk_ids: [N, K'] int64 μ's most probable ids (any order; −1 pads allowed).
        topk_logp: [N, K'] their processed log-probs (−inf allowed: cut by top-k/top-p).
        sampled: [N] int64 sampled ids k.
        sampled_logp: [N] log μ_k (finite).
        vocab_size: n.
        k: K, how many top tokens to keep (default K').
        convention: ``union`` or ``kslot``.
        row_mask: [N] bool, rows to check; other rows (padding) are replaced by a trivial valid row.

    μ_T comes from log1mexp of the head's log-mass, since the engine shows no tail (SPEC §8).
    """
    _check_convention(convention)
    check_tensor("topk_ids", topk_ids, ndim=2, integer=True)
    check_tensor("topk_logp", topk_logp, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_tensor("sampled_logp", sampled_logp, ndim=1, floating=True)
    check_same(("topk_ids", "topk_logp"), topk_ids, topk_logp)
    check_same(("topk_ids", "sampled"), topk_ids, sampled, dims=(0,))
    check_same(("sampled", "sampled_logp"), sampled, sampled_logp)
    k = topk_ids.shape[1] if k is None else k
    _check_k(k)
    topk_ids, sampled = topk_ids.long(), sampled.long()
    if row_mask is not None:
        check_same(("row_mask", "sampled"), row_mask, sampled)
        keep = row_mask.bool()
        topk_ids = torch.where(keep[:, None], topk_ids, torch.full_like(topk_ids, -1))
        topk_ids[:, 0] = torch.where(keep, topk_ids[:, 0], torch.zeros_like(sampled))
        topk_logp = torch.where(keep[:, None], topk_logp, torch.full_like(topk_logp, float("-inf")))
        topk_logp[:, 0] = torch.where(keep, topk_logp[:, 0], torch.zeros_like(sampled_logp))
        sampled = torch.where(keep, sampled, torch.zeros_like(sampled))
        sampled_logp = torch.where(keep, sampled_logp, torch.zeros_like(sampled_logp))
    topk_pad = topk_ids < 0
    if bool(topk_pad.any()):
        topk_logp = topk_logp.masked_fill(topk_pad, float("-inf"))
    check_logp("topk_logp", topk_logp)
    check_logp("sampled_logp", sampled_logp, allow_neg_inf=False)
    top_ids, top_logp = _sort_top(topk_ids, topk_logp)
    top_ids, top_logp = top_ids[:, :k], top_logp[:, :k]
    count = (top_ids >= 0).sum(dim=1)
    kth = top_logp.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0] if k else None
    ids, logp = _attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention)
    return support_from_slots(ids, logp, sampled, vocab_size=vocab_size, mu_kth_logp=kth)


def support_from_full(mu_logp_full: Tensor, sampled: Tensor, *, k: int,
                      convention: str = "union") -> Support:
    """Support from μ's full log-probabilities (toys, oracle checks).

    Args:
        mu_logp_full: [N, n] log μ over the whole vocabulary.
        sampled: [N] int64 sampled ids k.
        k: K (clipped to n).
        convention: ``union`` or ``kslot``.

    μ_T is a log-sum-exp over the tokens outside S, not 1 − head (SPEC §8).
    """
    _check_convention(convention)
    _check_k(k)
    check_tensor("mu_logp_full", mu_logp_full, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_same(("mu_logp_full", "sampled"), mu_logp_full, sampled, dims=(0,))
    check_logp("mu_logp_full", mu_logp_full)
    n_rows, vocab = mu_logp_full.shape
    if vocab == 0:
        raise PDMInputError("mu_logp_full: the vocabulary is empty (shape "
                            f"{tuple(mu_logp_full.shape)})")
    sampled = sampled.long()
    raise_at("sampled", (sampled < 0) | (sampled >= vocab), f"id out of range [0, {vocab})", sampled)
    total = torch.logsumexp(mu_logp_full, dim=1)
    raise_at("mu_logp_full", total > 1e-3 + logp_tolerance(mu_logp_full.dtype),
             "total probability above 1 (log-mass shown)", total)
    kk = min(k, vocab)
    top_ids, top_logp = topk_lower_id_ties(mu_logp_full, kk)
    sampled_logp = mu_logp_full.gather(1, sampled[:, None])[:, 0]
    ids, logp = _attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention)
    in_support = torch.zeros_like(mu_logp_full, dtype=torch.bool)
    in_support.scatter_(1, torch.where(ids >= 0, ids, sampled[:, None]), True)
    tail = masked_logsumexp(mu_logp_full, ~in_support, dim=1)
    return support_from_slots(ids, logp, sampled, vocab_size=vocab, mu_tail_logp=tail,
                              mu_kth_logp=top_logp[:, kk - 1])
