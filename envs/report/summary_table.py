"""report.md's opening table: what was measured, in which regime (SPEC §6b's band or a named
stress setting), and each verdict with its 95% interval — a verdict or "insufficient data" said
once per study, and a job too short for a criterion said to be short ("n/a")."""
from __future__ import annotations

import math

from pdm_lab.lab.evidence import MIN_SEEDS, collapse_measurable

from pdm_lab.envs.report.criteria import REWARD, _by_config, decide
from pdm_lab.envs.report.strength import separation_count, summary_rows as strength_rows


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _band(table: dict | None) -> str:
    """A regime in SPEC §6b's words: realistic inside the band, a stress setting outside it."""
    if not table:
        return "not measured"
    frac, tail = table["outside_fraction"], table["tail_ratio"]
    if frac == 0:
        return "control: no token outside δ"
    inside = 0.0002 <= frac <= 0.01 and tail >= 30
    return (f"{'realistic' if inside else '**stress**'}: {_pct(frac)} of Â ≠ 0 tokens outside δ, "
            f"p99.9/p50 {tail:.3g}")


def _interval(d: dict) -> str:
    if d is None or math.isnan(d.get("mean_diff", math.nan)):
        return "–"
    return f"{d['mean_diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"


def _sweep_row(rows: list[dict], regime: dict[str, dict]) -> str:

    steps = min(r["steps"] for r in rows)
    seeds = len({r.get("seed") for r in rows})
    settings = "; ".join(f"`{name}` {_band(t).split(':')[0]}" for name, t in regime.items()) or "–"
    what = f"sweep: final reward of {len(_by_config(rows))} configurations ({steps} steps, {seeds} seeds)"
    if not collapse_measurable(steps) or seeds < MIN_SEEDS:
        return (f"| {what} | {settings} | n/a: a short job (a ranking needs ≥ {MIN_SEEDS} seeds; the collapse "
                "rate ≥ 30 steps); the tables below show that it runs | – |")
    winner, words = decide(_by_config(rows), REWARD)
    return f"| {what} | {settings} | {words} | – |"


def _audit_row(doc: dict, label: str) -> str:
    pair = doc["pairs"][0]
    cfg = doc["config"]
    what = (f"{label}: unsafe-keep {pair['a']} − {pair['b']} ({cfg['seeds']} seeds × {cfg['sequences']} sequences, "
            f"`{cfg['mismatch']}`, training step {pair.get('audit_step', 0)})")
    return (f"| {what} | {_band(doc.get('regime'))} | {pair['pooled_verdict']} | "
            f"pooled {_interval(pair['pooled_unsafe_keep_diff'])}; per seed {_interval(pair['unsafe_keep_diff'])} |")


def _self_test_row(doc: dict) -> str | None:
    test = doc.get("self_test")
    if not test:
        return None
    checks = ", ".join(f"{rule} {_pct(c['unsafe_keep'])} of {c['kept']}" for rule, c in test["checks"].items())
    status = {True: "passed", False: "**FAILED**",
              None: f"not tested (no matched rule kept ≥ {test.get('min_tokens', 20)} tokens)"}[test["passed"]]
    return f"| the audit's self-test (one token per state; checks the audit, not PDM) | tabular first order | {status} | {checks} |"


def summary_lines(rows: list[dict] | None, regime: dict[str, dict], audit: dict | None,
                  stress_audit: dict | None) -> list[str]:
    """The summary table and one line on what it decides."""
    lines = ["## Summary", "", "| what was measured | regime (SPEC §6b) | verdict | A − B [95% CI] |",
             "| --- | --- | --- | --- |"]
    if rows:
        lines.append(_sweep_row(rows, regime))
        lines += strength_rows(rows)
    for doc, label in ((audit, "direction audit"), (stress_audit, "direction audit, stress setting")):
        if doc is not None:
            lines.append(_audit_row(doc, label))
            test = _self_test_row(doc)
            if test:
                lines.append(test)
    decided = [f"`{d['config']['mismatch']}` ({_band(d.get('regime')).split(':')[0]})"
               for d in (audit, stress_audit) if d is not None and _separated(d)]
    separated, compared = separation_count(rows) if rows else (0, 0)
    if separated:
        decided.append(f"{separated} of {compared} rule-pair comparisons of the strength study (reward and collapse "
                          f"rate at every point; at 95% about {0.05 * compared:.1f} separate by chance, and no "
                          "multiplicity correction is applied: read them as leads)")
    lines += ["", ("Separated (the interval excludes 0): " + "; ".join(decided) + "."
                   if decided else "No finding here has an interval that excludes 0."), ""]
    return lines


def _separated(doc: dict) -> bool:
    d = doc["pairs"][0]["pooled_unsafe_keep_diff"]
    data = doc["pairs"][0]["data"]
    backed = data["seeds_with_both"] >= data["min_seeds"] and min(data["tokens_a"], data["tokens_b"]) >= data["min_tokens"]
    return backed and not math.isnan(d["mean_diff"]) and (d["ci_low"] > 0 or d["ci_high"] < 0)
