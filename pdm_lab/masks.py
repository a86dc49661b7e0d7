"""The mask-rule registry (SPEC §4). M = 1 keeps a token's gradient, 0 drops it.

A rule is one function ``(stats, advantages, cfg) -> drop`` registered by name; adding a rule is
one decorated function and one test. Masks are constants in the gradient (no grad), and Â = 0 or
a zero direction always keeps the token (every outward test below is a strict inequality).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from .direction import DDOT_ESTIMATORS
from .errors import PDMInputError, check_same, raise_at

if TYPE_CHECKING:
    from .config import MaskConfig
    from .stats import TokenStats

MaskRule = Callable[["TokenStats", Tensor, "MaskConfig"], Tensor]
MASK_RULES: dict[str, MaskRule] = {}


def register_mask(name: str) -> Callable[[MaskRule], MaskRule]:
    """Decorator: register a rule returning a [N] bool *drop* tensor under `name`."""
    def wrap(fn: MaskRule) -> MaskRule:
        if name in MASK_RULES:
            raise ValueError(f"mask rule {name!r} is already registered")
        MASK_RULES[name] = fn
        return fn
    return wrap


def get_mask_rule(name: str) -> MaskRule:
    try:
        return MASK_RULES[name]
    except KeyError:
        raise PDMInputError(f"rule: unknown mask rule {name!r}; valid: {', '.join(sorted(MASK_RULES))}") from None


@torch.no_grad()
def compute_mask(cfg: "MaskConfig", stats: "TokenStats", advantages: Tensor) -> Tensor:
    """[N] keep mask (1.0 keep, 0.0 drop) of rule ``cfg.rule``, in the dtype of ``stats.ratio``."""
    check_same(("advantages", "stats.ratio"), advantages, stats.ratio)
    raise_at("advantages", ~torch.isfinite(advantages), "non-finite advantage", advantages)
    drop = get_mask_rule(cfg.rule)(stats, advantages.to(stats.ratio.dtype), cfg)
    return (~drop).to(stats.ratio.dtype)


def outside_region(divergence: Tensor, advantages: Tensor, cfg: "MaskConfig") -> Tensor:
    """[N] bool: divergence > δ (δ_neg for Â < 0, as DPPO's code allows) — outside the region."""
    delta = torch.where(advantages < 0, cfg.delta_for_negative, cfg.delta).to(divergence.dtype)
    return divergence > delta


def _ratio_outward(stats: "TokenStats", advantages: Tensor) -> Tensor:
    """PPO/DPPO direction test Â(r − 1) > 0, on log r to avoid rounding r at 1."""
    return advantages * stats.log_ratio > 0


@register_mask("none")
def mask_none(stats: "TokenStats", advantages: Tensor, cfg: "MaskConfig") -> Tensor:
    """Keep everything (plain importance-weighted policy gradient)."""
    return torch.zeros_like(advantages, dtype=torch.bool)


@register_mask("ppo_clip")
def mask_ppo_clip(stats: "TokenStats", advantages: Tensor, cfg: "MaskConfig") -> Tensor:
    """Drop (Â>0 ∧ r>1+ε_high) ∨ (Â<0 ∧ r<1−ε_low); GRPO clip-higher is (0.2, 0.28)."""
    r = stats.ratio
    return ((advantages > 0) & (r > 1 + cfg.eps_high)) | ((advantages < 0) & (r < 1 - cfg.eps_low))


@register_mask("dppo_binary_tv")
def mask_dppo_binary_tv(stats, advantages, cfg):
    """DPPO: drop |π_k − μ_k| > δ ∧ Â(r−1) > 0."""
    return outside_region(stats.binary_tv, advantages, cfg) & _ratio_outward(stats, advantages)


@register_mask("dppo_binary_kl")
def mask_dppo_binary_kl(stats, advantages, cfg):
    """DPPO: drop Bernoulli KL(μ_k‖π_k) > δ ∧ Â(r−1) > 0."""
    return outside_region(stats.binary_kl, advantages, cfg) & _ratio_outward(stats, advantages)


@register_mask("dppo_topk_tv")
def mask_dppo_topk_tv(stats, advantages, cfg):
    """DPPO: drop top-K TV > δ ∧ Â(r−1) > 0."""
    return outside_region(stats.topk_tv, advantages, cfg) & _ratio_outward(stats, advantages)


@register_mask("dppo_topk_kl")
def mask_dppo_topk_kl(stats, advantages, cfg):
    """DPPO-TopK-KL (the paper's baseline): drop D > δ ∧ Â(r−1) > 0."""
    return outside_region(stats.topk_kl, advantages, cfg) & _ratio_outward(stats, advantages)


def pdm_rule(estimator: str) -> MaskRule:
    def rule(stats, advantages, cfg):
        if estimator not in stats.ddot:
            raise PDMInputError(f"rule pdm_{estimator}: needs Ḋ_{estimator}, which these stats lack "
                                "(`exact` needs the full distributions)")
        return outside_region(stats.topk_kl, advantages, cfg) & (advantages * stats.ddot[estimator] > 0)
    rule.__doc__ = f"PDM: drop D > δ ∧ Â·Ḋ_{estimator} > 0 (the update would grow the top-K KL)."
    return rule


for _name in DDOT_ESTIMATORS:
    register_mask(f"pdm_{_name}")(pdm_rule(_name))


@register_mask("icepop")
def mask_icepop(stats, advantages, cfg):
    """IcePop: drop r ∉ [α, β], both directions."""
    return (stats.ratio < cfg.icepop_low) | (stats.ratio > cfg.icepop_high)
