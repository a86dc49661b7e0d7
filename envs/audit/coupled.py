"""The aggregate measure of SPEC §3b next to the per-token audit of SPEC §6.

Built on the audit's own mechanics (``envs/audit/batch.py`` and ``step.py``: the batch, the float64 cast, the
``shared``/``distinct`` contexts, ``rule_steps`` with its token-sum loss, so ``lr`` = η is the
effective per-token step). Per seed, with O = {t : D_t > δ, Â_t ≠ 0} (the audit's focus rows):

* per rule, the realised ΔD_O = Σ_{t∈O} (D_t after − D_t before) of the full-batch step, for the
  top-K KL and the full KL, at each step size η·s (``step_scales``), next to its first-order
  prediction η s Σ_t M_t c_t (SGD; for Adam the first step is a sign step and only the realised
  value is reported), split into O's own tokens and the in-region tokens. ``pdm_coupled`` makes
  every term of O's part ≤ 0; the in-region tokens (kept by every rule, c of either sign) move
  D_O too, so the rule bounds ΔD_O to first order only where they do not push it up. The scales
  show where first order stops holding;
* per rule, the per-token unsafe-keep and shrink rates (with the audit's tolerance) over the
  out-of-region tokens where it disagrees with the reference rule (``rules[0]``), at scale 1.

Across seeds: per-seed values, the paired bootstrap CI of each rule's ΔD_O minus
``pdm_coupled``'s, an exact sign test, pooled unsafe-keep differences with a seed-cluster CI
(``pdm_lab.audit.measure``). Results are appended per seed to a JSONL file, so a killed study resumes.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdm_lab.audit import intervals, measure as stats_lib
from pdm_lab.config import to_dict

from pdm_lab.envs.audit.batch import audit_batch, audit_model, float64_tokens
from pdm_lab.envs.audit.config import PRECISION, AuditConfig
from pdm_lab.envs.audit.seed import tokens_per_state
from pdm_lab.envs.audit.step import measure, rule_steps
from pdm_lab.envs.train.coupled_jvp import toy_coupled_scores
from pdm_lab.masks import outside_region
from pdm_lab.envs.train.update import current_stats

COUPLED = "pdm_coupled"
DIVERGENCES = stats_lib.MEASURED_DIVERGENCES


@dataclass(frozen=True)
class CoupledAuditConfig:
    """The aggregate ΔD_O study: the audit's batch and step, several step sizes, four rules."""

    audit: AuditConfig = field(default_factory=AuditConfig)
    """problem, policy, seeds, batch, δ, K, mismatch, optimiser, η (``lr``), tolerance, contexts."""
    rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_topk", "pdm_uniform", COUPLED)
    """rules[0] is the reference of the per-token disagreement sets."""
    step_scales: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0)
    """step = audit.lr × scale (scale 1: the audit's step, where unsafe-keep is scored)."""

    def __post_init__(self) -> None:
        if COUPLED not in self.rules:
            raise ValueError(f"rules must include {COUPLED!r}, got {list(self.rules)}")
        if 1.0 not in self.step_scales:
            raise ValueError("step_scales must include 1.0 (the audit's step, where unsafe-keep is scored)")
        for rule in self.rules:
            self.audit.mask(rule)


def context_record(cfg: CoupledAuditConfig, policy, tokens, focus, ctx: str) -> dict:
    """ΔD_O per rule and scale, its first-order prediction, per-token rates, for one context."""
    a = cfg.audit
    model, tok, foc = audit_model(policy, tokens, ctx, focus)
    before = measure(model, tok.rows(foc))
    c = toy_coupled_scores(model, tok, a.mask(COUPLED)).c  # P = I: SGD, or a fresh Adam's first step
    outside = torch.zeros(tok.num_tokens, dtype=torch.bool)
    outside[foc] = True
    rec = {"outside": int(foc.numel()), "rules": {}}
    base: dict = {}
    cache: dict = {}  # rules with the same mask take the same step
    for rule in cfg.rules:
        steps = rule_steps(model, tok, a.mask(rule), a, foc, before, cfg.step_scales, cache)
        entry = rec["rules"].setdefault(rule, {name: {} for name in ("delta_d_outside", "delta_full_kl_outside",
                                                                     "predicted")})
        for scale, st in steps.items():
            lr = a.lr * scale
            key = f"{scale:g}"
            entry["delta_d_outside"][key] = float(st.delta["topk_kl"][foc].sum())
            entry["delta_full_kl_outside"][key] = float(st.delta["full_kl"][foc].sum())
            keep = st.keep.to(c.dtype)
            entry["predicted"][key] = (float(lr * (keep * c).sum()) if a.optimizer == "sgd" else math.nan)
            if scale == 1.0:
                base[rule] = st
                entry["predicted_from_outside"] = float(lr * (keep * c)[outside].sum())
                entry["predicted_from_inside"] = float(lr * (keep * c)[~outside].sum())
                entry["kept_outside"] = int((st.keep & outside).sum())
                entry["kept_outside_positive_c"] = int((st.keep & outside & (c > 0)).sum())
    ref = cfg.rules[0]
    for rule in cfg.rules[1:]:
        disagree = outside & (base[ref].keep != base[rule].keep)
        rec["rules"][rule]["vs_ref"] = {"disagreement": int(disagree.sum()), **{
            who: stats_lib.delta_rates(base[who].delta["topk_kl"], disagree & base[who].keep, a.tolerance)
            for who in (ref, rule)}}
    for rule in cfg.rules:  # every kept out-of-region token, unpaired
        rec["rules"][rule]["all_kept_outside"] = stats_lib.delta_rates(
            base[rule].delta["topk_kl"], outside & base[rule].keep, a.tolerance)
    return rec


def coupled_audit_seed(cfg: CoupledAuditConfig, seed: int) -> dict:
    """One seed: the audit's batch and O, then ``context_record`` for each of the audit's contexts."""
    a = cfg.audit
    _, policy, batch, adv = audit_batch(a, seed)
    ref_mask = a.mask(cfg.rules[0])
    tokens = float64_tokens(batch, adv, ref_mask)
    resp = tokens.response_mask.reshape(-1)
    considered = resp & (tokens.advantages.reshape(-1) != 0)
    with torch.no_grad():
        stats = current_stats(copy.deepcopy(policy).to(PRECISION), tokens, full=False)
    focus = torch.nonzero(outside_region(stats.topk_kl, tokens.advantages.reshape(-1), ref_mask) & considered)[:, 0]
    record = {"seed": seed, "tokens": int(resp.sum()), "active_tokens": int(considered.sum()),
              "outside": int(focus.numel()), "tokens_per_state": tokens_per_state(tokens, resp),
              "d_outside_before": float(stats.topk_kl[focus].sum()), "contexts": {}}
    for ctx in a.contexts:
        record["contexts"][ctx] = context_record(cfg, policy, tokens, focus, ctx)
    return record


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summarize(cfg: CoupledAuditConfig, per_seed: list[dict], ctx: str) -> dict:
    """Means over seeds, paired comparisons of ΔD_O against ``pdm_coupled`` (bootstrap CI, sign
    test) and of unsafe-keep against the reference rule (per-seed paired CI, pooled cluster CI)."""
    n_boot = cfg.audit.n_boot
    recs = [s["contexts"][ctx] for s in per_seed]
    out: dict = {"seeds": len(per_seed), "outside_mean": _mean([r["outside"] for r in recs]),
                 "outside_total": sum(r["outside"] for r in recs), "rules": {}, "delta_d_vs_coupled": {},
                 "unsafe_keep_vs_ref": {}}
    for rule in cfg.rules:
        rows = [r["rules"][rule] for r in recs]
        entry = {}
        for scale in cfg.step_scales:
            key = f"{scale:g}"
            real = [row["delta_d_outside"][key] for row in rows]
            pred = [row["predicted"][key] for row in rows]
            entry[key] = {"delta_d_outside_mean": _mean(real), "predicted_mean": _mean(pred),
                          "delta_full_kl_outside_mean": _mean([row["delta_full_kl_outside"][key] for row in rows]),
                          "realised_over_predicted": (_mean(real) / _mean(pred)) if _mean(pred) else math.nan,
                          "seeds_delta_d_positive": sum(x > 0 for x in real)}
        entry["predicted_from_outside_mean"] = _mean([row["predicted_from_outside"] for row in rows])
        entry["predicted_from_inside_mean"] = _mean([row["predicted_from_inside"] for row in rows])
        entry["all_kept_outside"] = stats_lib.pool([row["all_kept_outside"] for row in rows])
        out["rules"][rule] = entry
        if rule != COUPLED:
            out["delta_d_vs_coupled"][rule] = {
                f"{s:g}": intervals.compare_paired([r["rules"][rule]["delta_d_outside"][f"{s:g}"] for r in recs],
                                                   [r["rules"][COUPLED]["delta_d_outside"][f"{s:g}"] for r in recs],
                                                   n_boot=n_boot) for s in cfg.step_scales}
    ref = cfg.rules[0]
    for rule in cfg.rules[1:]:
        pairs = [r["rules"][rule]["vs_ref"] for r in recs]
        a_entries, b_entries = [p[ref] for p in pairs], [p[rule] for p in pairs]
        out["unsafe_keep_vs_ref"][rule] = {
            "disagreement_mean": _mean([p["disagreement"] for p in pairs]),
            ref: stats_lib.pool(a_entries), rule: stats_lib.pool(b_entries),
            "per_seed_diff": intervals.compare_paired([e["unsafe_keep"] for e in a_entries],
                                                      [e["unsafe_keep"] for e in b_entries], n_boot=n_boot),
            "pooled_diff": intervals.pooled_diff_ci(a_entries, b_entries, n_boot=n_boot)}
    return out


def _g(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _ci(d: dict) -> str:
    return f"{_g(d['mean_diff'])} [{_g(d['ci_low'])}, {_g(d['ci_high'])}]"


def report_markdown(doc: dict) -> str:
    """``report.md`` of the study: per contexts setting, the full-batch step per rule (realised
    ΔD_O, its first-order parts, unsafe-keep), ΔD_O against ``pdm_coupled`` paired over seeds, and
    where first order stops holding (realised over predicted per step size)."""
    cfg, step = doc["config"], doc["step"]
    a = cfg["audit"]
    rules, scales = cfg["rules"], [f"{s:g}" for s in cfg["step_scales"]]
    lines = ["# The coupled mask's aggregate measure (SPEC §3b)", "",
             f"Regime: {a['problem']['kind']}, {a['policy']} policy, mismatch `{a['mismatch']}`, "
             f"{a['seeds']} seeds × {a['sequences']} sequences, δ = {a['delta']}, K = {a['k']}; "
             f"precision {str(PRECISION).removeprefix('torch.')}, optimiser {a['optimizer']}, "
             f"per-token step η = {a['lr']:g} (× the scales {', '.join(scales)}); ΔD tolerance "
             f"{a['tolerance']:g}. O = out-of-region tokens (D > δ, Â ≠ 0) of the reference rule "
             f"`{rules[0]}`'s statistics; ΔD_O = Σ_{{t∈O}} ΔD_t (top-K KL) of one full-batch step. "
             "CIs: 95%, bootstrap over seeds (paired); p: exact two-sided sign test. "
             f"Wall time {doc.get('wall_s', math.nan) / 60:.1f} min.", ""]
    for ctx, summ in doc["summary"].items():
        lines += [f"## Contexts: {ctx} ({summ['seeds']} seeds, {summ['outside_total']} tokens in O, "
                  f"{_g(summ['outside_mean'])} per seed)", "",
                  "| rule | ΔD_O mean (η) | first-order: O's part | in-region part | seeds ΔD_O > 0 | "
                  "kept in O | unsafe-keep in O (grew / kept) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for rule in rules:
            e = summ["rules"][rule]
            kept = e["all_kept_outside"]
            lines.append(f"| `{rule}` | {_g(e['1']['delta_d_outside_mean'])} | {_g(e['predicted_from_outside_mean'])} | "
                         f"{_g(e['predicted_from_inside_mean'])} | {e['1']['seeds_delta_d_positive']}/{summ['seeds']} | "
                         f"{kept['count']} | {_g(kept['unsafe_keep'])} ({kept['grew']}/{kept['count']}) |")
        lines += ["", f"ΔD_O of each rule minus `{COUPLED}`'s (negative: the rule shrank D_O more), paired over seeds:", "",
                  "| rule | " + " | ".join(f"scale {s}: diff [CI], p" for s in scales) + " |",
                  "| --- |" + " --- |" * len(scales)]
        for rule, per_scale in summ["delta_d_vs_coupled"].items():
            lines.append(f"| `{rule}` | " + " | ".join(
                f"{_ci(per_scale[s])}, p = {_g(per_scale[s]['sign_test_p'])}" for s in scales) + " |")
        lines += ["", "Realised ΔD_O over its first-order prediction η·s·Σ_t M_t c_t (1: first order holds):", "",
                  "| rule | " + " | ".join(f"scale {s}" for s in scales) + " |", "| --- |" + " ---: |" * len(scales)]
        for rule in rules:
            e = summ["rules"][rule]
            lines.append(f"| `{rule}` | " + " | ".join(_g(e[s]["realised_over_predicted"]) for s in scales) + " |")
        lines += ["", f"Per-token unsafe-keep on the O tokens where a rule and `{rules[0]}` disagree (pooled):", "",
                  f"| rule | disagreements per seed | `{rules[0]}` | rule | pooled diff [CI] |", "| --- | ---: | ---: | ---: | ---: |"]
        for rule, e in summ["unsafe_keep_vs_ref"].items():
            lines.append(f"| `{rule}` | {_g(e['disagreement_mean'])} | {_g(e[rules[0]]['unsafe_keep'])} "
                         f"({e[rules[0]]['grew']}/{e[rules[0]]['count']}) | {_g(e[rule]['unsafe_keep'])} "
                         f"({e[rule]['grew']}/{e[rule]['count']}) | {_ci(e['pooled_diff'])} |")
        lines.append("")
    return "\n".join(lines)


def run_coupled_audit(cfg: CoupledAuditConfig, out: str | Path | None = None, *, progress=None) -> dict:
    """Every seed (resuming from ``out``/per_seed.jsonl), then the summary (``out``/coupled_audit.json)."""
    start = time.perf_counter()
    done: dict[int, dict] = {}
    path = None
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "per_seed.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    done[rec["seed"]] = rec
    a = cfg.audit
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        if seed in done:
            continue
        done[seed] = coupled_audit_seed(cfg, seed)
        if path is not None:
            with open(path, "a") as fh:
                fh.write(json.dumps(done[seed]) + "\n")
        if progress:
            progress(seed, done[seed])
    per_seed = [done[s] for s in range(a.first_seed, a.first_seed + a.seeds)]
    doc = {"config": to_dict(cfg), "step": a.step_doc(),
           "summary": {ctx: summarize(cfg, per_seed, ctx) for ctx in a.contexts},
           "per_seed": per_seed, "wall_s": time.perf_counter() - start}
    if out is not None:
        (out / "coupled_audit.json").write_text(json.dumps(doc, indent=1))
        (out / "report.md").write_text(report_markdown(doc))
    return doc
