"""The mask-rule registry (SPEC §4). M = 1 keeps a token's gradient, 0 drops it.

A rule is a record (``MaskRule``): its name, its drop function ``(stats, advantages, cfg) ->
[N] bool``, and the facts stages ask instead of parsing names — the divergence it thresholds,
the Ḋ estimator that decides its direction, its support (μ's top-K, or the sampled token's one
slot), whether it reads δ, whether its drops change with K, its level, the inputs it needs and
DPPO's binary divergences (``pdm_lab.rule_record``). Adding a rule is one decorated function
whose keywords declare its record (docs/guide/rules.md)::

    @register_mask("my_rule", divergence="topk_kl", estimator="topk", support="topk",
                   uses_delta=True, uses_k=True)
    def my_rule(stats, advantages, cfg):
        return outside_region(stats.topk_kl, advantages, cfg) & (advantages * stats.ddot["topk"] > 0)

``register_mask`` runs the function over a varied check set (``pdm_lab.rule_check``) and refuses
a declaration that what it reads, or how its drops move with K, contradicts.

Masks are constants in the gradient (no grad), and Â = 0 or a zero direction always keeps the
token (every outward test below is a strict inequality).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_same, raise_at
from pdm_lab.mask_registry import (MASK_RULES, MaskRule, _register_builtin, check_registered, get_mask_rule,
                                   register_mask)
from pdm_lab.rule_check import DropFn, RuleCheckStats, RuleRecordError
from pdm_lab.rule_record import DIVERGENCES
from pdm_lab.tokenwise import TokenStats

__all__ = ["DIVERGENCES", "DropFn", "MASK_RULES", "MaskRule", "RuleCheckStats", "RuleRecordError", "check_registered",
           "compute_mask", "get_mask_rule", "kernel_outward", "outside_region", "pdm_rule", "predictive_outward", "ratio_outward", "register_mask"]


@torch.no_grad()
def compute_mask(cfg: Any, stats: TokenStats, advantages: Tensor,
                 response_mask: Tensor | None = None) -> Tensor:
    """[N] keep mask (1.0 keep, 0.0 drop) of rule ``cfg.rule``, in the dtype of ``stats.ratio``.

    ``response_mask`` [B, T] (B·T = N): the layout a ``level="sequence"`` rule needs (SPEC §4b).
    """
    check_same(("advantages", "stats.ratio"), advantages, stats.ratio)
    raise_at("advantages", ~torch.isfinite(advantages), "non-finite advantage", advantages)
    rule = get_mask_rule(cfg.rule)
    if rule.binary_stats and (stats.binary_kl is None or stats.binary_tv is None):
        raise PDMInputError(f"rule {rule.name!r} reads DPPO's binary divergences, which these stats lack: "
                            "compute them with token_stats(..., binary=True)")
    adv = advantages.to(stats.ratio.dtype)
    if rule.level == "sequence":
        if response_mask is None or response_mask.numel() != adv.numel() or response_mask.dim() != 2:
            raise PDMInputError(f"rule {rule.name!r} is sequence-level: pass response_mask [B, T] with "
                                f"B·T = {adv.numel()} (got {None if response_mask is None else tuple(response_mask.shape)})")
        drop = rule.drop(stats, adv, cfg, response_mask)
    else:
        drop = rule(stats, adv, cfg)
    return (~drop).to(stats.ratio.dtype)


def outside_region(divergence: Tensor, advantages: Tensor, cfg: Any) -> Tensor:
    """[N] bool: divergence > δ (δ_neg for Â < 0, as DPPO's code allows) — outside the region."""
    if cfg.delta_for_negative == cfg.delta:  # one threshold (the default): no [N] select of δ
        return divergence > cfg.delta  # δ rounded to divergence's dtype, as the select does
    delta = torch.where(advantages < 0, cfg.delta_for_negative, cfg.delta).to(divergence.dtype)
    return divergence > delta


def ratio_outward(stats: TokenStats, advantages: Tensor) -> Tensor:
    """PPO/DPPO direction test Â(r − 1) > 0, on log r to avoid rounding r at 1."""
    return advantages * stats.log_ratio > 0


def predictive_outward(stats: TokenStats, advantages: Tensor, estimator: str) -> Tensor:
    """PDM direction test Â·Ḋ_estimator > 0: the update would grow the divergence (SPEC §3)."""
    if estimator not in stats.ddot:
        raise PDMInputError(f"Ḋ_{estimator}: these stats lack it "
                            "(`exact` needs the full distributions)")
    return advantages * stats.ddot[estimator] > 0


@_register_builtin("none")
def mask_none(stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """Keep everything (plain importance-weighted policy gradient)."""
    return torch.zeros_like(advantages, dtype=torch.bool)


@_register_builtin("ppo_clip")
def mask_ppo_clip(stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """Drop (Â>0 ∧ r>1+ε_high) ∨ (Â<0 ∧ r<1−ε_low); GRPO clip-higher is (0.2, 0.28)."""
    r = stats.ratio
    return ((advantages > 0) & (r > 1 + cfg.eps_high)) | ((advantages < 0) & (r < 1 - cfg.eps_low))


def dppo_drop(divergence: Tensor, stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """DPPO (SPEC §4): drop divergence > δ ∧ Â(r−1) > 0 (trust region, ratio direction)."""
    return outside_region(divergence, advantages, cfg) & ratio_outward(stats, advantages)


@_register_builtin("dppo_binary_tv", divergence="binary_tv", uses_delta=True)
def mask_dppo_binary_tv(stats, advantages, cfg):
    """DPPO-Binary-TV: drop binary_tv > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.binary_tv, stats, advantages, cfg)


@_register_builtin("dppo_binary_kl", divergence="binary_kl", uses_delta=True)
def mask_dppo_binary_kl(stats, advantages, cfg):
    """DPPO-Binary-KL: drop binary_kl > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.binary_kl, stats, advantages, cfg)


@_register_builtin("dppo_topk_tv", divergence="topk_tv", support="topk", uses_delta=True, uses_k=True)
def mask_dppo_topk_tv(stats, advantages, cfg):
    """DPPO-TopK-TV: drop topk_tv > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.topk_tv, stats, advantages, cfg)


@_register_builtin("dppo_topk_kl", divergence="topk_kl", support="topk", uses_delta=True, uses_k=True)
def mask_dppo_topk_kl(stats, advantages, cfg):
    """DPPO-TopK-KL (the paper's baseline): drop topk_kl > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.topk_kl, stats, advantages, cfg)


def pdm_drop(stats: TokenStats, advantages: Tensor, cfg: Any, estimator: str) -> Tensor:
    """PDM (SPEC §4): drop D > δ ∧ Â·Ḋ_estimator > 0 (the update would grow the top-K KL)."""
    return outside_region(stats.topk_kl, advantages, cfg) & predictive_outward(stats, advantages, estimator)


@_register_builtin("pdm_exact", divergence="topk_kl", estimator="exact", support="topk", uses_delta=True, uses_k=True,
               needs=("full",))
def mask_pdm_exact(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_exact > 0 (Ḋ from the full distributions: toys)."""
    return pdm_drop(stats, advantages, cfg, "exact")


@_register_builtin("pdm_agg", divergence="topk_kl", estimator="agg", support="topk", uses_delta=True, uses_k=True)
def mask_pdm_agg(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_agg > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "agg")


@_register_builtin("pdm_uniform", divergence="topk_kl", estimator="uniform", support="topk", uses_delta=True,
               uses_k=True)
def mask_pdm_uniform(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_uniform > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "uniform")


@_register_builtin("pdm_topk", divergence="topk_kl", estimator="topk", support="topk", uses_delta=True, uses_k=True)
def mask_pdm_topk(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_topk > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "topk")


def kernel_outward(stats: TokenStats, advantages: Tensor, kernel_ratio: float) -> Tensor:
    """The kernel-aware direction test Â·(Ḋ_topk + λ·h_t) > 0, h_t = ⟨Wᵀg, Wᵀv⟩ from
    ``stats.kernel`` (``pdm_lab.kernel_direction``), λ = ``kernel_ratio`` (SPEC §6d)."""
    if stats.kernel is None:
        raise PDMInputError("pdm_kernel: these stats lack h_t = ⟨Wᵀg, Wᵀv⟩; the stage computes it with "
                            "pdm_lab.kernel_direction.kernel_scores and passes pdm_policy_loss(kernel=c)")
    check_same(("stats.kernel", "advantages"), stats.kernel, advantages)
    return (advantages != 0) & (advantages * (stats.ddot["topk"] + kernel_ratio * stats.kernel) > 0)


def pdm_rule(estimator: str) -> DropFn:
    """PDM's drop function for a Ḋ ``estimator`` added with ``register_ddot_estimator``; register it
    as ``register_mask("pdm_<name>", like="pdm_topk", estimator="<name>")(pdm_rule("<name>"))``."""
    def rule(stats, advantages, cfg):
        return pdm_drop(stats, advantages, cfg, estimator)
    rule.__doc__ = f"PDM: drop D > δ ∧ Â·Ḋ_{estimator} > 0 (the update would grow the top-K KL)."
    return rule


@_register_builtin("icepop")
def mask_icepop(stats, advantages, cfg):
    """IcePop: drop r ∉ [α, β], both directions (Â = 0 kept: it carries no gradient)."""
    return ((stats.ratio < cfg.icepop_low) | (stats.ratio > cfg.icepop_high)) & (advantages != 0)


@_register_builtin("pdm_coupled", divergence="topk_kl", support="topk", uses_delta=True, uses_k=True, needs=("coupled",))
def mask_pdm_coupled(stats, advantages, cfg):
    """PDM coupled (SPEC §3b): drop D > δ ∧ Â ≠ 0 ∧ c > 0, c_t = Â_t r_t ⟨P∇_θ D_O, ∇_θ log π_t(k_t)⟩
    (the token's update grows the batch's out-of-region divergence); c from ``pdm_lab.coupled``."""
    if stats.coupled is None:
        raise PDMInputError("pdm_coupled: these stats lack c_t; the stage computes it with "
                            "pdm_lab.coupled.coupled_scores and passes pdm_policy_loss(coupled=c)")
    check_same(("stats.coupled", "advantages"), stats.coupled, advantages)
    return outside_region(stats.topk_kl, advantages, cfg) & (advantages != 0) & (stats.coupled > 0)


@_register_builtin("pdm_kernel", divergence="topk_kl", estimator="topk", support="topk", uses_delta=True, uses_k=True,
               needs=("kernel",))
def mask_pdm_kernel(stats, advantages, cfg):
    """PDM kernel-aware (SPEC §6d): drop D > δ ∧ Â ≠ 0 ∧ Â·(Ḋ_topk + λ·h_t) > 0, h_t = ⟨Wᵀg_t, Wᵀv_t⟩
    (W the unembedding, g = ∇_z D, v = e_k − π; the head's part W Wᵀ of the network's logit
    kernel), λ = ``cfg.kernel_ratio``; c from ``pdm_lab.kernel_direction``."""
    return outside_region(stats.topk_kl, advantages, cfg) & kernel_outward(stats, advantages, cfg.kernel_ratio)


# The SPEC §4b rules register into the same registry, whichever module is imported first.
import pdm_lab.framework_rules  # noqa: E402,F401
