"""report.md: the sweep's figures and tables, which configuration won on which criterion, and
the audit — stated as the numbers show: a winner only where it is separated from the runner-up
at 95%, a collapse rate only for runs long enough for the collapse definition."""
from __future__ import annotations

import math
from pathlib import Path

from pdm_lab.lab.evidence import COLLAPSE_MIN_STEPS, CRITERION

from pdm_lab.envs.report.collapse import collapse_note, collapse_section
from pdm_lab.envs.report.criteria import COLLAPSE, MASKED, REWARD, UNSAFE_KEEP, _by_config, _num, _winner, decide
from pdm_lab.envs.report.strength import strength_section
from pdm_lab.envs.report.summary import config_summary, group_rows, mismatch_label, point_label


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
    configs = _by_config(rows)
    overall = {label: config_summary(group) for label, group in configs.items()}
    lines += ["### Which configuration won", "",
              f"Criterion: {CRITERION}. Over all mismatch settings (each configuration ran the same cells and seeds):", "",
              f"- highest final reward: {_winner(configs, REWARD)}",
              f"- lowest collapse rate: {_winner(configs, COLLAPSE)}",
              f"- lowest unsafe-keep rate: {_winner(configs, UNSAFE_KEEP)}",
              f"- fewest tokens masked: {_winner(configs, MASKED)}",
              "", "Per mismatch setting (highest final reward):", ""]
    by_mismatch = group_rows(rows, lambda r: (point_label(r),))
    for (mismatch,), group in by_mismatch.items():
        lines.append(f"- `{mismatch}`: {_winner(_by_config(group), REWARD)}")
    lines += ["", "### All configurations", ""] + _config_table(overall)
    for (mismatch,), group in by_mismatch.items():
        per = {label: config_summary(g) for label, g in _by_config(group).items()}
        lines += ["", f"#### mismatch `{mismatch}`", ""] + _config_table(per)
    lines += [""] + collapse_section(rows)
    lines += strength_section(rows)
    lines += ["", "### Figures", ""]
    captions = {"learning_curves": "Learning curves (mean batch reward, ±1.96 s.e. over seeds)",
                "final_reward": "Final reward of π against realised mismatch",
                "collapse": f"Collapse rate against realised mismatch (no points for runs shorter than {COLLAPSE_MIN_STEPS} steps)",
                "unsafe_keep": "Unsafe-keep rate (kept outside tokens whose D grew after the step) against realised mismatch",
                "mask_fraction": "Fraction of tokens masked against realised mismatch",
                "strength_reward": "Strength study: final reward of π per rule against each axis (95% Student-t band; "
                                   "grey: the points in SPEC §6b's realistic band)",
                "strength_collapse": "Strength study: collapse rate per rule against each axis (95% Wilson band; "
                                     "grey: the realistic points)"}
    for name, path in figures.items():
        lines += [f"![{captions.get(name, name)}]({path.relative_to(root).as_posix()})", "",
                  f"*{captions.get(name, name)}.*", ""]
    lines += ["Definitions: *final reward* is π's expected reward after training (exact for the bandit, "
              "on-policy samples for the token MDP); " + collapse_note() + " *Realised mismatch* is the mean "
              "top-K KL D(μ‖π) over the tokens the trainer used, measured at each update (so staleness counts); "
              "results.csv also has the rollout-time values.", ""]
    return lines


def regime_section(tables: dict[str, dict], *, title: str = "### Regime (SPEC §6b calibration table)") -> list[str]:
    """The calibration table of each mismatch setting, and which settings are in the realistic
    band (outside fraction of Â ≠ 0 tokens 0.02–1%, p99.9/p50 ≥ 30)."""
    from pdm_lab.envs.transfer.calibrate import MARKDOWN_HEADER, markdown_row

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
    decided = {name: decide(_by_config(group), REWARD) for name, group in groups.items() if group}
    lines = [f"- highest final reward over the {name} settings: {decided[name][1]}"
             for name in ("realistic", "stress") if name in decided]
    if len(decided) == 2:
        winners = [decided[name][0] for name in ("realistic", "stress")]
        if None in winners:
            lines.append("- at least one group has no separated winner: whether the verdict changes under stress is not measured here.")
        elif winners[0] == winners[1]:
            lines.append("- the verdict is the same under the stress settings.")
        else:
            lines.append("- the verdict **changes** under the stress settings: a stress-regime result does not carry over.")
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


def audit_section(doc: dict, figures: dict[str, Path], root: Path,
                  title: str = "## Direction audit (SPEC §6)") -> list[str]:
    from pdm_lab.audit.measure import verdict

    cfg = doc["config"]
    step = doc["step"]
    lines = [title, "",
             f"{cfg['seeds']} seeds × {cfg['sequences']} sequences, problem `{cfg['problem']['kind']}`, "
             f"policy `{cfg['policy']}`, mismatch `{cfg['mismatch']}`, δ = {cfg['delta']}, K = {cfg['k']}. "
             f"Step: one `{step['optimizer']}` step per rule from the same parameters, effective per-token step "
             f"η = {step['effective_per_token_step']:g} ({step['loss']}). Precision: ΔD in {doc['precision']} "
             f"(policy, μ and the step cast for the measurement), |ΔD| ≤ {doc['tolerance']:g} counted flat. "
             f"Outside and disagreement sets are over Â ≠ 0 tokens: on average {doc['outside_mean']:.1f} outside of "
             f"{doc['tokens_mean']:.0f} response tokens per seed ({doc['zero_advantage_mean']:.0f} had Â = 0).", ""]
    if doc.get("regime"):
        lines += regime_section({cfg["mismatch"]: doc["regime"]}, title="### Regime of the audited batches")
    from pdm_lab.envs.audit.report import decision_sections

    lines += decision_sections(doc)
    for ctx, block in doc["contexts"].items():
        if ctx == "distinct" and "self_test" in block and ctx != doc.get("main_contexts"):
            continue  # the audit's self-test (above), not a comparison
        label = {"shared": "shared states (the batch as it is)", "distinct": "one token per state"}[ctx]
        lines += [f"### {label}: tokens per state {block['tokens_per_state_mean']:.2f}", "",
                  "Each rule over the disagreement tokens it kept (pooled over seeds), against both divergences; "
                  "*scored against* is the divergence its direction test predicts.", ""]
        lines += _rule_tables(block["per_rule"]) + [""] + _pair_table(block["pairs"])
        main = block["pairs"][0]
        if ctx == doc.get("main_contexts") and "paper_side_by_side" in doc:
            lines += ["", "The paper reports 36.9% (ratio) vs 34.2% (predictive) without an interval; "
                      "this study's verdict is stated above.", ""]
            continue
        lines += ["", f"Verdict on the main pair ({ctx}), per seed: {main.get('verdict') or verdict(main['unsafe_keep_diff'], main['a'], main['b'])} "
                  f"Pooled over seeds: {main.get('pooled_verdict') or verdict(main['pooled_unsafe_keep_diff'], main['a'], main['b'])} "
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
                 audit_figs: dict[str, Path] | None = None, regime: dict[str, dict] | None = None,
                 stress_audit: dict | None = None, stress_figs: dict[str, Path] | None = None) -> Path:
    """Assemble report.md (figure links relative to its folder): the summary table first, then
    the details; ``regime``: the calibration table of each mismatch setting; ``stress_audit``: an
    audit in a stress setting where the rules separate."""
    from pdm_lab.envs.report.summary_table import summary_lines
    from pdm_lab.lab.machine import machine_line

    root = path.parent
    lines = [f"# {title}", ""]
    if rows is not None or audit is not None:
        lines += summary_lines(rows, regime or {}, audit, stress_audit)
    lines += intro + ["", f"Measured on {machine_line()}; the sweep's runs train in float32, so their rewards move with "
                      "the machine (docs/findings/reproducibility.md): compare the intervals, not the digits.", ""]
    if regime:
        lines += regime_section(regime, title="## Regime (SPEC §6b calibration table)")
        if rows:
            lines += stress_verdict(rows, regime)
    if rows is not None:
        lines += sweep_section(rows, sweep_figs or {}, root)
    if audit is not None:
        lines += audit_section(audit, audit_figs or {}, root)
    if stress_audit is not None:
        lines += audit_section(stress_audit, stress_figs or {}, root,
                               title="## Direction audit in a stress setting (outside SPEC §6b's band)")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
