"""pdm_lab.testing: the oracle agrees with hand values; the kit passes pdm_lab's own code and
catches a user-style implementation that computes the tails as 1 − Σ (the bug peers ship)."""
import math

import mpmath
import pytest
import torch

from pdm_lab.testing import (check_divergence, check_mask, llm_cases, oracle_row, oracle_support, pdm_lab_divergence,
                             pdm_lab_mask)


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


# binary KL once returned +inf when log π_k rounded to 0 for a near-certain token (true value
# finite); the kit found it (issue 10) and the complement from the rest of the distribution fixed
# it (issue 9), so binary_kl must pass like the others.
@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv", "binary_kl", "binary_tv"])
def test_pdm_lab_passes_its_own_kit(divergence):
    check_divergence(pdm_lab_divergence(divergence), divergence, max_examples=25)


@pytest.mark.parametrize("rule", ["dppo_topk_kl", "pdm_topk", "pdm_exact"])
def test_pdm_lab_masks_pass_the_kit(rule):
    check_mask(pdm_lab_mask(rule), rule, delta=0.15, max_examples=20)


def test_kit_catches_one_minus_sum_tails():
    # no exact ties: the user's torch.topk may order ties differently; the failure is the tails
    cases = llm_cases(regimes=("peaked", "flat", "near_certain", "deep_tail"))
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
