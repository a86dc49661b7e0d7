"""The reduced top-K support S of SPEC §2, built from a rollout engine's output or from full μ.

Two conventions:

* ``union`` (default; the paper's TopK ∪ {k}): |S| = K, or K + 1 when the sampled token k is
  outside μ's top-K.
* ``kslot`` (DPPO's public code, Stable-RL, TRL's former DPPO trainer): always K slots; when k is
  outside the top-K it overwrites the K-th slot.

Ties at the top-K boundary break to the lower token id. Padding slots hold id −1 and log-prob
−inf and never alias a real token in a gather or scatter (SPEC §8).

Each constructor runs pure tensor math (`_slots_math`, `_engine_math`) that builds the support and
flags bad rows, eagerly or through ``torch.compile`` as ``stats._support_math`` does; only when a
row is flagged do the eager checks run that name the argument and the first offending position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .compiled import maybe_compiled
from .errors import PDMInputError, check_logp, check_same, check_tensor, logp_tolerance, raise_at
from .numerics import log1mexp, masked_logsumexp

CONVENTIONS = ("union", "kslot")
_NEG_INF = float("-inf")


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


_FIELDS = ("ids", "valid", "k_index", "mu_logp", "mu_tail_logp", "mu_kth_logp", "tail_count")


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise PDMInputError(f"convention: unknown {convention!r}; valid: {', '.join(CONVENTIONS)}")


def _check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PDMInputError(f"k: the top-K size must be an integer ≥ 1, got {k!r}")


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise PDMInputError(f"vocab_size: must be a positive integer, got {vocab_size!r}")


def _fill_pads(logp: Tensor, pad: Tensor) -> Tensor:
    """−inf where `pad` ([N, m] bool). Eager skips the pass when nothing is padded."""
    if torch.compiler.is_compiling() or bool(pad.any()):
        return logp.masked_fill(pad, _NEG_INF)
    return logp


def _append_column(x: Tensor, column: Tensor) -> Tensor:
    """[N, m] and [N] → [N, m + 1]. Same as ``torch.cat([x, column[:, None]], dim=1)``, which
    eager runs in one pass; under ``torch.compile`` a pad plus a select fuses with what follows
    into one loop, where inductor's cat writes its own buffer first (measured ~25% slower here)."""
    if not torch.compiler.is_compiling():
        return torch.cat([x, column[:, None]], dim=1)
    m = x.shape[1]
    last = torch.arange(m + 1, device=x.device) == m
    return torch.where(last, column[:, None], torch.nn.functional.pad(x, (0, 1)))


def _first_true(mask: Tensor) -> Tensor:
    """[N, m] bool → [N] int64, the first True column per row (0 where none): ``argmax`` of the
    int8 mask. Inductor's CPU argmax is scalar; a masked ``amin`` of column numbers vectorises."""
    if not torch.compiler.is_compiling():
        return mask.to(torch.int8).argmax(dim=1)
    m = mask.shape[1]
    col = torch.arange(m, device=mask.device)
    return torch.where(mask, col, m).amin(dim=1) % m  # none → m → 0: stays a valid index


def _attach_sampled(top_ids: Tensor, top_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                    convention: str) -> tuple[Tensor, Tensor, Tensor]:
    """Add k to μ's top-K ids (sorted, −1 padded) by the convention's rule. Pure tensor math.

    Args:
        top_ids: [N, K] int64 (−1 pads), top_logp: [N, K], sampled: [N] int64, sampled_logp: [N].

    Returns: ids, log μ (both [N, K + 1] for ``union``, [N, K] for ``kslot``), in_top [N] bool.
    ``union`` always keeps the extra slot here (a width that depends on the data would break
    ``torch.compile``); the caller drops it when ``in_top.all()``: it is all padding then.
    """
    in_top = (top_ids == sampled[:, None]).any(dim=1)
    if convention == "union":
        extra_id = torch.where(in_top, -1, sampled)
        extra_lp = torch.where(in_top, _NEG_INF, sampled_logp)
        return _append_column(top_ids, extra_id), _append_column(top_logp, extra_lp), in_top
    # kslot: overwrite the last real slot (the K-th) when k is outside the top-K.
    last = ((top_ids >= 0).sum(dim=1) - 1).clamp(min=0)
    col = torch.arange(top_ids.shape[1], device=top_ids.device)
    put = (col[None, :] == last[:, None]) & ~in_top[:, None]
    return (torch.where(put, sampled[:, None], top_ids),
            torch.where(put, sampled_logp[:, None], top_logp), in_top)


def _head_log_mass(logp: Tensor) -> Tensor:
    """log Σ_{i∈S} μ_i per row ([N, m] → [N]). log(Σ exp) is exact enough while the sum is far
    from underflow (a head holding μ's top token has mass ≥ 1/n); rows below that fall back to
    logsumexp."""
    if logp.shape[1] == 0:
        return logp.new_full((logp.shape[0],), _NEG_INF)
    head = torch.log(torch.exp(logp).sum(dim=1))
    small = head < -60.0  # also catches a sum that underflowed to 0 (log → −inf)
    if torch.compiler.is_compiling():
        # fused into the same pass over the row; a branch on data would break the graph
        return torch.where(small, torch.logsumexp(logp, dim=1), head)
    if bool(small.any()):  # eager: the extra logsumexp pass only when some row needs it
        head = torch.where(small, torch.logsumexp(logp, dim=1), head)
    return head


def _sorted_duplicates(ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Each row of ids ([N, m] int64, −1 pads) sorted ascending, and dup [N, m − 1] bool: True
    where a real id equals the one before it."""
    narrow = ids.to(torch.int32) if vocab_size < 2**31 else ids  # half the bytes to sort
    srt = torch.sort(narrow, dim=1).values
    return srt, (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)


def _any_duplicate(ids: Tensor, vocab_size: int) -> Tensor:
    """0-d bool: some row of ids ([N, m] int64, −1 pads) holds a real id twice; never [N, m, m].

    Compiled: the m(m − 1)/2 column pairs, which inductor fuses into one pass over each row.
    Eager: one int32 sort per row, ~2× faster there than the pair loop's separate kernels."""
    m = ids.shape[1]
    if m < 2:
        return torch.zeros((), dtype=torch.bool, device=ids.device)
    if not torch.compiler.is_compiling():
        return _sorted_duplicates(ids, vocab_size)[1].any()
    dup = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for i in range(m - 1):
        col = ids[:, i]
        real = col >= 0
        for j in range(i + 1, m):
            dup = dup | ((col == ids[:, j]) & real)
    return dup.any()


def _slots_math(ids: Tensor, mu_logp: Tensor, sampled: Tensor, mu_tail_logp: Tensor | None,
                mu_kth_logp: Tensor | None, vocab_size: int) -> dict[str, Tensor]:
    """The tensor math of ``support_from_slots``: pure, so ``torch.compile`` can fuse it unchanged
    (eagerly it is ~20 passes over [N, m]).

    Args:
        ids: [N, m] int64, −1 at padding. mu_logp: [N, m]. sampled: [N] int64.
        mu_tail_logp, mu_kth_logp: [N] or None (then derived, see ``support_from_slots``).

    Returns: the tensor fields of `Support` by name but ``valid`` (see `_support`), and ``bad``:
    0-d bool, some row fails a check of `_raise_slots_error`. Values in bad rows are meaningless;
    the caller raises on them.
    """
    tol = logp_tolerance(mu_logp.dtype)
    valid = ids >= 0
    mu_logp = _fill_pads(mu_logp, ~valid)
    is_k = ids == sampled[:, None]
    k_index = _first_true(is_k)
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    head = _head_log_mass(mu_logp)
    size = valid.sum(dim=1)
    tail_count = vocab_size - size
    tail = log1mexp(head) if mu_tail_logp is None else mu_tail_logp
    tail = torch.where(tail_count == 0, _NEG_INF, tail)
    if mu_kth_logp is None:
        others = mu_logp.masked_fill(is_k | ~valid, float("inf"))
        mu_kth_logp = torch.where(size > 1, others.min(dim=1).values, mu_logp_k)
    # every check of _raise_slots_error, in its order (NaN fails each `<=`).
    # Only "any row bad" is read: whole-tensor reductions (eager's per-row all/any over a bool
    # [N, m] is ~4× slower), and has_k read at k_index, where argmax put a match if there is one.
    has_k = is_k.gather(1, k_index[:, None])
    bad = ((ids < -1) | (ids >= vocab_size)).any() | ((sampled < 0) | (sampled >= vocab_size)).any()
    bad = bad | _any_duplicate(ids, vocab_size) | ~has_k.all()
    bad = bad | ~(mu_logp <= tol).all() | (mu_logp_k == _NEG_INF).any() | (head > tol).any()
    if mu_tail_logp is not None:
        bad = bad | ~(mu_tail_logp <= logp_tolerance(mu_tail_logp.dtype)).all()
    bad = bad | (tail_count < 0).any()
    return {"ids": ids, "k_index": k_index, "mu_logp": mu_logp,
            "mu_tail_logp": tail, "mu_kth_logp": mu_kth_logp, "tail_count": tail_count, "bad": bad}


def _raise_slots_error(ids: Tensor, mu_logp: Tensor, sampled: Tensor, vocab_size: int,
                       mu_tail_logp: Tensor | None, tail_count: Tensor) -> None:
    """The failing path of `_slots_math`: run its checks in order, eagerly, and raise the first
    with the argument's name and the first offending position. mu_logp: [N, m], −inf at padding."""
    raise_at("support ids", (ids < -1) | (ids >= vocab_size),
             f"id out of range [0, {vocab_size}) (−1 pads)", ids)
    raise_at("sampled", (sampled < 0) | (sampled >= vocab_size), f"id out of range [0, {vocab_size})", sampled)
    if ids.shape[1] > 1:
        srt, dup = _sorted_duplicates(ids, vocab_size)
        if bool(dup.any()):
            row, col = (int(i) for i in torch.nonzero(dup)[0])
            raise PDMInputError(f"support ids: duplicate token id {int(srt[row, col + 1])} in row "
                                f"{row}; {int(dup.any(dim=1).sum())} rows affected")
    is_k = ids == sampled[:, None]
    raise_at("support ids", ~is_k.any(dim=1), "sampled token missing from the support (row index)")
    check_logp("mu_logp", mu_logp)
    mu_logp_k = mu_logp.gather(1, is_k.to(torch.int8).argmax(dim=1)[:, None])[:, 0]
    raise_at("mu_logp", mu_logp_k == _NEG_INF, "sampled token has zero probability under μ (row index)")
    head = _head_log_mass(mu_logp)
    raise_at("mu_logp", head > logp_tolerance(mu_logp.dtype), "top-K mass above 1 (log-mass shown)", head)
    if mu_tail_logp is not None:
        check_logp("mu_tail_logp", mu_tail_logp)
    raise_at("support ids", tail_count < 0, "more support ids than the vocabulary has")
    raise AssertionError("a row was flagged bad but passed every check")  # _slots_math and this disagree


def _support(out: dict[str, Tensor], vocab_size: int) -> Support:
    """`Support` from the math's outputs. ``valid`` is made here, eagerly: inductor's CPU code
    stores a bool [N, m] ~10× slower than eager's ``ids >= 0`` (measured at N = 10⁶, m = 21)."""
    return Support(**{f: out[f] for f in _FIELDS if f != "valid"}, valid=out["ids"] >= 0,
                   vocab_size=vocab_size)


def support_from_slots(ids: Tensor, mu_logp: Tensor, sampled: Tensor, *, vocab_size: int,
                       mu_tail_logp: Tensor | None = None, mu_kth_logp: Tensor | None = None,
                       compiled: bool | None = None) -> Support:
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
        compiled: run the math and checks through ``torch.compile`` (a pass or two over [N, m]
            instead of ~20); default from ``PDM_LAB_COMPILE``. Tested equal to eager.
    """
    check_tensor("support ids", ids, ndim=2, integer=True)
    check_tensor("mu_logp", mu_logp, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_same(("support ids", "mu_logp"), ids, mu_logp)
    check_same(("support ids", "sampled"), ids, sampled, dims=(0,))
    _check_vocab(vocab_size)
    if mu_tail_logp is not None:
        check_tensor("mu_tail_logp", mu_tail_logp, ndim=1, floating=True)
        check_same(("mu_tail_logp", "sampled"), mu_tail_logp, sampled)
    ids, sampled = ids.long(), sampled.long()
    math = maybe_compiled(_slots_math, False if ids.shape[0] == 0 else compiled)  # nothing to fuse
    out = math(ids, mu_logp, sampled, mu_tail_logp, mu_kth_logp, vocab_size)
    if bool(out["bad"]):
        _raise_slots_error(ids, out["mu_logp"], sampled, vocab_size, mu_tail_logp, out["tail_count"])
    return _support(out, vocab_size)


def _rows_ordered(ids: Tensor, logp: Tensor) -> Tensor:
    """0-d bool: every row ([N, K'] ids, logp) is already ordered as `_sort_top` would order it."""
    pad = ids < 0
    a, b = logp[:, :-1], logp[:, 1:]
    in_order = (a > b) | ((a == b) & (ids[:, :-1] < ids[:, 1:])) | pad[:, 1:]
    return (in_order & ~(pad[:, :-1] & ~pad[:, 1:])).all()


def _sort_top(ids: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    """Order each row ([N, K']) by log-prob descending, ties to the lower id, padding (−1) last."""
    pad = ids < 0
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


def _engine_rows(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                 keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows outside `keep` ([N] bool) become a trivial valid row (id 0 at log-prob 0, k = 0);
    padding slots (id < 0) get log-prob −inf. Shapes as ``support_from_topk``'s arguments."""
    if keep is not None:
        first = torch.arange(topk_ids.shape[1], device=topk_ids.device) == 0
        blank_lp = torch.where(first, 0.0, _NEG_INF).to(topk_logp.dtype)
        topk_ids = torch.where(keep[:, None], topk_ids, torch.where(first, 0, -1))
        topk_logp = torch.where(keep[:, None], topk_logp, blank_lp)
        sampled = torch.where(keep, sampled, 0)
        sampled_logp = torch.where(keep, sampled_logp, 0.0)
    return topk_ids, _fill_pads(topk_logp, topk_ids < 0), sampled, sampled_logp


def _engine_math(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                 keep: Tensor | None, vocab_size: int, k: int, convention: str) -> dict[str, Tensor]:
    """The tensor math of ``support_from_topk`` (arguments as there), pure so that
    ``torch.compile`` can fuse it with `_slots_math` into a pass or two over [N, K'].

    Returns `_slots_math`'s fields, less ``bad``, plus ``status``: [4] bool, read back once —
    (any bad engine log-prob, any row out of order, any bad support row, the ``union`` extra
    slot unused). The support is computed as if every row were ordered; the caller sorts and
    calls again when one is not.
    """
    topk_ids, topk_logp, sampled, sampled_logp = _engine_rows(topk_ids, topk_logp, sampled, sampled_logp, keep)
    bad_logp = ~(topk_logp <= logp_tolerance(topk_logp.dtype)).all()  # check_logp's conditions
    bad_logp = bad_logp | ~((sampled_logp <= logp_tolerance(sampled_logp.dtype)) & (sampled_logp > _NEG_INF)).all()
    top_ids, top_logp = topk_ids[:, :k], topk_logp[:, :k]
    count = (top_ids >= 0).sum(dim=1)
    kth = top_logp.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
    ids, logp, in_top = _attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention)
    out = _slots_math(ids, logp, sampled, None, kth, vocab_size)
    out["status"] = torch.stack([bad_logp, ~_rows_ordered(topk_ids, topk_logp), out.pop("bad"),
                                 in_top.all()])
    return out


def support_from_topk(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                      *, vocab_size: int, k: int | None = None, convention: str = "union",
                      row_mask: Tensor | None = None, compiled: bool | None = None) -> Support:
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
        compiled: run the math and checks through ``torch.compile`` (one or two passes over
            [N, K'] instead of ~25); default from ``PDM_LAB_COMPILE``. Tested equal to eager.

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
    _check_vocab(vocab_size)
    keep = None
    if row_mask is not None:
        check_same(("row_mask", "sampled"), row_mask, sampled)
        keep = row_mask.bool()
    # the sampled token's own top-K entry must carry its log-prob (issue 9; NaN −inf−(−inf) passes)
    listed = (topk_ids == sampled[:, None]) & (keep[:, None] if keep is not None else True)
    gap = (topk_logp - sampled_logp[:, None].to(topk_logp.dtype)).abs()
    raise_at("sampled_logp", listed & (gap > 1e-3 * (1.0 + topk_logp.abs())),
             "contradicts the sampled token's own top-K entry (topk_logp)", gap)
    inputs = (topk_ids.long(), topk_logp, sampled.long(), sampled_logp, keep)
    math = maybe_compiled(_engine_math, False if topk_ids.shape[0] == 0 else compiled)  # nothing to fuse
    out = math(*inputs, vocab_size, k, convention)
    bad_logp, unordered, bad_rows, extra_unused = out.pop("status").tolist()
    if bad_logp or unordered or bad_rows:  # the rare paths: eager, detailed
        top_ids, top_logp, sampled, sampled_logp = _engine_rows(*inputs)
        if bad_logp:
            check_logp("topk_logp", top_logp)
            check_logp("sampled_logp", sampled_logp, allow_neg_inf=False)
            raise AssertionError("a log-prob was flagged bad but passed check_logp")
        if unordered:  # rollout engines usually return rows in order: then nothing is sorted
            top_ids, top_logp = _sort_top(top_ids, top_logp)
            # keep again: blanking is idempotent, and the compiled graph stays the same
            out = math(top_ids, top_logp, sampled, sampled_logp, inputs[4], vocab_size, k, convention)
            _, _, bad_rows, extra_unused = out.pop("status").tolist()
        if bad_rows:
            _raise_slots_error(out["ids"], out["mu_logp"], sampled, vocab_size, None, out["tail_count"])
    if convention == "union" and min(k, topk_ids.shape[1]) > 0 and extra_unused:
        out.update({f: out[f][:, :-1] for f in ("ids", "mu_logp")})  # no row needs the extra slot
    return _support(out, vocab_size)


def support_from_full(mu_logp_full: Tensor, sampled: Tensor, *, k: int,
                      convention: str = "union", compiled: bool | None = None) -> Support:
    """Support from μ's full log-probabilities (toys, oracle checks).

    Args:
        mu_logp_full: [N, n] log μ over the whole vocabulary.
        sampled: [N] int64 sampled ids k.
        k: K (clipped to n).
        convention: ``union`` or ``kslot``.
        compiled: run ``support_from_slots``'s math through ``torch.compile``.

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
    ids, logp, in_top = _attach_sampled(top_ids, top_logp, sampled, sampled_logp, convention)
    if convention == "union" and bool(in_top.all()):
        ids, logp = ids[:, :-1], logp[:, :-1]  # no row needs the extra slot
    in_support = torch.zeros_like(mu_logp_full, dtype=torch.bool)
    in_support.scatter_(1, torch.where(ids >= 0, ids, sampled[:, None]), True)
    tail = masked_logsumexp(mu_logp_full, ~in_support, dim=1)
    return support_from_slots(ids, logp, sampled, vocab_size=vocab, mu_tail_logp=tail,
                              mu_kth_logp=top_logp[:, kk - 1], compiled=compiled)
