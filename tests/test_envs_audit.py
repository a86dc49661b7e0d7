"""The direction audit (SPEC §6): the audit's own test (matched pairs shrink with one token per
state), planted bugs it must catch, audit.json's schema and its counts."""
import copy
import dataclasses
import json
import math

import pytest
import torch

from pdm_lab import masks
from pdm_lab.envs.audit import batch as audit_batch_mod
from pdm_lab.envs.audit import step as audit_step
from pdm_lab.envs.audit import store as audit_store
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.seed import audit_seed
from pdm_lab.envs.audit.study import run_audit
from pdm_lab.envs.problems.problem import ProblemConfig

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
    real = audit_step.measure

    def swapped(model, tokens):
        out = real(model, tokens)
        return {"topk_kl": out["full_kl"], "full_kl": out["topk_kl"]}

    monkeypatch.setattr(audit_step, "measure", swapped)
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
    assert sorted(p.name for p in tmp_path.glob("seed_*")) == ["seed_0.pt", "seed_1.pt"]
    assert sorted(p.name for p in (tmp_path / "policies").iterdir()) == ["policy_0_at_0.pt"]
    again = run_audit(cfg, seed_dir=tmp_path)
    same = lambda x, y: json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)  # NaN-safe
    assert same(again["per_seed"], first["per_seed"]) and same(again["regime"], first["regime"])


def test_stored_policies_are_not_read_for_another_training_configuration(tmp_path):
    from pdm_lab.envs.audit.points import TrainedPolicies
    from pdm_lab.envs.problems.problem import make_problem

    cfg = AuditConfig(policy="neural", seeds=1, sequences=64, audit_at=(0, 2), train_groups=1, extra_rules=())
    problem = make_problem(cfg.problem)
    trained = TrainedPolicies(cfg, problem, tmp_path).at(0, 2).state_dict()
    again = TrainedPolicies(cfg, problem, tmp_path).at(0, 2).state_dict()  # read back, not retrained
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    other = dataclasses.replace(cfg, train_lr=cfg.train_lr * 10)
    retrained = TrainedPolicies(other, problem, tmp_path).at(0, 2).state_dict()
    fresh = TrainedPolicies(other, problem).at(0, 2).state_dict()  # no store: what it must equal
    assert all(torch.equal(retrained[k], fresh[k]) for k in fresh)
    assert not all(torch.equal(retrained[k], trained[k]) for k in trained)


# ---- audit points, verdicts that need data, flips, compact tokens, safe resume ----

from pdm_lab.audit.measure import FLIP_CAUSES, INSUFFICIENT  # noqa: E402
from pdm_lab.envs.audit import flips as audit_flips  # noqa: E402
from pdm_lab.envs.audit.batch import audit_batch, float64_tokens  # noqa: E402
from pdm_lab.envs.audit.step import measure, rule_step  # noqa: E402
from pdm_lab.envs.problems.problem import TokenMDPConfig  # noqa: E402

TINY_MDP = ProblemConfig(kind="token_mdp", token_mdp=TokenMDPConfig(vocab_size=32, max_len=6))


def verdict_failures(doc: dict) -> list[str]:
    """Why a document's verdicts are not backed by data, if they are not: every verdict other
    than "insufficient data" needs ≥ 10 seeds with kept tokens for both rules and ≥ 30 pooled each."""
    failures = []
    for pair in doc["pairs"]:
        data = pair["data"]
        backed = data["seeds_with_both"] >= 10 and min(data["tokens_a"], data["tokens_b"]) >= 30
        for key in ("verdict", "pooled_verdict"):
            if not pair[key].startswith(INSUFFICIENT) and not backed:
                failures.append(f"{pair['a']}|{pair['b']} {key}: {pair[key]!r} from {data}")
    return failures


@pytest.fixture(scope="module")
def small_doc():
    return run_audit(AuditConfig(seeds=2, sequences=64, n_boot=100, extra_rules=()))


def test_two_seed_audit_reports_insufficient_data(small_doc):
    pair = small_doc["pairs"][0]
    assert pair["verdict"].startswith(INSUFFICIENT) and pair["pooled_verdict"].startswith(INSUFFICIENT)
    assert "seed(s) gave kept disagreement tokens" in pair["verdict"]
    assert verdict_failures(small_doc) == []
    assert {"outside_mean", "per_rule", "audit_step", "peak_rss_gb", "wall_s"} <= set(small_doc)
    assert pair["audit_step"] == 0 and "disagreement_mean" in pair
    assert set(small_doc["per_rule"]["pdm_topk"]) >= {"topk_kl", "full_kl"}


def test_planted_bug_verdict_from_nine_seeds_is_caught(small_doc):
    doc = copy.deepcopy(small_doc)
    pair = doc["pairs"][0]
    pair["data"] = dict(pair["data"], seeds_with_both=9, tokens_a=500, tokens_b=500)
    pair["verdict"] = "pdm_topk keeps fewer divergence-growing updates than dppo_topk_kl (95% CI of A − B excludes 0)."
    assert verdict_failures(doc) != []


def test_audit_points_train_the_policy_and_report_every_point():
    cfg = AuditConfig(problem=TINY_MDP, policy="neural", mismatch="bf16_engine:0+outlier:0.5:1", seeds=2,
                      sequences=64, audit_at=(0, 3), trajectory_seeds=1, extra_rules=(), n_boot=100, delta=0.01,
                      contexts=("shared",), context_features=16)
    doc = run_audit(cfg)
    assert [p["step"] for p in doc["trajectory"]] == [0, 3]
    assert [p["seeds"] for p in doc["trajectory"]] == [1, 2]
    assert doc["pairs"][0]["audit_step"] == 3 and all(s["step"] == 3 for s in doc["per_seed"])
    assert doc["coupling"]["same_state_tokens"] >= doc["coupling"]["outside"] > 0
    # training moved the policy: the batch at step 3 is not the batch at step 0
    untrained = audit_batch(cfg, 0, step=0)[1]
    trained = audit_batch(cfg, 0, step=3)[1]
    assert not torch.equal(untrained.w2, trained.w2)


def test_audit_tensors_hold_response_tokens_only():
    cfg = AuditConfig(problem=TINY_MDP, policy="neural", seeds=1, sequences=64, extra_rules=())
    _, _, batch, adv = audit_batch(cfg, 0)
    tokens = float64_tokens(batch, adv, cfg.mask("dppo_topk_kl"))
    assert tokens.num_tokens == int(batch.response_mask.sum()) < batch.response_mask.numel()
    assert bool(tokens.response_mask.all())
    seq = torch.nonzero(batch.response_mask)[:, 0]
    assert torch.equal(tokens.advantages.reshape(-1), adv.double()[seq])


def _flip_terms(policy_kind: str, contexts: str = "shared", lr: float = 1e-3):
    cfg = AuditConfig(problem=TINY_MDP, policy=policy_kind, seeds=1, sequences=128, extra_rules=(), delta=0.0,
                      mismatch="noise:1", lr=lr)
    _, policy, batch, adv = audit_batch(cfg, 0)
    mask = cfg.mask("dppo_topk_kl")
    tokens = float64_tokens(batch, adv, mask)
    focus = torch.nonzero(tokens.advantages.reshape(-1) != 0)[:, 0]
    model, tok, foc = audit_batch_mod.audit_model(policy, tokens, contexts, focus)
    before = measure(model, tok.rows(foc))
    step = rule_step(model, tok, mask, cfg, foc, before)
    targets = foc[:12]
    terms = audit_flips.decompose(model, tok, mask, cfg.lr, step.keep, targets, "topk_kl", measure)
    return terms, step.delta["topk_kl"][targets]


def flip_failures(terms, realised, *, shares_weights: bool) -> list[str]:
    """The decomposition is wrong if its terms do not add up to the first-order total, the total
    is not the realised ΔD to first order, or (a tabular policy) other states contribute."""
    failures = []
    for t, r in zip(terms, realised.tolist()):
        parts = sum(t[c] for c in FLIP_CAUSES)
        if abs(parts - t["total"]) > 1e-6 * abs(t["total"]) + 1e-15:
            failures.append(f"row {t['row']}: terms {parts} vs total {t['total']}")
        scale = max(abs(r), sum(abs(t[c]) for c in FLIP_CAUSES))
        if abs(t["total"] - r) > 5e-2 * scale + 1e-12:  # second order: small at this step
            failures.append(f"row {t['row']}: first order {t['total']} vs realised {r}")
        if not shares_weights and abs(t["rest"]) > 1e-9 * abs(t["total"]) + 1e-18:
            failures.append(f"row {t['row']}: rest {t['rest']} through a table")
    return failures


def test_flip_terms_add_up_and_a_table_shares_nothing_across_states():
    terms, realised = _flip_terms("tabular")
    assert len(terms) == 12 and flip_failures(terms, realised, shares_weights=False) == []
    assert any(t["context"] != 0 or t["state"] != 0 for t in terms)  # tokens of one state do interact
    neural, realised_n = _flip_terms("neural", lr=1e-4)  # the network's token-sum step is ~N× larger
    assert flip_failures(neural, realised_n, shares_weights=True) == []
    assert any(abs(t["rest"]) > 0 for t in neural)  # the network couples every token


def test_flip_terms_from_the_rules_own_step_equal_a_fresh_gradient():
    cfg = AuditConfig(problem=TINY_MDP, policy="neural", seeds=1, sequences=128, extra_rules=(), delta=0.0,
                      mismatch="noise:1", lr=1e-4)
    _, policy, batch, adv = audit_batch(cfg, 0)
    mask = cfg.mask("dppo_topk_kl")
    tokens = float64_tokens(batch, adv, mask)
    focus = torch.nonzero(tokens.advantages.reshape(-1) != 0)[:, 0]
    model, tok, foc = audit_batch_mod.audit_model(policy, tokens, "shared", focus)
    step = rule_step(model, tok, mask, cfg, foc, measure(model, tok.rows(foc)))
    targets = foc[:6]
    fresh = audit_flips.decompose(model, tok, mask, cfg.lr, step.keep, targets, "topk_kl", measure)
    reused = audit_flips.decompose(model, tok, mask, cfg.lr, step.keep, targets, "topk_kl", measure,
                                   everything=list(step.step))
    for a, b in zip(fresh, reused):
        for cause in (*FLIP_CAUSES, "total"):
            assert abs(a[cause] - b[cause]) <= 1e-9 * max(abs(a["total"]), 1e-300), (cause, a, b)


def test_flip_terms_one_token_per_state_are_all_own():
    terms, realised = _flip_terms("tabular", "distinct")
    for t in terms:
        assert t["context"] == 0 and t["state"] == 0 and abs(t["rest"]) <= 1e-9 * abs(t["total"]) + 1e-18
    assert flip_failures(terms, realised, shares_weights=False) == []


def test_planted_bug_wrong_attribution_is_caught(monkeypatch):
    real = audit_flips.group_ids

    def shifted(model, tokens):  # every token attributed to its neighbour's context and state
        context, state = real(model, tokens)
        return context.roll(1), state.roll(1)

    monkeypatch.setattr(audit_flips, "group_ids", shifted)
    terms, realised = _flip_terms("tabular")
    assert flip_failures(terms, realised, shares_weights=False) != []


def test_crafted_seed_file_is_refused_and_runs_no_code(tmp_path):
    import os
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cfg = AuditConfig(seeds=1, sequences=64, n_boot=50, extra_rules=())
    (tmp_path / "seed_0.pt").write_bytes(pickle.dumps({"config": "x", "record": Payload(), "inputs": ()}))
    with pytest.raises(audit_store.SeedRecordError, match="seed_0.pt"):
        run_audit(cfg, seed_dir=tmp_path)
    assert not marker.exists()


def test_outlier_mismatch_is_a_function_of_the_activations():
    from pdm_lab.config import ConfigError
    from pdm_lab.envs.problems.mismatch import Mismatch
    from pdm_lab.envs.policies.models import make_policy
    from pdm_lab.envs.problems.problem import make_problem

    problem = make_problem(TINY_MDP)
    policy = make_policy("neural", problem.encoder, problem.prior, context_features=8)
    engine = Mismatch.parse("outlier:0.3:1").behaviour_copy(policy)
    from pdm_lab.envs.problems.rollout import RolloutRNG

    obs = problem.collect(policy, Mismatch(), 4, 4, RolloutRNG(0)).obs.reshape(-1, 7)
    with torch.no_grad():
        gap = engine(obs) - policy(obs)
        again = engine(obs) - policy(obs)
    assert torch.equal(gap, again) and gap.abs().max() > 0  # deterministic per context
    same = (obs[:, None] == obs[None]).all(-1)
    assert torch.allclose(gap[same.nonzero()[:, 0]], gap[same.nonzero()[:, 1]])
    with pytest.raises(ConfigError, match="neural"):
        Mismatch.parse("outlier:0.3").behaviour_copy(make_policy("tabular", problem.encoder, problem.prior))


def test_context_hash_in_one_pass_equals_the_column_loop():
    from pdm_lab.envs.problems.encoders import context_hash

    def loop(obs, salt):
        h = torch.full((obs.shape[0],), salt, dtype=torch.int64)
        for j in range(obs.shape[1]):
            h = (h * 1_000_003 + obs[:, j] + 1) % 2_147_483_647
        return (h * 48_271 + 11) % 2_147_483_647

    gen = torch.Generator().manual_seed(0)
    for width in (1, 7, 300):
        obs = torch.randint(0, 5000, (64, width), generator=gen)
        assert torch.equal(context_hash(obs, 3), loop(obs, 3))
    big = torch.randint(0, 2 ** 40, (8, 4), generator=gen)  # the loop's branch
    assert torch.equal(context_hash(big, 1), loop(big, 1))


@pytest.mark.slow
@pytest.mark.extended
def test_paper_preset_has_the_papers_power_per_seed():
    from pdm_lab.envs.presets import AUDIT_PRESETS

    cfg = dataclasses.replace(AUDIT_PRESETS["paper"], seeds=1, trajectory_seeds=0, flip_tokens=4)
    doc = run_audit(cfg)
    assert doc["outside_mean"] >= 1000 and doc["pairs"][0]["disagreement_mean"] >= 50, (
        doc["outside_mean"], doc["pairs"][0]["disagreement_mean"])
    # This power is reached only above SPEC §6b's band (1.78% outside at seed 0, 1.33% over 61 seeds,
    # README): the fraction is reported beside every verdict, so it is checked as reported here.
    regime = doc["regime"]
    assert 0.0002 <= regime["outside_fraction"] <= 0.05 and regime["tail_ratio"] >= 30, regime
    assert regime["topk_mass_ge_099"] > 0.5, regime


def test_context_features_on_a_bandit_is_a_config_error_naming_the_field():
    """The neural policy's hashed n-gram features read a token MDP's text; a bandit has none, so
    the config must refuse the pair before any forward runs."""
    from pdm_lab.config import ConfigError, from_dict, to_dict

    from pdm_lab.envs.audit.config import AuditConfig
    from pdm_lab.envs.presets import AUDIT_PRESETS, preset

    doc = to_dict(preset(AUDIT_PRESETS, "quick"))
    doc["problem"]["kind"] = "bandit"
    assert doc["policy"] == "neural" and doc["context_features"] > 0
    with pytest.raises(ConfigError, match="^context_features: .*bandit"):
        from_dict(AuditConfig, doc)
    from_dict(AuditConfig, dict(doc, context_features=0))


def test_kernel_ratio_reaches_the_audited_rules_mask():
    from pdm_lab.config import ConfigError

    from pdm_lab.envs.audit.config import AuditConfig

    cfg = AuditConfig(policy="neural", rules=("pdm_topk", "pdm_kernel"), kernel_ratio=2.5)
    assert cfg.mask("pdm_kernel").kernel_ratio == 2.5 and cfg.mask("pdm_topk").kernel_ratio == 2.5
    with pytest.raises(ConfigError, match="kernel_ratio"):
        AuditConfig(policy="neural", kernel_ratio=-1.0)
