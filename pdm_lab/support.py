"""The reduced top-K support S of SPEC §2, built from a rollout engine's output or from full μ.

    TopK(μ)  μ's K most probable token ids, ties to the lower id
    S        union (default; the paper's TopK ∪ {k}): TopK, plus k when k ∉ TopK (|S| = K or K + 1)
             kslot (DPPO's public code, Stable-RL): TopK, with k overwriting slot K when k ∉ TopK
    log μ_T  log(1 − Σ_{i∈S} μ_i) = log1mexp(log Σ_{i∈S} μ_i), never 1 − sum(exp) (SPEC §8);
             a log-sum-exp over the tail instead when the full μ is known

Padding slots hold id −1 and log-prob −inf and never alias a real token (SPEC §8). Ids are int32
when the vocabulary allows (half the bytes of int64). Each constructor's tensor math
(``_engine_math``, ``_slots_math``) builds the support and the validation flags of
``support_checks`` in one pass over the [N, K] block (fused by ``torch.compile``, or a few
whole-tensor passes eagerly, through the primitives of ``rowops``); only when a flag is raised do
the checks run that name the argument and the first offending position.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab import support_checks as checks
from pdm_lab.fast import compiled as compiled_mod
from pdm_lab.fast.compiled import maybe_compiled
from pdm_lab.errors import logp_tolerance
from pdm_lab.numerics import log1mexp, masked_logsumexp
from pdm_lab.fast.rowops import (all_true, any_duplicate, any_true, append_column, first_true, head_log_mass, order_rows,
                     rows_out_of_order, when)
from pdm_lab.support_checks import CONVENTIONS  # noqa: F401  (re-exported: the conventions' names)

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Support:
    """μ restricted to the reduced support, one row per token.

    Attributes:
        ids: [N, m] token ids, −1 at padding; int32 (int64 for a vocabulary ≥ 2³¹).
        k_index: [N] int64, the slot of the sampled token k in ``ids``.
        mu_logp: [N, m] log μ_i on the support, −inf at padding.
        mu_tail_logp: [N] log μ_T, the log-mass of μ outside S.
        mu_kth_logp: [N] log μ_(K), the K-th largest probability of μ (certified interval, §3).
        tail_count: [N] int64, t = n − |S|, the number of tokens in the tail.
        vocab_size: n.
        top_k: K, how many of μ's top tokens the support was built from (``support_from_topk``,
            ``support_from_full``; a loss checks its mask config's K against it), None where a
            caller gave ready slots (``support_from_slots`` without ``top_k``).
    """

    ids: Tensor
    k_index: Tensor
    mu_logp: Tensor
    mu_tail_logp: Tensor
    mu_kth_logp: Tensor
    tail_count: Tensor
    vocab_size: int
    top_k: int | None = None

    @property
    def valid(self) -> Tensor:
        """[N, m] bool, False at padding."""
        return self.ids >= 0

    @property
    def sampled(self) -> Tensor:
        """[N] int64, the sampled token ids k."""
        return self.ids.gather(1, self.k_index[:, None])[:, 0].long()

    @property
    def mu_logp_k(self) -> Tensor:
        """[N] log μ_k."""
        return self.mu_logp.gather(1, self.k_index[:, None])[:, 0]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take_rows(self, rows) -> "Support":
        """The rows ``rows`` (an index tensor or a slice) of every per-row field; n and K kept."""
        return dataclasses.replace(self, **{f: getattr(self, f)[rows] for f in _FIELDS})


_FIELDS = ("ids", "k_index", "mu_logp", "mu_tail_logp", "mu_kth_logp", "tail_count")


def id_dtype(vocab_size: int) -> torch.dtype:
    """The dtype of support ids for a vocabulary of n tokens: int32 while every id and n fit."""
    return torch.int32 if vocab_size < 2**31 else torch.int64


# --- SPEC §2: the definition ------------------------------------------------------------------

def topk_lower_id_ties(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """μ's K largest entries per row, ordered by value descending, ties to the lower id.

    Same as a stable descending ``torch.sort(...)[:, :k]`` but one ``torch.topk`` plus a few
    elementwise passes (``topk`` alone breaks ties at the boundary arbitrarily), then the one tie
    order, ``order_rows``.

    Returns: ids [N, k] int64, values [N, k].
    """
    threshold = torch.topk(logp, k, dim=1).values[:, -1:]
    above = logp > threshold
    at = logp == threshold
    room = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at & (torch.cumsum(at, dim=1) <= room))
    # nonzero walks rows in order: exactly k per row
    ids = torch.nonzero(chosen)[:, 1].reshape(logp.shape[0], k)
    return order_rows(ids, logp.gather(1, ids))


def attach_sampled(top_ids: Tensor, top_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                   convention: str, *, in_top: Tensor, count: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """S from μ's top-K: add k by the convention's rule. Pure tensor math.

    Args:
        top_ids: [N, K] ids ordered as TopK (−1 pads last), top_logp: [N, K], sampled: [N],
        sampled_logp: [N], in_top: [N] bool k ∈ TopK, count: [N] real ids per row, dtype: of ids.

    Returns: ids (in `dtype`), log μ; [N, K + 1] for ``union`` — the extra slot is padding where
    k ∈ TopK (a width that depends on the data would break ``torch.compile``; the caller drops the
    slot when no row uses it) — and [N, K] for ``kslot``.
    """
    if convention == "union":
        extra_id = torch.where(in_top, -1, sampled)
        extra_lp = torch.where(in_top, _NEG_INF, sampled_logp)
        return append_column(top_ids, extra_id, dtype), append_column(top_logp, extra_lp)
    # kslot: overwrite the last real slot (the K-th) when k is outside the top-K
    last = (count - 1).clamp(min=0)
    col = torch.arange(top_ids.shape[1], device=top_ids.device)
    put = (col[None, :] == last[:, None]) & ~in_top[:, None]
    return (torch.where(put, sampled[:, None], top_ids).to(dtype),
            torch.where(put, sampled_logp[:, None], top_logp))


def tail_from_head(head: Tensor, tail_count: Tensor) -> Tensor:
    """log μ_T = log(1 − e^head) from the head's log-mass; −inf where the tail is empty (t = 0)."""
    return torch.where(tail_count == 0, _NEG_INF, log1mexp(head))


# --- the constructors' tensor math (pure: eager or one compiled kernel) -----------------------

def _blank_rows(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows outside `keep` ([N] bool) become a trivial valid row: id 0 at log-prob 0, k = 0."""
    first = torch.arange(topk_ids.shape[1], device=topk_ids.device) == 0
    blank_lp = torch.where(first, 0.0, _NEG_INF).to(topk_logp.dtype)
    return (torch.where(keep[:, None], topk_ids, torch.where(first, 0, -1)),
            torch.where(keep[:, None], topk_logp, blank_lp),
            torch.where(keep, sampled, 0), torch.where(keep, sampled_logp, 0.0))


def _engine_rows(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                 keep: Tensor | None, vocab_size: int | None = None) -> tuple[Tensor, ...]:
    """The engine's rows as the support sees them: blanked outside `keep`, padding (id < 0) at
    log-prob −inf. Also returns has_pads and range_bad (0-d bools: some id < 0, some id outside
    [−1, vocab_size) or below −1 without it), from one read of the ids."""
    if keep is not None:
        topk_ids, topk_logp, sampled, sampled_logp = _blank_rows(topk_ids, topk_logp, sampled, sampled_logp, keep)
    has_pads, range_bad = checks.pads_and_range(topk_ids, vocab_size)  # no [N, K'] bool eagerly
    if when(has_pads):
        topk_logp = topk_logp.masked_fill(topk_ids < 0, _NEG_INF)
    return topk_ids, topk_logp, sampled, sampled_logp, has_pads, range_bad


def _engine_math(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                 keep: Tensor | None, vocab_size: int, k: int, convention: str) -> dict[str, Tensor]:
    """The tensor math of ``support_from_topk`` (arguments as there).

    Returns the tensor fields of `Support` by name, ``unordered`` ([N] bool: the rows out of
    order) and ``flags``: [4] bool, read back once — (a bad engine log-prob, a row out of order,
    a bad support row, some row uses the ``union`` extra slot). The support is computed as if
    every row were ordered; the caller orders the rows out of order and redoes them. Values in
    bad rows are meaningless; the caller raises.
    """
    topk_ids, topk_logp, sampled, sampled_logp, has_pads, range_bad = _engine_rows(
        topk_ids, topk_logp, sampled, sampled_logp, keep, vocab_size)
    bad_logp = checks.logp_flag(topk_logp) | checks.logp_flag(sampled_logp, allow_neg_inf=False)
    unordered = rows_out_of_order(topk_ids, topk_logp)
    top_ids, top_logp = topk_ids[:, :k], topk_logp[:, :k]
    width = top_ids.shape[1]
    in_top, pos = first_true(top_ids == sampled[:, None])
    count = (top_ids >= 0).sum(dim=1) if when(has_pads) else \
        torch.full(sampled.shape, width, dtype=torch.int64, device=sampled.device)
    ids, mu_logp = attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention,
                                  in_top=in_top, count=count, dtype=id_dtype(vocab_size))
    # k's slot and log μ_k follow from where k went: no search over the support
    k_slot = width if convention == "union" else (count - 1).clamp(min=0)
    k_index = torch.where(in_top, pos, k_slot)
    mu_logp_k, kth = sampled_logp, sampled_logp  # an empty top-K (K' = 0): S = {k}
    if width > 0:
        mu_logp_k = torch.where(in_top, top_logp.gather(1, pos[:, None])[:, 0], sampled_logp)
        kth = top_logp.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
    size = count + (~in_top).long() if convention == "union" else count.clamp(min=1)
    tail_count = vocab_size - size
    head = head_log_mass(mu_logp, for_tail=True)  # only log1mexp(head) is used
    # the engine's top-K ids are range-checked as given (narrowing could wrap a bad id)
    bad_support = checks.support_flag(
        top_ids, sampled, vocab_size, duplicate=any_duplicate(ids[:, :width]),
        has_k=in_top | (convention == "union" or width > 0), mu_logp_bad=torch.zeros_like(bad_logp),
        mu_logp_k=mu_logp_k, head=head, tail_count=tail_count,
        contradicts=checks.sampled_logp_contradicts(mu_logp_k, sampled_logp),
        range_bad=range_bad if width == topk_ids.shape[1] else None)  # else only the first K are S's
    return {"ids": ids, "k_index": k_index, "mu_logp": mu_logp,
            "mu_tail_logp": tail_from_head(head, tail_count), "mu_kth_logp": kth, "tail_count": tail_count,
            "unordered": unordered,
            "flags": torch.stack([bad_logp, any_true(unordered), bad_support, ~all_true(in_top)])}


def _slots_math(ids: Tensor, mu_logp: Tensor, sampled: Tensor, mu_tail_logp: Tensor | None,
                mu_kth_logp: Tensor | None, vocab_size: int) -> dict[str, Tensor]:
    """The tensor math of ``support_from_slots`` (arguments as there): the fields of `Support` and
    ``flags``, [1] bool: some row fails a check of ``support_checks.raise_support_error``."""
    valid = ids >= 0
    if when(~all_true(valid)):
        mu_logp = mu_logp.masked_fill(~valid, _NEG_INF)
    has_k, k_index = first_true(ids == sampled[:, None])
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    head = head_log_mass(mu_logp, for_tail=True)  # only log1mexp(head) is used
    size = valid.sum(dim=1)
    tail_count = vocab_size - size
    tail = tail_from_head(head, tail_count) if mu_tail_logp is None else \
        torch.where(tail_count == 0, _NEG_INF, mu_tail_logp)
    if mu_kth_logp is None:  # the smallest head log-prob other than k's
        others = mu_logp.masked_fill((ids == sampled[:, None]) | ~valid, float("inf"))
        mu_kth_logp = torch.where(size > 1, others.min(dim=1).values, mu_logp_k)
    narrow = ids.to(id_dtype(vocab_size))  # a wrapped bad id is caught by the range check first
    bad = checks.support_flag(ids, sampled, vocab_size, duplicate=any_duplicate(narrow), has_k=has_k,
                              mu_logp_bad=checks.logp_flag(mu_logp), mu_logp_k=mu_logp_k, head=head,
                              tail_count=tail_count, mu_tail_logp=mu_tail_logp)
    return {"ids": narrow, "k_index": k_index, "mu_logp": mu_logp,
            "mu_tail_logp": tail, "mu_kth_logp": mu_kth_logp, "tail_count": tail_count, "flags": bad[None]}


def _support(out: dict[str, Tensor], vocab_size: int, top_k: int | None) -> Support:
    return Support(**{f: out[f] for f in _FIELDS}, vocab_size=vocab_size, top_k=top_k)


# --- the constructors ---------------------------------------------------------------------------

def support_from_topk(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                      *, vocab_size: int, k: int | None = None, convention: str = "union",
                      row_mask: Tensor | None = None, compiled: bool | None = None) -> Support:
    """Support from what a rollout engine returns (vLLM: top-K log-probs plus the sampled one).

    Args:
        topk_ids: [N, K'] integer μ's most probable ids (any order; −1 pads allowed).
        topk_logp: [N, K'] their processed log-probs (−inf allowed: cut by top-k/top-p).
        sampled: [N] integer sampled ids k.
        sampled_logp: [N] log μ_k (finite; must agree with k's top-K entry when it has one).
        vocab_size: n.
        k: K, how many top tokens to keep (default K').
        convention: ``union`` or ``kslot``.
        row_mask: [N] bool, rows to check; other rows (padding) are replaced by a trivial valid row.
        compiled: run the math and checks through ``torch.compile`` (one pass over [N, K']);
            default from ``PDM_LAB_COMPILE``; eager runs them by cache-sized row blocks. Tested
            equal.

    μ_T comes from log1mexp of the head's log-mass, since the engine shows no tail (SPEC §8).
    """
    k = topk_ids.shape[1] if k is None and isinstance(topk_ids, Tensor) and topk_ids.dim() == 2 else k
    checks.check_topk_args(topk_ids, topk_logp, sampled, sampled_logp, row_mask, vocab_size, k, convention)
    inputs = (topk_ids, topk_logp, sampled, sampled_logp, None if row_mask is None else row_mask.bool())
    math = maybe_compiled(_engine_math, False if topk_ids.shape[0] == 0 else compiled, row_blocks=True)
    out = math(*inputs, vocab_size, k, convention)
    out_of_order = out.pop("unordered")
    bad_logp, unordered, bad_support, extra_used = out.pop("flags").tolist()
    if bad_logp:
        _raise_engine_logp_error(inputs)
    redone = None
    if unordered:
        out, redone, bad_support, extra_used = _redo_rows_out_of_order(
            out, out_of_order, inputs, math, bad_support, vocab_size, k, convention)
    if bad_support:
        _raise_bad_support(out, inputs, redone, vocab_size, k)
    if convention == "union" and min(k, topk_ids.shape[1]) > 0 and not extra_used:
        out.update({f: out[f][:, :-1] for f in ("ids", "mu_logp")})  # no row needs the extra slot
    return _support(out, vocab_size, k)


def _raise_engine_logp_error(inputs: tuple) -> None:
    """Name the first bad engine log-prob (NaN, +inf, a −inf sampled one), as the engine gave it."""
    _, engine_logp, _, engine_sampled_logp, _, _ = _engine_rows(*inputs)
    checks.raise_engine_logp_error(engine_logp, engine_sampled_logp)


def _redo_rows_out_of_order(out: dict[str, Tensor], out_of_order: Tensor, inputs: tuple, math, bad_support: bool,
                            vocab_size: int, k: int, convention: str):
    """Rollout engines usually return rows in μ's top-K order: only the rows that are not (a tie
    broken to the higher id, common with bf16 log-probs) are ordered (``order_rows``) and redone.

    Returns (out, (rows, their ordered ids), bad_support, extra_used). When a row fails a check,
    the whole batch is redone in order (pass one's flag may come from a row out of order), so
    the error names the first bad row."""
    topk_ids, topk_logp, sampled, sampled_logp, keep = inputs
    rows = torch.nonzero(out_of_order)[:, 0]
    sub_keep = None if keep is None else keep[rows]
    sub_ids, sub_logp, sub_sampled, sub_sampled_logp, _, _ = _engine_rows(
        topk_ids[rows], topk_logp[rows], sampled[rows], sampled_logp[rows], sub_keep)
    sub_ids, sub_logp = order_rows(sub_ids, sub_logp)
    # a handful of rows runs eagerly: a compiled graph specialises (recompiles) on one row
    redo = math if rows.numel() > compiled_mod.BLOCK_ROWS else maybe_compiled(_engine_math, False)
    sub = redo(sub_ids, sub_logp, sub_sampled, sub_sampled_logp, sub_keep, vocab_size, k, convention)
    sub.pop("unordered")
    sub_bad = sub.pop("flags").tolist()[2]
    if bad_support or sub_bad:
        top_ids, top_logp, all_sampled, all_sampled_logp, _, _ = _engine_rows(*inputs)
        top_ids, top_logp = top_ids.index_copy(0, rows, sub_ids), top_logp.index_copy(0, rows, sub_logp)
        out = math(top_ids, top_logp, all_sampled, all_sampled_logp, keep, vocab_size, k, convention)
        out.pop("unordered")
        bad_support, extra_used = out.pop("flags").tolist()[2:]
        return out, (rows, sub_ids), bad_support, extra_used
    for field in _FIELDS:  # in place: the math's outputs are its own (≥ 2 columns here)
        out[field].index_copy_(0, rows, sub[field])
    # whether k ∉ TopK somewhere depends on the order of a cut row: read it off S
    extra_used = convention == "union" and bool(any_true(out["ids"][:, -1] >= 0))
    return out, (rows, sub_ids), bad_support, extra_used


def _raise_bad_support(out: dict[str, Tensor], inputs: tuple, redone: tuple[Tensor, Tensor] | None,
                       vocab_size: int, k: int) -> None:
    """Name the first row whose support fails a check (range, duplicates, k, masses), reading the
    engine's ids as ordered (``redone``: the rows ordered and their ids)."""
    top_ids, _, all_sampled, all_sampled_logp, _, _ = _engine_rows(*inputs)
    if redone is not None:
        rows, sub_ids = redone
        top_ids = top_ids.index_copy(0, rows, sub_ids)
    checks.raise_support_error(out["ids"], out["mu_logp"], all_sampled, vocab_size, out["tail_count"],
                               range_ids=top_ids[:, :k], sampled_logp=all_sampled_logp)


def support_from_slots(ids: Tensor, mu_logp: Tensor, sampled: Tensor, *, vocab_size: int,
                       mu_tail_logp: Tensor | None = None, mu_kth_logp: Tensor | None = None,
                       top_k: int | None = None, compiled: bool | None = None) -> Support:
    """Validate a ready support (rows of token ids, −1 padded) and complete it.

    Call it directly when the rollout side already made the support (a K-slot support from
    DPPO-style code, say); ``support_from_full`` ends in it.

    Args:
        ids: [N, m] integer support ids, −1 at padding. Each row must contain `sampled`.
        mu_logp: [N, m] log μ on those ids (ignored at padding).
        sampled: [N] integer sampled token ids k.
        vocab_size: n.
        mu_tail_logp: [N] log μ_T if the full μ is known; else log1mexp of the head's log-mass.
        mu_kth_logp: [N] log μ_(K); default: the smallest head log-prob other than k's.
        top_k: K, the top-K size the slots come from (recorded as ``Support.top_k``), if known.
        compiled: run the math and checks through ``torch.compile`` (a pass or two over [N, m]);
            default from ``PDM_LAB_COMPILE``; eager runs them by cache-sized row blocks. Tested
            equal.
    """
    checks.check_slots_args(ids, mu_logp, sampled, mu_tail_logp, vocab_size)
    if top_k is not None:
        checks.check_k(top_k)
    math = maybe_compiled(_slots_math, False if ids.shape[0] == 0 else compiled, row_blocks=True)
    out = math(ids, mu_logp, sampled, mu_tail_logp, mu_kth_logp, vocab_size)
    if bool(out.pop("flags")):
        checks.raise_support_error(ids, out["mu_logp"], sampled, vocab_size, out["tail_count"],
                                   mu_tail_logp=mu_tail_logp)
    return _support(out, vocab_size, top_k)


def support_from_full(mu_logp_full: Tensor, sampled: Tensor, *, k: int,
                      convention: str = "union", compiled: bool | None = None) -> Support:
    """Support from μ's full log-probabilities (toys, oracle checks).

    Args:
        mu_logp_full: [N, n] log μ over the whole vocabulary.
        sampled: [N] integer sampled ids k.
        k: K (clipped to n).
        convention: ``union`` or ``kslot``.
        compiled: run ``support_from_slots``'s math through ``torch.compile``.

    μ_T is a log-sum-exp over the tokens outside S, not 1 − head (SPEC §8).
    """
    checks.check_full_args(mu_logp_full, sampled, k, convention)
    vocab = mu_logp_full.shape[1]
    kk = min(k, vocab)
    sampled = sampled.long()
    top_ids, top_logp = topk_lower_id_ties(mu_logp_full, kk)
    sampled_logp = mu_logp_full.gather(1, sampled[:, None])[:, 0]
    in_top = (top_ids == sampled[:, None]).any(dim=1)
    ids, logp = attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention, in_top=in_top,
                               count=torch.full_like(sampled, kk), dtype=torch.int64)
    if convention == "union" and bool(in_top.all()):
        ids, logp = ids[:, :-1], logp[:, :-1]  # no row needs the extra slot
    in_support = torch.zeros_like(mu_logp_full, dtype=torch.bool)
    in_support.scatter_(1, torch.where(ids >= 0, ids, sampled[:, None]), True)
    tail = masked_logsumexp(mu_logp_full, ~in_support, dim=1)
    return support_from_slots(ids, logp, sampled, vocab_size=vocab, mu_tail_logp=tail,
                              mu_kth_logp=top_logp[:, kk - 1], top_k=k, compiled=compiled)


__all__ = ["CONVENTIONS", "Support", "attach_sampled", "id_dtype", "support_from_full",
           "support_from_slots", "support_from_topk", "tail_from_head", "topk_lower_id_ties"]
