"""Group the results table and put confidence intervals on means and rates."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable

from pdm_lab.audit import intervals
from pdm_lab.audit.intervals import mean_ci  # noqa: F401  (re-exported for the report modules)
from pdm_lab.masks import MASK_RULES
from pdm_lab.metrics import finalize, merge_metrics, metric
from pdm_lab.lab.evidence import collapse_measurable


def finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def wilson_ci(successes: int, trials: int) -> tuple[float, float, float]:
    """(rate, low, high): the core's Wilson 95% interval (``pdm_lab.audit.intervals.wilson_ci``)
    beside its rate, the shape the report's tables print; all NaN with no trial."""
    if trials == 0:
        return math.nan, math.nan, math.nan
    low, high = intervals.wilson_ci(successes, trials)
    return successes / trials, low, high


def newcombe_diff_ci(s1: int, n1: int, s2: int, n2: int) -> tuple[float, float, float]:
    """(p1 − p2, low, high): the core's Newcombe 95% interval (``pdm_lab.audit.intervals.rate_diff_ci``);
    NaN: an empty side."""
    diff = intervals.rate_diff_ci(s1, n1, s2, n2)
    return diff["diff"], diff["lo"], diff["hi"]


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
    cap = row.get("clip_ratio_c")
    if cap is not None and not (isinstance(cap, float) and math.isnan(cap)):
        parts[0] += f"+TIS(c={cap:g})"  # the truncated importance weight min(r, c) beside the mask
    return " ".join(parts)


def mismatch_label(row: dict) -> str:
    return row.get("mismatch") or "none"


def point_label(row: dict) -> str:
    """A grid point's name: the mismatch, and M (optimiser steps per rollout batch) when above 1."""
    m = row.get("minibatches", 1) or 1
    return mismatch_label(row) + (f" · M={m}" if m > 1 else "")


def pooled_unsafe_keep(rows: list[dict]) -> tuple[float, int]:
    """Unsafe-keep pooled over runs: Σ unsafe / Σ considered (``merge_metrics``; NaN: none)."""
    pooled = merge_metrics(*({"u": metric("mean", r["unsafe_count"], r["unsafe_keep_count"])} for r in rows))
    if not pooled:
        return math.nan, 0
    return float(finalize(pooled)["u"]), int(pooled["u"].count)


def collapse_rate(rows: list[dict]) -> tuple[float, float, float]:
    """Collapse rate and its Wilson interval; NaN where a run is shorter than the collapse
    definition needs (``pdm_lab.lab.evidence.COLLAPSE_MIN_STEPS``)."""
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
