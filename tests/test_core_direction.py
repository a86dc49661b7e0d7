"""Ḋ and its estimators against float64 central finite differences and SPEC §3's exactness facts."""
import torch
from hypothesis import example, given, strategies as st

from core_helpers import kl_along, mismatched_pair, sample_from
from pdm_lab.divergence import topk_kl
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full

EPS = 1e-5


def _stats(mu, pi, k, sampled, convention="union"):
    support = support_from_full(mu, sampled, k=k, convention=convention)
    pol = policy_on_support(pi, support.ids)
    return support, token_stats(support, pol, mu_full=mu, pi_full=pi)


def _direction(pi_row, k):
    v = -torch.exp(pi_row)
    v[k] += 1.0
    return v


@given(n=st.integers(2, 3000), k=st.integers(1, 25), seed=st.integers(0, 10**6),
       scale=st.sampled_from([0.5, 2.0, 5.0]), convention=st.sampled_from(["union", "kslot"]))
def test_exact_ddot_matches_finite_difference(n, k, seed, scale, convention):
    mu, pi = mismatched_pair(3, n, seed, scale=scale)
    sampled = sample_from(mu, seed)
    _, stats = _stats(mu, pi, k, sampled, convention)
    for row in range(3):
        v = _direction(pi[row], int(sampled[row]))
        fd = (kl_along(mu[row], pi[row], v, EPS) - kl_along(mu[row], pi[row], v, -EPS)) / (2 * EPS)
        assert torch.isclose(stats.ddot["exact"][row], fd, rtol=1e-5, atol=1e-8), (row, fd)


@given(n=st.integers(3, 2000), k=st.integers(1, 20), seed=st.integers(0, 10**6),
       convention=st.sampled_from(["union", "kslot"]))
def test_topk_estimator_is_derivative_of_topk_kl(n, k, seed, convention):
    """`topk` is the exact first-order change of D itself, S held fixed, the full vocabulary moving."""
    mu, pi = mismatched_pair(2, n, seed)
    sampled = sample_from(mu, seed)
    support, stats = _stats(mu, pi, k, sampled, convention)

    def d_at(eta):
        moved = []
        for row in range(2):
            v = _direction(pi[row], int(sampled[row]))
            moved.append(torch.log_softmax(pi[row] + eta * v, dim=-1))
        pol = policy_on_support(torch.stack(moved), support.ids)
        return topk_kl(support.mu_logp, pol.logp, support.mu_tail_logp, pol.tail_logp)

    fd = (d_at(EPS) - d_at(-EPS)) / (2 * EPS)
    torch.testing.assert_close(stats.ddot["topk"], fd, rtol=1e-5, atol=1e-8)


@given(seed=st.integers(0, 10**6), n=st.integers(3, 400))
def test_agg_exact_when_tail_has_one_token(seed, n):
    mu, pi = mismatched_pair(4, n, seed)
    sampled = torch.argmax(mu, dim=1)  # inside the top-(n−1): t = 1
    _, stats = _stats(mu, pi, n - 1, sampled)
    torch.testing.assert_close(stats.ddot["agg"], stats.ddot["exact"], rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 10**6), n=st.integers(5, 400), k=st.integers(1, 4))
def test_uniform_exact_when_pi_uniform_on_tail(seed, n, k):
    mu, _ = mismatched_pair(3, n, seed)
    sampled = torch.argmax(mu, dim=1)
    support = support_from_full(mu, sampled, k=k)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(3, n, generator=gen, dtype=torch.float64)
    in_s = torch.zeros(3, n, dtype=torch.bool).scatter_(1, support.ids.clamp(min=0), True)
    z = torch.where(in_s, z, torch.full_like(z, -1.3))  # π equal on every tail token
    pi = torch.log_softmax(z, dim=-1)
    stats = token_stats(support, policy_on_support(pi, support.ids), mu_full=mu, pi_full=pi)
    torch.testing.assert_close(stats.ddot["uniform"], stats.ddot["exact"], rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 10**6), n=st.integers(5, 400), k=st.integers(1, 4), c=st.floats(0.2, 5.0))
@example(seed=17022, n=5, k=4, c=4.0)  # a tail token above the head's old +3 lift
def test_topk_exact_when_mu_over_pi_constant_on_tail(seed, n, k, c):
    gen = torch.Generator().manual_seed(seed)
    zpi = torch.randn(3, n, generator=gen, dtype=torch.float64)
    pi = torch.log_softmax(zpi, dim=-1)
    zmu = zpi + 0.7 * torch.randn(3, n, generator=gen, dtype=torch.float64)
    # make μ ∝ π on μ's own tail: build μ, read its support, then overwrite the tail
    mu0 = torch.log_softmax(zmu, dim=-1)
    sampled = torch.argmax(mu0, dim=1)
    top = support_from_full(mu0, sampled, k=k).ids
    in_s = torch.zeros(3, n, dtype=torch.bool).scatter_(1, top.clamp(min=0), True)
    tail = zpi + torch.log(torch.tensor(c, dtype=torch.float64))
    # the head lifted above every tail token (its order kept), so μ's top-K stays the same ids
    lift = (torch.where(in_s, -torch.inf, tail).amax(1) - torch.where(in_s, zmu, torch.inf).amin(1)).clamp(min=0) + 3.0
    zmu = torch.where(in_s, zmu + lift[:, None], tail)
    mu = torch.log_softmax(zmu, dim=-1)
    support = support_from_full(mu, sampled, k=k)
    assert torch.equal(support.ids, top)
    stats = token_stats(support, policy_on_support(pi, support.ids), mu_full=mu, pi_full=pi)
    torch.testing.assert_close(stats.ddot["topk"], stats.ddot["exact"], rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 10**6), n=st.integers(3, 2000), k=st.integers(1, 20),
       scale=st.sampled_from([0.3, 1.0, 3.0]), noise=st.sampled_from([0.1, 0.5, 2.0]))
def test_certified_interval_and_error_bounds(seed, n, k, scale, noise):
    mu, pi = mismatched_pair(8, n, seed, scale=scale, noise=noise)
    sampled = sample_from(mu, seed)
    support, stats = _stats(mu, pi, k, sampled)
    exact = stats.ddot["exact"]
    tol = 1e-12
    assert bool((stats.ddot_lower <= exact + tol).all() and (exact <= stats.ddot_upper + tol).all())
    t = support.tail_count.double()
    live = t > 0
    pt, mt = stats.pi_tail, stats.mu_tail
    inv_t = torch.where(live, 1 / t.clamp(min=1), torch.zeros_like(t))
    err_agg = stats.ddot["agg"] - exact
    assert bool((err_agg >= -(1 - inv_t) * pt**2 - tol).all() and (err_agg <= pt * mt + tol).all())
    err_uni = stats.ddot["uniform"] - exact
    assert bool((err_uni >= -(1 - inv_t) * pt * mt - tol).all())
    assert bool((err_uni <= pt * mt * inv_t + (1 - inv_t) * pt**2 + tol).all())


@given(seed=st.integers(0, 10**6), n=st.integers(2, 300))
def test_expectation_identities(seed, n):
    """E_{k∼μ}[Ḋ] = −‖μ − π‖² and E_{k∼π}[Ḋ] = 0, summing the exact Ḋ over every k."""
    mu, pi = mismatched_pair(1, n, seed)
    rows_mu, rows_pi = mu.expand(n, n).contiguous(), pi.expand(n, n).contiguous()
    _, stats = _stats(rows_mu, rows_pi, 3, torch.arange(n))
    p_mu, p_pi = torch.exp(mu[0]), torch.exp(pi[0])
    torch.testing.assert_close((p_mu * stats.ddot["exact"]).sum(), -((p_mu - p_pi) ** 2).sum(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close((p_pi * stats.ddot["exact"]).sum(), torch.zeros((), dtype=torch.float64), atol=1e-12, rtol=0)


def test_empty_tail_every_estimator_is_exact():
    mu, pi = mismatched_pair(5, 6, 3)
    sampled = sample_from(mu, 3)
    for k in (6, 10):
        support, stats = _stats(mu, pi, k, sampled)
        assert bool((support.tail_count == 0).all())
        for name in ("agg", "uniform", "topk"):
            torch.testing.assert_close(stats.ddot[name], stats.ddot["exact"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(stats.topk_kl, stats.full_kl, rtol=1e-12, atol=1e-14)
