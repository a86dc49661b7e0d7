"""Group the results table and put confidence intervals on means and rates."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable

from pdm_lab.audit import mean_ci  # noqa: F401  (SPEC §6 statistics live in the core)
from pdm_lab.masks import MASK_RULES
from pdm_lab.metrics import finalize, merge_metrics, metric
from pdm_lab.runtime.evidence import collapse_measurable


def finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def wilson_ci(successes: int, trials: int, *, z: float = 1.959964) -> tuple[float, float, float]:
    """Rate and Wilson score interval for a binomial proportion (collapse rate)."""
    if trials == 0:
        return math.nan, math.nan, math.nan
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def newcombe_diff_ci(s1: int, n1: int, s2: int, n2: int) -> tuple[float, float, float]:
    """p1 − p2 and Newcombe's hybrid-score 95% interval (from the two Wilson intervals); NaN: an
    empty side."""
    p1, l1, u1 = wilson_ci(s1, n1)
    p2, l2, u2 = wilson_ci(s2, n2)
    if math.isnan(p1) or math.isnan(p2):
        return math.nan, math.nan, math.nan
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def group_rows(rows: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
    """Rows grouped by ``key(row)``, groups in first-seen order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return dict(groups)


def config_label(row: dict) -> str:
    """A mask configuration's display name: rule, plus δ/K/convention when not the paper's."""
    parts = [row["rule"]]
    record = MASK_RULES.get(row["rule"])
    if row.get("delta") is not None and record is not None and record.uses_delta:
        parts.append(f"δ={row['delta']:g}")
    if row.get("k") is not None and record is not None and record.uses_k:
        if row["k"] != 20:
            parts.append(f"K={row['k']}")
        if row.get("convention", "union") != "union":
            parts.append(row["convention"])
    return " ".join(parts)


def mismatch_label(row: dict) -> str:
    return row.get("mismatch") or "none"


def pooled_unsafe_keep(rows: list[dict]) -> tuple[float, int]:
    """Unsafe-keep pooled over runs: Σ unsafe / Σ considered (``merge_metrics``; NaN: none)."""
    pooled = merge_metrics(*({"u": metric("mean", r["unsafe_count"], r["unsafe_keep_count"])} for r in rows))
    if not pooled:
        return math.nan, 0
    return float(finalize(pooled)["u"]), int(pooled["u"].count)


def collapse_rate(rows: list[dict]) -> tuple[float, float, float]:
    """Collapse rate and its Wilson interval; NaN where a run is shorter than the collapse
    definition needs (``pdm_lab.runtime.evidence.COLLAPSE_MIN_STEPS``)."""
    if not all(collapse_measurable(r["steps"]) for r in rows):
        return math.nan, math.nan, math.nan
    return wilson_ci(sum(bool(r["collapsed"]) for r in rows), len(rows))


def config_summary(rows: list[dict]) -> dict:
    """Final reward (mean, CI), collapse rate (Wilson CI; NaN where a run is shorter than the
    collapse definition needs), pooled unsafe-keep, mask fraction."""
    reward = mean_ci(r["final_reward"] for r in rows)
    collapsed = sum(bool(r["collapsed"]) for r in rows)
    measurable = all(collapse_measurable(r["steps"]) for r in rows)
    mask = mean_ci(r["mask_fraction"] for r in rows)
    uk, uk_n = pooled_unsafe_keep(rows)
    return {"runs": len(rows), "final_reward": reward,
            "collapse": collapse_rate(rows),
            "collapses": collapsed, "collapse_measurable": measurable, "unsafe_keep": uk,
            "unsafe_keep_tokens": uk_n, "mask_fraction": mask,
            "mismatch": mean_ci((r["update_topk_kl_mean"] for r in rows), n_boot=500)}
