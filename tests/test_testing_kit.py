"""pdm_lab.testing: the oracle agrees with hand values; the kit passes pdm_lab's own code and
catches a user-style implementation that computes the tails as 1 − Σ (the bug peers ship)."""
import dataclasses
import math

import mpmath
import pytest
import torch

from pdm_lab import masks
from pdm_lab import oracle as oracle_module
from pdm_lab.testing import (check_divergence, check_mask, llm_cases, oracle, oracle_keep, oracle_mask_rules,
                             oracle_row, oracle_support, pdm_lab_divergence, pdm_lab_mask)


def user_topk_kl_one_minus_sum(mu_logp, pi_logp, sampled, k, convention):
    """How public code often does it: gather the head, tails as clamp(1 − Σ head, ε)."""
    top = torch.topk(mu_logp, k, dim=-1).indices
    ids = top.clone()
    outside = ~(top == sampled[:, None]).any(-1)
    if convention == "union":
        ids = torch.cat([top, sampled[:, None]], dim=-1)
    else:
        ids[outside, -1] = sampled[outside]
    mu = mu_logp.exp().gather(-1, ids)
    pi = pi_logp.exp().gather(-1, ids)
    if convention == "union":  # the appended column duplicates a top-K id when k is inside
        mu[~outside, -1] = 0.0
        pi[~outside, -1] = 0.0
    mu_t = (1 - mu.sum(-1)).clamp(min=1e-8)
    pi_t = (1 - pi.sum(-1)).clamp(min=1e-8)
    head = torch.where(mu > 0, mu * (mu.log() - pi.log()), torch.zeros_like(mu)).sum(-1)
    return head + mu_t * (mu_t.log() - pi_t.log())


def test_oracle_hand_values():
    mu = [math.log(0.5), math.log(0.3), math.log(0.2)]
    pi = [math.log(0.4), math.log(0.4), math.log(0.2)]
    row = oracle_row(mu, pi, sampled=1, k=1, convention="union")  # S = {0, 1}, tail {2}
    want = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert float(row["topk_kl"]) == pytest.approx(want, rel=1e-14)
    assert float(row["binary_tv"]) == pytest.approx(0.1, rel=1e-14)
    assert float(row["ddot_exact"]) == pytest.approx(0.1 + 0.4 * 0.1 + 0.4 * -0.1 + 0.0, rel=1e-12)
    # ties: lower id first; kslot overwrites the K-th slot
    assert oracle_support([0.0, 0.0, 0.0], sampled=2, k=2, convention="union") == [0, 1, 2]
    assert oracle_support([0.0, 0.0, 0.0], sampled=2, k=2, convention="kslot") == [0, 2]


# binary KL is where a near-certain token's log π_k rounds to 0 (log1mexp(0) = −inf): its
# complement comes from the rest of the distribution, so it must pass like the others.
@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv", "binary_kl", "binary_tv"])
def test_pdm_lab_passes_its_own_kit(divergence):
    check_divergence(pdm_lab_divergence(divergence), divergence, max_examples=25)


@pytest.mark.parametrize("rule", ["dppo_topk_kl", "pdm_topk", "pdm_exact", "pdm_uniform"])
def test_pdm_lab_masks_pass_the_kit(rule):
    check_mask(pdm_lab_mask(rule), rule, delta=0.15, max_examples=20)


def test_kit_catches_one_minus_sum_tails():
    # no exact ties (nor the engine's cuts, ties at −inf): the user's torch.topk may order ties
    # differently; the failure is the tails
    cases = llm_cases(regimes=("peaked", "flat", "near_certain", "deep_tail"), cuts=("none",))
    with pytest.raises(AssertionError, match="topk_kl of token"):
        check_divergence(user_topk_kl_one_minus_sum, "topk_kl", max_examples=60, cases=cases)


def test_the_bug_on_one_case_by_hand():
    # π is near-certain on the head (tail 1e-40); μ's tail is 1e-3: 1 − Σ gives π_T = ε = 1e-8
    n = 6
    mu = torch.log(torch.tensor([[0.6, 0.399, 2.5e-4, 2.5e-4, 2.5e-4, 2.5e-4]], dtype=torch.float64))
    pi = torch.log(torch.tensor([[0.5, 0.5, 2.5e-41, 2.5e-41, 2.5e-41, 2.5e-41]], dtype=torch.float64))
    sampled = torch.tensor([0])
    true = oracle_row(mu[0].tolist(), pi[0].tolist(), 0, 2, "union")["topk_kl"]
    ours = pdm_lab_divergence("topk_kl")(mu, pi, sampled, 2, "union")
    theirs = user_topk_kl_one_minus_sum(mu, pi, sampled, 2, "union")
    assert float(ours[0]) == pytest.approx(float(true), rel=1e-9)
    assert abs(float(theirs[0]) - float(true)) > 0.05  # μ_T·log(1e-40/1e-8) ≈ 0.074 lost
    assert n == mu.shape[1] and mpmath.mpf(true) > 0


# --- tokens cut by the engine's top-k / top-p: −inf in μ (SPEC §8), legal input -----------------

def user_topk_kl_naive_zeros(mu_logp, pi_logp, sampled, k, convention):
    """Exact tails (log-sum-exp), but the KL terms as μ·(log μ − log π): 0·(−inf) = NaN for a
    token the engine cut when it lands in S (K beyond the kept tokens)."""
    from pdm_lab import support_from_full

    support = support_from_full(mu_logp, sampled, k=k, convention=convention)
    n, valid = mu_logp.shape[1], support.valid
    ids = torch.where(valid, support.ids.long(), n)  # padding → a spare column n, never a real id
    mu, pi = mu_logp.gather(1, ids.clamp(max=n - 1)), pi_logp.gather(1, ids.clamp(max=n - 1))
    head = torch.where(valid, mu.exp() * (mu - pi), torch.zeros_like(mu)).sum(-1)
    outside = torch.ones(len(ids), n + 1, dtype=torch.bool).scatter(1, ids, False)[:, :n]
    mu_t = torch.logsumexp(mu_logp.masked_fill(~outside, float("-inf")), -1)
    pi_t = torch.logsumexp(pi_logp.masked_fill(~outside, float("-inf")), -1)
    return head + torch.where(torch.isfinite(mu_t), mu_t.exp() * (mu_t - pi_t), torch.zeros_like(mu_t))


def test_cases_hold_cut_tokens_in_both_places_and_conventions():
    from hypothesis import find

    def rows(case):  # (μ row, its support S) per token
        return [(case.mu_logp[i].tolist(), oracle_support(case.mu_logp[i].tolist(), int(case.sampled[i]), case.k,
                                                          case.convention)) for i in range(len(case.sampled))]

    def cut_inside(case):  # a cut token in S (K beyond the kept tokens)
        return any(math.isinf(mu[j]) for mu, support in rows(case) for j in support)

    def tail_all_cut(case):  # a non-empty tail the engine cut whole: μ_T = 0 exactly, π_T > 0
        return any(len(support) < len(mu) and all(math.isinf(mu[j]) for j in range(len(mu)) if j not in support)
                   for mu, support in rows(case))

    for convention in ("union", "kslot"):
        for cut in ("top_k", "top_p"):
            cases = llm_cases(cuts=(cut,), conventions=(convention,))
            inside = find(cases, cut_inside)
            assert inside.convention == convention and cut in inside.regime
            assert all(math.isfinite(inside.mu_logp[i, inside.sampled[i]]) for i in range(len(inside.sampled)))
            assert torch.isfinite(inside.pi_logp).all()  # π (the trainer's) is never cut
        find(llm_cases(cuts=("top_k",), conventions=(convention,)), tail_all_cut)


def test_oracle_hand_values_with_cut_tokens():
    mu = [math.log(0.6), math.log(0.4), -math.inf, -math.inf]
    pi = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]
    inside = oracle_row(mu, pi, sampled=0, k=3, convention="union")  # S = {0, 1, 2}: token 2 cut, tail {3}
    want = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.3)  # cut tokens add 0 (μ_i = 0, μ_T = 0)
    assert float(inside["topk_kl"]) == pytest.approx(want, rel=1e-14)
    assert float(inside["topk_tv"]) == pytest.approx((0.1 + 0.1 + 0.15 + 0.05) / 2, rel=1e-14)
    # Ḋ_topk: (π_k − μ_k) + Σ_S π_i(μ_i − π_i) + (μ_T/π_T − 1)·Σ_T π_i² with μ_T = 0
    ddot = (0.5 - 0.6) + 0.5 * 0.1 + 0.3 * 0.1 + 0.15 * -0.15 - 0.05 ** 2
    assert float(inside["ddot_topk"]) == pytest.approx(ddot, rel=1e-12)
    assert oracle_support(mu, sampled=1, k=3, convention="kslot") == [0, 1, 2]  # ties among −inf: lower id


def test_pdm_lab_passes_the_kit_on_cut_tokens():
    cases = llm_cases(cuts=("top_k", "top_p"))
    for divergence in ("topk_kl", "topk_tv", "binary_kl"):
        check_divergence(pdm_lab_divergence(divergence), divergence, max_examples=15, cases=cases)
    check_mask(pdm_lab_mask("pdm_topk"), "pdm_topk", delta=0.15, max_examples=15, cases=cases)


def test_kit_catches_nan_from_cut_tokens_in_the_support():
    user = user_topk_kl_naive_zeros
    check_divergence(user, "topk_kl", max_examples=20, cases=llm_cases(cuts=("none",)))  # right without cuts
    with pytest.raises(AssertionError, match=r"got nan"):
        check_divergence(user, "topk_kl", max_examples=40, cases=llm_cases(cuts=("top_k", "top_p")))


# --- one oracle, and rules read from their records ------------------------------------------------

def test_the_kit_and_the_proofs_share_one_oracle_that_imports_no_code_under_test():
    import ast
    from pathlib import Path

    from pdm_lab.proofs import reference

    assert reference.Instance is oracle_module.Instance and reference.topk_kl is oracle_module.topk_kl
    tree = ast.parse(Path(oracle_module.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "functools", "mpmath"}, imported


def test_the_rules_the_oracle_decides_come_from_the_records():
    assert oracle_mask_rules() == ("dppo_binary_kl", "dppo_binary_tv", "dppo_topk_kl", "dppo_topk_tv",
                                   "pdm_agg", "pdm_exact", "pdm_topk", "pdm_uniform")
    with pytest.raises(ValueError, match="not a rule the oracle decides"):
        check_mask(pdm_lab_mask("ppo_clip"), "ppo_clip")


def test_oracle_keep_reads_the_direction_off_the_record(monkeypatch):
    """A row where Ḋ_topk > 0 > Ḋ_agg and r < 1 outside δ: each rule's record picks its direction;
    a record that named another estimator (a planted mismatch) changes the oracle's answer."""
    row = {"topk_kl": 0.5, "topk_tv": 0.5, "log_ratio": -0.2, "ddot_topk": 0.1, "ddot_agg": -0.1}
    assert oracle_keep(row, 1.0, "pdm_topk", 0.15, 1e-9) is False
    assert oracle_keep(row, 1.0, "pdm_agg", 0.15, 1e-9) is True
    assert oracle_keep(row, 1.0, "dppo_topk_kl", 0.15, 1e-9) is True
    assert oracle_keep(row, -1.0, "dppo_topk_tv", 0.15, 1e-9) is False
    monkeypatch.setitem(masks.MASK_RULES, "pdm_topk",
                        dataclasses.replace(masks.MASK_RULES["pdm_topk"], estimator="agg"))
    assert oracle_keep(row, 1.0, "pdm_topk", 0.15, 1e-9) is True


def test_oracle_binary_and_topk_values_by_hand():
    mu = [math.log(0.5), math.log(0.3), math.log(0.2)]
    pi = [math.log(0.4), math.log(0.4), math.log(0.2)]
    row = oracle_row(mu, pi, sampled=1, k=1, convention="union")  # S = {0, 1}, tail {2}
    assert float(row["binary_kl"]) == pytest.approx(0.3 * math.log(0.3 / 0.4) + 0.7 * math.log(0.7 / 0.6), rel=1e-14)
    assert float(row["log_ratio"]) == pytest.approx(math.log(0.4 / 0.3), rel=1e-14)
    head = (0.4 - 0.3) + 0.4 * 0.1 + 0.4 * -0.1
    assert float(row["ddot_agg"]) == pytest.approx(head, rel=1e-12)  # μ_T = π_T: the tail term is 0
