"""The toy's verdict at the run's relative step size (SPEC §6d: a toy is faithful to a step only
when its median |ΔD|/D matches the run's).

A toy trained at the paper's δ and a run audited at a small δ take steps of very different
relative size: the same lr moves a D of 0.2 by a far smaller fraction than a D of 5e-4. Both
sides audit every rule at several multiples of their own step (``step_scales``, keys
``steps/…`` of ``pdm_lab.audit.probe_record.step_scale_record``), so the toy can be read at the multiple
whose median |ΔD|/D is nearest (in log) to the run's at its own step. There each rule's
unsafe-keep rate is compared with the run's: the toy *predicts* a rate when its estimate lies in
the run's Wilson 95% interval. The A − B difference of the two rules' rates on each side (their
kept disagreement tokens differ, so Newcombe's unpaired interval, ``pdm_lab.audit.intervals.rate_diff_ci``)
goes through SPEC §6c's outcome table (``faithful.outcome``), faithfulness now judged on the step
size alone.
"""
from __future__ import annotations

import math
import statistics

from pdm_lab.audit.intervals import rate_diff_ci, wilson_ci

from pdm_lab.envs.transfer.faithful import outcome

#: The common steps SPEC §6d's selection controls score each rule's kept disagreement tokens under.
SELECTION_STEPS = ("reference_step", "momentum_only")

STEP_TOLERANCE = 3.0  # a toy scale within this factor of the run's |ΔD|/D counts as matched


def _rates(entries: list[dict]) -> dict:
    grew = sum(int(e.get("grew") or 0) for e in entries)
    count = sum(int(e.get("count") or 0) for e in entries)
    lo, hi = wilson_ci(grew, count)
    return {"rate": grew / count if count else math.nan, "lo": lo, "hi": hi, "grew": grew, "n": count}


def pooled_step_scales(records: list[dict], rules) -> dict:
    """Scale (as written, e.g. ``"1"``) → each rule's unsafe-keep, the two controls and the median
    |ΔD|/D, pooled over ``records`` (the run's audit lines' ``step_scales``, or the toy's one
    already pooled ``step_scales``). Rates pool exactly (counts add); the median |ΔD|/D of several
    records is the median of their medians, weighted by nothing (stated as ``median_of``)."""
    scales: dict[str, dict] = {}
    for record in records:
        for key, entry in (record or {}).items():
            scales.setdefault(key, []).append(entry)
    out = {}
    for key, entries in scales.items():
        row = {"lr_scale": float(entries[0]["steps/lr_scale"]),
               "disagreement": sum(int(e.get("steps/disagreement") or 0) for e in entries)}
        for rule in rules:
            row[rule] = _rates([e[f"steps/unsafe_keep/{rule}"] for e in entries if f"steps/unsafe_keep/{rule}" in e])
        for control in ("kept_by_all", "momentum_only"):
            row[control] = _rates([e[f"steps/control/{control}"] for e in entries if f"steps/control/{control}" in e])
        row["selection"] = {rule: {step: _rates([e[k] for e in entries if k in e])
                                   for step in SELECTION_STEPS for k in [f"steps/selection/{rule}/{step}"]}
                            for rule in rules}
        medians = [e["steps/median_abs_dd_over_d"]["value"] for e in entries
                   if (e.get("steps/median_abs_dd_over_d") or {}).get("n")]
        medians = [m for m in medians if m is not None and not math.isnan(m)]
        row["median_abs_dd_over_d"] = statistics.median(medians) if medians else math.nan
        row["median_of"] = len(medians)
        out[key] = row
    return out


def nearest_scale(toy: dict, target: float) -> str | None:
    """The toy's scale key whose median |ΔD|/D is nearest ``target`` in log (None: none measured)."""
    usable = {k: r["median_abs_dd_over_d"] for k, r in toy.items() if r["median_abs_dd_over_d"] > 0}
    if not usable or not target > 0:
        return None
    return min(usable, key=lambda k: abs(math.log(usable[k] / target)))


def _diff(side: dict, a: str, b: str) -> dict:
    d = rate_diff_ci(side[a]["grew"], side[a]["n"], side[b]["grew"], side[b]["n"])
    return {"mean_diff": d["diff"], "ci_low": d["lo"], "ci_high": d["hi"]}


def step_matched(toy_doc: dict, lines: list[dict], rules) -> dict:
    """The comparison of the module docstring (``available`` False with a ``reason`` when a side
    has no step-size audit)."""
    a, b = rules[0], rules[1]
    run = pooled_step_scales([ln.get("step_scales") for ln in lines], rules)
    toy = pooled_step_scales([toy_doc.get("step_scales")], rules)
    own = next((k for k, r in run.items() if r["lr_scale"] == 1.0), None)
    if own is None or not toy:
        return {"available": False, "reason": "a side has no step-size audit (step_scales)"}
    target = run[own]["median_abs_dd_over_d"]
    key = nearest_scale(toy, target)
    if key is None:
        return {"available": False, "reason": "no median |ΔD|/D to match"}
    t, r = toy[key], run[own]
    factor = t["median_abs_dd_over_d"] / target
    matched = 1 / STEP_TOLERANCE <= factor <= STEP_TOLERANCE
    predicted = {}
    for rule in (a, b, "kept_by_all", "momentum_only"):
        x, iv = t[rule]["rate"], r[rule]
        predicted[rule] = {"toy": t[rule], "run": iv,
                           "hit": bool(not math.isnan(x) and not math.isnan(iv["lo"]) and iv["lo"] <= x <= iv["hi"])}
    toy_diff, run_diff = _diff(t, a, b), _diff(r, a, b)
    data = (t[a]["n"] > 0 and t[b]["n"] > 0, r[a]["n"] > 0 and r[b]["n"] > 0)
    verdict = outcome(toy_diff, run_diff, matched, data=data)
    return {"available": True, "toy_scale": t["lr_scale"], "toy_median_abs_dd_over_d": t["median_abs_dd_over_d"],
            "run_median_abs_dd_over_d": target, "run_median_of_steps": r["median_of"], "factor": factor,
            "step_matched": matched, "predicted": predicted, "toy_diff": toy_diff, "run_diff": run_diff,
            "outcome": verdict["outcome"], "reason": verdict["reason"], "toy_scales": toy, "run_scales": run}


def step_matched_lines(doc: dict, a: str, b: str) -> list[str]:
    """``transfer.md``'s section for ``step_matched``."""
    if not doc.get("available"):
        return [f"Step-matched comparison: not available ({doc.get('reason')})."]
    pct = lambda x: "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"  # noqa: E731
    out = ["## At the run's relative step size", "",
           f"The run's step: median |ΔD|/D {doc['run_median_abs_dd_over_d']:.3g} (median over "
           f"{doc['run_median_of_steps']} audited steps). The toy read at {doc['toy_scale']:g} × its step: "
           f"{doc['toy_median_abs_dd_over_d']:.3g} (× {doc['factor']:.2g}; "
           f"{'matched' if doc['step_matched'] else f'not within × {STEP_TOLERANCE:g}: unfaithful step'}).", "",
           "| unsafe-keep | toy (Wilson 95%) | run (Wilson 95%) | toy inside run's interval |", "| --- | --- | --- | --- |"]
    for rule, p in doc["predicted"].items():
        t, r = p["toy"], p["run"]
        out.append(f"| {rule} | {pct(t['rate'])} [{pct(t['lo'])}, {pct(t['hi'])}] (n {t['n']}) | "
                   f"{pct(r['rate'])} [{pct(r['lo'])}, {pct(r['hi'])}] (n {r['n']}) | {'hit' if p['hit'] else 'miss'} |")
    for side in ("toy", "run"):
        d = doc[f"{side}_diff"]
        out.append(f"\n{side} A − B ({a} − {b}): {pct(d['mean_diff'])} [{pct(d['ci_low'])}, {pct(d['ci_high'])}] (Newcombe)")
    out += ["", f"**SPEC §6c outcome at the matched step: {doc['outcome']}** ({doc['reason']}).", ""]
    return out
