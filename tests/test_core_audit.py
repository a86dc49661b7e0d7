"""Audit statistics: unsafe-keep rates, paired bootstrap CI, exact sign test."""
import math

import pytest
import torch

from pdm_lab.audit.intervals import paired_bootstrap_ci, sign_test
from pdm_lab.audit.measure import unsafe_keep_rates


def test_rates():
    dd = torch.tensor([0.1, -0.2, 0.0, 0.3, -0.1])
    out = unsafe_keep_rates(dd, torch.tensor([True, True, True, False, True]))
    assert out == {"unsafe_keep": 0.25, "shrink": 0.5, "flat": 0.25, "count": 4, "grew": 1, "shrank": 2,
                   "flat_count": 1}
    assert math.isnan(unsafe_keep_rates(dd, torch.zeros(5, dtype=torch.bool))["unsafe_keep"])


def test_sign_test_exact_values():
    # 9 wins of 10: p = 2·(C(10,0)+C(10,1))/2^10
    x = [1.0] * 9 + [0.0]
    y = [0.5] * 10
    assert sign_test(x, y) == pytest.approx(2 * 11 / 1024)
    assert sign_test([1, 2], [1, 2]) == 1.0


def test_bootstrap_ci_covers_mean_and_shrinks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(61, generator=gen, dtype=torch.float64) + 0.5
    y = torch.zeros(61, dtype=torch.float64)
    mean, lo, hi = paired_bootstrap_ci(x, y, seed=1)
    assert lo < mean < hi and lo > 0
    _, lo2, hi2 = paired_bootstrap_ci(torch.cat([x, x, x, x]), torch.cat([y, y, y, y]), seed=1)
    assert hi2 - lo2 < hi - lo


def test_nan_pairs_dropped():
    mean, lo, hi = paired_bootstrap_ci([1.0, float("nan"), 3.0], [0.0, 0.0, 1.0], seed=0)
    assert mean == pytest.approx(1.5)


def test_group_advantages_invalid_samples_and_flat_groups():
    from pdm_lab.lab.advantages import group_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    ok = torch.tensor([True, True, True, False, True, True, True])
    a = group_advantages(r, g, ok)
    assert a[3] == 0 and a[4] == 0 and a[5] == 0 and a[6] == 0  # skipped, flat group, singleton
    assert abs(float(a[:3].sum())) < 1e-6 and a[0] > 0 > a[1]
    torch.testing.assert_close(a[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / ((1 / 3) ** 0.5 + 1e-6))
    assert group_advantages(r, g, ok, scale_by_std=False)[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_tolerance_separates_flat_from_grow_and_shrink():
    from pdm_lab.audit.measure import delta_rates

    dd = torch.tensor([1e-3, -1e-3, 1e-14, -1e-14, 0.0], dtype=torch.float64)
    out = delta_rates(dd, torch.ones(5, dtype=torch.bool), tol=1e-12)
    assert (out["grew"], out["shrank"], out["flat_count"], out["count"]) == (1, 1, 3, 5)
    assert out["unsafe_keep"] == pytest.approx(0.2) and out["flat"] == pytest.approx(0.6)
    with pytest.raises(Exception, match="non-finite"):
        delta_rates(torch.tensor([float("nan")]), torch.tensor([True]))


def test_pool_weights_tokens_not_seeds():
    from pdm_lab.audit.measure import delta_rates, pool, rate_summary

    a = delta_rates(torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.ones(4, dtype=torch.bool))
    b = delta_rates(torch.tensor([-1.0]), torch.ones(1, dtype=torch.bool))
    assert pool([a, b])["unsafe_keep"] == pytest.approx(3 / 5)
    s = rate_summary([a, b])
    assert s["unsafe_keep_mean"] == pytest.approx((0.75 + 0.0) / 2) and s["kept_disagreement_tokens"] == 5


def test_pooled_diff_ci_brackets_the_point_and_handles_empty_seeds():
    from pdm_lab.audit.measure import delta_rates
    from pdm_lab.audit.intervals import pooled_diff_ci

    gen = torch.Generator().manual_seed(0)
    seeds_a, seeds_b = [], []
    for _ in range(30):
        seeds_a.append(delta_rates(torch.rand(3, generator=gen) - 0.2, torch.ones(3, dtype=torch.bool)))
        seeds_b.append(delta_rates(torch.rand(2, generator=gen) - 0.8, torch.ones(2, dtype=torch.bool)))
    seeds_b[0] = delta_rates(torch.zeros(1), torch.zeros(1, dtype=torch.bool))  # a seed with no tokens
    d = pooled_diff_ci(seeds_a, seeds_b, n_boot=2000)
    assert d["ci_low"] <= d["mean_diff"] <= d["ci_high"] and d["ci_low"] > 0
    empty = [delta_rates(torch.zeros(1), torch.zeros(1, dtype=torch.bool))] * 3
    assert math.isnan(pooled_diff_ci(empty, seeds_a[:3])["mean_diff"])


def test_predicted_divergence_reads_the_record_not_the_name():
    import dataclasses

    from pdm_lab.audit.measure import predicted_divergence
    from pdm_lab.masks import MASK_RULES

    assert predicted_divergence(MASK_RULES["pdm_exact"]) == "full_kl"
    assert predicted_divergence(MASK_RULES["pdm_topk"]) == "topk_kl"
    assert predicted_divergence(MASK_RULES["dppo_topk_kl"]) == "topk_kl"
    renamed = dataclasses.replace(MASK_RULES["pdm_topk"], name="my_oracle_rule", estimator="exact")
    assert predicted_divergence(renamed) == "full_kl"


def test_regime_table_quantiles_fractions_and_tail_ratio():
    from pdm_lab.audit.measure import regime_table

    d = torch.cat([torch.full((990,), 1e-3), torch.full((10,), 1.0)]).double()
    considered = torch.ones(1000, dtype=torch.bool)
    considered[:500] = False  # Â = 0 on half the (small-D) tokens
    t = regime_table(d, d > 0.15, considered, topk_mass=torch.full((1000,), 0.995), tokens_per_state=2.0)
    assert t["outside_fraction"] == pytest.approx(10 / 500) and t["zero_advantage_tokens"] == 500
    assert t["d_quantiles"]["p50"] == pytest.approx(1e-3) and t["d_quantiles"]["max"] == 1.0
    assert t["tail_ratio"] == pytest.approx(t["d_quantiles"]["p999"] / 1e-3)
    assert t["topk_mass_ge_099"] == 1.0 and t["tokens_per_state"] == 2.0


def test_mean_ci_lives_in_the_core_and_summary_reuses_it():
    from pdm_lab.audit.intervals import mean_ci
    from pdm_lab.envs.report import summary

    assert summary.mean_ci is mean_ci
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0, float("nan")], n_boot=500)
    assert mean == 2.0 and lo <= mean <= hi


def test_verdict_needs_ten_seeds_and_thirty_tokens_each():
    from pdm_lab.audit.measure import INSUFFICIENT, data_sufficiency, gated_verdict

    strong = {"mean_diff": 0.3, "ci_low": 0.2, "ci_high": 0.4}
    enough = data_sufficiency([3] * 10, [3] * 10)
    assert enough["sufficient"] and enough["seeds_with_both"] == 10 and enough["reason"] == ""
    assert gated_verdict(strong, "a", "b", enough).startswith("b keeps fewer")
    nine = data_sufficiency([9] * 9 + [0], [9] * 10)  # 9 seeds with both, plenty of tokens
    assert not nine["sufficient"] and "9 seed(s)" in nine["reason"]
    assert gated_verdict(strong, "a", "b", nine).startswith(INSUFFICIENT)
    few = data_sufficiency([2] * 12, [3] * 12)  # 24 tokens for A
    assert not few["sufficient"] and "24 and 36" in few["reason"]
    with pytest.raises(Exception, match="differ in length"):
        data_sufficiency([1], [1, 2])


def test_seeds_for_power_matches_the_normal_formula():
    from pdm_lab.audit.measure import seeds_for_power

    diffs = [0.1, -0.1] * 20  # sd = 0.1013 (n − 1 denominator)
    out = seeds_for_power(diffs, effect=0.027)
    sd = torch.tensor(diffs, dtype=torch.float64).std().item()
    assert out["sd"] == pytest.approx(sd)
    assert out["seeds_needed"] == math.ceil(((1.959964 + 0.841621) * sd / 0.027) ** 2)
    assert math.isnan(seeds_for_power([0.1, float("nan")])["seeds_needed"])  # one usable seed


def test_flip_summary_counts_the_largest_cause():
    from pdm_lab.audit.measure import flip_summary

    terms = [{"own": -1.0, "context": 0.0, "state": 0.5, "rest": 2.0, "total": 1.5},
             {"own": 0.2, "context": 0.1, "state": 0.0, "rest": -0.1, "total": 0.2}]
    out = flip_summary(terms)
    assert out["dominant"] == {"own": 1, "context": 0, "state": 0, "rest": 1} and out["own_grew"] == 1
    assert out["median_ratio_to_own"] == pytest.approx((2.5 + 0.0) / 2)
    assert flip_summary([])["tokens"] == 0


def test_self_test_passes_only_the_first_order_construction():
    from pdm_lab.audit.measure import self_test

    def rules(rate, kept=50):
        entry = {"unsafe_keep_pooled": rate, "kept_disagreement_tokens": kept}
        return {"pdm_topk": {"scored_against": "topk_kl", "topk_kl": entry, "full_kl": entry}}

    assert self_test(rules(0.0))["passed"] is True
    failed = self_test(rules(0.3))  # a swapped estimator keeps growing tokens
    assert failed["passed"] is False and "pdm_topk" in failed["failures"][0]
    assert self_test(rules(0.3, kept=3))["passed"] is None  # too few tokens: not tested
