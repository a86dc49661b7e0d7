"""Validation of what support construction is given: bad input → `PDMInputError` naming the tensor
and the first offending position (SPEC §8).

Two halves. The *flags* are pure tensor math that the constructors' math computes alongside the
support, in the same pass over the [N, K] block (fused when compiled; whole-tensor reductions
eagerly), and reads back once as 0-d bools. Only when one is raised do the *raise_* functions
below run, eagerly and in a fixed order, to find and name the first offending entry; their checks
and the flags must agree (a flag that no check confirms is an internal error).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_logp, check_same, check_tensor, logp_tolerance, raise_at
from pdm_lab.fast.rowops import all_true, any_true, first_true, head_log_mass

CONVENTIONS = ("union", "kslot")
_NEG_INF = float("-inf")

#: How far log μ_k given as ``sampled_logp`` may sit from the top-K entry of the same token before
#: the two contradict each other: absolute plus relative to |log μ_k|, loose enough for an engine
#: that rounds one of them to bf16 (8 mantissa bits), tight enough to catch misaligned arrays.
SAMPLED_LOGP_ATOL, SAMPLED_LOGP_RTOL = 1e-3, 1e-2

#: How far a full distribution's total log-mass log Σ_i p_i may sit from 0 (plus a few ulps):
#: ±0.1% of the mass, loose for a float32 log-softmax over any vocabulary, tight enough that a
#: row that is not a distribution (total mass e⁻⁵, say) is refused, not read as a tiny μ.
MASS_LOG_ATOL = 1e-3


# --- arguments at the public boundary ------------------------------------------------------

def check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise PDMInputError(f"convention: unknown {convention!r}; valid: {', '.join(CONVENTIONS)}")


def check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PDMInputError(f"k: the top-K size must be an integer ≥ 1, got {k!r}")


def check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise PDMInputError(f"vocab_size: must be a positive integer, got {vocab_size!r}")


def check_topk_args(topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor, sampled_logp: Tensor,
                    row_mask: Tensor | None, vocab_size: int, k: int, convention: str) -> None:
    check_convention(convention)
    check_tensor("topk_ids", topk_ids, ndim=2, integer=True)
    check_tensor("topk_logp", topk_logp, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_tensor("sampled_logp", sampled_logp, ndim=1, floating=True)
    check_same(("topk_ids", "topk_logp"), topk_ids, topk_logp)
    check_same(("topk_ids", "sampled"), topk_ids, sampled, dims=(0,))
    check_same(("sampled", "sampled_logp"), sampled, sampled_logp)
    check_k(k)
    check_vocab(vocab_size)
    given = topk_ids.shape[1]
    if k > given and given < vocab_size:  # K ≥ n with every token given is the empty tail
        raise PDMInputError(f"k: K = {k} exceeds the {given} top-K columns given (topk_ids has shape "
                            f"{tuple(topk_ids.shape)}); pass k ≤ {given}")
    if row_mask is not None:
        check_same(("row_mask", "sampled"), row_mask, sampled)


def check_slots_args(ids: Tensor, mu_logp: Tensor, sampled: Tensor, mu_tail_logp: Tensor | None,
                     vocab_size: int) -> None:
    check_tensor("support ids", ids, ndim=2, integer=True)
    check_tensor("mu_logp", mu_logp, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_same(("support ids", "mu_logp"), ids, mu_logp)
    check_same(("support ids", "sampled"), ids, sampled, dims=(0,))
    check_vocab(vocab_size)
    if mu_tail_logp is not None:
        check_tensor("mu_tail_logp", mu_tail_logp, ndim=1, floating=True)
        check_same(("mu_tail_logp", "sampled"), mu_tail_logp, sampled)


def check_full_args(mu_logp_full: Tensor, sampled: Tensor, k: int, convention: str) -> None:
    """Arguments of ``support_from_full``, values included (the toys' path: no fused pass)."""
    check_convention(convention)
    check_k(k)
    check_tensor("mu_logp_full", mu_logp_full, ndim=2, floating=True)
    check_tensor("sampled", sampled, ndim=1, integer=True)
    check_same(("mu_logp_full", "sampled"), mu_logp_full, sampled, dims=(0,))
    check_logp("mu_logp_full", mu_logp_full)
    vocab = mu_logp_full.shape[1]
    if vocab == 0:
        raise PDMInputError("mu_logp_full: the vocabulary is empty (shape "
                            f"{tuple(mu_logp_full.shape)})")
    raise_at("sampled", (sampled < 0) | (sampled >= vocab), f"id out of range [0, {vocab})", sampled)
    check_full_mass("mu_logp_full", mu_logp_full)


def check_full_mass(name: str, logp_full: Tensor) -> None:
    """Each row of [N, n] log-probabilities is a distribution: |log Σ_i p_i| ≤ ``MASS_LOG_ATOL``
    (one log-sum-exp per row; NaN is `check_logp`'s to name first)."""
    total = torch.logsumexp(logp_full, dim=1)
    tol = MASS_LOG_ATOL + logp_tolerance(logp_full.dtype)
    raise_at(name, ~(total.abs() <= tol), f"total probability is not 1 within {MASS_LOG_ATOL:g} in log "
             "space (row index; log-mass shown)", total)


# --- flags: pure, computed in the constructors' pass -----------------------------------------

def outside(x: Tensor, low: int, high: int | None = None) -> Tensor:
    """0-d bool: some entry of the integer tensor x lies outside [low, high) (high None: no upper
    bound). Eagerly one read (``aminmax``, no [N, K] bool written) and exact Python comparisons;
    compiled, fused compares in int64 (a bound past int32 must not wrap)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    if torch.compiler.is_compiling():
        x = x.long()
        return ((x < low) | (x >= high)).any() if high is not None else (x < low).any()
    lo, hi = (int(v) for v in torch.aminmax(x))
    return torch.tensor(lo < low or (high is not None and hi >= high), device=x.device)


def pads_and_range(ids: Tensor, high: int | None) -> tuple[Tensor, Tensor]:
    """0-d bools (some id < 0: padding, some id outside [−1, high)) of the integer tensor ids
    (high None: no upper bound); eagerly from one read (``aminmax``), where two ``outside``
    calls would read it twice."""
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return outside(ids, 0), outside(ids, -1, high)
    lo, hi = (int(v) for v in torch.aminmax(ids))
    return (torch.tensor(lo < 0, device=ids.device),
            torch.tensor(lo < -1 or (high is not None and hi >= high), device=ids.device))


def logp_flag(logp: Tensor, *, allow_neg_inf: bool = True) -> Tensor:
    """0-d bool: `check_logp` would raise (NaN, +inf or above 0 beyond rounding; −inf if barred)."""
    tol = logp_tolerance(logp.dtype)
    if not torch.compiler.is_compiling() and logp.numel() > 0:
        # eagerly one read: max and min propagate NaN, which fails both tests as it fails ``<=``
        lo, hi = torch.aminmax(logp)
        return ~(hi <= tol) if allow_neg_inf else ~((hi <= tol) & (lo > _NEG_INF))
    ok = logp <= tol  # NaN and +inf both fail it
    if not allow_neg_inf:
        ok = ok & (logp > _NEG_INF)
    return ~all_true(ok)


def sampled_logp_contradicts(mu_logp_k: Tensor, sampled_logp: Tensor) -> Tensor:
    """[N] bool: the engine's log μ_k (``sampled_logp``) disagrees with log μ_k on the support,
    which is k's top-K entry when k is among the top-K (else ``sampled_logp`` itself, gap 0): the
    two arrays are misaligned, or come from different distributions."""
    gap = (mu_logp_k - sampled_logp).abs()
    return ~(gap <= SAMPLED_LOGP_ATOL + SAMPLED_LOGP_RTOL * sampled_logp.abs())


def support_flag(ids: Tensor, sampled: Tensor, vocab_size: int, *, duplicate: Tensor, has_k: Tensor,
                 mu_logp_bad: Tensor, mu_logp_k: Tensor, head: Tensor, tail_count: Tensor,
                 mu_tail_logp: Tensor | None = None, contradicts: Tensor | None = None,
                 range_bad: Tensor | None = None) -> Tensor:
    """0-d bool: some row fails a check of `raise_support_error` (NaN fails each ``<=``). `ids`: the
    ids whose range is checked, in the caller's dtype (before any narrowing to int32); range_bad:
    that check's flag when the caller has it already (``pads_and_range``)."""
    range_bad = outside(ids, -1, vocab_size) if range_bad is None else range_bad
    bad = range_bad | outside(sampled, 0, vocab_size) | duplicate | ~all_true(has_k)
    bad = bad | mu_logp_bad | any_true(mu_logp_k == _NEG_INF) | logp_flag(head)
    if mu_tail_logp is not None:
        bad = bad | logp_flag(mu_tail_logp)
    if contradicts is not None:
        bad = bad | any_true(contradicts)
    return bad | outside(tail_count, 0)


# --- the failing path: eager, in order, naming the first offending entry --------------------

def raise_duplicate_ids(name: str, ids: Tensor) -> None:
    """Raise if a row of [N, m] ids (negative: padding) holds a real id twice, naming the first
    such row and id."""
    if ids.shape[1] < 2:
        return
    srt = torch.sort(ids.long(), dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        row, col = (int(i) for i in torch.nonzero(dup)[0])
        raise PDMInputError(f"{name}: duplicate token id {int(srt[row, col + 1])} in row {row}; "
                            f"{int(dup.any(dim=1).sum())} rows affected")


def raise_engine_logp_error(topk_logp: Tensor, sampled_logp: Tensor) -> None:
    """The engine's log-probs (padding already −inf) when `logp_flag` fired on one of them."""
    check_logp("topk_logp", topk_logp)
    check_logp("sampled_logp", sampled_logp, allow_neg_inf=False)
    raise AssertionError("a log-prob was flagged bad but passed check_logp")


def raise_support_error(ids: Tensor, mu_logp: Tensor, sampled: Tensor, vocab_size: int,
                        tail_count: Tensor, *, range_ids: Tensor | None = None,
                        mu_tail_logp: Tensor | None = None, sampled_logp: Tensor | None = None) -> None:
    """Run the checks behind `support_flag` in order and raise the first, with the argument's name
    and the first offending position. ids, mu_logp: the support's [N, m] (−inf at padding);
    range_ids: the ids `support_flag` range-checked (default `ids`); sampled_logp: the engine's
    log μ_k (checked against the top-K entry of k)."""
    range_ids = ids if range_ids is None else range_ids
    raise_at("support ids", (range_ids < -1) | (range_ids >= vocab_size),
             f"id out of range [0, {vocab_size}) (−1 pads)", range_ids)
    raise_at("sampled", (sampled < 0) | (sampled >= vocab_size), f"id out of range [0, {vocab_size})", sampled)
    raise_duplicate_ids("support ids", ids)
    has_k, k_index = first_true(ids == sampled[:, None])
    raise_at("support ids", ~has_k, "sampled token missing from the support (row index)")
    check_logp("mu_logp", mu_logp)
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    raise_at("mu_logp", mu_logp_k == _NEG_INF, "sampled token has zero probability under μ (row index)")
    if sampled_logp is not None:
        raise_at("sampled_logp", sampled_logp_contradicts(mu_logp_k, sampled_logp),
                 "contradicts topk_logp at the sampled token (row index; value shown)", sampled_logp)
    head = head_log_mass(mu_logp)
    raise_at("mu_logp", head > logp_tolerance(mu_logp.dtype), "top-K mass above 1 (log-mass shown)", head)
    if mu_tail_logp is not None:
        check_logp("mu_tail_logp", mu_tail_logp)
    raise_at("support ids", tail_count < 0, "more support ids than the vocabulary has")
    raise AssertionError("a row was flagged bad but passed every check")  # the flags and this disagree
