"""The two-axis strength study (``SweepConfig.design: axes``): each rule along the precision-mismatch
axis (at the anchor's M) and along the staleness axis (M optimiser steps per rollout batch, at the
anchor's mismatch), with final reward and collapse rate at 95% per point, the regime each point
was measured in, the minimal detectable difference, where each rule first degrades and where rules
separate — every verdict read off an interval (``pdm_lab.lab.evidence``, ``summary.wilson_ci``,
``summary.newcombe_diff_ci``), none from a point estimate.

- *first degrades*: along an axis, the first point whose reward interval (Student-t 95%) lies
  wholly below the anchor point's (upper end < the anchor's lower end).
- *separates*: at a point, two rules whose 95% Welch interval of the difference in final reward
  (or Newcombe interval of the difference in collapse rate) excludes 0, with ≥ ``MIN_SEEDS`` runs
  each.
- *regime*: measured by the trainer over every update (pooled over mini-batches j = 0 … M−1,
  SPEC §6b): the fraction of response tokens outside δ with Â ≠ 0 and the tail ratio p99.9/p50 of
  D; realistic when 0.02–1% lie outside and p99.9/p50 ≥ 30.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pdm_lab.lab.evidence import (LEVEL, MIN_SEEDS, POWER, Estimate, collapse_measurable, mean_t_ci,
                                  minimal_detectable_difference, welch_diff_ci)

from pdm_lab.envs.report.summary import collapse_rate, config_label, finite, group_rows, newcombe_diff_ci

#: SPEC §6b's band: the fraction of tokens outside δ, and the least tail ratio p99.9/p50.
BAND = (0.0002, 0.01)
MIN_TAIL = 30.0


def _mean(values) -> float:
    xs = [x for x in finite(values) if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


@dataclass(frozen=True)
class Point:
    """One point of an axis: its mismatch, M, and the rows of every rule there."""

    axis: str
    """``precision`` or ``staleness``."""
    mismatch: str
    m: int
    rows: tuple

    @property
    def label(self) -> str:
        if self.axis == "staleness":
            return f"M={self.m}"
        return self.mismatch.split("+")[-1] if self.mismatch != "none" else "none"

    def by_rule(self) -> dict[str, list[dict]]:
        return {label: g for (label,), g in group_rows(list(self.rows), lambda r: (config_label(r),)).items()}

    @property
    def outside(self) -> float:
        return _mean(r["outside_fraction"] for r in self.rows)

    @property
    def tail(self) -> float:
        return _mean(r.get("update_tail_ratio", math.nan) for r in self.rows)

    def regime(self) -> str:
        frac, tail = self.outside, self.tail
        if math.isnan(frac):
            return "not measured"
        if frac == 0:
            return "control"
        return "realistic" if self.realistic else "stress"

    @property
    def realistic(self) -> bool:
        return BAND[0] <= self.outside <= BAND[1] and self.tail >= MIN_TAIL

    def mdd(self) -> float:
        return minimal_detectable_difference([r["final_reward"] for r in g] for g in self.by_rule().values())

    def reward(self, label: str) -> Estimate:
        return mean_t_ci(r["final_reward"] for r in self.by_rule().get(label, []))


def axes(rows: list[dict]) -> dict[str, list[Point]]:
    """The study's axes from its rows: the anchor is mismatch ``none`` (else the first seen) at the
    smallest M; ``precision``: every mismatch at the anchor's M; ``staleness``: every M at the
    anchor's mismatch; an axis with one point is left out."""
    if not rows or any("minibatches" not in r or "mismatch" not in r for r in rows):
        return {}  # rows of another table (no grid point): no study
    mismatches = list(dict.fromkeys(r["mismatch"] for r in rows))
    anchor_mm = "none" if "none" in mismatches else mismatches[0]
    anchor_m = min(r["minibatches"] for r in rows)
    precision = [Point("precision", mm, anchor_m, tuple(r for r in rows if r["mismatch"] == mm
                                                         and r["minibatches"] == anchor_m))
                 for mm in mismatches]
    ms = sorted({r["minibatches"] for r in rows if r["mismatch"] == anchor_mm})
    staleness = [Point("staleness", anchor_mm, m, tuple(r for r in rows if r["mismatch"] == anchor_mm
                                                         and r["minibatches"] == m)) for m in ms]
    out = {"precision": [p for p in precision if p.rows], "staleness": [p for p in staleness if p.rows]}
    return {name: pts for name, pts in out.items() if len(pts) >= 2}


def is_study(rows: list[dict]) -> bool:
    return bool(axes(rows))


def _ci(e: Estimate, digits: int = 3) -> str:
    return "n/a" if e.n == 0 else (f"{e.mean:.{digits}f}" + ("" if math.isnan(e.lo) else f" [{e.lo:.{digits}f}, {e.hi:.{digits}f}]"))


def _rate(triple, digits: int = 2) -> str:
    p, lo, hi = triple
    return "n/a" if math.isnan(p) else f"{p:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.2f}%"


def first_degrades(points: list[Point], label: str) -> tuple[Point | None, str]:
    """The first point after the anchor whose reward interval lies wholly below the anchor's, and
    the words (with both intervals and the Welch interval of the difference)."""
    anchor = points[0].reward(label)
    if anchor.n < 2 or math.isnan(anchor.lo):
        return None, f"n/a (the anchor has {anchor.n} run(s) of {label})"
    for point in points[1:]:
        est = point.reward(label)
        if est.n >= 2 and not math.isnan(est.hi) and est.hi < anchor.lo:
            d, lo, hi, _ = welch_diff_ci([r["final_reward"] for r in point.by_rule()[label]],
                                         [r["final_reward"] for r in points[0].by_rule()[label]])
            return point, (f"**{point.label}**: {_ci(est)} below the anchor's {_ci(anchor)}; "
                           f"difference {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    last = points[-1].reward(label)
    return None, f"does not degrade within the axis (last point {points[-1].label}: {_ci(last)}; anchor {_ci(anchor)})"


@dataclass(frozen=True)
class Pair:
    point: Point
    a: str
    b: str
    what: str
    diff: float
    lo: float
    hi: float
    separated: bool

    def text(self) -> str:
        ci = "no interval" if math.isnan(self.lo) else f"[{self.lo:+.3f}, {self.hi:+.3f}]"
        return f"{self.a} − {self.b} {self.what} {self.diff:+.3f} {ci}"


def pairs(point: Point) -> list[Pair]:
    """Every pair of rules at ``point`` on final reward (Welch) and collapse rate (Newcombe)."""
    groups = point.by_rule()
    out = []
    for a, b in itertools.combinations(groups, 2):
        ga, gb = groups[a], groups[b]
        enough = min(len(ga), len(gb)) >= MIN_SEEDS
        d, lo, hi, _ = welch_diff_ci([r["final_reward"] for r in ga], [r["final_reward"] for r in gb])
        sep = enough and not math.isnan(lo) and (lo > 0 or hi < 0)
        out.append(Pair(point, a, b, "reward", d, lo, hi, sep))
        if all(collapse_measurable(r["steps"]) for r in ga + gb):
            ca, cb = (sum(bool(r["collapsed"]) for r in g) for g in (ga, gb))
            d, lo, hi = newcombe_diff_ci(ca, len(ga), cb, len(gb))
            sep = enough and not math.isnan(lo) and (lo > 0 or hi < 0)
            out.append(Pair(point, a, b, "collapse rate", d, lo, hi, sep))
    return out


def first_separation(points: list[Point]) -> tuple[Point | None, list[Pair]]:
    for point in points:
        found = [p for p in pairs(point) if p.separated]
        if found:
            return point, found
    return None, []


def separation_count(rows: list[dict]) -> tuple[int, int]:
    """(separated, compared): the rule-pair comparisons (reward and collapse rate, every point of
    every axis) whose 95% interval excludes 0, and how many were made — at 95% about one in twenty
    of the compared separate by chance, and no multiplicity correction is applied."""
    found = [p.separated for pts in axes(rows).values() for point in pts for p in pairs(point)]
    return sum(found), len(found)


def powered_null(study: dict[str, list[Point]]) -> str | None:
    """One sentence when no pair separates at any realistic point: the tie with its detectable
    difference (None when there is no realistic point, or one separates)."""
    realistic = {p.label: p for pts in study.values() for p in pts if p.realistic}
    if not realistic:
        return None
    if any(pair.separated for p in realistic.values() for pair in pairs(p)):
        return None
    mdds = [p.mdd() for p in realistic.values()]
    mdds = [m for m in mdds if math.isfinite(m)]
    runs = min(len(g) for p in realistic.values() for g in p.by_rule().values())
    if not mdds:
        return None
    return (f"At the realistic point(s) ({', '.join(f'`{k}`' for k in realistic)}) every rule ties: a powered null — "
            f"no pair's {int(LEVEL * 100)}% interval excludes 0, and with {runs} runs per rule a difference in final "
            f"reward of {max(mdds):.3f} or more would have been detected with {int(POWER * 100)}% power "
            "(the minimal detectable difference).")


def summary_rows(rows: list[dict]) -> list[str]:
    """Rows of report.md's summary table: per axis, where each rule first degrades and where rules
    separate, with intervals."""
    study = axes(rows)
    lines = []
    for name, points in study.items():
        span = f"{points[0].label} → {points[-1].label}"
        degrade = "; ".join(f"{label}: {first_degrades(points, label)[1]}" for label in points[0].by_rule())
        lines.append(f"| {name} axis ({span}): where each rule first degrades (reward interval below the anchor's) "
                     f"| {', '.join(f'{p.label} {p.regime()}' for p in points)} | {degrade} | – |")
        point, found = first_separation(points)
        if point is None:
            mdd = max((m for m in (p.mdd() for p in points) if math.isfinite(m)), default=math.nan)
            verdict = ("no pair of rules separates at any point (every interval includes 0); minimal detectable "
                       f"reward difference ≤ {mdd:.3f} at 80% power" if math.isfinite(mdd) else
                       "no pair of rules separates at any point")
            lines.append(f"| {name} axis: where rules separate | – | {verdict} | – |")
        else:
            lines.append(f"| {name} axis: where rules separate | {point.label} {point.regime()} | first at "
                         f"**{point.label}** | " + "; ".join(p.text() for p in found[:6])
                         + (" …" if len(found) > 6 else "") + " |")
    return lines


def strength_section(rows: list[dict]) -> list[str]:
    """report.md's section: a table per axis (point × rule), then the per-axis verdicts."""
    study = axes(rows)
    if not study:
        return []
    lines = ["### Strength study (two axes)", "", __doc__.split("\n\n", 1)[1].strip(), ""]
    for name, points in study.items():
        lines += [f"#### {name} axis", "",
                  "| point | regime (outside δ, p99.9/p50) | optimiser steps per batch | rule | runs | final reward [95% CI] | "
                  "collapse rate [95% Wilson CI] | outside δ | MDD (reward, 80% power) |",
                  "| --- | --- | ---: | --- | ---: | --- | --- | --- | ---: |"]
        for point in points:
            mdd = point.mdd()
            for label, group in point.by_rule().items():
                steps = [r.get("optimizer_steps", -1) / max(1, r["steps"] * r["epochs"]) for r in group
                         if r.get("optimizer_steps", -1) >= 0 and not r["nonfinite"]]
                per_batch = f"{_mean(steps):g}" if steps else "n/a"
                tail = _mean(r.get("update_tail_ratio", math.nan) for r in group)
                lines.append(f"| {point.label} | {point.regime()} ({_pct(point.outside)}, {tail:.3g}) | {per_batch} | "
                             f"{label} | {len(group)} | {_ci(mean_t_ci(r['final_reward'] for r in group))} | "
                             f"{_rate(collapse_rate(group))} | {_pct(_mean(r['outside_fraction'] for r in group))} | "
                             f"{'n/a' if math.isnan(mdd) else f'{mdd:.3f}'} |")
        lines.append("")
        for label in points[0].by_rule():
            lines.append(f"- {label} first degrades: {first_degrades(points, label)[1]}")
        point, found = first_separation(points)
        lines.append("- rules separate: " + (f"first at **{point.label}**: " + "; ".join(p.text() for p in found)
                                            if point else "at no point (every interval includes 0)"))
        lines.append("")
    null = powered_null(study)
    if null:
        lines += [null, ""]
    return lines
