"""Statistics of the direction audit (SPEC §6) and of the regime it runs in (SPEC §6b).

The stages run the updates; everything that scores them lives here, once: per-token ΔD
classified with a tolerance (grow / shrink / flat, with counts), pooling over seeds, the paired
bootstrap CI of a difference, the exact sign test, the paired comparison of two rules, the
bootstrap CI of a mean, which divergence a rule's direction test predicts, and the calibration
table of a mismatch regime. The paper reports point rates only; pdm_lab adds per-seed values,
counts, a paired bootstrap CI and a sign test.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_same
from pdm_lab.masks import MaskRule

#: The divergences whose change the audit measures (keys of audit.json's per-rule tables).
MEASURED_DIVERGENCES = ("topk_kl", "full_kl")

#: Quantiles of the calibration table (SPEC §6b), as key → probability.
D_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}


def predicted_divergence(rule: MaskRule) -> str:
    """The divergence whose first-order change a rule's direction test predicts (SPEC §6).

    Ḋ_exact is the derivative of the full KL, so ``pdm_exact`` is scored against ``full_kl``.
    Every other rule is scored against the top-K KL: ``pdm_topk``'s Ḋ is its exact derivative,
    ``pdm_agg``/``pdm_uniform`` estimate it with a guessed tail, the ratio test (``dppo_*``,
    ``ppo_clip``) is the first-order rule for the per-token |log r|, and ``none`` predicts nothing.
    Read from the record (``MaskRule.estimator``), never from the name.
    """
    return "full_kl" if rule.estimator == "exact" else "topk_kl"


@torch.no_grad()
def delta_rates(delta_d: Tensor, considered: Tensor, tol: float = 0.0) -> dict[str, float]:
    """Over the tokens in `considered` (disagreement tokens a rule kept): how often D grew.

    Args:
        delta_d: [N] ΔD = D_after − D_before per token (float64 for an audit).
        considered: [N] bool.
        tol: |ΔD| ≤ tol counts as flat (neither grow nor shrink), reported separately.

    Returns:
        ``unsafe_keep`` (fraction with ΔD > tol), ``shrink`` (ΔD < −tol), ``flat``, and the
        counts ``count``, ``grew``, ``shrank``, ``flat_count``; rates are NaN when nothing was
        considered (reported, never averaged in silently).
    """
    check_same(("delta_d", "considered"), delta_d, considered)
    if tol < 0:
        raise PDMInputError(f"tol: must be ≥ 0, got {tol}")
    sel = delta_d[considered.bool()]
    if not bool(torch.isfinite(sel).all()):
        raise PDMInputError("delta_d: non-finite ΔD among the considered tokens")
    count = int(sel.numel())
    grew, shrank = int((sel > tol).sum()), int((sel < -tol).sum())
    flat = count - grew - shrank
    if count == 0:
        nan = float("nan")
        return {"unsafe_keep": nan, "shrink": nan, "flat": nan, "count": 0, "grew": 0, "shrank": 0,
                "flat_count": 0}
    return {"unsafe_keep": grew / count, "shrink": shrank / count, "flat": flat / count,
            "count": count, "grew": grew, "shrank": shrank, "flat_count": flat}


def unsafe_keep_rates(delta_d: Tensor, considered: Tensor, tol: float = 0.0) -> dict[str, float]:
    """``delta_rates`` (kept name for the training loop's online rate)."""
    return delta_rates(delta_d, considered, tol)


def pool(entries: Iterable[dict]) -> dict[str, float]:
    """Rates pooled over seeds from their counts (each token weighs the same)."""
    entries = list(entries)
    count = sum(int(e["count"]) for e in entries)
    grew = sum(int(e["grew"]) for e in entries)
    shrank = sum(int(e["shrank"]) for e in entries)
    nan = float("nan")
    return {"unsafe_keep": grew / count if count else nan, "shrink": shrank / count if count else nan,
            "flat": (count - grew - shrank) / count if count else nan, "count": count, "grew": grew,
            "shrank": shrank}


def _finite_mean(values: list[float]) -> float:
    xs = [v for v in values if not math.isnan(v)]
    return sum(xs) / len(xs) if xs else float("nan")


def rate_summary(entries: list[dict]) -> dict:
    """Per-seed ``delta_rates`` entries → per-seed lists, the mean over seeds with a rate, pooled."""
    pooled = pool(entries)
    unsafe = [e["unsafe_keep"] for e in entries]
    shrink = [e["shrink"] for e in entries]
    return {"unsafe_keep_per_seed": unsafe, "shrink_per_seed": shrink,
            "flat_per_seed": [e["flat"] for e in entries],
            "count_per_seed": [e["count"] for e in entries],
            "unsafe_keep_mean": _finite_mean(unsafe), "shrink_mean": _finite_mean(shrink),
            "unsafe_keep_pooled": pooled["unsafe_keep"], "shrink_pooled": pooled["shrink"],
            "flat_pooled": pooled["flat"], "kept_disagreement_tokens": pooled["count"]}


def verdict(diff: dict, a: str, b: str) -> str:
    """One sentence on a paired A − B unsafe-keep comparison, as its CI supports."""
    if math.isnan(diff["mean_diff"]):
        return "no seed had kept disagreement tokens for both rules: no comparison."
    if diff["ci_low"] > 0:
        return f"{b} keeps fewer divergence-growing updates than {a} (95% CI of A − B excludes 0)."
    if diff["ci_high"] < 0:
        return f"{a} keeps fewer divergence-growing updates than {b} (95% CI of A − B excludes 0)."
    return "the difference is not significant at 95% (the CI of A − B contains 0)."


@torch.no_grad()
def regime_table(d: Tensor, outside: Tensor, considered: Tensor, *,
                 topk_mass: Tensor | None = None, entropy: Tensor | None = None,
                 tokens_per_state: float | None = None) -> dict:
    """The calibration table of a mismatch regime (SPEC §6b).

    Args:
        d: [N] per-token top-K KL D(μ‖π) over response tokens.
        outside: [N] bool, D > δ (δ_neg for Â < 0).
        considered: [N] bool, tokens with Â ≠ 0 (the only ones a rule can mask).
        topk_mass: [N] μ's mass on its top K (1 − μ_T with k's slot left out), if known.
        entropy: [N] μ's entropy in nats, if known.
        tokens_per_state: response tokens per distinct context, if known.

    Returns:
        ``d_quantiles`` {p50, p90, p99, p999, max}, ``outside_fraction`` (of Â ≠ 0 tokens),
        ``tail_ratio`` (p99.9/p50), ``topk_mass_quantiles``, ``entropy_quantiles``,
        ``tokens_per_state``, and the counts behind them.
    """
    check_same(("d", "outside"), d, outside)
    check_same(("d", "considered"), d, considered)
    x = d.double()
    if x.numel() == 0:
        raise PDMInputError("d: no tokens to calibrate on")
    probs = torch.tensor(list(D_QUANTILES.values()), dtype=torch.float64)
    q = torch.quantile(x, probs)
    quantiles = {key: float(v) for key, v in zip(D_QUANTILES, q)}
    quantiles["max"] = float(x.max())
    n_considered = int(considered.sum())
    n_out = int((outside & considered).sum())
    out = {"d_quantiles": quantiles,
           "outside_fraction": n_out / n_considered if n_considered else float("nan"),
           "tail_ratio": quantiles["p999"] / quantiles["p50"] if quantiles["p50"] > 0 else float("inf"),
           "tokens": int(x.numel()), "nonzero_advantage_tokens": n_considered,
           "zero_advantage_tokens": int(x.numel()) - n_considered, "outside_tokens": n_out,
           "tokens_per_state": tokens_per_state}
    mass_probs = torch.tensor([0.01, 0.05, 0.1, 0.5], dtype=torch.float64)
    if topk_mass is not None:
        m = topk_mass.double()
        out["topk_mass_quantiles"] = {f"p{int(p * 100):02d}": float(v)
                                      for p, v in zip(mass_probs, torch.quantile(m, mass_probs))}
        out["topk_mass_ge_099"] = float((m >= 0.99).double().mean())
    if entropy is not None:
        ent_probs = torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
        out["entropy_quantiles"] = {f"p{int(p * 100):02d}": float(v)
                                    for p, v in zip(ent_probs, torch.quantile(entropy.double(), ent_probs))}
    return out


#: A verdict (per seed or pooled) needs at least this many seeds whose batch gave kept
#: disagreement tokens to both rules, …
VERDICT_MIN_SEEDS = 10
#: … and at least this many kept disagreement tokens pooled for each rule (SPEC §6).
VERDICT_MIN_TOKENS = 30
INSUFFICIENT = "insufficient data"

#: The paper's figures (61 seeds, one fresh 1024-sequence batch each; SPEC §6), for the
#: side-by-side table: the ratio rule (``dppo_topk_kl``) and the predictive rule (``pdm_topk``).
PAPER_FIGURES = {"seeds": 61, "unsafe_keep": {"dppo_topk_kl": 0.369, "pdm_topk": 0.342},
                 "shrink": {"dppo_topk_kl": 0.629, "pdm_topk": 0.651}, "pdm_lower_seeds": 38,
                 "sign_test_p": 0.07, "outside_per_seed": 1435, "disagreement_per_seed": 82}
#: The paper's unsafe-keep difference (36.9% − 34.2%): the effect the power line sizes for.
PAPER_EFFECT = 0.027


def data_sufficiency(counts_a: list[int], counts_b: list[int], *, min_seeds: int = VERDICT_MIN_SEEDS,
                     min_tokens: int = VERDICT_MIN_TOKENS) -> dict:
    """Whether a verdict on rules A and B may be drawn from their per-seed kept disagreement
    token counts (paired by seed), and if not, why.

    Returns ``sufficient``, ``seeds_with_both`` (seeds with ≥ 1 kept token for each rule),
    ``tokens_a``, ``tokens_b`` (pooled) and ``reason`` (empty when sufficient).
    """
    if len(counts_a) != len(counts_b):
        raise PDMInputError(f"paired seed lists differ in length: {len(counts_a)} vs {len(counts_b)}")
    both = sum(1 for x, y in zip(counts_a, counts_b) if x > 0 and y > 0)
    ta, tb = sum(counts_a), sum(counts_b)
    reasons = []
    if both < min_seeds:
        reasons.append(f"{both} seed(s) gave kept disagreement tokens to both rules (a verdict needs {min_seeds})")
    if min(ta, tb) < min_tokens:
        reasons.append(f"{ta} and {tb} kept disagreement tokens pooled (a verdict needs {min_tokens} for each)")
    return {"sufficient": not reasons, "seeds_with_both": both, "tokens_a": ta, "tokens_b": tb,
            "min_seeds": min_seeds, "min_tokens": min_tokens, "reason": "; ".join(reasons)}


def gated_verdict(diff: dict, a: str, b: str, data: dict) -> str:
    """``verdict`` where ``data`` (``data_sufficiency``) allows one, else "insufficient data: why"."""
    if not data["sufficient"]:
        return f"{INSUFFICIENT}: {data['reason']}."
    return verdict(diff, a, b)


def seeds_for_power(diffs, *, effect: float = PAPER_EFFECT, power: float = 0.8, level: float = 0.95) -> dict:
    """Seeds a paired comparison needs to detect a mean difference of `effect` with `power` at a
    two-sided `level`, at the per-seed standard deviation measured in `diffs` (normal
    approximation: n = ((z_{1−α/2} + z_power)·sd / effect)²).

    Args:
        diffs: per-seed differences A − B (NaN pairs dropped).

    Returns:
        ``sd`` (per seed), ``seeds_used``, ``seeds_needed`` (NaN with fewer than 2 seeds),
        ``effect``, ``power``, ``level``.
    """
    if not effect > 0 or not 0 < power < 1 or not 0 < level < 1:
        raise PDMInputError(f"seeds_for_power: effect > 0 and power, level in (0, 1), got {effect}, {power}, {level}")
    x = torch.as_tensor([float(v) for v in diffs], dtype=torch.float64)
    x = x[torch.isfinite(x)]
    out = {"effect": effect, "power": power, "level": level, "seeds_used": int(x.numel())}
    if x.numel() < 2:
        return {**out, "sd": float("nan"), "seeds_needed": float("nan")}
    normal = torch.distributions.Normal(0.0, 1.0)
    z = float(normal.icdf(torch.tensor(1 - (1 - level) / 2)) + normal.icdf(torch.tensor(power)))
    sd = float(x.std(unbiased=True))
    return {**out, "sd": sd, "seeds_needed": math.ceil((z * sd / effect) ** 2)}


#: The causes a kept token's first-order ΔD splits into (``envs/audit/flips.py``).
FLIP_CAUSES = ("own", "context", "state", "rest")


def flip_summary(terms: list[dict]) -> dict:
    """Per-token first-order terms of grown kept tokens → which cause dominated, and medians.

    Args:
        terms: one dict per token with a float per ``FLIP_CAUSES`` key (first-order ΔD from that
            group of tokens' updates) and ``total``.

    Returns:
        ``tokens``; ``dominant`` (cause → how many tokens it was the largest positive term of);
        ``own_grew`` (tokens whose own term was > 0: the per-token rule's sign was wrong);
        ``median`` (cause → median term) and ``median_ratio_to_own`` (median |others| / |own|).
    """
    out = {"tokens": len(terms), "dominant": {c: 0 for c in FLIP_CAUSES}, "own_grew": 0,
           "median": {}, "median_ratio_to_own": float("nan")}
    if not terms:
        return out
    for t in terms:
        out["dominant"][max(FLIP_CAUSES, key=lambda c: t[c])] += 1
        out["own_grew"] += int(t["own"] > 0)
    for c in (*FLIP_CAUSES, "total"):
        out["median"][c] = float(torch.tensor([t[c] for t in terms], dtype=torch.float64).quantile(0.5))
    ratios = torch.tensor([abs(t["context"] + t["state"] + t["rest"]) / max(abs(t["own"]), 1e-300) for t in terms],
                          dtype=torch.float64)
    out["median_ratio_to_own"] = float(ratios.quantile(0.5))
    return out


def self_test(per_rule: dict, *, max_unsafe: float = 0.005, min_tokens: int = 20) -> dict:
    """The audit's own test (SPEC §6): with one token per state, every direction rule whose Ḋ is
    the exact derivative of the divergence it is scored against (``pdm_topk`` on the top-K KL,
    ``pdm_exact`` on the full KL) keeps no divergence-growing update, to first order.

    Args:
        per_rule: the ``distinct`` study's per-rule tables (``per_rule`` of the audit document).

    Returns:
        ``passed`` (None where no matched rule had ``min_tokens`` kept tokens: not tested),
        ``checks`` (rule → its unsafe-keep, kept tokens, pass) and ``failures``.
    """
    checks, failures = {}, []
    for rule in ("pdm_topk", "pdm_exact"):
        if rule not in per_rule:
            continue
        scored = per_rule[rule]["scored_against"]
        entry = per_rule[rule][scored]
        rate, kept = entry["unsafe_keep_pooled"], entry["kept_disagreement_tokens"]
        tested = kept >= min_tokens
        ok = (not tested) or rate <= max_unsafe
        checks[rule] = {"scored_against": scored, "unsafe_keep": rate, "kept": kept, "tested": tested, "passed": ok}
        if not ok:
            failures.append(f"{rule} on {scored}: unsafe-keep {rate:.4f} > {max_unsafe} over {kept} kept tokens")
    tested = [c for c in checks.values() if c["tested"]]
    return {"passed": (not failures) if tested else None, "checks": checks, "failures": failures,
            "max_unsafe": max_unsafe, "min_tokens": min_tokens}


