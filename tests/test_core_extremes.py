"""Extreme but finite inputs never make the loss, its gradient or a statistic NaN/inf.

Masked, Â = 0 and capped tokens contribute exactly 0 (or min(r, c)·Â) with finite gradients for
log-probs down to −1e4 and rounding to 0; binary KL stays finite when π_k is within 1e-8 of 1.

Run as a script for a longer randomized sweep (prints the NaN/inf count)::

    python tests/test_core_extremes.py --calls 6000
"""
from __future__ import annotations

import argparse
import math
import sys

import mpmath
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from hypothesis.errors import HypothesisException

from pdm_lab import MaskConfig, pdm_policy_loss, policy_on_support, support_from_full, token_stats
from pdm_lab import tokenwise as stats_module
from pdm_lab.diagnosis import diagnose
from pdm_lab.loss import token_surrogate
from pdm_lab.masks import MASK_RULES, compute_mask

#: Token-level rules that need nothing beyond full distributions (pdm_coupled needs a model).
RULES = tuple(sorted(name for name, rec in MASK_RULES.items()
                     if rec.level == "token" and set(rec.needs) <= {"full"}))
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: A kept, uncapped token's r = e^{log r} is the true value; beyond this it overflows float32
#: (×|Â| ≤ 10, summed over tokens), so the property asks finiteness only below it.
LOG_RATIO_REPRESENTABLE = 60.0


def _logit(gen: torch.Generator) -> float:
    """One logit from the ranges float32 LLM logits reach: −1e4 … 0, −100, −110, rounding to 0, ordinary."""
    kind = int(torch.randint(6, (1,), generator=gen))
    u = float(torch.rand((), generator=gen))
    return (-1e4 * u, -100.0, -110.0, -1e-7 * u, 3.0 * (2 * u - 1), 0.0)[kind]


def extreme_case(seed: int) -> dict:
    """A random batch with extreme logits for μ and π, Â ∈ {0, ±small, ±10}, random masks/caps."""
    gen = torch.Generator().manual_seed(seed)
    b, t = int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
    n = int(torch.randint(2, 9, (1,), generator=gen))
    mu_z = torch.tensor([[_logit(gen) for _ in range(n)] for _ in range(b * t)])
    pi_z = torch.tensor([[_logit(gen) for _ in range(n)] for _ in range(b * t)])
    adv_choices = torch.tensor([0.0, 0.0, 1.0, -1.0, 10.0, -10.0, 1e-30, -0.3])
    adv = adv_choices[torch.randint(len(adv_choices), (b, t), generator=gen)]
    resp = torch.rand(b, t, generator=gen) > 0.2
    caps = (None, None, 0.5, 1.0, 2.0, 10.0)
    cfg = MaskConfig(rule=RULES[int(torch.randint(len(RULES), (1,), generator=gen))],
                     k=int(torch.randint(1, n + 1, (1,), generator=gen)),
                     delta=(0.0, 0.05, 0.15, 10.0)[int(torch.randint(4, (1,), generator=gen))],
                     clip_ratio_c=caps[int(torch.randint(len(caps), (1,), generator=gen))],
                     aggregation=AGGREGATIONS[int(torch.randint(4, (1,), generator=gen))])
    sampled = torch.randint(n, (b * t,), generator=gen)
    return {"mu_z": mu_z, "pi_z": pi_z, "adv": adv, "resp": resp, "cfg": cfg, "sampled": sampled}


def run_case(case: dict) -> tuple[bool, bool]:
    """(in scope, finite): loss, gradient and statistics all finite? Out of scope: a kept,
    uncapped token whose ratio overflows (the true value is then beyond the dtype)."""
    mu = torch.log_softmax(case["mu_z"], -1)
    logits = case["pi_z"].clone().requires_grad_()
    cfg = case["cfg"]
    support = support_from_full(mu, case["sampled"], k=cfg.k)
    pol = policy_on_support(logits, support.ids)
    # Scope first: the loss refuses (naming the token) a kept, uncapped ratio beyond the dtype
    adv = torch.where(case["resp"], case["adv"], 0.0).reshape(-1)
    before = token_stats(support, pol, mu_full=mu, pi_full=torch.log_softmax(logits.detach(), -1))
    active = compute_mask(cfg, before, adv, case["resp"]).bool() & (adv != 0)
    if cfg.clip_ratio_c is None and bool((active & (before.log_ratio > LOG_RATIO_REPRESENTABLE)).any()):
        return False, True
    out = pdm_policy_loss(pol, support, case["adv"], case["resp"], cfg,
                          mu_full=mu, pi_full=torch.log_softmax(logits.detach(), -1))
    out.loss.backward()
    # the loss computes DPPO's binary divergences only for a rule that reads them: ask for them
    binary = token_stats(support, pol, mu_full=mu, pi_full=torch.log_softmax(logits.detach(), -1), binary=True)
    stats = [out.stats.topk_kl, out.stats.topk_tv, binary.binary_kl, binary.binary_tv,
             out.stats.full_kl, *out.stats.ddot.values()]
    # r itself (ratio/* metrics) is +inf exactly where e^{log r} is beyond float32: the true value
    r_overflows = bool((case["resp"].reshape(-1) & (out.stats.log_ratio > 88.0)).any())
    finite = (bool(torch.isfinite(out.loss)) and bool(torch.isfinite(logits.grad).all())
              and all(bool(torch.isfinite(s).all()) for s in stats)
              # a metric over no token is NaN by design ("n/a", never 0.0): judge the others
              and all(bool(torch.isfinite(v).all()) for key, v in out.metrics.items()
                      if float(out.metric_sums[key].count) > 0
                      and not (r_overflows and key.startswith("ratio/"))))
    return True, finite


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_extreme_inputs_give_finite_loss_gradient_and_stats(seed):
    in_scope, finite = run_case(extreme_case(seed))
    assume(in_scope)  # an overflowing kept ratio is no evidence either way: draw another case
    assert finite


def _topk_kl_one_minus_sum(mu_logp, pi_logp, mu_tail_logp, pi_tail_logp, mu=None):
    """A planted bug: D with the tails as 1 − Σ head (SPEC §2 forbids it), x·log(x/y) unguarded."""
    mu_p, pi_p = mu_logp.exp(), pi_logp.exp()
    mu_t, pi_t = 1 - mu_p.sum(-1), 1 - pi_p.sum(-1)
    return (mu_p * (mu_logp - pi_logp)).sum(-1) + mu_t * torch.log(mu_t / pi_t)


def test_planted_non_finite_divergence_fails_the_property(monkeypatch):
    monkeypatch.setattr(stats_module, "topk_kl", _topk_kl_one_minus_sum)
    with pytest.raises(AssertionError):
        test_extreme_inputs_give_finite_loss_gradient_and_stats()


def test_draws_out_of_scope_are_not_passes(monkeypatch):
    """Every draw out of scope (a planted ``run_case``): the property fails for want of evidence."""
    monkeypatch.setattr(sys.modules[__name__], "run_case", lambda case: (False, True))
    with pytest.raises(HypothesisException):
        test_extreme_inputs_give_finite_loss_gradient_and_stats()


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e4, 0.0), st.floats(-1e4, 0.0), st.sampled_from([0.0, 1.0, -1.0, 5.0]),
       st.booleans(), st.sampled_from([None, 0.5, 2.0]))
def test_dropped_zero_advantage_and_capped_tokens(logp, mu_logp, adv, keep, cap):
    # a kept, uncapped token's r = e^{log r} is the true value: finite only while representable
    assume(not (keep and adv != 0 and cap is None and logp - mu_logp > LOG_RATIO_REPRESENTABLE))
    f64 = torch.float64  # float64: the check compares with math.exp, not float32 rounding
    lp = torch.tensor([logp], dtype=f64, requires_grad=True)
    value = token_surrogate(lp, torch.tensor([mu_logp], dtype=f64), torch.tensor([adv], dtype=f64),
                            torch.tensor([float(keep)], dtype=f64), cap)
    value.sum().backward()
    assert torch.isfinite(lp.grad).all()
    if not keep or adv == 0:  # exactly 0, value and gradient: selected, not multiplied
        assert value.item() == 0.0 and lp.grad.item() == 0.0
    elif cap is not None:  # −Â·min(r, c), gradient −Â·min(r, c)
        expected = -adv * math.exp(min(logp - mu_logp, math.log(cap)))
        assert value.item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
        assert lp.grad.item() == pytest.approx(expected, rel=1e-5, abs=1e-30)


def test_masked_token_at_minus_100_and_capped_token_at_minus_110():
    lp = torch.tensor([0.0, -110.0], requires_grad=True)
    mu = torch.tensor([-100.0, 0.0])
    value = token_surrogate(lp, mu, torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), clip_ratio_c=2.0)
    value.sum().backward()
    assert value[0].item() == 0.0 and torch.isfinite(value).all() and torch.isfinite(lp.grad).all()
    assert value[1].item() == -math.exp(-110.0) or value[1].item() == 0.0  # float32 underflow


def test_binary_kl_near_one_is_the_true_finite_value():
    # π_k within 1e-9 of 1 in float32: log π_k rounds to 0; the complement comes from the rest
    n = 8
    mu_z = torch.full((1, n), -10.0)
    mu_z[0, 0] = 0.0
    pi_z = torch.full((1, n), -22.0)
    pi_z[0, 0] = 0.0
    mu, pi = torch.log_softmax(mu_z, -1), torch.log_softmax(pi_z, -1)
    assert pi[0, 0].item() == 0.0
    support = support_from_full(mu, torch.tensor([0]), k=3)
    from pdm_lab.tokenwise import token_stats

    got = token_stats(support, policy_on_support(pi, support.ids)).binary_kl.item()
    mpmath.mp.dps = 40
    m0, p0 = 1 / (1 + 7 * mpmath.e ** -10), 1 / (1 + 7 * mpmath.e ** -22)
    want = float(m0 * mpmath.log(m0 / p0) + (1 - m0) * mpmath.log((1 - m0) / (1 - p0)))
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-3)


def test_diagnose_ratio_is_finite_where_r_is():
    mu = torch.log_softmax(torch.tensor([[0.0, -100.0, 0.0]]), -1)
    pi = torch.log_softmax(torch.tensor([[0.0, 0.0, -5.0]]), -1)
    out = diagnose(mu, pi, torch.tensor([1]), torch.tensor([1.0]), k=1)
    assert torch.isfinite(out["ratio"]).all() and out["ratio"].item() > 1e40


def main() -> None:
    parser = argparse.ArgumentParser(description="randomized extreme calls of pdm_policy_loss")
    parser.add_argument("--calls", type=int, default=6000)
    args = parser.parse_args()
    bad = skipped = 0
    for seed in range(args.calls):
        in_scope, finite = run_case(extreme_case(seed))
        skipped += not in_scope
        bad += in_scope and not finite
    print(f"{args.calls} randomized extreme calls: {bad} with NaN/inf in loss, gradient or stats; "
          f"{skipped} out of scope (a kept, uncapped token with log r > {LOG_RATIO_REPRESENTABLE:g})")


if __name__ == "__main__":
    main()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_binary_kl_with_a_rest_below_float_underflow_is_rescued(compiled):
    # π's rest 7·e⁻¹¹⁰ ≈ 1.2e-47 is below even float32's denormals: the plain sum of the rest's
    # probabilities (the fast path) underflowed to 0 (KL +inf), so the row is redone by log-sum-exp
    from pdm_lab.numerics import rest_logmass_from_probs
    from pdm_lab.tokenwise import token_stats

    n = 8
    mu_z, pi_z = torch.full((1, n), -10.0), torch.full((1, n), -110.0)
    mu_z[0, 0] = pi_z[0, 0] = 0.0
    mu, pi = torch.log_softmax(mu_z, -1), torch.log_softmax(pi_z, -1)
    support = support_from_full(mu, torch.tensor([0]), k=3)
    pol = policy_on_support(pi, support.ids)
    _, rescue = rest_logmass_from_probs(pol.logp[:, 0].detach(), torch.exp(pol.logp.detach()),
                                        torch.exp(pol.tail_logp), support.k_index)
    assert rescue.tolist() == [True]  # the fast path alone would not do
    got = token_stats(support, pol, compiled=compiled).binary_kl.item()
    mpmath.mp.dps = 60
    m0, p0 = 1 / (1 + 7 * mpmath.e ** -10), 1 / (1 + 7 * mpmath.e ** -110)
    want = float(m0 * mpmath.log(m0 / p0) + (1 - m0) * mpmath.log((1 - m0) / (1 - p0)))
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-3)
