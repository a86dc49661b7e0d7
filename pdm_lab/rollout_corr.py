"""verl's rollout-correction metrics as mergeable sums: k1 and k3 KL, χ², the perplexity ratio,
importance-weight statistics and the fraction rejected, computed once per loss call by the core.

verl 0.9 (``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_offpolicy_metrics``,
``compute_is_metrics``, ``compute_rollout_rejection_mask``) logs them as ``rollout_corr/<name>``
from the trainer's log π_k before the update and the rollout's log μ_k. Here every loss call
reports them as ``corr/<name>`` (merged over the step's mini-batches like every metric), and
``pdm_lab.metrics.as_mismatch`` gives the rollout-time ones (the batch before any optimiser step)
verl's keys (``ROLLOUT_CORR_KEYS``). The table with the formulas: ``docs/guide/metrics.md``.

Per response token, l = log r = log π_k − log μ_k, in float64:

- k1 = −l (the estimator of KL(μ‖π) under k ∼ μ); k3 = e^l − 1 − l ≥ 0;
- χ²_token term e^{2 l̃} − 1 and importance weight w = min(e^{l̃}, c), l̃ = clamp(l, ±20)
  (verl's ``SAFETY_BOUND``), c = ``clip_ratio_c`` (no cap: w = e^{l̃});
- per sequence i of the [B, T] layout (response tokens only): d_i = −mean_t l
  (``log_ppl_diff`` = log of the trainer's over the rollout's perplexity), ppl ratio e^{d_i},
  χ²_seq term e^{2·clamp(Σ_t l, ±20)} − 1.

Every exponential of a log-ratio is clamped at ±20 as verl clamps its weights and χ² (k3 on the
upper side only, d_i on both), so finite input gives finite metrics (SPEC §8); the values equal
verl's wherever |l| ≤ 20. Differences from verl: sequences without response tokens are left out
of the per-sequence means (verl counts them with d_i = 0), and the ``- 1`` of χ² is taken per
term (expm1: no cancellation for a small mismatch). Masks and all of this run without grad.
"""
from __future__ import annotations

import torch
from torch import Tensor

SAFETY_BOUND = 20.0
"""verl's clamp on a log importance weight before exponentiating (``rollout_corr_helper``)."""

#: The per-key terms: ``{where: {key: (reduction, [where-shaped] values)}}``, one group per set
#: of entries a key averages over (response tokens, sequences); ``pdm_lab.metrics`` sums them.
Terms = list[tuple[Tensor, dict[str, tuple[str, Tensor]]]]


@torch.no_grad()
def rollout_corr_terms(log_ratio: Tensor, response: Tensor, *, keep: Tensor | None = None,
                       cap: float | Tensor | None = None, layout: tuple[int, int] | None = None) -> Terms:
    """The ``corr/*`` terms: per response token, and per sequence when ``layout`` is given.

    Args: log_ratio [N] log r (any float dtype; taken to float64); response [N] bool; keep [N]
    1/0 mask or None (no mask: the sequence rejection key is left out); cap: c (number or 0-d
    tensor) or None (no ``corr/is_frac_*`` keys); layout (B, T) with N = B·T, or None (no
    per-sequence keys). The key set depends only on which of keep, cap and layout are None.
    ``pdm_lab.metrics.rollout_corr_sums`` turns them into mergeable sums.
    """
    resp = response.bool()
    lr = log_ratio.to(torch.float64)
    clamped = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    weight = torch.exp(clamped)  # verl's raw weight, before the cap
    capped = weight if cap is None else torch.clamp(weight, max=cap)
    tokens = {
        "corr/k1_kl": ("mean", -lr),
        "corr/k3_kl": ("mean", torch.expm1(lr.clamp(max=SAFETY_BOUND)) - lr),
        "corr/chi2_token": ("mean", torch.expm1(2.0 * clamped)),
        "corr/is_mean": ("mean", capped),
        "corr/is_max": ("max", capped),
        "corr/is_min": ("min", capped),
    }
    if cap is not None:  # the fraction the cap truncates, and the one below its reciprocal
        tokens["corr/is_frac_high"] = ("mean", weight > cap)
        tokens["corr/is_frac_low"] = ("mean", weight < 1.0 / cap)
    terms = [(resp, tokens)]
    if layout is not None:
        terms.append(_per_sequence(lr, resp, keep, layout))
    return terms


def _per_sequence(lr: Tensor, resp: Tensor, keep: Tensor | None,
                  layout: tuple[int, int]) -> tuple[Tensor, dict[str, tuple[str, Tensor]]]:
    """Terms over the sequences with at least one response token."""
    b, t = layout
    resp2 = resp.reshape(b, t)
    total = torch.where(resp2, lr.reshape(b, t), 0.0).sum(1)  # Σ_t l per sequence
    tokens = resp2.sum(1)
    seqs = tokens > 0
    diff = -total / tokens.clamp(min=1).to(torch.float64)  # d_i = −mean_t l
    terms = {
        "corr/log_ppl_diff": ("mean", diff),
        "corr/log_ppl_abs_diff": ("mean", diff.abs()),
        "corr/log_ppl_diff_max": ("max", diff),
        "corr/log_ppl_diff_min": ("min", diff),
        "corr/ppl_ratio": ("mean", torch.exp(diff.clamp(-SAFETY_BOUND, SAFETY_BOUND))),
        "corr/chi2_seq": ("mean", torch.expm1(2.0 * total.clamp(-SAFETY_BOUND, SAFETY_BOUND))),
    }
    if keep is not None:  # a sequence with any dropped response token counts as rejected
        terms["corr/rs_seq_masked_fraction"] = ("mean", ((keep.reshape(b, t) == 0) & resp2).any(1))
    return seqs, terms


#: verl's key of each rollout-time metric (``as_mismatch``); ``mask/frac_dropped`` is verl's
#: token rejection fraction. pdm_lab's own key ↔ verl's: docs/guide/metrics.md.
ROLLOUT_CORR_KEYS = {
    "corr/k1_kl": "rollout_corr/kl", "corr/k3_kl": "rollout_corr/k3_kl",
    "corr/chi2_token": "rollout_corr/chi2_token", "corr/chi2_seq": "rollout_corr/chi2_seq",
    "corr/ppl_ratio": "rollout_corr/ppl_ratio", "corr/log_ppl_diff": "rollout_corr/log_ppl_diff",
    "corr/log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
    "corr/log_ppl_diff_max": "rollout_corr/log_ppl_diff_max",
    "corr/log_ppl_diff_min": "rollout_corr/log_ppl_diff_min",
    "corr/is_mean": "rollout_corr/rollout_is_mean", "corr/is_max": "rollout_corr/rollout_is_max",
    "corr/is_min": "rollout_corr/rollout_is_min",
    "corr/is_frac_high": "rollout_corr/rollout_is_ratio_fraction_high",
    "corr/is_frac_low": "rollout_corr/rollout_is_ratio_fraction_low",
    "mask/frac_dropped": "rollout_corr/rollout_rs_masked_fraction",
    "corr/rs_seq_masked_fraction": "rollout_corr/rollout_rs_seq_masked_fraction",
}
