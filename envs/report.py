"""report.md: the sweep's figures and tables, which configuration won on which criterion, and
the audit — stated as the numbers show, ties included."""
from __future__ import annotations

import math
from pathlib import Path

from .collapse import collapse_section
from .summary import config_label, config_summary, group_rows, mismatch_label


def _num(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if abs(x) < 0.5 * 10 ** -digits:
        x = 0.0  # no "-0.000" from rounding-level values
    return f"{x:.{digits}f}"


def _ci(triple: tuple[float, float, float], digits: int = 3) -> str:
    mean, lo, hi = triple
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _p(x: float) -> str:
    """A p-value: two significant digits, scientific when small."""
    return "n/a" if x is None or math.isnan(x) else (f"{x:.2g}" if x >= 1e-3 else f"{x:.1e}")


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _winner(summaries: dict[str, dict], value, *, higher: bool, interval=None) -> str:
    """Best config on one criterion, and whether its CI separates it from the runner-up."""
    scored = [(label, value(s)) for label, s in summaries.items() if not math.isnan(value(s))]
    if not scored:
        return "no data"
    scored.sort(key=lambda item: item[1], reverse=higher)
    best, best_v = scored[0]
    if len(scored) == 1:
        return f"**{best}** ({_num(best_v)}; the only configuration)"
    second, second_v = scored[1]
    tied = [label for label, v in scored if v == best_v]
    if len(tied) > 1:
        return f"tie at {_num(best_v)} between {', '.join(f'**{t}**' for t in tied)}"
    if interval is None:
        return f"**{best}** ({_num(best_v)}; next: {second} {_num(second_v)})"
    b_lo, b_hi = interval(summaries[best])[1:]
    s_lo, s_hi = interval(summaries[second])[1:]
    separated = (b_lo > s_hi) if higher else (b_hi < s_lo)
    verdict = "separated at 95%" if separated else "not separable from the runner-up at 95% (a tie within noise)"
    return f"**{best}** ({_num(best_v)}; next: {second} {_num(second_v)}; {verdict})"


def _config_table(summaries: dict[str, dict]) -> list[str]:
    lines = ["| configuration | runs | final reward [95% CI] | collapse rate [95% CI] | unsafe-keep (tokens) | mask fraction | realised mismatch |",
             "| --- | ---: | --- | --- | --- | --- | --- |"]
    for label, s in summaries.items():
        lines.append(f"| {label} | {s['runs']} | {_ci(s['final_reward'])} | {_ci(s['collapse'], 2)} | "
                     f"{_pct(s['unsafe_keep'])} ({s['unsafe_keep_tokens']}) | {_num(s['mask_fraction'][0])} | "
                     f"{_num(s['mismatch'][0])} |")
    return lines


def sweep_section(rows: list[dict], figures: dict[str, Path], root: Path) -> list[str]:
    lines = ["## Sweep", ""]
    if not rows:
        return lines + ["No finished runs.", ""]
    overall = {label: config_summary(group) for (label,), group in
               group_rows(rows, lambda r: (config_label(r),)).items()}
    lines += ["### Which configuration won", "",
              "Over all mismatch settings (each configuration ran the same cells and seeds):", "",
              f"- highest final reward: {_winner(overall, lambda s: s['final_reward'][0], higher=True, interval=lambda s: s['final_reward'])}",
              f"- lowest collapse rate: {_winner(overall, lambda s: s['collapse'][0], higher=False, interval=lambda s: s['collapse'])}",
              f"- lowest unsafe-keep rate (pooled over kept outside tokens): {_winner(overall, lambda s: s['unsafe_keep'], higher=False)}",
              f"- fewest tokens masked: {_winner(overall, lambda s: s['mask_fraction'][0], higher=False)}",
              "", "Per mismatch setting (highest final reward):", ""]
    by_mismatch = group_rows(rows, lambda r: (mismatch_label(r),))
    for (mismatch,), group in by_mismatch.items():
        per = {label: config_summary(g) for (label,), g in group_rows(group, lambda r: (config_label(r),)).items()}
        lines.append(f"- `{mismatch}`: {_winner(per, lambda s: s['final_reward'][0], higher=True, interval=lambda s: s['final_reward'])}")
    lines += ["", "### All configurations", ""] + _config_table(overall)
    for (mismatch,), group in by_mismatch.items():
        per = {label: config_summary(g) for (label,), g in group_rows(group, lambda r: (config_label(r),)).items()}
        lines += ["", f"#### mismatch `{mismatch}`", ""] + _config_table(per)
    lines += [""] + collapse_section(rows)
    lines += ["", "### Figures", ""]
    captions = {"learning_curves": "Learning curves (mean batch reward, ±1.96 s.e. over seeds)",
                "final_reward": "Final reward of π against realised mismatch",
                "collapse": "Collapse rate against realised mismatch",
                "unsafe_keep": "Unsafe-keep rate (kept outside tokens whose D grew after the step) against realised mismatch",
                "mask_fraction": "Fraction of tokens masked against realised mismatch"}
    for name, path in figures.items():
        lines += [f"![{captions.get(name, name)}]({path.relative_to(root).as_posix()})", "",
                  f"*{captions.get(name, name)}.*", ""]
    lines += ["Definitions: *final reward* is π's expected reward after training (exact for the bandit, "
              "on-policy samples for the token MDP); *collapsed* means training produced non-finite values or "
              "its smoothed batch-reward curve ended below half of the best it reached (and more than 0.05 below it); *realised mismatch* is the mean "
              "top-K KL D(μ‖π) over the tokens the trainer used, measured at each update (so staleness counts); "
              "results.csv also has the rollout-time values.", ""]
    return lines


def regime_section(tables: dict[str, dict], *, title: str = "### Regime (SPEC §6b calibration table)") -> list[str]:
    """The calibration table of each mismatch setting, and which settings are in the realistic
    band (outside fraction of Â ≠ 0 tokens 0.02–1%, p99.9/p50 ≥ 30)."""
    from .calibrate import MARKDOWN_HEADER, markdown_row

    lines = [title, "", MARKDOWN_HEADER]
    for name, table in tables.items():
        lines.append(markdown_row(f"`{name}`", table))
    realistic = [n for n, t in tables.items() if _realistic(t)]
    lines += ["", "Realistic (0.02–1% of Â ≠ 0 tokens outside δ and p99.9/p50 ≥ 30): "
              + (", ".join(f"`{n}`" for n in realistic) or "none of these settings") + "; the others are stress settings.", ""]
    return lines


def _realistic(table: dict) -> bool:
    return 0.0002 <= table["outside_fraction"] <= 0.01 and table["tail_ratio"] >= 30


def stress_verdict(rows: list[dict], regime: dict[str, dict]) -> list[str]:
    """Which configuration has the highest final reward over the realistic settings and over the
    stress settings, and whether the verdict changes between them."""
    groups = {"realistic": [r for r in rows if mismatch_label(r) in regime and _realistic(regime[mismatch_label(r)])],
              "stress": [r for r in rows if mismatch_label(r) in regime and not _realistic(regime[mismatch_label(r)])
                         and mismatch_label(r) != "none"]}
    best = {}
    for name, group in groups.items():
        if group:
            summaries = {label: config_summary(g) for (label,), g in group_rows(group, lambda r: (config_label(r),)).items()}
            best[name] = (max(summaries, key=lambda k: summaries[k]["final_reward"][0]),
                          _winner(summaries, lambda s: s["final_reward"][0], higher=True, interval=lambda s: s["final_reward"]))
    lines = []
    for name in ("realistic", "stress"):
        if name in best:
            lines.append(f"- highest final reward over the {name} settings: {best[name][1]}")
    if len(best) == 2:
        same = best["realistic"][0] == best["stress"][0]
        lines.append("- the verdict " + ("is the same under the stress settings." if same else
                                         "**changes** under the stress settings: a stress-regime result does not carry over."))
    elif lines:
        lines.append("- no stress setting in this grid: whether the verdict changes under stress is not measured here "
                     "(the `stress` preset and the paper audit's stress study measure it).")
    return lines + [""] if lines else []


def _rule_tables(per_rule: dict) -> list[str]:
    lines = ["| rule | scored against | unsafe-keep, top-K KL | shrink, top-K KL | flat | unsafe-keep, full KL | shrink, full KL | kept disagreement tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | ---: |"]
    for rule, r in per_rule.items():
        t, f = r["topk_kl"], r["full_kl"]
        lines.append(f"| {rule} | {r['scored_against']} | {_pct(t['unsafe_keep_pooled'])} | {_pct(t['shrink_pooled'])} | "
                     f"{_pct(t['flat_pooled'])} | {_pct(f['unsafe_keep_pooled'])} | {_pct(f['shrink_pooled'])} | "
                     f"{t['kept_disagreement_tokens']} |")
    return lines


def _pair_table(pairs: list[dict]) -> list[str]:
    lines = ["| pair A vs B | disagreement tokens / seed | A unsafe-keep (pooled) | B unsafe-keep (pooled) | pooled A − B [95% seed-bootstrap CI] | per-seed A − B [95% CI] | sign test p | seeds B lower / A lower |",
             "| --- | ---: | --- | --- | --- | --- | ---: | --- |"]
    for pair in pairs:
        a, b = pair["a"], pair["b"]
        d, pooled = pair["unsafe_keep_diff"], pair["pooled_unsafe_keep_diff"]
        lines.append(f"| {a} vs {b} | {pair['disagreement_mean']:.2f} | {_pct(pair[a]['unsafe_keep_pooled'])} | "
                     f"{_pct(pair[b]['unsafe_keep_pooled'])} | {_num(pooled['mean_diff'])} [{_num(pooled['ci_low'])}, {_num(pooled['ci_high'])}] | "
                     f"{_num(d['mean_diff'])} [{_num(d['ci_low'])}, {_num(d['ci_high'])}] | {_p(d['sign_test_p'])} | "
                     f"{d['b_lower_seeds']} / {d['a_lower_seeds']} of {d['seeds_used']} |")
    return lines


def audit_section(doc: dict, figures: dict[str, Path], root: Path) -> list[str]:
    from pdm_lab.audit import verdict

    cfg = doc["config"]
    step = doc["step"]
    lines = ["## Direction audit (SPEC §6)", "",
             f"{cfg['seeds']} seeds × {cfg['sequences']} sequences, problem `{cfg['problem']['kind']}`, "
             f"policy `{cfg['policy']}`, mismatch `{cfg['mismatch']}`, δ = {cfg['delta']}, K = {cfg['k']}. "
             f"Step: one `{step['optimizer']}` step per rule from the same parameters, effective per-token step "
             f"η = {step['effective_per_token_step']:g} ({step['loss']}). Precision: ΔD in {doc['precision']} "
             f"(policy, μ and the step cast for the measurement), |ΔD| ≤ {doc['tolerance']:g} counted flat. "
             f"Outside and disagreement sets are over Â ≠ 0 tokens: on average {doc['outside_mean']:.1f} outside of "
             f"{doc['tokens_mean']:.0f} response tokens per seed ({doc['zero_advantage_mean']:.0f} had Â = 0).", ""]
    if doc.get("regime"):
        lines += regime_section({cfg["mismatch"]: doc["regime"]}, title="### Regime of the audited batches")
    for ctx, block in doc["contexts"].items():
        label = {"shared": "shared states (the batch as it is)", "distinct": "one token per state"}[ctx]
        lines += [f"### {label}: tokens per state {block['tokens_per_state_mean']:.2f}", "",
                  "Each rule over the disagreement tokens it kept (pooled over seeds), against both divergences; "
                  "*scored against* is the divergence its direction test predicts.", ""]
        lines += _rule_tables(block["per_rule"]) + [""] + _pair_table(block["pairs"])
        main = block["pairs"][0]
        lines += ["", f"Verdict on the main pair ({ctx}), per seed: {verdict(main['unsafe_keep_diff'], main['a'], main['b'])} "
                  f"Pooled over seeds: {verdict(main['pooled_unsafe_keep_diff'], main['a'], main['b'])} "
                  "The paper reports 36.9% (ratio) vs 34.2% (predictive) without an interval.", ""]
    studies = doc.get("studies") or {}
    stress = studies.get("stress")
    if stress:
        pair = stress["pair"]
        a, b = pair["a"], pair["b"]
        d = pair["unsafe_keep_diff"]
        lines += ["### Under a stress setting", "",
                  f"The main pair on `{stress['mismatch']}` ({stress['seeds']} seeds, {stress['outside_mean']:.0f} outside "
                  f"of {stress['tokens_mean']:.0f} tokens per seed): {a} {_pct(pair[a]['unsafe_keep_pooled'])} vs "
                  f"{b} {_pct(pair[b]['unsafe_keep_pooled'])} unsafe-keep; A − B {_num(d['mean_diff'])} "
                  f"[{_num(d['ci_low'])}, {_num(d['ci_high'])}]. {stress['verdict']} "
                  + ("**The verdict changes** between the realistic regime and this stress setting."
                     if stress["verdict_changes"] else "The verdict is the same as in the realistic regime."), ""]
    ks = studies.get("k_sweep")
    if ks:
        a, b = doc["pairs"][0]["a"], doc["pairs"][0]["b"]
        lines += ["### K sweep", "",
                  f"| K | outside / seed | disagreement / seed | {a} unsafe-keep | {b} unsafe-keep | A − B [95% CI] | mean μ_T |",
                  "| ---: | ---: | ---: | --- | --- | --- | --- |"]
        for row in ks:
            c = row["unsafe_keep_diff"]
            lines.append(f"| {row['k']} | {row['outside_mean']:.1f} | {row['disagreement_mean']:.1f} | "
                         f"{_pct(row[a]['unsafe_keep_pooled'])} | {_pct(row[b]['unsafe_keep_pooled'])} | "
                         f"{_num(c['mean_diff'])} [{_num(c['ci_low'])}, {_num(c['ci_high'])}] | {_num(row['mu_tail_mean'])} |")
        lines.append("")
    for name, path in figures.items():
        lines += [f"![{name}]({path.relative_to(root).as_posix()})", ""]
    return lines


def write_report(path: Path, *, title: str, intro: list[str], rows: list[dict] | None = None,
                 sweep_figs: dict[str, Path] | None = None, audit: dict | None = None,
                 audit_figs: dict[str, Path] | None = None, regime: dict[str, dict] | None = None) -> Path:
    """Assemble report.md (figure links relative to its folder); ``regime``: the calibration table
    of each mismatch setting."""
    root = path.parent
    lines = [f"# {title}", ""] + intro + [""]
    if regime:
        lines += regime_section(regime, title="## Regime (SPEC §6b calibration table)")
        if rows:
            lines += stress_verdict(rows, regime)
    if rows is not None:
        lines += sweep_section(rows, sweep_figs or {}, root)
    if audit is not None:
        lines += audit_section(audit, audit_figs or {}, root)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
