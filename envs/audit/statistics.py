"""The audit's statistics over seeds (SPEC §6): per pair and rule the pooled rates, the paired
comparison and its gated verdict, the trajectory points, the flip causes, the paper side by side
and the pooled regime table. Every formula is ``pdm_lab.audit.measure``'s."""
from __future__ import annotations

from dataclasses import replace

import torch

from pdm_lab.audit.intervals import compare_paired, pooled_diff_ci
from pdm_lab.audit.measure import (MEASURED_DIVERGENCES, PAPER_FIGURES, data_sufficiency, flip_summary, gated_verdict,
                                   predicted_divergence, rate_summary, seeds_for_power)
from pdm_lab.masks import get_mask_rule

from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.seed import regime_of


def summarize_pairs(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> list[dict]:
    """Per pair: each rule's rates against both divergences (and the one it predicts), and the
    paired comparison (A − B) of unsafe-keep and shrink, each rule on its predicted divergence."""
    out = []
    for a, b in cfg.pairs:
        key = f"{a}|{b}"
        entries = [s["contexts"][contexts]["pairs"][key] for s in per_seed]
        dis = [e["disagreement"] for e in entries]
        pair = {"a": a, "b": b, "disagreement_per_seed": dis,
                "disagreement_mean": sum(dis) / max(1, len(dis))}
        for rule in (a, b):
            scored = predicted_divergence(get_mask_rule(rule))
            tables = {name: rate_summary([e[rule][name] for e in entries]) for name in MEASURED_DIVERGENCES}
            pair[rule] = {**tables[scored], "scored_against": scored, **tables}
        pair["unsafe_keep_diff"] = compare_paired(pair[a]["unsafe_keep_per_seed"], pair[b]["unsafe_keep_per_seed"],
                                                  n_boot=cfg.n_boot)
        pair["shrink_diff"] = compare_paired(pair[a]["shrink_per_seed"], pair[b]["shrink_per_seed"], n_boot=cfg.n_boot)
        scored = {rule: predicted_divergence(get_mask_rule(rule)) for rule in (a, b)}
        pair["pooled_unsafe_keep_diff"] = pooled_diff_ci([e[a][scored[a]] for e in entries],
                                                         [e[b][scored[b]] for e in entries], n_boot=cfg.n_boot)
        pair["unsafe_keep_diff_by_divergence"] = {
            name: compare_paired(pair[a][name]["unsafe_keep_per_seed"], pair[b][name]["unsafe_keep_per_seed"],
                                 n_boot=cfg.n_boot) for name in MEASURED_DIVERGENCES}
        pair["audit_step"] = per_seed[0].get("step", cfg.main_step) if per_seed else cfg.main_step
        pair["data"] = data_sufficiency(pair[a]["count_per_seed"], pair[b]["count_per_seed"])
        pair["verdict"] = gated_verdict(pair["unsafe_keep_diff"], a, b, pair["data"])
        pair["pooled_verdict"] = gated_verdict(pair["pooled_unsafe_keep_diff"], a, b, pair["data"])
        pair["power"] = seeds_for_power([x - y for x, y in zip(pair[a]["unsafe_keep_per_seed"],
                                                                pair[b]["unsafe_keep_per_seed"])])
        out.append(pair)
    return out


def per_rule(pairs: list[dict]) -> dict:
    """Rule → its scored divergence and pooled unsafe-keep / shrink / flat under ``topk_kl`` and
    ``full_kl`` (the reference rule's figures from its pair with the main B rule)."""
    out = {}
    for pair in pairs:
        for rule in (pair["a"], pair["b"]):
            if rule in out:
                continue
            s = pair[rule]
            out[rule] = {"scored_against": s["scored_against"], "paired_with": pair["b"] if rule == pair["a"] else pair["a"],
                         **{name: {key: s[name][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "flat_pooled",
                                                                 "unsafe_keep_mean", "shrink_mean",
                                                                 "kept_disagreement_tokens")}
                            for name in MEASURED_DIVERGENCES}}
    return out


def main_pair_summary(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> dict:
    main_cfg = replace(cfg, extra_rules=())
    (pair,) = summarize_pairs(main_cfg, per_seed, contexts)
    return pair


def trajectory_points(cfg: AuditConfig, earlier: dict[int, list[dict]], main: dict) -> list[dict]:
    """The main pair at every audit point: the earlier points over the seeds audited there
    (`earlier`: step → per-seed records), the main point from the main study."""
    points = [_point(cfg, per_seed, main_pair_summary(cfg, per_seed, cfg.contexts[0]))
              for step, per_seed in earlier.items() if per_seed]
    return points + [_point(cfg, main["per_seed"], main["pair"])]


def _point(cfg: AuditConfig, per_seed: list[dict], pair: dict) -> dict:
    a, b = pair["a"], pair["b"]
    return {"step": pair["audit_step"], "seeds": len(per_seed),
            "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
            "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
            "disagreement_mean": pair["disagreement_mean"], "verdict": pair["verdict"], "data": pair["data"],
            "unsafe_keep_diff": pair["unsafe_keep_diff"], "pooled_unsafe_keep_diff": pair["pooled_unsafe_keep_diff"],
            **{rule: {key: pair[rule][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "unsafe_keep_mean",
                                                       "shrink_mean", "kept_disagreement_tokens")}
               for rule in (a, b)}}


def flip_decomposition(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> dict:
    """Per rule of the main pair: the cause split of its grown kept disagreement tokens (pooled
    over seeds) and its interference-only rate (dropped outside tokens that grew anyway)."""
    from pdm_lab.audit.measure import pool

    out = {}
    for rule in cfg.all_rules:
        blocks = [s["contexts"][contexts] for s in per_seed]
        terms = [t for blk in blocks for t in blk.get("flips", {}).get(rule, [])]
        entry = {"interference_only": pool(blk["interference"][rule] for blk in blocks if rule in blk.get("interference", {}))}
        if rule in cfg.rules:
            entry["causes"] = flip_summary(terms)
            entry["first_order_check"] = _first_order_check(terms)
        out[rule] = entry
    return out


def _first_order_check(terms: list[dict]) -> dict:
    """How well the cause terms add up to the first-order total (max relative gap)."""
    gaps = [abs(sum(t[c] for c in ("own", "context", "state", "rest")) - t["total"]) / max(abs(t["total"]), 1e-300)
            for t in terms]
    return {"tokens": len(terms), "max_relative_gap": max(gaps) if gaps else float("nan")}


def paper_side_by_side(pair: dict) -> dict:
    """The main pair next to the paper's figures (SPEC §6): per-seed mean unsafe-keep and shrink
    of each rule, seeds where B is lower, the paired CI and the sign test."""
    a, b = pair["a"], pair["b"]
    d, sh = pair["unsafe_keep_diff"], pair["shrink_diff"]
    return {"paper": PAPER_FIGURES, "a": a, "b": b,
            "unsafe_keep_mean": {a: pair[a]["unsafe_keep_mean"], b: pair[b]["unsafe_keep_mean"]},
            "shrink_mean": {a: pair[a]["shrink_mean"], b: pair[b]["shrink_mean"]},
            "unsafe_keep_pooled": {a: pair[a]["unsafe_keep_pooled"], b: pair[b]["unsafe_keep_pooled"]},
            "shrink_pooled": {a: pair[a]["shrink_pooled"], b: pair[b]["shrink_pooled"]},
            "b_lower_seeds": d["b_lower_seeds"], "a_lower_seeds": d["a_lower_seeds"], "ties": d["ties"],
            "seeds_used": d["seeds_used"], "unsafe_keep_diff": d, "shrink_diff": sh,
            "verdict": pair["verdict"], "power": pair["power"]}


def mean_coupling(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))] if rows else []
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}


def pooled_regime(pooled: list[tuple]) -> dict | None:
    """The calibration table over every seed's tokens (tokens per state: the mean over seeds)."""
    if not pooled:
        return None
    cat = [torch.cat([p[i] for p in pooled]) for i in range(5)]
    return regime_of((*cat, sum(p[5] for p in pooled) / len(pooled)))

