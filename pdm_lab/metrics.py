"""Per-step metrics of SPEC §5, as a dict of 0-d tensors with namespaced keys."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .masks import outside_region

if TYPE_CHECKING:
    from .config import MaskConfig
    from .stats import TokenStats


def _mean(x: Tensor, where: Tensor) -> Tensor:
    w = where.to(x.dtype)  # select, don't multiply: a padding slot's r may be inf (inf·0 = NaN)
    return torch.where(where, x, torch.zeros_like(x)).sum() / w.sum().clamp(min=1)


def _masked_max(x: Tensor, where: Tensor) -> Tensor:
    return x[where].max() if bool(where.any()) else x.new_zeros(())


def _masked_min(x: Tensor, where: Tensor) -> Tensor:
    return x[where].min() if bool(where.any()) else x.new_zeros(())


@torch.no_grad()
def direction_disagreement(stats: "TokenStats", estimator: str) -> Tensor:
    """[N] bool: sign(r − 1) ≠ sign(Ḋ_estimator), the ratio test and PDM pointing different ways."""
    return torch.sign(stats.log_ratio) != torch.sign(stats.ddot[estimator])


@torch.no_grad()
def step_metrics(stats: "TokenStats", keep: Tensor, advantages: Tensor, response: Tensor,
                 cfg: "MaskConfig") -> dict[str, Tensor]:
    """Metrics over response tokens: mask fractions, region, direction disagreement, D, tails, r.

    Args: stats [N]; keep [N] 1/0; advantages [N]; response [N] bool; cfg for δ and estimator.
    """
    dropped = 1.0 - keep
    outside = outside_region(stats.topk_kl, advantages, cfg) & response
    metrics = {
        "mask/frac_dropped": _mean(dropped, response),
        "mask/frac_dropped_pos": _mean(dropped, response & (advantages > 0)),
        "mask/frac_dropped_neg": _mean(dropped, response & (advantages < 0)),
        "mask/frac_outside": _mean(outside.to(dropped.dtype), response),
        "div/topk_kl_mean": _mean(stats.topk_kl, response),
        "div/topk_kl_max": _masked_max(stats.topk_kl, response),
        "div/topk_tv_mean": _mean(stats.topk_tv, response),
        "div/mu_tail_mean": _mean(stats.mu_tail, response),
        "div/pi_tail_mean": _mean(stats.pi_tail, response),
        "ratio/mean": _mean(stats.ratio, response),
        "ratio/min": _masked_min(stats.ratio, response),
        "ratio/max": _masked_max(stats.ratio, response),
        "tokens/response": response.sum().to(dropped.dtype),
    }
    if stats.full_kl is not None:
        metrics["div/full_kl_mean"] = _mean(stats.full_kl, response)
        metrics["div/full_kl_max"] = _masked_max(stats.full_kl, response)
    if cfg.direction_estimator in stats.ddot:
        disagree = direction_disagreement(stats, cfg.direction_estimator).to(dropped.dtype)
        metrics["mask/dir_disagree"] = _mean(disagree, outside)
    certain = (stats.ddot_lower > 0) | (stats.ddot_upper < 0)
    metrics["mask/ddot_sign_certified"] = _mean(certain.to(dropped.dtype), outside)
    return metrics
