"""The direction audit (SPEC §6): audit.json's schema, its statistics, and the first-order law."""
import math

import pytest

from pdm_lab.envs.audit import AuditConfig, audit_seed, run_audit
from pdm_lab.envs.problems import ProblemConfig

SMALL = AuditConfig(seeds=4, sequences=256, k_sweep=(5, 20), k_sweep_seeds=2, single_token_max=8,
                    n_boot=500)


@pytest.fixture(scope="module")
def doc():
    return run_audit(SMALL)


def test_audit_document_schema(doc):
    assert set(doc) >= {"config", "rules", "pairs", "per_seed", "studies", "wall_s"}
    assert doc["rules"][:2] == ["dppo_topk_kl", "pdm_uniform"]
    assert len(doc["per_seed"]) == SMALL.seeds
    assert [p["b"] for p in doc["pairs"]] == ["pdm_uniform", "pdm_agg", "pdm_topk", "pdm_exact"]
    for pair in doc["pairs"]:
        a, b = pair["a"], pair["b"]
        for rule in (a, b):
            s = pair[rule]
            assert len(s["unsafe_keep_per_seed"]) == len(s["count_per_seed"]) == SMALL.seeds
        d = pair["unsafe_keep_diff"]
        assert set(d) >= {"mean_diff", "ci_low", "ci_high", "sign_test_p", "a_lower_seeds", "b_lower_seeds"}
        if not math.isnan(d["mean_diff"]):
            assert d["ci_low"] <= d["mean_diff"] <= d["ci_high"]
        assert 0 <= d["sign_test_p"] <= 1
        assert d["a_lower_seeds"] + d["b_lower_seeds"] + d["ties"] == d["seeds_used"] <= SMALL.seeds
    assert [row["k"] for row in doc["studies"]["k_sweep"]] == [5, 20]
    assert set(doc["studies"]["single_token"]) == {"dppo_topk_kl", "pdm_uniform", "pdm_exact"}


def test_counts_nest_and_rates_are_fractions(doc):
    for seed in doc["per_seed"]:
        assert 0 <= seed["outside"] <= seed["tokens"] == SMALL.sequences
        for key, entry in seed["pairs"].items():
            a, b = key.split("|")
            assert 0 <= entry["disagreement"] <= seed["outside"]
            # the disagreement tokens split exactly between the rule that kept and the one that masked
            assert entry[a]["count"] + entry[b]["count"] == entry["disagreement"]
            for rule in (a, b):
                e = entry[rule]
                if e["count"]:
                    assert 0 <= e["unsafe_keep"] <= 1 and e["unsafe_keep"] + e["shrink"] <= 1 + 1e-12


def test_repeated_rules_collapse_and_nothing_outside_means_no_disagreement():
    cfg = AuditConfig(rules=("pdm_uniform", "dppo_topk_kl"), extra_rules=("pdm_uniform",),
                      sequences=128, single_token=False)
    record = audit_seed(cfg, 0)
    assert list(record["pairs"]) == ["pdm_uniform|dppo_topk_kl"]
    same = AuditConfig(rules=("dppo_topk_kl", "dppo_binary_kl"), extra_rules=(), sequences=128,
                       single_token=False, delta=1e9)  # nothing outside: nothing to disagree on
    assert audit_seed(same, 0)["pairs"]["dppo_topk_kl|dppo_binary_kl"]["disagreement"] == 0


def test_single_token_updates_follow_the_first_order_prediction(doc):
    # SPEC §3: a lone gradient step moves D by η·Â·r·Ḋ. The exact predictive rule keeps only
    # tokens with Â·Ḋ ≤ 0, so alone they shrink D; the ratio rule's kept disagreement tokens have
    # Â·Ḋ > 0, so alone they grow it.
    single = doc["studies"]["single_token"]
    assert single["pdm_exact"]["tokens"] > 0
    assert single["pdm_exact"]["single_unsafe_keep_pooled"] < 0.1
    assert single["dppo_topk_kl"]["single_unsafe_keep_pooled"] > 0.9


@pytest.mark.parametrize("problem, policy", [("token_mdp", "neural"), ("bandit", "neural")])
def test_audit_runs_on_other_problems(problem, policy):
    cfg = AuditConfig(problem=ProblemConfig(kind=problem), policy=policy, seeds=2, sequences=128,
                      k_sweep=(), single_token_max=4, n_boot=200)
    out = run_audit(cfg)
    assert len(out["per_seed"]) == 2 and out["tokens_mean"] > 0


def test_stale_mismatch_moves_pi_before_the_audited_batch():
    fresh = audit_seed(AuditConfig(mismatch="none", sequences=128, extra_rules=()), 0)
    stale = audit_seed(AuditConfig(mismatch="stale:3", sequences=128, extra_rules=(), delta=0.0), 0)
    assert fresh["outside"] == 0
    assert stale["outside"] > 0  # π moved away from μ during the two earlier mini-batch steps
