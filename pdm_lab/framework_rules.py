"""The rules the frameworks ship that a comparison needs (SPEC §4b), in the one registry.

* ``ppo_clip_dual`` — verl's dual-clip PPO: ``ppo_clip`` plus drop Â<0 ∧ r > c (verl: c = 3).
  verl clips the loss at −c·Â there, whose gradient is 0, so a drop is the same update.
* ``seq_k1``, ``seq_k2``, ``seq_k3``, ``seq_topk_kl`` — verl's rollout-correction sequence
  rejection: drop a response when the mean/max/sum (``seq_agg``) of its per-token statistic lies
  outside [``band_low``, ``band_high``]; ``seq_geo_mean`` is the geometric-mean ratio test (k1,
  mean, whatever ``seq_agg`` says). Every ``seq_*`` rule also applies the veto: drop the
  response if any of its tokens has r < ``veto_floor`` (None: no veto).
* ``opsm`` — slime's off-policy sequence masking: drop a response with Â < 0 whose mean of
  log μ_k − log π_k exceeds ``opsm_delta``.
* ``token_k1``, ``token_k2``, ``token_k3`` — the same bands per token.

k1 = log r, k2 = ½(log r)², k3 = (r − 1) − log r, from ``stats.log_ratio`` (never from a rounded r).
A sequence rule's drop function takes the [B, T] response mask as a fourth argument (the
registry passes it for ``level="sequence"``); Â = 0 keeps, as for every rule. Each rule's record
is declared at its registration (``pdm_lab.rule_record``); the band and OPSM thresholds are not δ.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pdm_lab.mask_registry import _register_builtin

if TYPE_CHECKING:
    from pdm_lab.tokenwise import TokenStats

#: Per-token statistics the band rules threshold (SPEC §4b).
BAND_STATISTICS = ("k1", "k2", "k3", "topk_kl")
#: How a sequence rule aggregates a statistic over a response's tokens.
SEQ_AGGREGATIONS = ("mean", "max", "sum")


def k_statistic(stats: "TokenStats", name: str) -> Tensor:
    """[N] k1 = log r, k2 = ½(log r)², k3 = (r − 1) − log r (expm1: exact near r = 1), or D."""
    lr = stats.log_ratio
    if name == "k1":
        return lr
    if name == "k2":
        return 0.5 * lr * lr
    if name == "k3":
        return torch.expm1(lr) - lr
    if name == "topk_kl":
        return stats.topk_kl
    raise ValueError(f"statistic: unknown {name!r}; valid: {', '.join(BAND_STATISTICS)}")


def outside_band(x: Tensor, cfg: Any) -> Tensor:
    """x ∉ [band_low, band_high] (a None bound is open)."""
    out = torch.zeros_like(x, dtype=torch.bool)
    if cfg.band_low is not None:
        out |= x < cfg.band_low
    if cfg.band_high is not None:
        out |= x > cfg.band_high
    return out


def per_sequence(x: Tensor, response_mask: Tensor, how: str) -> Tensor:
    """[B] mean/max/sum of the [N] = [B·T] values over each response's tokens (0 when empty)."""
    resp = response_mask.bool()
    x = x.reshape(resp.shape)
    if how == "max":
        filled = torch.where(resp, x, torch.full_like(x, -math.inf)).amax(dim=1)
        return torch.where(resp.any(dim=1), filled, torch.zeros_like(filled))
    sums = torch.where(resp, x, torch.zeros_like(x)).sum(dim=1)
    if how == "sum":
        return sums
    if how == "mean":
        return sums / resp.sum(dim=1).clamp(min=1).to(x.dtype)
    raise ValueError(f"seq_agg: unknown {how!r}; valid: {', '.join(SEQ_AGGREGATIONS)}")


def _sequence_sign(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """[B] sign of the response's Â (GRPO: one Â per response; 0 when it carries no gradient)."""
    return torch.sign(per_sequence(advantages, response_mask, "sum"))


def _broadcast(seq_drop: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """[B] drop → [N] drop over each response's tokens (Â = 0 tokens kept)."""
    return (seq_drop[:, None] & response_mask.bool()).reshape(-1) & (advantages != 0)


def veto(stats: "TokenStats", response_mask: Tensor, cfg: Any) -> Tensor:
    """[B] True where a response token has r < veto_floor (compared as log r < log floor)."""
    if cfg.veto_floor is None:
        return torch.zeros(response_mask.shape[0], dtype=torch.bool, device=response_mask.device)
    low = (stats.log_ratio < math.log(cfg.veto_floor)).reshape(response_mask.shape)
    return (low & response_mask.bool()).any(dim=1)


@_register_builtin("ppo_clip_dual")
def mask_ppo_clip_dual(stats: "TokenStats", advantages: Tensor, cfg: Any) -> Tensor:
    """Dual-clip PPO (verl): ppo_clip, plus drop Â<0 ∧ r > c (``dual_clip_c``, verl: 3)."""
    r = stats.ratio
    clip = ((advantages > 0) & (r > 1 + cfg.eps_high)) | ((advantages < 0) & (r < 1 - cfg.eps_low))
    return clip | ((advantages < 0) & (r > cfg.dual_clip_c))


def sequence_band_drop(statistic: str, how: str, stats: "TokenStats", advantages: Tensor, cfg: Any,
                       response_mask: Tensor) -> Tensor:
    """Drop a response whose ``how`` (mean/max/sum) of ``statistic`` over its tokens lies outside
    [band_low, band_high], or that the veto drops."""
    seq = per_sequence(k_statistic(stats, statistic), response_mask, how)
    drop = outside_band(seq, cfg) | veto(stats, response_mask, cfg)
    return _broadcast(drop, advantages, response_mask)


@_register_builtin("seq_k1", level="sequence")
def mask_seq_k1(stats, advantages, cfg, response_mask):
    """Sequence rejection (verl rollout correction): seq_agg of k1 = log r outside the band, or vetoed."""
    return sequence_band_drop("k1", cfg.seq_agg, stats, advantages, cfg, response_mask)


@_register_builtin("seq_k2", level="sequence")
def mask_seq_k2(stats, advantages, cfg, response_mask):
    """Sequence rejection (verl rollout correction): seq_agg of k2 = ½(log r)² outside the band, or vetoed."""
    return sequence_band_drop("k2", cfg.seq_agg, stats, advantages, cfg, response_mask)


@_register_builtin("seq_k3", level="sequence")
def mask_seq_k3(stats, advantages, cfg, response_mask):
    """Sequence rejection (verl rollout correction): seq_agg of k3 = (r−1) − log r outside the band, or vetoed."""
    return sequence_band_drop("k3", cfg.seq_agg, stats, advantages, cfg, response_mask)


@_register_builtin("seq_topk_kl", divergence="topk_kl", support="topk", uses_k=True, level="sequence")
def mask_seq_topk_kl(stats, advantages, cfg, response_mask):
    """Sequence rejection (verl rollout correction): seq_agg of the top-K KL D outside the band, or vetoed."""
    return sequence_band_drop("topk_kl", cfg.seq_agg, stats, advantages, cfg, response_mask)


@_register_builtin("seq_geo_mean", level="sequence")
def mask_seq_geo_mean(stats, advantages, cfg, response_mask):
    """Geometric-mean ratio test (verl): the mean of k1 over a response outside the band, or vetoed."""
    return sequence_band_drop("k1", "mean", stats, advantages, cfg, response_mask)


@_register_builtin("opsm", level="sequence")
def mask_opsm(stats, advantages, cfg, response_mask):
    """OPSM (slime): drop a response with Â<0 whose mean of log μ_k − log π_k exceeds opsm_delta."""
    seq_kl = per_sequence(-stats.log_ratio, response_mask, "mean")
    drop = (_sequence_sign(advantages, response_mask) < 0) & (seq_kl > cfg.opsm_delta)
    return _broadcast(drop, advantages, response_mask)


def token_band_drop(statistic: str, stats: "TokenStats", advantages: Tensor, cfg: Any) -> Tensor:
    """Drop a token whose ``statistic`` lies outside [band_low, band_high] (Â = 0 kept)."""
    return outside_band(k_statistic(stats, statistic), cfg) & (advantages != 0)


@_register_builtin("token_k1")
def mask_token_k1(stats, advantages, cfg):
    """Token rejection (verl token_k1): drop log r ∉ [band_low, band_high]."""
    return token_band_drop("k1", stats, advantages, cfg)


@_register_builtin("token_k2")
def mask_token_k2(stats, advantages, cfg):
    """Token rejection (verl token_k2): drop ½(log r)² ∉ [band_low, band_high]."""
    return token_band_drop("k2", stats, advantages, cfg)


@_register_builtin("token_k3")
def mask_token_k3(stats, advantages, cfg):
    """Token rejection (verl token_k3): drop (r−1) − log r ∉ [band_low, band_high]."""
    return token_band_drop("k3", stats, advantages, cfg)


#: Rules whose decision reads the band (``band_low``/``band_high``): config checks one is set.
BAND_RULES = tuple(f"seq_{s}" for s in BAND_STATISTICS) + ("seq_geo_mean", "token_k1", "token_k2", "token_k3")
