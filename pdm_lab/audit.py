"""Statistics of the direction audit (SPEC §6). The environment runs the updates; this scores them.

The paper reports point rates only; pdm_lab adds per-seed values, a paired bootstrap CI of the
difference and an exact two-sided sign test.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import PDMInputError, check_same


@torch.no_grad()
def unsafe_keep_rates(delta_d: Tensor, considered: Tensor) -> dict[str, float]:
    """Over the tokens in `considered` (disagreement tokens a rule kept): how often D grew.

    Args:
        delta_d: [N] ΔD = D_after − D_before per token.
        considered: [N] bool.

    Returns:
        ``unsafe_keep`` (fraction with ΔD > 0), ``shrink`` (ΔD < 0), ``count``; rates are NaN
        when nothing was considered (reported, never averaged in silently); ``unsafe_count`` and
        ``shrink_count`` the numerators (what merges exactly across batches).
    """
    check_same(("delta_d", "considered"), delta_d, considered)
    sel = delta_d[considered.bool()]
    count = int(sel.numel())
    if count == 0:
        return {"unsafe_keep": float("nan"), "shrink": float("nan"), "count": 0, "unsafe_count": 0,
                "shrink_count": 0}
    unsafe, shrink = int((sel > 0).sum()), int((sel < 0).sum())
    return {"unsafe_keep": unsafe / count, "shrink": shrink / count, "count": count,
            "unsafe_count": unsafe, "shrink_count": shrink}


def _paired(x, y) -> tuple[Tensor, Tensor]:
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(y, dtype=torch.float64).reshape(-1)
    if x.shape != y.shape:
        raise PDMInputError(f"paired samples differ in length: {x.numel()} vs {y.numel()}")
    keep = torch.isfinite(x) & torch.isfinite(y)
    return x[keep], y[keep]


def paired_bootstrap_ci(x, y, *, n_boot: int = 10_000, level: float = 0.95,
                        seed: int = 0) -> tuple[float, float, float]:
    """Mean of x − y over paired seeds and a percentile bootstrap CI (pairs with a NaN dropped)."""
    x, y = _paired(x, y)
    diff = x - y
    if diff.numel() == 0:
        return float("nan"), float("nan"), float("nan")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, diff.numel(), (n_boot, diff.numel()), generator=gen)
    means = diff[idx].mean(dim=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = torch.quantile(means, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
    return float(diff.mean()), float(lo), float(hi)


def sign_test(x, y) -> float:
    """Exact two-sided sign test of x vs y over paired seeds (ties and NaN pairs dropped)."""
    x, y = _paired(x, y)
    diff = x - y
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(wins, losses) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)
