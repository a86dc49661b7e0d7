"""The mask-rule registry (SPEC §4). M = 1 keeps a token's gradient, 0 drops it.

A rule is a record (``MaskRule``): its name, the divergence it thresholds, the Ḋ estimator that
decides its direction (or none), whether it reads δ, the reduced support and DPPO's binary
divergences (computed only for the rules that read them), and its drop function
``(stats, advantages, cfg) -> [N] bool``. Stages ask the record; nothing parses rule names.

The record cannot disagree with its function: ``register_mask`` runs the function once on a
probe (``RuleProbe``) that notes every statistic and every config field it reads, derives the
record from those reads, and refuses a declared fact the reads contradict. Adding a rule is one
decorated function and one test::

    @register_mask("my_rule")                      # record: topk_kl, estimator topk, δ, support
    def my_rule(stats, advantages, cfg):
        return outside_region(stats.topk_kl, advantages, cfg) & (advantages * stats.ddot["topk"] > 0)

Masks are constants in the gradient (no grad), and Â = 0 or a zero direction always keeps the
token (every outward test below is a strict inequality).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .direction import DDOT_ESTIMATORS
from .errors import PDMInputError, check_same, raise_at
from .rule_probe import DIVERGENCES, LEVELS, DropFn, RuleProbe, arity_level, facts_from_reads, probe_reads
from .stats import TokenStats

__all__ = ["DIVERGENCES", "DropFn", "MASK_RULES", "MaskRule", "RuleProbe", "compute_mask", "get_mask_rule",
           "outside_region", "pdm_rule", "predictive_outward", "ratio_outward", "register_mask"]


@dataclass(frozen=True)
class MaskRule:
    """One registered rule and the facts about it that stages, metrics and reports need, each
    derived from what its drop function reads (``register_mask``)."""

    name: str
    drop: DropFn
    """``(stats, advantages, cfg) -> [N] bool`` drop tensor (cfg: a ``MaskConfig``)."""
    divergence: str | None = None
    """the ``TokenStats`` divergence the rule reads (``topk_kl``, …), or None (no trust region)."""
    estimator: str | None = None
    """the Ḋ estimator whose sign decides the direction (``pdm_*``), or None (ratio test / none)."""
    uses_delta: bool = False
    """reads δ (and δ_neg): a sweep over δ is meaningful for this rule."""
    uses_support: bool = False
    """reads the reduced top-K support (K and the convention change its decisions)."""
    level: str = "token"
    """``token`` or ``sequence`` (drops whole responses; sees the [B, T] layout)."""
    needs: tuple[str, ...] = ()
    """inputs beyond token stats: ``full`` (full distributions), ``coupled`` (c_t from the stage)."""
    binary_stats: bool = False
    """reads ``stats.binary_kl`` / ``binary_tv``: ``pdm_policy_loss`` computes them only then."""
    doc: str = ""

    def __call__(self, stats: TokenStats, advantages: Tensor, cfg: Any) -> Tensor:
        return self.drop(stats, advantages, cfg)


MASK_RULES: dict[str, MaskRule] = {}


_DERIVE: Any = object()  # a keyword left out of register_mask: the fact comes from the reads


def register_mask(name: str, *, divergence: str | None = _DERIVE, estimator: str | None = _DERIVE,
                  uses_delta: bool = _DERIVE, uses_support: bool = _DERIVE, level: str = _DERIVE,
                  needs: tuple[str, ...] = _DERIVE, binary_stats: bool = _DERIVE) -> Callable[[DropFn], DropFn]:
    """Decorator: register a drop function under `name`, its record derived from what it reads.

    The function is called once here, on a probe (``RuleProbe``, six tokens, under two configs):
    the ``TokenStats`` fields, Ḋ estimators and δ it reads give ``divergence``, ``estimator``,
    ``uses_delta``, ``uses_support``, ``needs`` and ``binary_stats``; its signature gives
    ``level`` (a fourth argument, the [B, T] response mask: ``sequence``). A keyword given here
    is a declaration and must equal what the reads give: a rule that reads a statistic its
    declaration leaves out (or declares one it never reads) is refused with ``ValueError``. A
    read that only a branch the probe does not take makes is not seen.
    """
    declared = {key: value for key, value in (
        ("divergence", divergence), ("estimator", estimator), ("uses_delta", uses_delta),
        ("uses_support", uses_support), ("needs", needs), ("binary_stats", binary_stats),
    ) if value is not _DERIVE}
    if "needs" in declared:
        declared["needs"] = tuple(declared["needs"])
    if declared.get("divergence") not in (None, *DIVERGENCES):
        raise ValueError(f"rule {name!r}: divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if declared.get("estimator") not in (None, *DDOT_ESTIMATORS):
        raise ValueError(f"rule {name!r}: unknown Ḋ estimator {estimator!r}")
    if level is not _DERIVE and level not in LEVELS:
        raise ValueError(f"rule {name!r}: level must be 'token' or 'sequence', got {level!r}")

    def wrap(fn: DropFn) -> DropFn:
        if name in MASK_RULES:
            raise ValueError(f"mask rule {name!r} is already registered")
        by_signature = arity_level(name, fn)
        if level is not _DERIVE and by_signature not in (None, level):
            raise ValueError(f"rule {name!r}: declares level={level!r}, but its function's signature is "
                             f"a {by_signature}-level rule's")
        rule_level = by_signature if level is _DERIVE else level
        if rule_level is None:
            raise ValueError(f"rule {name!r}: its signature does not say its level: declare level=")
        stats_reads, cfg_reads = probe_reads(name, fn, rule_level)
        facts = facts_from_reads(name, stats_reads, cfg_reads)
        for key, value in declared.items():
            if value != facts[key]:
                read = ", ".join(sorted(stats_reads | {f"cfg.{c}" for c in cfg_reads})) or "nothing"
                raise ValueError(f"rule {name!r}: declares {key}={value!r}, but its function reads {read}, "
                                 f"which makes {key}={facts[key]!r}; declare that, or leave {key} out")
        MASK_RULES[name] = MaskRule(name=name, drop=fn, level=rule_level, doc=(fn.__doc__ or "").strip(),
                                    **facts)
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


def _dppo_rule(divergence: str, title: str) -> DropFn:
    def rule(stats, advantages, cfg):
        return outside_region(getattr(stats, divergence), advantages, cfg) & ratio_outward(stats, advantages)
    rule.__doc__ = f"{title}: drop {divergence} > δ ∧ Â(r−1) > 0 (DPPO: trust region, ratio direction)."
    return rule


for _divergence, _title in (("binary_tv", "DPPO-Binary-TV"), ("binary_kl", "DPPO-Binary-KL"),
                            ("topk_tv", "DPPO-TopK-TV"), ("topk_kl", "DPPO-TopK-KL (the paper's baseline)")):
    register_mask(f"dppo_{_divergence}", divergence=_divergence)(_dppo_rule(_divergence, _title))


def pdm_rule(estimator: str) -> DropFn:
    """PDM's drop function for Ḋ `estimator` (SPEC §4): ``register_mask(f"pdm_{name}")(pdm_rule(name))``
    registers it for an estimator added with ``register_ddot_estimator``."""
    def rule(stats, advantages, cfg):
        return outside_region(stats.topk_kl, advantages, cfg) & predictive_outward(stats, advantages, estimator)
    rule.__doc__ = f"PDM: drop D > δ ∧ Â·Ḋ_{estimator} > 0 (the update would grow the top-K KL)."
    return rule


for _name in DDOT_ESTIMATORS:
    register_mask(f"pdm_{_name}", divergence="topk_kl", estimator=_name)(pdm_rule(_name))


@register_mask("icepop")
def mask_icepop(stats, advantages, cfg):
    """IcePop: drop r ∉ [α, β], both directions (Â = 0 kept: it carries no gradient)."""
    return ((stats.ratio < cfg.icepop_low) | (stats.ratio > cfg.icepop_high)) & (advantages != 0)


@register_mask("pdm_coupled", divergence="topk_kl", needs=("coupled",))
def mask_pdm_coupled(stats, advantages, cfg):
    """PDM coupled (SPEC §3b): drop D > δ ∧ Â ≠ 0 ∧ c > 0, c_t = Â_t r_t ⟨P∇_θ D_O, ∇_θ log π_t(k_t)⟩
    (the token's update grows the batch's out-of-region divergence); c from ``pdm_lab.coupled``."""
    if stats.coupled is None:
        raise PDMInputError("pdm_coupled: these stats lack c_t; the stage computes it with "
                            "pdm_lab.coupled.coupled_scores and passes pdm_policy_loss(coupled=c)")
    check_same(("stats.coupled", "advantages"), stats.coupled, advantages)
    return outside_region(stats.topk_kl, advantages, cfg) & (advantages != 0) & (stats.coupled > 0)
