"""What moved the divergence in an audited run (SPEC §6d), pooled over its audited steps and seeds.

From the audit lines the loop (``audit.jsonl``) or TRL writes with ``audit.probe_tokens > 0``:

* the own-update probe: per rule, how often its predicted direction has the sign of the token's
  own first-order ΔD under the model's kernel K (and under AdamW's J P Jᵀ), over outside and over
  disagreement tokens (Wilson 95%); the kernel-aware test a·I + b·W Wᵀ and its paired difference
  to each rule; cos(K v, v) and the output layer's share of ‖K v‖²;
* the step decomposition per rule: own / rest of the batch / optimiser memory / remainder shares
  of |ΔD| and the median |ΔD|/D;
* the step-size audit: each rule's unsafe-keep and the two controls at each multiple of the
  run's step, against that step's median |ΔD|/D (``mechanism_step_sizes.png``);
* each audited pair (the reference rule, another): the other rule's sign agreement minus the
  reference's on the probed disagreement tokens (paired), and its unsafe-keep minus the
  reference's at each step size (Newcombe: their kept tokens differ); the fitted b/a of the
  kernel-aware test over the audited steps.

``pdm-lab mechanism RUN_DIR... --out DIR`` writes ``mechanism.json``, ``mechanism.md`` and the figure.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from pdm_lab.lab.machine import machine_info, machine_line
from pdm_lab.audit.intervals import paired_rate_diff_ci, rate_diff_ci, wilson_ci
from pdm_lab.audit.probe import pool_decomposition, pool_probe

from pdm_lab.envs.transfer.step_matched import pooled_step_scales

DIVERGENCE = "topk_kl"


def _no_data(d: dict | None) -> dict | None:
    return None if d is None else {k: v for k, v in d.items() if not k.endswith("/data")}


def _flat(x) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def _b_over_a(fit: dict | None) -> dict | None:
    """The kernel-aware test's fitted b/a over the pooled probes (one per audited step and rank)."""
    if not fit:
        return None
    ratios = sorted(b / a for a, b in zip(_flat(fit["a"]), _flat(fit["b"]))
                    if a is not None and b is not None and a != 0 and math.isfinite(b / a))
    if not ratios:
        return None
    q = lambda f: ratios[0] if len(ratios) == 1 else statistics.quantiles(ratios, n=4, method="inclusive")[f]  # noqa: E731
    return {"n": len(ratios), "min": ratios[0], "q1": q(0), "median": statistics.median(ratios), "q3": q(2),
            "max": ratios[-1], "values": ratios}


def rule_pairs(rules: list[str], probe: dict | None, scales: dict) -> dict:
    """``"A|B"`` (A the reference, ``rules[0]``) → B − A: the sign agreement with the token's own
    first-order ΔD under K on the probed disagreement tokens (paired: the same tokens), and
    unsafe-keep at each step size (Newcombe: each rule's own kept disagreement tokens)."""
    data = (probe or {}).get("probe/data")
    out = {}
    for b in rules[1:]:
        a = rules[0]
        entry: dict = {"sign_agreement_diff": None, "unsafe_keep_diff": {}}
        if data and a in data["outward"] and b in data["outward"] and DIVERGENCE in data["grows"]:
            dis = [bool(x) for x in data["disagreement"]]
            truth = data["grows"][DIVERGENCE]
            right = {r: [bool(p) == bool(t) for p, t, s in zip(data["outward"][r], truth, dis) if s] for r in (a, b)}
            entry["sign_agreement_diff"] = paired_rate_diff_ci(right[b], right[a])
        for key, row in scales.items():
            entry["unsafe_keep_diff"][key] = rate_diff_ci(row[b]["grew"], row[b]["n"], row[a]["grew"], row[a]["n"])
        out[f"{a}|{b}"] = entry
    return out


def pooled_mini_batches(lines: list[dict]) -> dict:
    """The mini-batch(es) the pooled lines were audited at (SPEC §6b/§6c; a line without
    ``mini_batch`` is j = 0 of M = 1), or a ``ConfigError`` naming ``mini_batch`` when they come
    from different j — unless every line is from an ``audit.mini_batch: all`` run, whose pool over
    j = 0 … M − 1 is §6b's regime (then ``pooled_over_all`` says so)."""
    from pdm_lab.config import ConfigError

    from pdm_lab.envs.transfer.compare import mini_batch_provenance

    prov = mini_batch_provenance(lines)
    if len(prov["mini_batch"]) > 1 and not prov["all"]:
        raise ConfigError(f"mini_batch: the audit lines come from mini-batches {prov['mini_batch']} "
                          f"({prov['lines_per_mini_batch']} lines) of M = {prov['mini_batches']}, not from audit.mini_batch: "
                          "all runs; pool lines audited at one j (or runs with audit.mini_batch: all)")
    return {**prov, "pooled_over_all": len(prov["mini_batch"]) > 1}


def mechanism_doc(lines: list[dict], run_names: list[str]) -> dict:
    """The pooled statistics of the module docstring (``probe`` None: no line carries a probe);
    ``mini_batches``: the mini-batch(es) they came from (``pooled_mini_batches``)."""
    mini_batches = pooled_mini_batches(lines)
    rules = list(lines[0]["rules"])
    probes = [ln["probe"] for ln in lines if (ln.get("probe") or {}).get("probe/tokens")]
    decomposition = {}
    for rule in rules:
        parts = [ln["decomposition"][rule] for ln in lines
                 if ((ln.get("decomposition") or {}).get(rule) or {}).get("decomp/tokens")]
        decomposition[rule] = _no_data(pool_decomposition(parts)) if parts else None
    probe = pool_probe(probes) if probes else None
    scales = pooled_step_scales([ln.get("step_scales") for ln in lines], rules)
    return {"runs": run_names, "machine": machine_info(), "rules": rules, "delta": lines[0]["delta"], "k": lines[0]["k"],
            "audited_steps": len(lines), "mini_batches": mini_batches,
            "outside_tokens": sum(int(ln.get("outside") or 0) for ln in lines),
            "probe": _no_data(probe), "decomposition": decomposition, "step_scales": scales,
            "pairs": rule_pairs(rules, probe, scales),
            "kernel_b_over_a": _b_over_a((probe or {}).get("probe/kernel_fit")),
            "disagreement_share": disagreement_share(lines, scales),
            "decisions": outside_decisions(lines, rules),
            "per_seed": per_seed_rows(lines, rules)}


def outside_decisions(lines: list[dict], rules: list[str]) -> dict | None:
    """How the rules decide the outside tokens, from the records' per-token rows (``outside_tokens``):
    for Â > 0 and Â < 0, the tokens every rule keeps, every rule drops, and those the rules decide
    differently. None where no line carries per-token rows (records written before they existed).

    Why: where the outside set comes from staleness, an outside token is mostly one that the
    earlier mini-batches pushed along its own advantage — r − 1 and Ḋ then share Â's sign and
    both tests drop it — so the disagreement tokens a verdict needs are a small share."""
    per_rank = [rows for ln in lines for rows in (ln.get("outside_tokens") or [])]
    if not per_rank:
        return None
    counts = {side: {"kept_by_all": 0, "dropped_by_all": 0, "differ": 0} for side in ("positive", "negative")}
    for rows in per_rank:
        for i, adv in enumerate(rows["advantage"]):
            keeps = [bool(rows["keep"][r][i]) for r in rules]
            what = "kept_by_all" if all(keeps) else "dropped_by_all" if not any(keeps) else "differ"
            counts["positive" if adv > 0 else "negative"][what] += 1
    total = sum(sum(c.values()) for c in counts.values())
    return {"tokens": total, **counts}


def disagreement_share(lines: list[dict], scales: dict) -> dict:
    """How often the compared rules decide an outside token differently at the run's step: the
    disagreement tokens over the outside tokens, Wilson 95%. Where it is 0 the rules are one mask
    on these tokens, and no unsafe-keep difference can exist however many steps are audited."""
    outside = sum(int(ln.get("outside") or 0) for ln in lines)
    disagreement = int((scales.get("1") or {}).get("disagreement") or 0)
    lo, hi = wilson_ci(disagreement, outside)
    return {"disagreement": disagreement, "outside": outside, "share": disagreement / outside if outside else math.nan,
            "lo": lo, "hi": hi}


def step_records(doc: dict) -> dict:
    """The pooled step sizes in ``step_scale_record``'s keys (for ``envs.report.step_sizes``)."""
    out = {}
    for key, row in doc["step_scales"].items():
        rec = {"steps/lr_scale": row["lr_scale"], "steps/median_abs_dd_over_d": {"value": row["median_abs_dd_over_d"]}}
        for name in [*doc["rules"], "kept_by_all", "momentum_only"]:
            r = row[name]
            prefix = "steps/unsafe_keep/" if name in doc["rules"] else "steps/control/"
            rec[prefix + name] = {"unsafe_keep": r["rate"], "lo": r["lo"], "hi": r["hi"], "count": r["n"]}
        out[key] = rec
    return out


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _rate(e: dict | None) -> str:
    return "–" if not e else f"{_pct(e['rate'])} [{_pct(e['lo'])}, {_pct(e['hi'])}] (n {e['n']})"


def mechanism_markdown(doc: dict) -> str:
    rules, p = doc["rules"], doc["probe"]
    out = [f"# What moved the divergence: {', '.join(doc['runs'])}", "",
           f"δ = {doc['delta']}, K = {doc['k']}; {doc['audited_steps']} audited steps, {doc['outside_tokens']} "
           f"outside tokens. ΔD of the top-K KL; intervals 95% (Wilson for rates, paired Wald for "
           "differences, bootstrap for shares, order statistics for medians).", "",
           f"Pooled on {machine_line(doc.get('machine'))} (the runs' own machine is in their run folders).", ""]
    share = doc.get("disagreement_share")
    if share and share["outside"]:
        out += [f"The rules decide differently on {share['disagreement']} of {share['outside']} outside tokens: "
                f"{_pct(share['share'])} [{_pct(share['lo'])}, {_pct(share['hi'])}] (Wilson 95%).", ""]
    out += decisions_markdown(doc)
    mb = doc.get("mini_batches")
    if mb:
        js = ", ".join(str(j) for j in mb["mini_batch"])
        out += [(f"Audited mini-batches j = {js} of M = {mb['mini_batches'][0]}, pooled (audit.mini_batch: all runs: "
                 "SPEC §6b's regime, the pool over j)." if mb["pooled_over_all"] else
                 f"Audited mini-batch j = {js} of M = {', '.join(str(m) for m in mb['mini_batches'])} (SPEC §6c)."), ""]
    if p is None:
        out += ["No probe keys: the run was audited with `audit.probe_tokens: 0` (or before the probe existed).", ""]
    else:
        out += [f"## The own-update probe ({p['probe/tokens']} probed outside tokens, "
                f"{p['probe/disagreement_tokens']} where the rules disagree)", "",
                "Share of tokens on which the rule's predicted direction has the sign of the token's own "
                "first-order ΔD (under K = J Jᵀ; and under AdamW's J P Jᵀ).", "",
                "| test | disagreement, K | disagreement, J P Jᵀ | outside, K |", "| --- | --- | --- | --- |"]
        for name, prefix in [*((r, f"probe/agree/{r}") for r in rules), ("kernel-aware a·I + b·W Wᵀ", "probe/kernel_test")]:
            pre = prefix.replace("probe/agree/", "probe/agree_precond/").replace("probe/kernel_test", "probe/kernel_test_precond")
            out.append(f"| {name} | {_rate(p.get(f'{prefix}/disagreement/{DIVERGENCE}'))} | "
                       f"{_rate(p.get(f'{pre}/disagreement/{DIVERGENCE}'))} | {_rate(p.get(f'{prefix}/outside/{DIVERGENCE}'))} |")
        out.append("")
        for r in rules:
            d = p.get(f"probe/kernel_vs/{r}/disagreement/{DIVERGENCE}")
            if d:
                out.append(f"- kernel-aware test − `{r}` on disagreement tokens: {_pct(d['diff'])} "
                           f"[{_pct(d['lo'])}, {_pct(d['hi'])}] (paired, n {d['n']})")
        for pair, e in doc.get("pairs", {}).items():
            d = e["sign_agreement_diff"]
            if d:
                a, b = pair.split("|")
                out.append(f"- `{b}` − `{a}` on disagreement tokens: {_pct(d['diff'])} "
                           f"[{_pct(d['lo'])}, {_pct(d['hi'])}] (paired, n {d['n']})")
        ba = doc.get("kernel_b_over_a")
        if ba:
            out.append(f"- the kernel-aware test's fitted b/a over {ba['n']} probes (audited steps × ranks): median "
                       f"{ba['median']:.3g}, quartiles {ba['q1']:.3g} and {ba['q3']:.3g}, range {ba['min']:.3g} to {ba['max']:.3g}")
        for key, label in (("probe/cos_kv_v", "cos(K v, v)"), ("probe/head_share", "output layer's share of ‖K v‖²")):
            e = p.get(key)
            if e:
                out.append(f"- {label}: median {e['median']:.3g} [{e['lo']:.3g}, {e['hi']:.3g}] (n {e['n']})")
        out.append("")
    out += ["## The step decomposition (probed outside tokens each rule kept)", "",
            "| rule | tokens | own | rest of batch | optimiser memory | remainder | median \\|ΔD\\|/D |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rules:
        d = doc["decomposition"].get(r)
        if not d:
            out.append(f"| {r} | 0 | – | – | – | – | – |")
            continue
        share = lambda part: "{:.3f} [{:.3f}, {:.3f}]".format(*(d[f"decomp/share/{part}"][k] for k in ("mean", "lo", "hi")))  # noqa: E731
        m = d["decomp/median_abs_dd_over_d"]
        out.append(f"| {r} | {d['decomp/tokens']} | {share('own')} | {share('rest')} | {share('memory')} | "
                   f"{share('remainder')} | {m['value']:.3g} [{m['lo']:.3g}, {m['hi']:.3g}] |")
    out += ["", "## Unsafe-keep across step sizes (disagreement tokens each rule kept; the controls over outside tokens)", "",
            "| × the run's step | median \\|ΔD\\|/D | " + " | ".join(rules) + " | kept by all | momentum only |",
            "| --- | --- | " + " | ".join("---" for _ in rules) + " | --- | --- |"]
    for row in sorted(doc["step_scales"].values(), key=lambda r: -r["lr_scale"]):
        cells = [_rate({"rate": row[n]["rate"], "lo": row[n]["lo"], "hi": row[n]["hi"], "n": row[n]["n"]})
                 for n in [*rules, "kept_by_all", "momentum_only"]]
        out.append(f"| {row['lr_scale']:g} | {row['median_abs_dd_over_d']:.3g} | " + " | ".join(cells) + " |")
    for pair, e in doc.get("pairs", {}).items():
        a, b = pair.split("|")
        out += ["", f"`{b}` − `{a}` (Newcombe 95%): " + "; ".join(
            f"×{doc['step_scales'][k]['lr_scale']:g} {_pct(d['diff'])} [{_pct(d['lo'])}, {_pct(d['hi'])}]"
            for k, d in sorted(e["unsafe_keep_diff"].items(), key=lambda kv: -doc["step_scales"][kv[0]]["lr_scale"]))]
    out += selection_markdown(doc)
    out += per_seed_markdown(doc)
    out += ["", "A direction test can matter only where the median |ΔD|/D is well below 1 (first order); above "
            "it the step overshoots whatever the mask. The median |ΔD|/D of several steps is the median of "
            "their medians.", ""]
    return "\n".join(out)


def decisions_markdown(doc: dict) -> list[str]:
    dec = doc.get("decisions")
    if not dec or not dec["tokens"]:
        return []
    out = ["| outside tokens | kept by every rule | dropped by every rule | rules differ |", "| --- | ---: | ---: | ---: |"]
    for side, label in (("positive", "Â > 0"), ("negative", "Â < 0")):
        c = dec[side]
        n = sum(c.values())
        out.append(f"| {label} ({n}) | " + " | ".join(
            f"{c[k]} ({_pct(c[k] / n) if n else 'n/a'})" for k in ("kept_by_all", "dropped_by_all", "differ")) + " |")
    return out + [""]


def selection_markdown(doc: dict) -> list[str]:
    """SPEC §6d's selection controls at each step size: each rule's kept disagreement tokens under
    its own step (its unsafe-keep), under the reference rule's step and under the momentum-only step."""
    rules = doc["rules"]
    rows = [r for r in sorted(doc["step_scales"].values(), key=lambda r: -r["lr_scale"]) if r.get("selection")]
    if not rows:
        return []
    out = ["", f"## Which tokens, or what the mask does? (SPEC §6d's selection controls; reference `{rules[0]}`)", "",
           "Each rule's kept disagreement tokens scored under three steps: its own (its unsafe-keep), the reference "
           "rule's (one common batch gradient) and the momentum-only step (Â = 0). If a rule's kept tokens grow "
           "less often under the common steps too, the gap comes from *which* tokens it keeps (selection); if they "
           "grow as often there as the other rule's, it comes from what its mask changes in the step.", "",
           "| × the run's step | rule | own step | reference rule's step | momentum only |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        for r in rules:
            own, sel = row[r], row["selection"][r]
            out.append(f"| {row['lr_scale']:g} | {r} | {_rate(own)} | {_rate(sel['reference_step'])} | "
                       f"{_rate(sel['momentum_only'])} |")
    return out


def per_seed_rows(lines: list[dict], rules: list[str]) -> list[dict]:
    """Per seed at the run's own step (scale 1): disagreement tokens and each rule's unsafe-keep
    (grew, n), from that seed's audit lines alone — the spread a pooled figure hides."""
    seeds = sorted({ln.get("seed", 0) for ln in lines})
    out = []
    for seed in seeds:
        own = [ln.get("step_scales") for ln in lines if ln.get("seed", 0) == seed]
        row = pooled_step_scales(own, rules).get("1")
        if row is None:
            continue
        out.append({"seed": seed, "audited_steps": len(own), "disagreement": row["disagreement"],
                    **{r: {"grew": row[r]["grew"], "n": row[r]["n"], "rate": row[r]["rate"]} for r in rules}})
    return out


def per_seed_markdown(doc: dict) -> list[str]:
    rows, rules = doc.get("per_seed") or [], doc["rules"]
    if len(rows) < 1:
        return []
    out = ["", f"## Per seed at the run's step ({len(rows)} seeds)", "",
           "| seed | audited mini-batches | disagreement | " + " | ".join(rules) + " |",
           "| --- | --- | --- | " + " | ".join("---" for _ in rules) + " |"]
    for row in rows:
        out.append(f"| {row['seed']} | {row['audited_steps']} | {row['disagreement']} | " + " | ".join(
            f"{_pct(row[r]['rate'])} ({row[r]['grew']}/{row[r]['n']})" for r in rules) + " |")
    diffs = [row[rules[1]]["rate"] - row[rules[0]]["rate"] for row in rows
             if len(rules) > 1 and row[rules[0]]["n"] and row[rules[1]]["n"]]
    if diffs:
        out += ["", f"`{rules[1]}` − `{rules[0]}` per seed: " + ", ".join(_pct(d) for d in diffs) +
                f" (range {_pct(min(diffs))} to {_pct(max(diffs))} over {len(diffs)} seeds with tokens on both sides)"]
    return out


def write_mechanism(run_dirs: list[Path], out: Path) -> dict:
    """Read the runs' audit lines (seeds of one setting), write ``mechanism.json`` and
    ``mechanism.md``, return the doc (the command draws the figure: ``envs.report`` sits above)."""
    import json

    from pdm_lab.audit.live import json_safe

    from pdm_lab.envs.transfer.compare import read_runs_lines

    lines = read_runs_lines([Path(r) for r in run_dirs])
    doc = mechanism_doc(lines, [Path(r).name for r in run_dirs])
    out.mkdir(parents=True, exist_ok=True)
    (out / "mechanism.json").write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "mechanism.md").write_text(mechanism_markdown(doc), encoding="utf-8")
    return doc
