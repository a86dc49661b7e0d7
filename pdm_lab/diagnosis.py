"""``diagnose``: every per-token quantity and the main masks for full distributions, in one call.

Built from the same functions the trainers use (support → π on support → stats → mask registry);
it is a convenience view for checks and notebooks, not a second implementation.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from pdm_lab.mask_config import MaskConfig
from pdm_lab.errors import check_logp, check_same, check_tensor
from pdm_lab.masks import compute_mask, outside_region
from pdm_lab.metrics import direction_disagreement, sign_certified
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full
from pdm_lab.support_checks import check_full_mass

DIAGNOSE_MASKS = ("dppo_topk_kl", "pdm_exact", "pdm_agg", "pdm_uniform", "pdm_topk")


@torch.no_grad()
def diagnose(mu_logp: Tensor, pi_logp: Tensor, sampled: Tensor, advantages: Tensor, *,
             k: int = 20, delta: float = 0.15, delta_neg: float | None = None,
             convention: str = "union") -> dict[str, Tensor]:
    """Per-token divergences, Ḋ estimates and masks from full μ and π.

    Args:
        mu_logp, pi_logp: [N, n] full log-probabilities of μ and π: each row a distribution,
            its total mass 1 within ``support_checks.MASS_LOG_ATOL`` in log space.
        sampled: [N] int64 sampled ids k.
        advantages: [N] Â.
        k, delta, delta_neg, convention: K, δ, δ for Â < 0 (None: δ) and the support
            convention (SPEC §2, §4).

    Returns:
        [N] tensors ``topk_kl, topk_tv, full_kl, ratio`` (float64; +inf only where log r > 709,
        i.e. r is beyond float64 itself: read ``log_ratio`` there), ``log_ratio, mu_tail, pi_tail,
        ddot_exact, ddot_agg, ddot_uniform, ddot_topk, ddot_lower, ddot_upper, outside`` (bool,
        D > δ, δ_neg for Â < 0: ``pdm_lab.masks.outside_region``), ``dir_disagree_<estimator>``
        (bool, sign(r − 1) ≠ sign(Ḋ)), ``sign_certified`` (bool, the Ḋ bounds fix its sign) and masks
        ``mask_<rule>`` (1.0 keep, 0.0 drop) for ``DIAGNOSE_MASKS``; ``support`` [N, m] int32
        (int64 past 2³¹ − 1 tokens: ``support.id_dtype``) padded with −1.
    """
    check_tensor("mu_logp", mu_logp, ndim=2, floating=True)
    check_tensor("pi_logp", pi_logp, ndim=2, floating=True)
    check_same(("mu_logp", "pi_logp"), mu_logp, pi_logp, dtype=True)
    check_tensor("advantages", advantages, ndim=1, floating=True)
    check_same(("sampled", "advantages"), sampled, advantages)
    for name, logp in (("mu_logp", mu_logp), ("pi_logp", pi_logp)):  # named as the caller knows them
        check_logp(name, logp)
        check_full_mass(name, logp)  # read as given below (full KL, exact Ḋ), never renormalised
    support = support_from_full(mu_logp, sampled, k=k, convention=convention)
    pi = policy_on_support(pi_logp, support.ids)
    stats = token_stats(support, pi, mu_full=mu_logp, pi_full=pi_logp)
    adv = advantages.to(stats.ratio.dtype)
    base = MaskConfig(delta=delta, delta_neg=delta_neg, k=k, convention=convention)
    out: dict[str, Tensor] = {
        "topk_kl": stats.topk_kl, "topk_tv": stats.topk_tv, "full_kl": stats.full_kl,
        # float64: e^{100} overflows float32 though r is finite; inf only past log r ≈ 709
        "ratio": torch.exp(stats.log_ratio.double()), "log_ratio": stats.log_ratio, "mu_tail": stats.mu_tail, "pi_tail": stats.pi_tail,
        "ddot_lower": stats.ddot_lower, "ddot_upper": stats.ddot_upper,
        "outside": outside_region(stats.topk_kl, adv, base), "support": support.ids,
    }
    out.update({f"ddot_{name}": value for name, value in stats.ddot.items()})
    out.update({f"dir_disagree_{name}": direction_disagreement(stats, name) for name in stats.ddot})
    out["sign_certified"] = sign_certified(stats)
    for rule in DIAGNOSE_MASKS:
        out[f"mask_{rule}"] = compute_mask(dataclasses.replace(base, rule=rule), stats, adv)
    return out
