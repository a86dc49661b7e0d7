"""The direction audit (SPEC §6): the audit's own test (matched pairs shrink with one token per
state), planted bugs it must catch, audit.json's schema and its counts."""
import dataclasses
import json
import math

import pytest

from pdm_lab import masks
from pdm_lab.envs import audit as audit_mod
from pdm_lab.envs.audit import AuditConfig, audit_seed, run_audit
from pdm_lab.envs.problems import ProblemConfig

# SPEC §6's own test: tabular softmax, SGD, a small step, one token per state, float64.
FIRST_ORDER = AuditConfig(policy="tabular", optimizer="sgd", lr=1e-3, contexts=("distinct",),
                          mismatch="noise:1", seeds=2, sequences=1024, n_boot=200)
MATCHED = ("pdm_topk", "pdm_exact")


def matched_pair_failures(doc: dict) -> list[str]:
    """Why the audit is wrong, if it is: each matched rule, on the divergence the audit scores it
    against, must have unsafe-keep ≤ 0.5%, and the ratio rule must be far above."""
    failures = []
    rules = doc["per_rule"]
    for rule in MATCHED:
        scored = rules[rule]["scored_against"]
        rate = rules[rule][scored]["unsafe_keep_pooled"]
        if rules[rule][scored]["kept_disagreement_tokens"] < 20 or not rate <= 0.005:
            failures.append(f"{rule} on {scored}: unsafe-keep {rate}")
    ref = rules["dppo_topk_kl"]
    if not ref["topk_kl"]["unsafe_keep_pooled"] >= 0.5:
        failures.append(f"dppo_topk_kl: unsafe-keep {ref['topk_kl']['unsafe_keep_pooled']}")
    return failures


@pytest.fixture(scope="module")
def first_order_doc():
    return run_audit(FIRST_ORDER)


def test_matched_pairs_have_no_unsafe_keep_with_one_token_per_state(first_order_doc):
    assert matched_pair_failures(first_order_doc) == []
    rules = first_order_doc["per_rule"]
    assert rules["pdm_topk"]["scored_against"] == "topk_kl"
    assert rules["pdm_exact"]["scored_against"] == "full_kl"
    assert first_order_doc["precision"] == "float64"
    assert first_order_doc["step"]["effective_per_token_step"] == FIRST_ORDER.lr
    assert first_order_doc["tolerance"] == FIRST_ORDER.tolerance


def test_planted_bug_swapped_measured_divergence_is_caught(monkeypatch):
    real = audit_mod.measure

    def swapped(model, tokens):
        out = real(model, tokens)
        return {"topk_kl": out["full_kl"], "full_kl": out["topk_kl"]}

    monkeypatch.setattr(audit_mod, "measure", swapped)
    assert matched_pair_failures(run_audit(FIRST_ORDER)) != []


def test_planted_bug_swapped_estimator_is_caught(monkeypatch):
    topk, exact = masks.MASK_RULES["pdm_topk"], masks.MASK_RULES["pdm_exact"]
    monkeypatch.setitem(masks.MASK_RULES, "pdm_topk", dataclasses.replace(topk, drop=exact.drop, needs=exact.needs))
    monkeypatch.setitem(masks.MASK_RULES, "pdm_exact", dataclasses.replace(exact, drop=topk.drop))
    assert matched_pair_failures(run_audit(FIRST_ORDER)) != []


SMALL = AuditConfig(seeds=3, sequences=256, k_sweep=(5, 20), k_sweep_seeds=2, n_boot=300,
                    stress_mismatch="noise:2", stress_seeds=2)


@pytest.fixture(scope="module")
def doc():
    return run_audit(SMALL)


def test_audit_document_schema(doc):
    assert set(doc) >= {"config", "rules", "pairs", "per_rule", "contexts", "regime", "per_seed", "studies",
                        "precision", "step", "tolerance", "zero_advantage_mean", "wall_s"}
    assert doc["rules"][:2] == ["dppo_topk_kl", "pdm_topk"]
    assert set(doc["contexts"]) == {"shared", "distinct"}
    assert [p["b"] for p in doc["pairs"]] == ["pdm_topk", "pdm_uniform", "pdm_agg", "pdm_exact"]
    for rule, entry in doc["per_rule"].items():
        assert set(entry) >= {"scored_against", "topk_kl", "full_kl"}
        for name in ("topk_kl", "full_kl"):
            assert set(entry[name]) >= {"unsafe_keep_pooled", "shrink_pooled", "flat_pooled"}
    for pair in doc["pairs"]:
        a, b = pair["a"], pair["b"]
        for rule in (a, b):
            assert len(pair[rule]["unsafe_keep_per_seed"]) == SMALL.seeds
        d = pair["unsafe_keep_diff"]
        if not math.isnan(d["mean_diff"]):
            assert d["ci_low"] <= d["mean_diff"] <= d["ci_high"]
        assert 0 <= d["sign_test_p"] <= 1
        assert d["a_lower_seeds"] + d["b_lower_seeds"] + d["ties"] == d["seeds_used"] <= SMALL.seeds
    assert [row["k"] for row in doc["studies"]["k_sweep"]] == [5, 20]
    assert doc["studies"]["stress"]["mismatch"] == "noise:2"
    assert doc["regime"]["tokens"] == SMALL.seeds * SMALL.sequences


def test_counts_nest_and_exclude_zero_advantage(doc):
    for seed in doc["per_seed"]:
        assert seed["outside"] <= seed["tokens"] - seed["zero_advantage"]
        assert seed["zero_advantage"] > 0  # the bandit's flat groups: reported, never scored
        for ctx in ("shared", "distinct"):
            for key, entry in seed["contexts"][ctx]["pairs"].items():
                a, b = key.split("|")
                assert 0 <= entry["disagreement"] <= seed["outside"]
                for name in ("topk_kl", "full_kl"):
                    # the disagreement tokens split exactly between the rule that kept and the one that masked
                    assert entry[a][name]["count"] + entry[b][name]["count"] == entry["disagreement"]
                    for rule in (a, b):
                        e = entry[rule][name]
                        assert e["grew"] + e["shrank"] + e["flat_count"] == e["count"]
    assert doc["contexts"]["distinct"]["tokens_per_state_mean"] == 1.0
    assert doc["contexts"]["shared"]["tokens_per_state_mean"] == SMALL.group_size  # bandit: G per prompt


def test_nothing_outside_means_no_disagreement():
    same = AuditConfig(rules=("dppo_topk_kl", "dppo_binary_kl"), extra_rules=(), sequences=128, delta=1e9)
    record = audit_seed(same, 0)
    assert record["outside"] == 0
    assert record["contexts"]["shared"]["pairs"]["dppo_topk_kl|dppo_binary_kl"]["disagreement"] == 0


@pytest.mark.parametrize("problem, policy", [("token_mdp", "neural"), ("bandit", "neural")])
def test_audit_runs_on_other_problems(problem, policy):
    cfg = AuditConfig(problem=ProblemConfig(kind=problem), policy=policy, seeds=2, sequences=128, n_boot=200)
    out = run_audit(cfg)
    assert len(out["per_seed"]) == 2 and out["tokens_mean"] > 0


def test_stale_mismatch_moves_pi_before_the_audited_batch():
    fresh = audit_seed(AuditConfig(mismatch="none", sequences=128, extra_rules=()), 0)
    stale = audit_seed(AuditConfig(mismatch="stale:3", sequences=128, extra_rules=(), delta=0.0), 0)
    assert fresh["outside"] == 0
    assert stale["outside"] > 0  # π moved away from μ during the two earlier mini-batch steps


def test_resumed_audit_reads_finished_seeds(tmp_path):
    cfg = AuditConfig(seeds=2, sequences=128, n_boot=100, extra_rules=())
    first = run_audit(cfg, seed_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed_0.pt", "seed_1.pt"]
    again = run_audit(cfg, seed_dir=tmp_path)
    same = lambda x, y: json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)  # NaN-safe
    assert same(again["per_seed"], first["per_seed"]) and same(again["regime"], first["regime"])
