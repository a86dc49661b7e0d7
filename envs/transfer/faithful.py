"""Is a toy faithful to a run, and what does its verdict say about the run? (SPEC §6c, §6d)

The mechanism statistics of SPEC §6d, read from the same keys on both sides (the toy's
``audit.json``: ``probe``, ``decomposition``, ``step_scales``; the loop's ``audit.jsonl`` lines:
the same per line, pooled token by token with the core's ``pool_probe``/``pool_decomposition``):

* per rule, the sign agreement of its predicted direction with the own update's first-order ΔD
  over outside tokens (``probe/agree/<rule>/outside/topk_kl``, Wilson 95%);
* cos(K v, v) (``probe/cos_kv_v``, median with its 95% CI);
* the optimiser-memory share of the reference rule's step (``decomp/share/memory``, mean, CI);
* the median |ΔD|/D of that step (``decomp/median_abs_dd_over_d``, CI).

The toy is *faithful* when each of its point estimates lies inside the run's interval. The
comparison's outcome follows SPEC §6c's table, never more lenient: "unfaithful toy" first; then
"undecided" when both A − B intervals contain 0 (or a side lacks SPEC §6's data); "transfers"
when both exclude 0 with the same sign; "consistent" when one excludes 0 and the other contains
that side's point estimate with its own point estimate of the same sign; else "does not
transfer". A run whose audit has no probe keys cannot show the toy faithful: its outcome is at
most "undecided", and the report says why.
"""
from __future__ import annotations

import math

from pdm_lab.audit.probe import pool_decomposition, pool_probe

DIVERGENCE = "topk_kl"
OUTCOMES = ("unfaithful toy", "undecided", "transfers", "consistent", "does not transfer")
NO_PROBE = "the run's audit.jsonl has no probe keys (audited before the own-update probe): faithfulness unknown"


def _interval(value, lo, hi, n=None) -> dict:
    return {"value": value, "lo": lo, "hi": hi, "n": n}


def probe_statistics(probe: dict | None, decomposition: dict | None, rules) -> dict | None:
    """The statistics above from one side's pooled probe and decomposition (None: no probe)."""
    if not probe or not probe.get("probe/tokens"):
        return None
    out = {}
    for rule in rules:
        entry = probe.get(f"probe/agree/{rule}/outside/{DIVERGENCE}")
        if entry is not None:
            out[f"agree/{rule}"] = _interval(entry["rate"], entry["lo"], entry["hi"], entry["n"])
    cos = probe.get("probe/cos_kv_v")
    if cos:
        out["cos_kv_v"] = _interval(cos["median"], cos["lo"], cos["hi"], cos.get("n"))
    ref = (decomposition or {}).get(rules[0])
    if ref:
        mem = ref["decomp/share/memory"]
        out["memory_share"] = _interval(mem["mean"], mem["lo"], mem["hi"], ref.get("decomp/tokens"))
        med = ref["decomp/median_abs_dd_over_d"]
        out["median_abs_dd_over_d"] = _interval(med["value"], med["lo"], med["hi"], ref.get("decomp/tokens"))
    return out


def toy_statistics(doc: dict, rules) -> dict | None:
    """From a toy ``audit.json`` document."""
    return probe_statistics(doc.get("probe"), doc.get("decomposition"), rules)


def run_statistics(lines: list[dict], rules) -> dict | None:
    """From a run's audit lines, pooled over its audited steps (None: no line carries a probe)."""
    probes = [ln["probe"] for ln in lines if ln.get("probe") and ln["probe"].get("probe/tokens")]
    if not probes:
        return None
    decomposition = {}
    for rule in rules[:1]:
        parts = [ln["decomposition"][rule] for ln in lines if (ln.get("decomposition") or {}).get(rule)
                 and ln["decomposition"][rule].get("decomp/tokens")]
        decomposition[rule] = pool_decomposition(parts) if parts else None
    return probe_statistics(pool_probe(probes), decomposition, rules)


def faithfulness(toy: dict | None, run: dict | None) -> dict:
    """Per statistic: the toy's estimate, the run's interval and whether it lies inside; ``faithful``
    is True (all inside), False (one outside) or None (not measured on a side: ``reason``)."""
    if run is None:
        return {"faithful": None, "reason": NO_PROBE, "statistics": {}}
    if toy is None:
        return {"faithful": None, "reason": "the toy audit ran without the probe (probe_tokens = 0)",
                "statistics": {}}
    stats = {}
    for key, interval in run.items():
        mine = toy.get(key)
        x = None if mine is None else mine["value"]
        inside = (x is not None and not math.isnan(x) and not math.isnan(interval["lo"])
                  and interval["lo"] <= x <= interval["hi"])
        stats[key] = {"toy": mine, "run": interval, "match": inside}
    missing = [k for k, s in stats.items() if s["toy"] is None]
    outside = [k for k, s in stats.items() if not s["match"]]
    faithful = not outside
    reason = ("every statistic inside the run's interval" if faithful else
              "outside the run's interval: " + ", ".join(outside) + (f" (not measured by the toy: {', '.join(missing)})"
                                                                      if missing else ""))
    return {"faithful": faithful, "reason": reason, "statistics": stats}


def _excludes_zero(d: dict) -> bool:
    return d["ci_low"] > 0 or d["ci_high"] < 0


def _contains(d: dict, x: float) -> bool:
    return d["ci_low"] <= x <= d["ci_high"]


def outcome(toy_diff: dict, loop_diff: dict, faithful: bool | None, *, data: tuple[bool, bool] = (True, True)) -> dict:
    """SPEC §6c's outcome from the A − B intervals (``mean_diff``, ``ci_low``, ``ci_high``) of the toy
    and the loop, the toy's faithfulness and whether each side has SPEC §6's data."""
    if faithful is False:
        return {"outcome": "unfaithful toy", "reason": "the toy's mechanism statistics lie outside the run's intervals"}
    lacking = [name for name, ok in zip(("toy", "loop"), data) if not ok]
    if lacking:
        return {"outcome": "undecided", "reason": f"insufficient data ({' and '.join(lacking)})"}
    values = [toy_diff["mean_diff"], toy_diff["ci_low"], toy_diff["ci_high"], loop_diff["mean_diff"],
              loop_diff["ci_low"], loop_diff["ci_high"]]
    if any(v is None or math.isnan(v) for v in values):
        return {"outcome": "undecided", "reason": "an A − B interval is undefined"}
    t, l = _excludes_zero(toy_diff), _excludes_zero(loop_diff)
    if not t and not l:
        return {"outcome": "undecided", "reason": "both A − B intervals contain 0"}
    same = math.copysign(1.0, toy_diff["mean_diff"]) == math.copysign(1.0, loop_diff["mean_diff"])
    if t and l:
        found = "transfers" if same else "does not transfer"
    else:
        decided, other = (toy_diff, loop_diff) if t else (loop_diff, toy_diff)
        found = "consistent" if _contains(other, decided["mean_diff"]) and same else "does not transfer"
    if faithful is None and found in ("transfers", "consistent"):
        return {"outcome": "undecided", "reason": f"the intervals alone would say {found!r}, but {NO_PROBE}"}
    return {"outcome": found, "reason": {"transfers": "both intervals exclude 0 with the same sign",
                                         "consistent": "one interval excludes 0; the other contains its estimate, "
                                                       "with the same sign",
                                         "does not transfer": "the intervals disagree"}[found]}


def run_probe_report(lines: list[dict] | None, toy_doc: dict | None = None) -> dict:
    """``calibrate --from-run``'s probe part: the run's mechanism statistics from its audit lines
    (pooled over audited steps; None: the run has no ``audit.jsonl``) and, given a toy
    ``audit.json`` document, which of the toy's match (``faithfulness``)."""
    if not lines:
        return {"run": None, "note": "the run has no audit.jsonl (train with audit.every=N)", "faithfulness": None}
    rules = list(lines[0]["rules"])
    run = run_statistics(lines, rules)
    report = {"rules": rules, "run": run, "note": NO_PROBE if run is None else None, "faithfulness": None}
    if toy_doc is not None and run is not None:
        report["faithfulness"] = faithfulness(toy_statistics(toy_doc, rules), run)
    return report


def format_probe_report(report: dict) -> str:
    """The probe part of ``calibrate --from-run``'s printout."""
    if report["run"] is None:
        return f"mechanism statistics (SPEC §6d): none — {report['note']}"
    lines = ["mechanism statistics of the run (SPEC §6d, pooled over its audited steps):"]
    faith = report.get("faithfulness")
    for key, x in report["run"].items():
        line = f"  {key}: {x['value']:.3g} [{x['lo']:.3g}, {x['hi']:.3g}] (n = {x['n']})"
        if faith:
            s = faith["statistics"][key]
            line += f"; toy {'n/a' if s['toy'] is None else format(s['toy']['value'], '.3g')}: " \
                    f"{'matches' if s['match'] else 'does not match'}"
        lines.append(line)
    if faith:
        lines.append(f"faithful: {faith['faithful']} ({faith['reason']})")
    return "\n".join(lines)
