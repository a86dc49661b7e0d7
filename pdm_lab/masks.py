"""The mask-rule registry (SPEC §4). M = 1 keeps a token's gradient, 0 drops it.

A rule is a record (``MaskRule``): its name, its drop function ``(stats, advantages, cfg) ->
[N] bool``, and the facts stages ask instead of parsing names — the divergence it thresholds,
the Ḋ estimator that decides its direction, its support (μ's top-K, or the sampled token's one
slot), whether it reads δ, whether its drops change with K, its level, the inputs it needs and
DPPO's binary divergences (``pdm_lab.rule_record``). Adding a rule is one decorated function
whose keywords declare its record (docs/rules.md)::

    @register_mask("my_rule", divergence="topk_kl", estimator="topk", support="topk",
                   uses_delta=True, uses_k=True)
    def my_rule(stats, advantages, cfg):
        return outside_region(stats.topk_kl, advantages, cfg) & (advantages * stats.ddot["topk"] > 0)

``register_mask`` runs the function over a varied probe set (``pdm_lab.rule_probe``) and refuses
a declaration that what it reads, or how its drops move with K, contradicts.

Masks are constants in the gradient (no grad), and Â = 0 or a zero direction always keeps the
token (every outward test below is a strict inequality).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .errors import PDMInputError, check_same, raise_at
from .rule_probe import DropFn, RuleProbe, RuleRecordError, observe, signature_level
from .rule_record import DIVERGENCES, FIELDS, check_declaration, check_level, resolve_declaration
from .stats import TokenStats

__all__ = ["DIVERGENCES", "DropFn", "MASK_RULES", "MaskRule", "RuleProbe", "RuleRecordError", "compute_mask",
           "get_mask_rule", "kernel_outward", "outside_region", "pdm_rule", "predictive_outward", "ratio_outward", "register_mask"]


@dataclass(frozen=True)
class MaskRule:
    """One registered rule and its declared record (``pdm_lab.rule_record`` says how each field
    is checked at registration)."""

    name: str
    drop: DropFn
    """``(stats, advantages, cfg) -> [N] bool`` drop tensor (cfg: a ``MaskConfig``)."""
    divergence: str | None = None
    """the ``TokenStats`` divergence the rule thresholds (``topk_kl``, …), or None (no trust region)."""
    estimator: str | None = None
    """the Ḋ estimator whose sign decides the direction (``pdm_*``), or None (ratio test / none)."""
    support: str = "slot"
    """``topk``: reads μ's reduced top-K support; ``slot``: the sampled token's one slot decides."""
    uses_delta: bool = False
    """reads δ (and δ_neg): a sweep over δ is meaningful for this rule."""
    uses_k: bool = False
    """its drops change with K or the convention: a sweep over them is meaningful."""
    level: str = "token"
    """``token`` or ``sequence`` (drops whole responses; sees the [B, T] layout)."""
    needs: tuple[str, ...] = ()
    """inputs beyond token stats: ``full`` (full distributions), ``coupled`` (c_t from the model),
    ``kernel`` (c_t = ⟨Wᵀg, Wᵀv⟩ from the unembedding W)."""
    binary_stats: bool = False
    """reads ``stats.binary_kl`` / ``binary_tv``: ``pdm_policy_loss`` computes them only then."""
    doc: str = ""

    @property
    def uses_support(self) -> bool:
        """Reads μ's top-K support (``support == "topk"``): the top-K path, never the one slot."""
        return self.support == "topk"

    def record(self) -> dict[str, Any]:
        """The declared record, as ``register_mask``'s keywords."""
        return {field: getattr(self, field) for field in FIELDS}

    def __call__(self, stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
        return self.drop(stats, advantages, cfg)


MASK_RULES: dict[str, MaskRule] = {}


_LEFT_OUT: Any = object()  # a keyword left out of register_mask: ``like``'s value, else the default


def register_mask(name: str, *, like: str | None = None, divergence: str | None = _LEFT_OUT,
                  estimator: str | None = _LEFT_OUT, support: str = _LEFT_OUT, uses_delta: bool = _LEFT_OUT,
                  uses_k: bool = _LEFT_OUT, level: str = _LEFT_OUT, needs: tuple[str, ...] = _LEFT_OUT,
                  binary_stats: bool | None = _LEFT_OUT) -> Callable[[DropFn], DropFn]:
    """Decorator: register a drop function under ``name`` with the record its keywords declare.

    A keyword left out declares ``like``'s value (another registered rule's record, for a rule
    that delegates to it), else its default (``rule_record.DEFAULTS``: no divergence, no
    estimator, the one slot, no δ, no K, token level, nothing more; ``binary_stats`` follows the
    divergence). The function is then run over the probe set (``rule_probe``): its signature
    must match ``level``, and what it reads and how its drops move with K must match every
    other field; a mismatch is refused with ``RuleRecordError`` (a ``ValueError``), one line
    naming the rule and the field.
    """
    keywords = {"divergence": divergence, "estimator": estimator, "support": support, "uses_delta": uses_delta,
                "uses_k": uses_k, "level": level, "needs": needs, "binary_stats": binary_stats}
    given = {key: value for key, value in keywords.items() if value is not _LEFT_OUT}
    if like is not None and like not in MASK_RULES:
        raise RuleRecordError(f"rule {name!r}: like: {like!r} is not a registered rule; valid: "
                              f"{', '.join(sorted(MASK_RULES))}")
    base = MASK_RULES[like].record() if like is not None else None
    declared = resolve_declaration(name, given, base)
    said = set(given) | (set(FIELDS) if like is not None else set())

    def wrap(fn: DropFn) -> DropFn:
        if name in MASK_RULES:
            raise RuleRecordError(f"rule {name!r}: name: already registered")
        check_level(name, declared["level"], signature_level(name, fn), said)
        check_declaration(name, declared, said, observe(name, fn, declared["level"]))
        MASK_RULES[name] = MaskRule(name=name, drop=fn, doc=(fn.__doc__ or "").strip(), **declared)
        return fn
    return wrap


def get_mask_rule(name: str) -> MaskRule:
    """The record of rule `name`; an unknown name raises, listing the valid ones."""
    try:
        return MASK_RULES[name]
    except KeyError:
        raise PDMInputError(f"rule: unknown mask rule {name!r}; valid: {', '.join(sorted(MASK_RULES))}") from None


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


@register_mask("none")
def mask_none(stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """Keep everything (plain importance-weighted policy gradient)."""
    return torch.zeros_like(advantages, dtype=torch.bool)


@register_mask("ppo_clip")
def mask_ppo_clip(stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """Drop (Â>0 ∧ r>1+ε_high) ∨ (Â<0 ∧ r<1−ε_low); GRPO clip-higher is (0.2, 0.28)."""
    r = stats.ratio
    return ((advantages > 0) & (r > 1 + cfg.eps_high)) | ((advantages < 0) & (r < 1 - cfg.eps_low))


def dppo_drop(divergence: Tensor, stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
    """DPPO (SPEC §4): drop divergence > δ ∧ Â(r−1) > 0 (trust region, ratio direction)."""
    return outside_region(divergence, advantages, cfg) & ratio_outward(stats, advantages)


@register_mask("dppo_binary_tv", divergence="binary_tv", uses_delta=True)
def mask_dppo_binary_tv(stats, advantages, cfg):
    """DPPO-Binary-TV: drop binary_tv > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.binary_tv, stats, advantages, cfg)


@register_mask("dppo_binary_kl", divergence="binary_kl", uses_delta=True)
def mask_dppo_binary_kl(stats, advantages, cfg):
    """DPPO-Binary-KL: drop binary_kl > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.binary_kl, stats, advantages, cfg)


@register_mask("dppo_topk_tv", divergence="topk_tv", support="topk", uses_delta=True, uses_k=True)
def mask_dppo_topk_tv(stats, advantages, cfg):
    """DPPO-TopK-TV: drop topk_tv > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.topk_tv, stats, advantages, cfg)


@register_mask("dppo_topk_kl", divergence="topk_kl", support="topk", uses_delta=True, uses_k=True)
def mask_dppo_topk_kl(stats, advantages, cfg):
    """DPPO-TopK-KL (the paper's baseline): drop topk_kl > δ ∧ Â(r−1) > 0."""
    return dppo_drop(stats.topk_kl, stats, advantages, cfg)


def pdm_drop(stats: TokenStats, advantages: Tensor, cfg: Any, estimator: str) -> Tensor:
    """PDM (SPEC §4): drop D > δ ∧ Â·Ḋ_estimator > 0 (the update would grow the top-K KL)."""
    return outside_region(stats.topk_kl, advantages, cfg) & predictive_outward(stats, advantages, estimator)


@register_mask("pdm_exact", divergence="topk_kl", estimator="exact", support="topk", uses_delta=True, uses_k=True,
               needs=("full",))
def mask_pdm_exact(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_exact > 0 (Ḋ from the full distributions: toys)."""
    return pdm_drop(stats, advantages, cfg, "exact")


@register_mask("pdm_agg", divergence="topk_kl", estimator="agg", support="topk", uses_delta=True, uses_k=True)
def mask_pdm_agg(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_agg > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "agg")


@register_mask("pdm_uniform", divergence="topk_kl", estimator="uniform", support="topk", uses_delta=True,
               uses_k=True)
def mask_pdm_uniform(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_uniform > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "uniform")


@register_mask("pdm_topk", divergence="topk_kl", estimator="topk", support="topk", uses_delta=True, uses_k=True)
def mask_pdm_topk(stats, advantages, cfg):
    """PDM: drop D > δ ∧ Â·Ḋ_topk > 0 (the update would grow the top-K KL)."""
    return pdm_drop(stats, advantages, cfg, "topk")


def kernel_outward(stats: TokenStats, advantages: Tensor, kernel_ratio: float) -> Tensor:
    """The kernel-aware direction test Â·(Ḋ_topk + λ·c_t) > 0, c_t = ⟨Wᵀg, Wᵀv⟩ from
    ``stats.kernel`` (``pdm_lab.kernel_direction``), λ = ``kernel_ratio`` (SPEC §6d)."""
    if stats.kernel is None:
        raise PDMInputError("pdm_kernel: these stats lack c_t = ⟨Wᵀg, Wᵀv⟩; the stage computes it with "
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


@register_mask("icepop")
def mask_icepop(stats, advantages, cfg):
    """IcePop: drop r ∉ [α, β], both directions (Â = 0 kept: it carries no gradient)."""
    return ((stats.ratio < cfg.icepop_low) | (stats.ratio > cfg.icepop_high)) & (advantages != 0)


@register_mask("pdm_coupled", divergence="topk_kl", support="topk", uses_delta=True, uses_k=True, needs=("coupled",))
def mask_pdm_coupled(stats, advantages, cfg):
    """PDM coupled (SPEC §3b): drop D > δ ∧ Â ≠ 0 ∧ c > 0, c_t = Â_t r_t ⟨P∇_θ D_O, ∇_θ log π_t(k_t)⟩
    (the token's update grows the batch's out-of-region divergence); c from ``pdm_lab.coupled``."""
    if stats.coupled is None:
        raise PDMInputError("pdm_coupled: these stats lack c_t; the stage computes it with "
                            "pdm_lab.coupled.coupled_scores and passes pdm_policy_loss(coupled=c)")
    check_same(("stats.coupled", "advantages"), stats.coupled, advantages)
    return outside_region(stats.topk_kl, advantages, cfg) & (advantages != 0) & (stats.coupled > 0)


@register_mask("pdm_kernel", divergence="topk_kl", estimator="topk", support="topk", uses_delta=True, uses_k=True,
               needs=("kernel",))
def mask_pdm_kernel(stats, advantages, cfg):
    """PDM kernel-aware (SPEC §6d): drop D > δ ∧ Â ≠ 0 ∧ Â·(Ḋ_topk + λ·c_t) > 0, c_t = ⟨Wᵀg_t, Wᵀv_t⟩
    (W the unembedding, g = ∇_z D, v = e_k − π; the head's part W Wᵀ of the network's logit
    kernel), λ = ``cfg.kernel_ratio``; c from ``pdm_lab.kernel_direction``."""
    return outside_region(stats.topk_kl, advantages, cfg) & kernel_outward(stats, advantages, cfg.kernel_ratio)
