"""SPEC §3b: the coupled direction c_t = Â_t r_t ⟨P ∇_θ D_O, ∇_θ log π_t(k_t)⟩.

Two claims: (1) for a tabular softmax with one token per state and P = I it is Â_t r_t Ḋ_topk,t,
so ``pdm_coupled`` is ``pdm_topk``; (2) with shared parameters and any diagonal P, Σ_t M_t c_t is
the exact first-order change of D_O under the step Σ_t M_t Â_t r_t P ∇_θ log π_t(k_t) (and c_t
alone under token t's step). Each is proved with sympy on a small instance, then pdm_lab's
``pdm_lab.coupled`` is run in float64 and compared with the derivative of D_O's definition at
50 digits (``reference.topk_kl``, mpmath differentiation).
"""
from __future__ import annotations

import dataclasses

import sympy as sp
import torch
from mpmath import mp
from torch.func import jvp

from pdm_lab.mask_config import MaskConfig
from pdm_lab.coupled import coupled_scores, differentiable_topk_kl
from pdm_lab.masks import compute_mask
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_full

from .reference import random_logits, softmax, spec_support, topk_kl
from .registry import Checker, ClaimFailed, claim
from .symbolic import residual, simplex_point, softmax_of, weights

DTYPE = torch.float64
#: The shared-parameter claim's numeric part: how many draws with an out-of-region token it checks,
#: and the δ that decides O (small enough that most draws have one).
SHARED_TRIALS = 3
SHARED_DELTA = 0.03


# ------------------------------------------------------------------------------ the torch side

class _LinearPolicy:
    """logits_t = prior[s_t] + X[s_t] θ: states share θ (X = I per state and no sharing: tabular).

    A ``CoupledDirection``: u = P ∇_θ D_O by autograd, g by forward-mode JVP.
    """

    def __init__(self, prior, X, theta, states, support, precond=None):
        self.prior, self.X, self.theta, self.states = prior, X, theta, states
        self.support, self.precond = support, precond
        self.k_ids = support.ids.gather(1, support.k_index[:, None])

    def logits(self, theta):
        return self.prior[self.states] + torch.einsum("tij,j->ti", self.X[self.states], theta)

    def logp_k(self, theta):
        return torch.log_softmax(self.logits(theta), -1).gather(1, self.k_ids)[:, 0]

    def grad_of_outside_divergence(self, outside):
        theta = self.theta.clone().requires_grad_(True)
        d = differentiable_topk_kl(self.support, policy_on_support(self.logits(theta), self.support.ids))
        (grad,) = torch.autograd.grad(d[outside].sum(), theta)
        return grad if self.precond is None else self.precond * grad

    def directional_logp(self, u):
        return jvp(self.logp_k, (self.theta,), (u,))[1]

    def grad_logp(self, t):
        theta = self.theta.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.logp_k(theta)[t], theta)
        return grad


def _random_problem(check: Checker, *, states: int, n: int, dim: int, tokens: int, K: int,
                    tabular: bool = False):
    """Random μ per state, π = softmax(prior + Xθ), sampled k from μ, random Â (some zero)."""
    rng = check.rng
    if tabular:  # θ = the logits table itself: X[s] selects the block of state s
        dim = states * n
        X = torch.zeros(states, n, dim, dtype=DTYPE)
        for s in range(states):
            X[s, :, s * n:(s + 1) * n] = torch.eye(n, dtype=DTYPE)
    else:
        X = torch.tensor([[[rng.gauss(0, 1) for _ in range(dim)] for _ in range(n)] for _ in range(states)],
                         dtype=DTYPE)
    prior = torch.tensor([random_logits(rng, n, "gauss") for _ in range(states)], dtype=DTYPE)
    theta = torch.tensor([rng.gauss(0, 0.3) for _ in range(dim)], dtype=DTYPE)
    mu_state = torch.log_softmax(prior + torch.tensor([[rng.gauss(0, 1.2) for _ in range(n)]
                                                       for _ in range(states)], dtype=DTYPE), -1)
    st = list(range(states)) if tabular else [rng.randrange(states) for _ in range(tokens)]
    st_t = torch.tensor(st)
    mu_full = mu_state[st_t]
    k = torch.tensor([rng.choices(range(n), weights=[float(x) for x in mu_full[t].exp()])[0]
                      for t in range(len(st))])
    adv = torch.tensor([0.0 if rng.random() < 0.15 else rng.gauss(0, 1) for _ in st], dtype=DTYPE)
    support = support_from_full(mu_full, k, k=K)
    return prior, X, theta, st_t, mu_full, k, adv, support


def _mp_d_outside(policy: _LinearPolicy, mu_full, k, K, outside, step) -> mp.mpf:
    """d/dη Σ_{t∈O} D_t(θ + η·step) at η = 0, at 50 digits, from the definitions."""
    prior = [[mp.mpf(float(x)) for x in row] for row in policy.prior]
    X = policy.X.tolist()
    theta = [mp.mpf(float(x)) for x in policy.theta]
    step = [mp.mpf(float(x)) for x in step]
    rows = [int(t) for t in torch.nonzero(outside)[:, 0]]
    mus = {t: softmax([mp.mpf(float(x)) for x in mu_full[t]]) for t in rows}
    sups = {t: spec_support(mus[t], int(k[t]), K, "union") for t in rows}

    def d_o(eta):
        th = [a + eta * b for a, b in zip(theta, step)]
        total = mp.mpf(0)
        for t in rows:
            s = int(policy.states[t])
            z = [prior[s][i] + mp.fsum(X[s][i][j] * th[j] for j in range(len(th))) for i in range(len(prior[s]))]
            total += topk_kl(mus[t], softmax(z), sups[t])
        return total
    return mp.diff(d_o, 0)


# ------------------------------------------------------------------------------ the claims

@claim("coupled_reduces_to_topk",
       method="sympy n=2..4, two states (every |S|) + pdm_lab.coupled float64 vs 50-digit d/dη D")
def coupled_reduces_to_topk(check: Checker) -> None:
    """Tabular softmax, one token per state, P = I: c_t = Â_t r_t Ḋ_topk,t on O and 0 off O, so
    ``pdm_coupled`` drops exactly what ``pdm_topk`` drops.

    Symbolic: two states a, b (own logits, both tokens in O); ⟨∇_θ D_O, ∇_θ log π_a(k_a)⟩ has
    no cross-state term and equals Ḋ_topk,a = head + (μ_T/π_T − 1)Σ_{i∉S}π_i². Numeric: the core
    driver with a JVP direction on random tabular instances vs the 50-digit derivative of D.
    """
    for size in range(2, 5):
        za = list(sp.symbols(f"za0:{size}", real=True))
        zb = list(sp.symbols(f"zb0:{size}", real=True))
        mu_a, mu_b = simplex_point(size, "ma"), simplex_point(size, "mb")
        for s in range(1, size):
            support = list(range(s))  # k = 0 ∈ S (any S ∋ k up to relabelling)
            tail = range(s, size)

            def d_of(z, mu):
                pi = softmax_of([sp.exp(x) for x in z])
                mu_t, pi_t = sp.Add(*[mu[t] for t in tail]), sp.Add(*[pi[t] for t in tail])
                head = sp.Add(*[mu[t] * (sp.log(mu[t]) - sp.log(pi[t])) for t in support])
                return head + (mu_t * (sp.log(mu_t) - sp.log(pi_t)) if s < size else 0), pi

            d_a, pi_a = d_of(za, mu_a)
            d_b, _ = d_of(zb, mu_b)
            log_pi_k = za[0] - sp.log(sp.Add(*[sp.exp(x) for x in za]))
            theta = za + zb
            g = sp.Add(*[sp.diff(d_a + d_b, x) * sp.diff(log_pi_k, x) for x in theta])
            mu_t, pi_t = sp.Add(*[mu_a[t] for t in tail]), sp.Add(*[pi_a[t] for t in tail])
            head = (pi_a[0] - mu_a[0]) + sp.Add(*[pi_a[t] * (mu_a[t] - pi_a[t]) for t in support])
            topk = head + (mu_t / pi_t - 1) * sp.Add(*[pi_a[t] ** 2 for t in tail])
            w = weights(size, "wa")
            check.zero(residual((g - topk).subs({sp.exp(x): wi for x, wi in zip(za, w)})),
                       f"n={size}, |S|={s}: ⟨∇D_O, ∇log π_a⟩ − Ḋ_topk,a (two tabular states)")

    cfg = MaskConfig(rule="pdm_coupled", delta=0.02, k=3)
    for trial in range(4):
        n = check.rng.choice((4, 7, 12))
        prior, X, theta, states, mu_full, k, adv, support = _random_problem(
            check, states=24, n=n, dim=0, tokens=24, K=3, tabular=True)
        policy = _LinearPolicy(prior, X, theta, states, support)
        pi = policy_on_support(policy.logits(theta), support.ids)
        stats = token_stats(support, pi)
        out = coupled_scores(policy, stats.topk_kl, adv, stats.ratio, cfg)
        check.that(bool(out.outside.any()), f"trial {trial}: some token is outside the region")
        for t in range(len(states)):
            if not bool(out.outside[t]):
                check.close(out.c[t], 0, f"trial {trial}, token {t} off O: c = 0", atol=0)
                continue
            step = policy.grad_logp(t)  # P = I: the token's own step, unit Â r
            only_t = torch.arange(len(states)) == t  # other tokens live in other states: their D is fixed
            want = _mp_d_outside(policy, mu_full, k, 3, only_t, step)
            check.close(out.c[t], float(adv[t] * stats.ratio[t]) * want,
                        f"trial {trial}, token {t}: c_t vs Â r d/dη D_t (50 digits)", atol=1e-13, rtol=1e-9)
        coupled = compute_mask(cfg, dataclasses.replace(stats, coupled=out.c), adv)
        topk = compute_mask(MaskConfig(rule="pdm_topk", delta=cfg.delta, k=3), stats, adv)
        check.that(torch.equal(coupled, topk), f"trial {trial}: pdm_coupled mask = pdm_topk mask")


@claim("coupled_is_first_order_change",
       method="sympy shared θ ∈ R², 3 tokens, diagonal P + float64 vs 50-digit d/dη D_O")
def coupled_is_first_order_change(check: Checker) -> None:
    """With shared parameters and a diagonal preconditioner P, d/dη D_O(θ + η Σ_t M_t Â_t r_t P
    ∇_θ log π_t(k_t)) at η = 0 equals Σ_t M_t c_t, c_t = Â_t r_t ⟨P ∇_θ D_O, ∇_θ log π_t(k_t)⟩.

    Symbolic: two states over n = 3 tokens whose logits are integer combinations of θ ∈ R²,
    three tokens (two in O, supports of size 2), symbolic P, Â, r, M. Numeric: random shared
    linear models (tokens per state > 1), the core driver vs the 50-digit derivative of D_O
    along the masked batch step and along each token's own step.
    """
    # θ ∈ R² enters through e_j = exp θ_j (so exp z is a Laurent monomial in e, and every
    # expression is rational in e after differentiation); ∂/∂θ_j = e_j ∂/∂e_j
    e = list(sp.symbols("e0:2", positive=True))
    eta_ = sp.Symbol("eta", real=True)
    p = list(sp.symbols("p0:2", positive=True))
    X = [[[1, 0], [0, 1], [1, -1]], [[2, 1], [-1, 0], [0, 0]]]  # states × tokens × dim
    toks = [(0, 0, [0, 1]), (1, 1, [1, 0]), (0, 2, [2, 0])]       # (state, k, S)
    mus = [[sp.Rational(1, 2), sp.Rational(1, 3), sp.Rational(1, 6)],
           [sp.Rational(1, 5), sp.Rational(3, 5), sp.Rational(1, 5)]]
    outside = [0, 1]
    adv = sp.symbols("A0:3", real=True)
    ratio = sp.symbols("r0:3", positive=True)
    keep = sp.symbols("M0:3", real=True)

    def pi_of(s, ev):
        return softmax_of([sp.Mul(*[ev[j] ** X[s][i][j] for j in range(2)]) for i in range(3)])

    def d_tok(t, ev):
        s, _, sup = toks[t]
        pi, mu = pi_of(s, ev), mus[s]
        tail = [i for i in range(3) if i not in sup]
        mu_t, pi_t = sp.Add(*[mu[i] for i in tail]), sp.Add(*[pi[i] for i in tail])
        return sp.Add(*[mu[i] * (sp.log(mu[i]) - sp.log(pi[i])) for i in sup]) + mu_t * (sp.log(mu_t) - sp.log(pi_t))

    def d_theta(f, j):
        return e[j] * sp.diff(f, e[j])

    d_o = sp.Add(*[d_tok(t, e) for t in outside])
    grad_do = [d_theta(d_o, j) for j in range(2)]
    grad_lp = [[d_theta(sp.log(pi_of(toks[t][0], e)[toks[t][1]]), j) for j in range(2)] for t in range(3)]
    c = [adv[t] * ratio[t] * sp.Add(*[p[j] * grad_do[j] * grad_lp[t][j] for j in range(2)]) for t in range(3)]
    step = [sp.Add(*[keep[t] * adv[t] * ratio[t] * p[j] * grad_lp[t][j] for t in range(3)]) for j in range(2)]
    moved = [ej * sp.exp(eta_ * sj) for ej, sj in zip(e, step)]  # θ + η·step
    lhs = sp.diff(sp.Add(*[d_tok(t, moved) for t in outside]), eta_).subs(eta_, 0)
    check.zero(residual(lhs - sp.Add(*[keep[t] * c[t] for t in range(3)])),
               "d/dη D_O(θ + η·step) − Σ_t M_t c_t (shared θ ∈ R², symbolic diagonal P, Â, r, M)")

    cfg = MaskConfig(rule="pdm_coupled", delta=SHARED_DELTA, k=3)
    trial = draws = 0
    while trial < SHARED_TRIALS:  # a draw with no out-of-region token tests nothing: draw again
        if draws == 10 * SHARED_TRIALS:
            raise ClaimFailed(f"only {trial} of {SHARED_TRIALS} numeric trials ran: {draws} draws, the "
                              f"others without an out-of-region token (δ = {cfg.delta})")
        draws += 1
        prior, X_t, theta, states, mu_full, k, adv_t, support = _random_problem(
            check, states=3, n=6, dim=5, tokens=10, K=3)
        precond = torch.tensor([check.rng.uniform(0.2, 5.0) for _ in range(5)], dtype=DTYPE)
        policy = _LinearPolicy(prior, X_t, theta, states, support, precond)
        stats = token_stats(support, policy_on_support(policy.logits(theta), support.ids))
        out = coupled_scores(policy, stats.topk_kl, adv_t, stats.ratio, cfg)
        if not bool(out.outside.any()):
            continue
        trial += 1
        mask = torch.tensor([check.rng.random() < 0.7 for _ in range(len(states))], dtype=DTYPE)
        steps = [adv_t[t] * stats.ratio[t] * precond * policy.grad_logp(t) for t in range(len(states))]
        batch_step = sum(m * s for m, s in zip(mask, steps))
        want = _mp_d_outside(policy, mu_full, k, 3, out.outside, batch_step)
        check.close(float((mask * out.c).sum()), want, f"trial {trial}: Σ M c vs d/dη D_O (50 digits)",
                    atol=1e-13, rtol=1e-9)
        for t in range(len(states)):
            want_t = _mp_d_outside(policy, mu_full, k, 3, out.outside, steps[t])
            check.close(out.c[t], want_t, f"trial {trial}, token {t}: c_t vs d/dη D_O along its own step",
                        atol=1e-13, rtol=1e-9)
