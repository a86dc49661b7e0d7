"""audit.md's sections on what the audit decides: verdicts that need data, the power line, the
self-test, the trajectory over training points, where flips come from, coupling, and the
paper's figures side by side — each stated as measured."""
from __future__ import annotations

import math

from pdm_lab.lab.machine import machine_line
from pdm_lab.audit.measure import INSUFFICIENT


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(d: dict, scale: float = 1.0, digits: int = 3) -> str:
    if d is None or math.isnan(d.get("mean_diff", float("nan"))):
        return "n/a"
    return (f"{scale * d['mean_diff']:.{digits}f} [{scale * d['ci_low']:.{digits}f}, "
            f"{scale * d['ci_high']:.{digits}f}]")


def verdict_lines(doc: dict) -> list[str]:
    """The main pair's verdicts (or "insufficient data" and why) and the power line."""
    pair = doc["pairs"][0]
    data, power = pair["data"], pair["power"]
    needed = power["seeds_needed"]
    same = pair["verdict"] == pair["pooled_verdict"]  # "insufficient data" and its reason, said once
    lines = ["### Verdict (main study, training step %d)" % pair.get("audit_step", doc.get("audit_step", 0)), ""]
    lines += ([f"- per seed and pooled over seeds: {pair['verdict']}" if not pair["verdict"].startswith(INSUFFICIENT)
               else "- per seed and pooled over seeds: none drawn (the data line below and the summary table say why)"]
              if same else
              [f"- per seed: {pair['verdict']}", f"- pooled over seeds: {pair['pooled_verdict']}"])
    lines += [
             f"- data: {data['seeds_with_both']} seeds gave kept disagreement tokens to both rules; "
             f"{data['tokens_a']} / {data['tokens_b']} kept disagreement tokens pooled "
             f"(a verdict needs ≥ {data['min_seeds']} seeds and ≥ {data['min_tokens']} tokens each).",
             f"- power: at the measured per-seed spread of A − B (sd {_num(power['sd'])} over "
             f"{power['seeds_used']} seeds), detecting the paper's {100 * power['effect']:.1f}-point difference at "
             f"{100 * power['power']:.0f}% power (two-sided {100 * power['level']:.0f}%) needs "
             + (f"**{needed} seeds**" if not (isinstance(needed, float) and math.isnan(needed)) else "n/a (fewer than 2 seeds)")
             + f"; this audit has {doc['config']['seeds']}.", ""]
    return lines


def self_test_lines(doc: dict) -> list[str]:
    test = doc.get("self_test")
    if not test:
        return []
    least = test.get("min_tokens", 20)
    status = {True: "**passed**", False: "**FAILED**",
              None: f"not tested (no matched rule kept ≥ {least} disagreement tokens)"}[test["passed"]]
    lines = ["### Self-test (one token per state)", "",
             "With one token per state each token's ΔD comes from its own update alone, so a rule whose Ḋ is "
             "the exact derivative of the divergence it is scored against keeps no divergence-growing update "
             "to first order. This checks the audit; it is not evidence about PDM. Result: " + status + ".", ""]
    for rule, c in test["checks"].items():
        state = ("not tested: too few kept tokens" if not c.get("tested", True)
                 else "passed" if c["passed"] else "FAILED")
        lines.append(f"- {rule} on {c['scored_against']}: unsafe-keep {_pct(c['unsafe_keep'])} over {c['kept']} kept "
                     f"tokens (limit {_pct(test['max_unsafe'])} over ≥ {least}): {state}")
    return lines + [""]


def trajectory_lines(doc: dict) -> list[str]:
    points = doc.get("trajectory") or []
    if not points:
        return []
    a, b = doc["pairs"][0]["a"], doc["pairs"][0]["b"]
    lines = ["### Unsafe-keep over training (plain GRPO under the audited mismatch)", "",
             f"| training step | seeds | outside / seed | disagreement / seed | {a} unsafe-keep (kept) | {b} unsafe-keep (kept) | per-seed A − B [95% CI] | verdict |",
             "| ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for p in points:
        lines.append(f"| {p['step']} | {p['seeds']} | {p['outside_mean']:.1f} | {p['disagreement_mean']:.1f} | "
                     f"{_pct(p[a]['unsafe_keep_pooled'])} ({p[a]['kept_disagreement_tokens']}) | "
                     f"{_pct(p[b]['unsafe_keep_pooled'])} ({p[b]['kept_disagreement_tokens']}) | "
                     f"{_ci(p['unsafe_keep_diff'])} | "
                     + ("the main study (above)" if p["step"] == doc["pairs"][0].get("audit_step") else p["verdict"]) + " |")
    return lines + [""]


def flip_lines(doc: dict) -> list[str]:
    flips = doc.get("flips") or {}
    if not flips:
        return []
    lines = ["### Where a flip comes from (first-order terms of grown kept disagreement tokens)", "",
             "Each grown kept disagreement token's first-order ΔD split by whose update caused it: its own, "
             "its context's other tokens (same observation), its state's (same trainable input, another "
             "context), the rest of the batch (through shared weights). SGD only.", "",
             "| rule | grown tokens decomposed | largest term: own / context / state / rest | own term > 0 | median (context + state + rest) / own | dropped outside tokens that grew anyway |",
             "| --- | ---: | --- | ---: | ---: | --- |"]
    for rule, entry in flips.items():
        inter = entry["interference_only"]
        rate = f"{_pct(inter['unsafe_keep'])} ({inter['grew']} of {inter['count']})"
        causes = entry.get("causes")
        if causes is None:
            lines.append(f"| {rule} | – | – | – | – | {rate} |")
            continue
        dom = causes["dominant"]
        lines.append(f"| {rule} | {causes['tokens']} | {dom['own']} / {dom['context']} / {dom['state']} / {dom['rest']} | "
                     f"{causes['own_grew']} | {_num(causes['median_ratio_to_own'], 2)} | {rate} |")
    return lines + [""]


def coupling_lines(doc: dict) -> list[str]:
    c = doc.get("coupling")
    if not c:
        return []
    return ["### Coupling", "",
            f"Per seed (means): {c['tokens']:.0f} response tokens, {c['tokens_per_context']:.2f} tokens per context, "
            f"{c['tokens_per_trainable_state']:.2f} per trainable state; per outside token "
            f"{c['same_state_per_outside']:.1f} other tokens share its trainable state; {c['same_state_tokens']:.0f} "
            f"batch tokens share a trainable state with an outside token and {c['share_feature_tokens']:.0f} share "
            "at least one active input feature with one (the output head is shared by every token).", ""]


def paper_lines(doc: dict) -> list[str]:
    side = doc.get("paper_side_by_side")
    if not side:
        return []
    a, b, paper = side["a"], side["b"], side["paper"]
    d, sh = side["unsafe_keep_diff"], side["shrink_diff"]

    def paper_value(table: str, rule: str) -> str:
        return _pct(paper[table].get(rule)) if rule in paper[table] else "–"
    lines = ["### The paper's figures side by side", "",
             "| figure | paper | this audit |", "| --- | --- | --- |",
             f"| seeds | {paper['seeds']} | {side['seeds_used']} with kept tokens for both rules (of {doc['config']['seeds']}) |",
             f"| outside / disagreement tokens per seed | {paper['outside_per_seed']} / {paper['disagreement_per_seed']} | "
             f"{doc['outside_mean']:.0f} / {doc['pairs'][0]['disagreement_mean']:.1f} |",
             f"| {a} unsafe-keep (per-seed mean) | {paper_value('unsafe_keep', a)} | {_pct(side['unsafe_keep_mean'][a])} |",
             f"| {b} unsafe-keep (per-seed mean) | {paper_value('unsafe_keep', b)} | {_pct(side['unsafe_keep_mean'][b])} |",
             f"| {a} shrink | {paper_value('shrink', a)} | {_pct(side['shrink_mean'][a])} |",
             f"| {b} shrink | {paper_value('shrink', b)} | {_pct(side['shrink_mean'][b])} |",
             f"| seeds where {b} is lower | {paper['pdm_lower_seeds']} of {paper['seeds']} | {side['b_lower_seeds']} of "
             f"{side['seeds_used']} ({side['ties']} ties) |",
             f"| unsafe-keep A − B, per seed [95% paired bootstrap CI] | 0.027 (no CI) | {_ci(d)} |",
             f"| shrink A − B [95% CI] | −0.022 (no CI) | {_ci(sh)} |",
             f"| sign test p | ≈ {paper['sign_test_p']} | {d['sign_test_p']:.3g} |", ""]
    if side["verdict"] != doc["pairs"][0]["verdict"]:  # the main verdict is stated once, above
        lines += [f"Verdict: {side['verdict']}", ""]
    return lines


def cost_lines(doc: dict) -> list[str]:
    """The cost, and the machine every figure above was measured on (``pdm_lab.lab.machine``)."""
    lines = [f"Cost: {doc['wall_s']:.0f} s wall ({doc['main_audit_wall_s']:.0f} s the main study, training to the audit "
             f"point included), peak memory {doc.get('peak_rss_gb', float('nan')):.2f} GB (resident set).", ""]
    if "machine" in doc:
        precision = doc.get("config", {}).get("train_precision", "float32")
        same = ("the trained point is float64: counts agree across CPU paths and thread counts"
                if precision == "float64" else
                "the trained point is float32: its counts move with the CPU path (docs/findings/reproducibility.md)")
        lines += [f"{machine_line(doc['machine'])}; {same}.", ""]
    return lines


def decision_sections(doc: dict) -> list[str]:
    """Every section above, in reading order (for ``report.audit_section``)."""
    if "paper_side_by_side" not in doc:
        return []
    return (verdict_lines(doc) + paper_lines(doc) + trajectory_lines(doc) + flip_lines(doc)
            + coupling_lines(doc) + self_test_lines(doc) + cost_lines(doc))
