"""Every confidence interval and test pdm_lab reports, in one place: the audit (SPEC §6), the
probe (SPEC §6d), transfer (SPEC §6c), the sweep reports and ``mechanism`` all call these.

Rates: ``wilson_ci`` (one binomial rate), ``rate_diff_ci`` (Newcombe's difference of two
independent rates), ``paired_rate_diff_ci`` (two rates on the same tokens), ``pooled_rate_ci`` and
``pooled_diff_ci`` (rates pooled over seeds, seed-cluster bootstrap). Paired seeds:
``paired_bootstrap_ci``, ``sign_test``, ``compare_paired``. Location: ``mean_ci`` (percentile
bootstrap), ``median_ci`` (order statistics). Sweep-level t intervals (Welch) live with the sweep's
evidence rules in ``pdm_lab.lab.evidence``.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError


def _paired(x, y) -> tuple[Tensor, Tensor]:
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(y, dtype=torch.float64).reshape(-1)
    if x.shape != y.shape:
        raise PDMInputError(f"paired samples differ in length: {x.numel()} vs {y.numel()}")
    keep = torch.isfinite(x) & torch.isfinite(y)
    return x[keep], y[keep]


def _bootstrap_means(x: Tensor, n_boot: int, level: float, seed: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    means = x[torch.randint(0, x.numel(), (n_boot, x.numel()), generator=gen)].mean(dim=1)
    return _percentiles(means, level)


def _cluster_index(seeds: int, n_boot: int, seed: int) -> Tensor:
    """[n_boot, seeds] seed indices drawn with replacement: the seed-cluster bootstrap (each drawn
    seed keeps all its tokens, so tokens of one seed are never treated as independent)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, seeds, (n_boot, seeds), generator=gen)


def _percentiles(values: Tensor, level: float) -> tuple[float, float]:
    alpha = (1.0 - level) / 2.0
    lo, hi = torch.quantile(values, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
    return float(lo), float(hi)


def mean_ci(values: Iterable, *, level: float = 0.95, n_boot: int = 2000,
            seed: int = 0) -> tuple[float, float, float]:
    """Mean and a percentile-bootstrap CI over runs (NaN/None dropped; one value: a zero-width CI)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return math.nan, math.nan, math.nan
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    x = torch.tensor(xs, dtype=torch.float64)
    lo, hi = _bootstrap_means(x, n_boot, level, seed)
    return float(x.mean()), lo, hi


def paired_bootstrap_ci(x, y, *, n_boot: int = 10_000, level: float = 0.95,
                        seed: int = 0) -> tuple[float, float, float]:
    """Mean of x − y over paired seeds and a percentile bootstrap CI (pairs with a NaN dropped)."""
    x, y = _paired(x, y)
    diff = x - y
    if diff.numel() == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = _bootstrap_means(diff, n_boot, level, seed)
    return float(diff.mean()), lo, hi


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


def compare_paired(x: list[float], y: list[float], *, n_boot: int = 10_000) -> dict:
    """Paired over seeds: mean of x − y, bootstrap 95% CI, sign test, wins per side, ties."""
    mean, lo, hi = paired_bootstrap_ci(x, y, n_boot=n_boot)
    xs, ys = _paired(x, y)
    return {"mean_diff": mean, "ci_low": lo, "ci_high": hi, "level": 0.95,
            "sign_test_p": sign_test(x, y), "seeds_used": int(xs.numel()),
            "a_lower_seeds": int((xs < ys).sum()), "b_lower_seeds": int((ys < xs).sum()),
            "ties": int((xs == ys).sum())}


def pooled_diff_ci(a: list[dict], b: list[dict], *, n_boot: int = 10_000, level: float = 0.95,
                   seed: int = 0) -> dict:
    """Pooled unsafe-keep of A minus B, with a seed-cluster bootstrap CI (seeds resampled, each
    keeping all its tokens): usable where few tokens per seed leave most per-seed rates undefined.

    Args:
        a, b: per-seed ``delta_rates`` entries of the two rules, paired by seed.
    """
    if len(a) != len(b):
        raise PDMInputError(f"paired seed lists differ in length: {len(a)} vs {len(b)}")
    counts = torch.tensor([[e["count"] for e in a], [e["count"] for e in b]], dtype=torch.float64)
    grew = torch.tensor([[e["grew"] for e in a], [e["grew"] for e in b]], dtype=torch.float64)
    nan = float("nan")
    if counts[0].sum() == 0 or counts[1].sum() == 0:
        return {"mean_diff": nan, "ci_low": nan, "ci_high": nan, "level": level,
                "tokens_a": int(counts[0].sum()), "tokens_b": int(counts[1].sum())}
    point = float(grew[0].sum() / counts[0].sum() - grew[1].sum() / counts[1].sum())
    idx = _cluster_index(len(a), n_boot, seed)
    ca, cb = counts[0][idx].sum(1), counts[1][idx].sum(1)
    diffs = grew[0][idx].sum(1) / ca - grew[1][idx].sum(1) / cb
    lo, hi = _percentiles(diffs[(ca > 0) & (cb > 0)], level)
    return {"mean_diff": point, "ci_low": lo, "ci_high": hi, "level": level,
            "tokens_a": int(counts[0].sum()), "tokens_b": int(counts[1].sum())}


def pooled_rate_ci(entries: list[dict], key: str, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """Pooled rate (``entries[i][key]`` over ``entries[i]["count"]``, e.g. ``grew`` or ``shrank``)
    with a seed-cluster bootstrap CI; NaN with no token."""
    counts = torch.tensor([e["count"] for e in entries], dtype=torch.float64)
    hits = torch.tensor([e[key] for e in entries], dtype=torch.float64)
    total = float(counts.sum())
    if total == 0:
        return {"rate": math.nan, "ci_low": math.nan, "ci_high": math.nan, "tokens": 0}
    idx = _cluster_index(len(entries), n_boot, seed)
    c, h = counts[idx].sum(1), hits[idx].sum(1)
    lo, hi = _percentiles((h / c)[c > 0], level)
    return {"rate": float(hits.sum()) / total, "ci_low": lo, "ci_high": hi, "tokens": int(total)}


def wilson_ci(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (Wilson 1927): (NaN, NaN) when n = 0.

    Unlike the Wald interval it stays inside [0, 1] and keeps its coverage at rates near 0 or 1,
    which the probe's sign-agreement rates often are.
    """
    if not 0 < level < 1:
        raise PDMInputError(f"level: must be in (0, 1), got {level}")
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise PDMInputError(f"wilson_ci: need 0 ≤ successes ≤ n, got successes={successes}, n={n}")
    if n == 0:
        return math.nan, math.nan
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - (1 - level) / 2, dtype=torch.float64)))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # the interval always holds p; rounding would put the bound 1e-17 past it at k = 0 or k = n
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def median_ci(values, level: float = 0.95) -> tuple[float, float, float]:
    """Median and a distribution-free interval from order statistics (the binomial(n, ½) ranks
    n/2 ± z·√n/2, normal approximation); NaN entries dropped, all NaN when none is left."""
    x = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    x = x[~torch.isnan(x)].sort().values
    n = int(x.numel())
    if n == 0:
        return math.nan, math.nan, math.nan
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - (1 - level) / 2, dtype=torch.float64)))
    lo = max(0, math.floor(n / 2 - z * math.sqrt(n) / 2))
    hi = min(n - 1, math.ceil(n / 2 + z * math.sqrt(n) / 2) - 1)
    return float(x.quantile(0.5)), float(x[lo]), float(x[max(hi, lo)])


def rate_diff_ci(x1: int, n1: int, x2: int, n2: int, level: float = 0.95) -> dict:
    """Rate x₁/n₁ minus rate x₂/n₂ of two independent samples (different tokens), with Newcombe's
    hybrid score interval (Newcombe 1998, method 10) built from each rate's Wilson interval
    (l_i, u_i): d − √((p₁ − l₁)² + (u₂ − p₂)²) … d + √((u₁ − p₁)² + (p₂ − l₂)²). NaN when a sample
    is empty."""
    if n1 == 0 or n2 == 0:
        return {"diff": math.nan, "lo": math.nan, "hi": math.nan, "n": (n1, n2)}
    l1, u1 = wilson_ci(x1, n1, level)
    l2, u2 = wilson_ci(x2, n2, level)
    p1, p2 = x1 / n1, x2 / n2
    d = p1 - p2
    return {"diff": d, "lo": d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            "hi": d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2), "n": (n1, n2)}


def paired_rate_diff_ci(a_right, b_right, level: float = 0.95) -> dict:
    """Rate of A minus rate of B on the same tokens (paired), with the Wald interval of a paired
    difference of proportions: d = (n₁₀ − n₀₁)/n, se = √((n₁₀ + n₀₁) − (n₁₀ − n₀₁)²/n)/n.

    Args:
        a_right, b_right: [n] bool, whether A (B) was right on each token.
    """
    a = torch.as_tensor(a_right, dtype=torch.bool).reshape(-1)
    b = torch.as_tensor(b_right, dtype=torch.bool).reshape(-1)
    if a.shape != b.shape:
        raise PDMInputError(f"paired samples differ in length: {a.numel()} vs {b.numel()}")
    n = int(a.numel())
    if n == 0:
        return {"diff": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "a_only": 0, "b_only": 0}
    n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - (1 - level) / 2, dtype=torch.float64)))
    d = (n10 - n01) / n
    se = math.sqrt(max((n10 + n01) - (n10 - n01) ** 2 / n, 0.0)) / n
    return {"diff": d, "lo": d - z * se, "hi": d + z * se, "n": n, "a_only": n10, "b_only": n01}
