"""``pdm-lab transfer RUN_DIR --out DIR``: does a toy's audit verdict hold in the real loop? (SPEC §6c)

Reads a scaling run's directory — ``audit.jsonl`` (the loop's audited steps) and
``mismatch_sample.jsonl`` (its per-token mismatch, read by ``calibrate --from-run``'s code) — and
never imports the scaling stage. Then:

1. the run's regime: the calibration table of its mismatch sample at the audit's δ; its outside
   fraction is the target;
2. the toy calibrated to it: the mismatch strength of the toy preset searched (``calibrate``'s
   bisection) until the toy's outside fraction matches the run's;
3. the toy audit there (``envs.audit.run_audit``) with the run's rules, δ and K;
4. side by side, each with a 95% CI: outside fraction and disagreement fraction (means over
   audit points / seeds), each rule's unsafe-keep and shrink on its kept disagreement tokens
   (pooled over points, seed-cluster bootstrap), and the rules' difference A − B (pooled, seed-
   cluster bootstrap; and per point, paired bootstrap with a sign test). Every rule is scored on
   the top-K KL on both sides: the loop cannot measure the full KL (the engine returns μ's top-K).

The verdict of a side ("which rule keeps fewer divergence-growing tokens, by how much") is drawn
only with SPEC §6's minimum — at least ``MIN_POINTS`` audit points (seeds) with kept
disagreement tokens for both rules and ``MIN_TOKENS`` pooled for each — else it is
"insufficient data". The comparison's outcome is SPEC §6c's (``faithful``): "unfaithful toy" when
the toy's mechanism statistics (SPEC §6d: per-rule sign agreement, cos(K v, v), optimiser-memory
share, median |ΔD|/D) lie outside the run's intervals, else "undecided", "transfers",
"consistent" or "does not transfer" from the two A − B intervals; a run without probe keys is
said to have none, and its outcome is at most "undecided".

One module of about 360 lines on purpose: the reading, the two sides' summaries, the outcome and
the markdown share one document's fields, and ``markdown`` prints exactly what ``run_transfer``
computed; split, each part would re-read the same keys.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdm_lab.audit.intervals import pooled_rate_ci, compare_paired, mean_ci, pooled_diff_ci
from pdm_lab.audit.measure import verdict
from pdm_lab.lab.records import read_jsonl
from pdm_lab.lab.results import ResultsError

from pdm_lab.envs.transfer.faithful import faithfulness, outcome, run_statistics, toy_statistics
from pdm_lab.envs.transfer.step_matched import step_matched, step_matched_lines

MIN_POINTS = 10
"""audit points (seeds) that gave kept disagreement tokens to both rules (SPEC §6)."""
MIN_TOKENS = 30
"""kept disagreement tokens pooled for each rule (SPEC §6)."""
DIVERGENCE = "topk_kl"
MIN_SAMPLE_OUTSIDE = 10
"""outside tokens the run's mismatch sample must hold to set the toy's target outside fraction."""


def _nan(x):
    return float("nan") if x is None else x


#: what every ``audit.jsonl`` line must hold (``pdm_lab.lab.records.read_jsonl`` checks it)
AUDIT_FIELDS = {"step": "int", "rules": "list", "delta": "number", "k": "int"}


def line_mini_batch(rec: dict) -> tuple[int, int]:
    """(j, M) of an audit line (SPEC §6c): the audited mini-batch and the step's mini-batches; a
    line without ``mini_batch`` (written before the loop audited a stated j) is j = 0 of M = 1."""
    j = rec.get("mini_batch")
    return (0, 1) if j is None else (int(j), int(rec.get("mini_batches") or 1))


def mini_batch_provenance(lines: list[dict]) -> dict:
    """Which mini-batches the lines were audited at: ``mini_batch`` (the sorted j's),
    ``mini_batches`` (the sorted M's), ``lines_per_mini_batch`` and ``all`` — True when they come
    from ``audit.mini_batch: all`` runs (M > 1 and every audited step, per seed, holds one line for
    each j = 0 … M − 1)."""
    per_step: dict[tuple, set] = {}
    counts: dict[int, int] = {}
    ms = set()
    for rec in lines:
        j, m = line_mini_batch(rec)
        ms.add(m)
        counts[j] = counts.get(j, 0) + 1
        per_step.setdefault((rec.get("seed"), rec.get("step")), set()).add(j)
    full = len(ms) == 1 and min(ms) > 1 and all(js == set(range(min(ms))) for js in per_step.values())
    return {"mini_batch": sorted(counts), "mini_batches": sorted(ms), "all": bool(lines) and full,
            "lines_per_mini_batch": {str(j): counts[j] for j in sorted(counts)}}


def toy_mini_batch(doc: dict) -> tuple[int, int]:
    """(j, M) a toy ``audit.json`` was audited at; one written before the toy took ``mini_batches``
    is j = 0 of M = 1 (the whole fresh batch)."""
    if "mini_batch" in doc:
        return int(doc["mini_batch"]), int(doc.get("mini_batches", 1))
    return 0, 1


def read_audit_lines(run_dir: Path) -> list[dict]:
    """The run's audited steps (the last line of each step and audited mini-batch: a step redone
    after a resume is appended again; an ``audit.mini_batch: all`` run writes one line per j)."""
    path = Path(run_dir) / "audit.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no audit lines (train with audit.every=N)")
    by_step: dict[tuple[int, int], dict] = {}
    for _, rec in read_jsonl(path, fields=AUDIT_FIELDS):
        by_step[(rec["step"], line_mini_batch(rec)[0])] = rec
    if not by_step:
        raise ResultsError(f"{path}: empty")
    lines = [by_step[s] for s in sorted(by_step)]
    first = lines[0]
    for rec in lines[1:]:
        for key in ("rules", "delta", "k"):
            if rec[key] != first[key]:
                raise ResultsError(f"{path}: step {rec['step']} has {key}={rec[key]!r}, step {first['step']} "
                                 f"{first[key]!r}; audit one setting per run")
    return lines


def read_runs_lines(run_dirs: list[Path]) -> list[dict]:
    """The audit lines of several runs (seeds of one setting), or a ``ResultsError`` when they
    audited different rules, δ or K."""
    lines = [line for run in run_dirs for line in read_audit_lines(run)]
    for line in lines[1:]:
        for key in ("rules", "delta", "k"):
            if line[key] != lines[0][key]:
                raise ResultsError(f"run_dir: the runs audited different {key} ({line[key]!r} vs {lines[0][key]!r}); "
                                   "pool only seeds of one setting")
    return lines


def _entry(rates: dict | None) -> dict:
    """A ``delta_rates`` entry with null rates back to NaN (a missing table: nothing counted)."""
    if rates is None:
        return {"unsafe_keep": math.nan, "shrink": math.nan, "flat": math.nan, "count": 0, "grew": 0,
                "shrank": 0, "flat_count": 0}
    return {k: _nan(v) for k, v in rates.items()}


def loop_points(lines: list[dict], a: str, b: str) -> list[dict]:
    """Per audited step: outside and disagreement fractions and each rule's rates (pair A|B)."""
    out = []
    for rec in lines:
        pair = rec["pairs"][f"{a}|{b}"]
        considered = rec["tokens"] - rec["zero_advantage"]
        out.append({"point": rec["step"], "outside_fraction": rec["outside"] / considered if considered else math.nan,
                    "disagreement_fraction": pair["disagreement"] / rec["outside"] if rec["outside"] else math.nan,
                    "outside": rec["outside"], "disagreement": pair["disagreement"],
                    a: _entry(pair[a][DIVERGENCE]), b: _entry(pair[b][DIVERGENCE])})
    return out


def toy_points(doc: dict, a: str, b: str) -> list[dict]:
    """The same per-seed quantities from a toy ``audit.json`` document (its main study)."""
    ctx = doc.get("main_contexts", "shared")
    out = []
    for seed in doc["per_seed"]:
        pair = seed["contexts"][ctx]["pairs"][f"{a}|{b}"]
        outside = seed["outside"]
        out.append({"point": seed["seed"], "outside_fraction": seed["regime"]["outside_fraction"],
                    "disagreement_fraction": pair["disagreement"] / outside if outside else math.nan,
                    "outside": outside, "disagreement": pair["disagreement"],
                    a: _entry(pair[a][DIVERGENCE]), b: _entry(pair[b][DIVERGENCE])})
    return out


def sufficiency(points: list[dict], a: str, b: str) -> dict:
    """SPEC §6's minimum for a verdict: points with kept tokens for both rules, tokens per rule."""
    both = sum(1 for p in points if p[a]["count"] > 0 and p[b]["count"] > 0)
    tokens = {a: sum(p[a]["count"] for p in points), b: sum(p[b]["count"] for p in points)}
    ok = both >= MIN_POINTS and min(tokens.values()) >= MIN_TOKENS
    return {"points_with_both": both, "tokens": tokens, "sufficient": ok,
            "minimum": {"points_with_both": MIN_POINTS, "tokens_each": MIN_TOKENS}}


def side_summary(points: list[dict], a: str, b: str, *, n_boot: int = 2000) -> dict:
    """One side's column of the table (module docstring, step 4)."""
    def ci(values):
        m, lo, hi = mean_ci(values, n_boot=n_boot)
        return {"mean": m, "ci_low": lo, "ci_high": hi}

    out = {"points": len(points), "outside_fraction": ci([p["outside_fraction"] for p in points]),
           "disagreement_fraction": ci([p["disagreement_fraction"] for p in points]),
           "outside_tokens": sum(p["outside"] for p in points),
           "disagreement_tokens": sum(p["disagreement"] for p in points)}
    for rule in (a, b):
        entries = [p[rule] for p in points]
        out[rule] = {"unsafe_keep": pooled_rate_ci(entries, "grew", n_boot=n_boot),
                     "shrink": pooled_rate_ci(entries, "shrank", n_boot=n_boot)}
    out["diff_pooled"] = pooled_diff_ci([p[a] for p in points], [p[b] for p in points], n_boot=n_boot)
    out["diff_paired"] = compare_paired([p[a]["unsafe_keep"] for p in points], [p[b]["unsafe_keep"] for p in points],
                                        n_boot=n_boot)
    out["sufficiency"] = sufficiency(points, a, b)
    d = out["diff_pooled"]
    if not out["sufficiency"]["sufficient"]:
        out["verdict"] = "insufficient data"
    else:
        out["verdict"] = verdict(d, a, b)
    out["fewer_unsafe"] = (None if math.isnan(d["mean_diff"]) or d["mean_diff"] == 0
                           else (b if d["mean_diff"] > 0 else a))
    return out


def transfer_verdict(toy: dict, loop: dict, faithful: bool | None = True) -> dict:
    """SPEC §6c's outcome (``faithful.outcome``) of two sides' pooled A − B intervals: ``outcome``
    and ``reason``. ``faithful``: the toy's mechanism statistics inside the run's intervals (None:
    not measured, so never "transfers" or "consistent")."""
    return outcome(toy["diff_pooled"], loop["diff_pooled"], faithful,
                   data=(toy["sufficiency"]["sufficient"], loop["sufficiency"]["sufficient"]))


def faithfulness_lines(faith: dict) -> list[str]:
    """The mechanism statistics (SPEC §6d) toy vs run, and which match."""
    lines = ["Mechanism statistics (SPEC §6d; a toy is faithful when each lies inside the run's interval):", ""]
    if not faith["statistics"]:
        return lines + [f"Not compared: {faith['reason']}.", ""]
    lines += ["| statistic | toy | run (95% interval) | match |", "| --- | ---: | ---: | --- |"]
    for key, s in faith["statistics"].items():
        toy = "n/a" if s["toy"] is None else f"{s['toy']['value']:.3g}"
        run = s["run"]
        lines.append(f"| {key} | {toy} | {run['value']:.3g} [{run['lo']:.3g}, {run['hi']:.3g}] | "
                     f"{'yes' if s['match'] else 'no'} |")
    return lines + ["", f"Faithful: {faith['faithful']} ({faith['reason']}).", ""]


def _fmt_ci(x: dict, value: str = "mean", pct: bool = True) -> str:
    v = x[value]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    s = 100.0 if pct else 1.0
    unit = "%" if pct else ""
    return f"{s * v:.3g}{unit} [{s * x['ci_low']:.3g}, {s * x['ci_high']:.3g}]"


def markdown(doc: dict) -> str:
    a, b = doc["rules"][:2]
    toy, loop = doc["toy"], doc["loop"]
    rows = [("audit points (loop: audited steps; toy: seeds)", str(toy["points"]), str(loop["points"])),
            ("outside fraction (D > δ among Â ≠ 0)", _fmt_ci(toy["outside_fraction"]), _fmt_ci(loop["outside_fraction"])),
            (f"disagreement fraction of outside ({a} vs {b})", _fmt_ci(toy["disagreement_fraction"]),
             _fmt_ci(loop["disagreement_fraction"])),
            ("outside / disagreement tokens", f"{toy['outside_tokens']} / {toy['disagreement_tokens']}",
             f"{loop['outside_tokens']} / {loop['disagreement_tokens']}")]
    for rule in (a, b):
        for key in ("unsafe_keep", "shrink"):
            rows.append((f"{rule} {key.replace('_', '-')} (kept tokens)",
                         _fmt_ci(toy[rule][key], "rate") + f" ({toy[rule][key]['tokens']})",
                         _fmt_ci(loop[rule][key], "rate") + f" ({loop[rule][key]['tokens']})"))
    rows.append((f"unsafe-keep {a} − {b}, pooled (seed-cluster CI)", _fmt_ci(toy["diff_pooled"], "mean_diff"),
                 _fmt_ci(loop["diff_pooled"], "mean_diff")))
    rows.append((f"unsafe-keep {a} − {b}, per point (paired CI; sign test p)",
                 _fmt_ci(toy["diff_paired"], "mean_diff") + f"; p = {toy['diff_paired']['sign_test_p']:.3g}",
                 _fmt_ci(loop["diff_paired"], "mean_diff") + f"; p = {loop['diff_paired']['sign_test_p']:.3g}"))
    rows.append(("points with kept tokens for both / tokens each",
                 f"{toy['sufficiency']['points_with_both']} / {toy['sufficiency']['tokens'][a]}, {toy['sufficiency']['tokens'][b]}",
                 f"{loop['sufficiency']['points_with_both']} / {loop['sufficiency']['tokens'][a]}, {loop['sufficiency']['tokens'][b]}"))
    rows.append(("verdict", toy["verdict"], loop["verdict"]))
    lines = [f"# Transfer: toy audit vs the loop's own audit ({doc['run_dir_name']})", "",
             f"Rules A = `{a}`, B = `{b}`; δ = {doc['delta']}, K = {doc['k']}; ΔD of the top-K KL on both sides; "
             f"tolerance: loop {doc['loop_tolerance']}, toy {doc['toy_tolerance']}.",
             *([f"Audited mini-batch (SPEC §6b/§6c): loop j = {mb['run']} of M = {mb['run_mini_batches']}, "
                f"toy j = {mb['toy']} of M = {mb['toy_mini_batches']}."] if (mb := doc.get("mini_batch")) else []),
             (f"Toy: the given audit `{doc['toy_audit']}` at mismatch `{doc['toy_mismatch']}` (not calibrated; the "
              f"run's outside fraction is {100 * doc['target_outside_fraction']:.3g}%, from {doc['target_source']})."
              if doc.get("toy_audit") else
              f"Toy: preset `{doc['preset']}` at mismatch `{doc['toy_mismatch']}` (calibrated to the run's outside "
              f"fraction {100 * doc['target_outside_fraction']:.3g}%, from {doc['target_source']})."), "",
             f"| quantity | toy{'' if doc.get('toy_audit') else ' (calibrated)'} | loop |", "| --- | --- | --- |"]
    lines += [f"| {q} | {t} | {l} |" for q, t, l in rows]
    lines.append("")
    for name, reg in (("run (mismatch sample)", doc.get("run_regime")), ("toy (pooled seeds)", doc.get("toy_regime"))):
        if reg:
            q = reg["d_quantiles"]
            lines.append(f"Regime, {name}: D p50 {q['p50']:.3g}, p99 {q['p99']:.3g}, p99.9 {q['p999']:.3g}, "
                         f"max {q['max']:.3g}; tail ratio p99.9/p50 {reg['tail_ratio']:.3g}; outside "
                         f"{100 * _nan(reg['outside_fraction']):.3g}%.")
    lines += [""] + faithfulness_lines(doc["faithfulness"])
    lines += [f"**SPEC §6c outcome: {doc['transfer']}** ({doc['transfer_reason']}).",
              f"Minimum for a verdict (SPEC §6): {MIN_POINTS} points with kept disagreement tokens for both rules, "
              f"{MIN_TOKENS} tokens pooled for each.", ""]
    if "step_matched" in doc:
        lines += step_matched_lines(doc["step_matched"], a, b)
    return "\n".join(lines)


def _pooled_sample(run_dirs: list[Path], out: Path) -> Path:
    """One run's mismatch sample, or several runs' concatenated into ``out`` (seeds of one setting)."""
    if len(run_dirs) == 1:
        return run_dirs[0]
    pooled = out / "mismatch_sample.jsonl"
    with pooled.open("w", encoding="utf-8") as fh:
        for run in run_dirs:
            path = run / "mismatch_sample.jsonl"
            if not path.exists():
                raise FileNotFoundError(f"{path}: no per-token mismatch sample (the scaling loop writes it)")
            fh.write(path.read_text(encoding="utf-8"))
    return pooled


def _given_toy_audit(path: Path, rules: list[str], delta: float, k: int) -> dict:
    """A toy ``audit.json`` made for this run's setting (rules, δ, K), or a ``ResultsError`` naming
    what differs."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        cfg = doc["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ResultsError(f"--toy-audit {path}: not a toy audit.json ({err})") from None
    for key, want, got in (("rules", rules, list(cfg.get("rules", []))[:2]), ("delta", delta, cfg.get("delta")),
                           ("k", k, cfg.get("k"))):
        if got != want:
            raise ResultsError(f"--toy-audit {path}: its {key} is {got!r}, the run's {want!r} "
                               f"(run the toy with {key}=… as the run)")
    return doc


def select_mini_batch(lines: list[dict], mini_batch: int | None, toy_j: int | None = None) -> tuple[list[dict], int, int]:
    """The run's lines at one audited mini-batch j, with (j, M): like with like (SPEC §6b/§6c).

    ``mini_batch``: the j asked for; else the lines' one j; else, for lines from several j (an
    ``audit.mini_batch: all`` run), ``toy_j`` (the given toy's); else a ``ConfigError`` naming
    ``mini_batch``. Lines of runs trained over different M are refused (``mini_batches``)."""
    from pdm_lab.config import ConfigError

    prov = mini_batch_provenance(lines)
    if len(prov["mini_batches"]) > 1:
        raise ConfigError(f"mini_batches: the runs' audit lines come from steps split into {prov['mini_batches']} "
                          "mini-batches; pool only runs of one trainer.mini_batches")
    m = prov["mini_batches"][0]
    want = mini_batch if mini_batch is not None else (
        prov["mini_batch"][0] if len(prov["mini_batch"]) == 1 else toy_j)
    if want is None:
        raise ConfigError(f"mini_batch: the run's audit lines come from mini-batches {prov['mini_batch']} of {m} "
                          "(audit.mini_batch: all); the toy audits one j: choose one with mini_batch=j")
    chosen = [rec for rec in lines if line_mini_batch(rec)[0] == want]
    if not chosen:
        raise ConfigError(f"mini_batch: the run audited mini-batches {prov['mini_batch']} of {m}, not {want}")
    return chosen, want, m


def run_transfer(run_dir, out: Path, base, *, preset_name: str = "", seeds: int | None = None,
                 mismatch: str | None = None, overrides: list[str] = (), n_boot: int = 2000,
                 search_iters: int = 12, toy_audit: Path | None = None, log=print,
                 mini_batch: int | None = None) -> dict:
    """Steps 1–4 of the module docstring; writes ``transfer.json`` and ``transfer.md`` into ``out``.

    ``run_dir``: one run directory, or a list of them (seeds of one setting): their audited steps
    are pooled as audit points and their mismatch samples concatenated. ``base``: the toy's
    ``AuditConfig`` before the run's rules, δ and K are laid over it (``preset_name`` labels it).
    ``toy_audit``: an existing toy ``audit.json`` to compare instead of running one (its rules, δ
    and K must be the run's; no calibration): one toy against many runs.

    Like with like (SPEC §6b/§6c): the run's lines are those of one audited mini-batch j of M
    (``select_mini_batch``; a line without ``mini_batch`` is j = 0 of M = 1; ``mini_batch`` picks j
    from an ``audit.mini_batch: all`` run, whose j otherwise comes from the given toy). The toy
    run here is audited at the run's M and j; a given ``toy_audit`` audited at another j is
    refused (a ``ConfigError`` naming ``mini_batch``)."""
    from pdm_lab.config import ConfigError
    from pdm_lab.config import from_dict, to_dict
    from pdm_lab.lab.yaml_config import apply_overrides

    from pdm_lab.envs.audit.config import AuditConfig
    from pdm_lab.envs.audit.study import run_audit
    from pdm_lab.envs.transfer.calibrate import run_table, search_strength

    start = time.perf_counter()
    run_dirs = [Path(r) for r in (run_dir if isinstance(run_dir, (list, tuple)) else [run_dir])]
    lines = read_runs_lines(run_dirs)
    given_doc = None
    if toy_audit is not None:
        try:
            given_doc = json.loads(Path(toy_audit).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ResultsError(f"--toy-audit {toy_audit}: not a toy audit.json ({err})") from None
    toy_j = toy_mini_batch(given_doc)[0] if isinstance(given_doc, dict) else None
    lines, run_j, run_m = select_mini_batch(lines, mini_batch, toy_j)
    out.mkdir(parents=True, exist_ok=True)
    rules, delta, k = lines[0]["rules"], float(lines[0]["delta"]), int(lines[0]["k"])
    a, b = rules[0], rules[1]
    run_regime = run_table(_pooled_sample(run_dirs, out), delta)
    outside = sum(r["outside"] for r in lines)
    considered = sum(r["tokens"] - r["zero_advantage"] for r in lines)
    audited = outside / considered if considered else 0.0
    # the mismatch sample keeps one token in 64: with few outside tokens in it, the audited
    # steps' own count (every token of those batches) estimates the fraction better
    if run_regime["outside_tokens"] >= MIN_SAMPLE_OUTSIDE:
        target, target_source = run_regime["outside_fraction"], "mismatch_sample.jsonl"
    else:
        target, target_source = audited, "audit.jsonl (the sample holds too few outside tokens)"
    doc = apply_overrides(to_dict(base), list(overrides))
    # the run's rules, δ and K; the main study only (no K sweep, stress or trajectory study)
    changes = dict(rules=[a, b], extra_rules=[r for r in rules[2:]], delta=delta, k=k, contexts=["shared"],
                   k_sweep=[], stress_mismatch="", trajectory_seeds=0, n_boot=n_boot,
                   mini_batches=run_m, mini_batch=run_j)  # the run's audited mini-batch j of M
    doc.update({key: value for key, value in changes.items() if key in doc})
    if seeds is not None:
        doc["seeds"] = seeds
    cfg: AuditConfig = from_dict(AuditConfig, doc)
    if toy_audit is not None:
        toy_doc = _given_toy_audit(Path(toy_audit), [a, b], delta, k)
        toy_j, toy_m = toy_mini_batch(toy_doc)
        if toy_j != run_j:
            raise ConfigError(f"mini_batch: --toy-audit {Path(toy_audit).name} was audited at mini-batch {toy_j} of "
                              f"{toy_m}, the run's lines at mini-batch {run_j} of {run_m}; compare like with like "
                              f"(audit the toy with mini_batches={run_m} mini_batch={run_j})")
        cfg = from_dict(AuditConfig, toy_doc["config"])
        log(f"[transfer] the toy audit {Path(toy_audit).name}: {cfg.mismatch}, {cfg.seeds} seeds")
    elif mismatch is None:
        if target <= 0:
            log("[transfer] the run has no outside tokens at this δ: the toy keeps the preset's mismatch")
        else:
            mismatch, _ = search_strength(cfg, target, seeds=2, iters=search_iters,
                                          progress=lambda s, f: log(f"  {s}: outside {100 * f:.3f}%"))
    if toy_audit is None:
        if mismatch is not None:
            cfg = replace(cfg, mismatch=mismatch)
        log(f"[transfer] toy audit at {cfg.mismatch}, {cfg.seeds} seeds × {cfg.sequences} sequences")
        toy_doc = run_audit(cfg)
    toy = side_summary(toy_points(toy_doc, a, b), a, b, n_boot=n_boot)
    loop = side_summary(loop_points(lines, a, b), a, b, n_boot=n_boot)
    result = {"run_dir_name": ", ".join(r.name for r in run_dirs), "rules": list(rules), "delta": delta, "k": k,
              "preset": preset_name, "toy_audit": None if toy_audit is None else Path(toy_audit).name,
              "toy_mismatch": cfg.mismatch, "target_outside_fraction": target,
              "target_source": target_source, "audited_outside_fraction": audited,
              "run_regime": run_regime, "toy_regime": toy_doc.get("regime"),
              "loop_tolerance": lines[0].get("tolerance"), "toy_tolerance": cfg.tolerance,
              "toy_config": to_dict(cfg), "toy": toy, "loop": loop,
              "mini_batch": {"run": run_j, "run_mini_batches": run_m, "toy": toy_mini_batch(toy_doc)[0],
                             "toy_mini_batches": toy_mini_batch(toy_doc)[1]}}
    faith = faithfulness(toy_statistics(toy_doc, rules), run_statistics(lines, rules))
    verdict_doc = transfer_verdict(toy, loop, faith["faithful"])
    result.update({"faithfulness": faith, "transfer": verdict_doc["outcome"], "transfer_reason": verdict_doc["reason"],
                   "step_matched": step_matched(toy_doc, lines, rules), "wall_s": time.perf_counter() - start})
    from pdm_lab.audit.live import json_safe

    (out / "transfer.json").write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "transfer.md").write_text(markdown(result), encoding="utf-8")
    return result
