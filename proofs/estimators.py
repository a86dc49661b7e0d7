"""SPEC §3's estimator table: when each top-K estimator of Ḋ is exact, and what `topk` is.

Every estimator is head + tail term, head = (π_k − μ_k) + Σ_{i∈S} π_i(μ_i − π_i), t = n − |S|:

    agg      π_T(μ_T − π_T)            exact when t ≤ 1
    uniform  π_T(μ_T − π_T)/t          exact when π is uniform on the tail
    topk     (μ_T/π_T − 1)·Σ_{i∉S} π_i²  exact when μ/π is constant on the tail;
                                        always = d/dη of the top-K KL D along v

On generic instances each claim also checks pdm_lab's estimator against the SPEC formula
evaluated at 50 digits, so a wrong formula in the code fails here.
"""
from __future__ import annotations

import sympy as sp
import torch
from mpmath import mp

from pdm_lab.errors import PDMInputError
from pdm_lab.support import support_from_slots

from . import implementation as impl
from .reference import Instance, log_softmax_float64, random_instance, topk_kl
from .registry import Checker, claim
from .symbolic import (d_at_zero, expand_sums, general_residual, i, kl_along, mu_, pi_, residual,
                       simplex_point, softmax_of, topk_kl_along, weights)

t_sym = sp.Symbol("t", integer=True, positive=True)


def _generic(check: Checker, count: int, sizes=(4, 9, 30), min_tail: int = 2) -> list[Instance]:
    """Random instances whose tail has at least `min_tail` tokens, both conventions."""
    out: list[Instance] = []
    while len(out) < count:
        size = check.rng.choice(sizes)
        inst = random_instance(check.rng, size, check.rng.randint(1, size - min_tail),
                               check.rng.choice(("union", "kslot")))
        if inst.tail.count >= min_tail:
            out.append(inst)
    return out


def _check_against_formula(check: Checker, name: str, insts: list[Instance], rows: list[dict],
                           source: str) -> None:
    """pdm_lab's Ḋ_<name> equals head + SPEC's tail term (50 digits) on every instance."""
    for inst, row in zip(insts, rows):
        check.close(row[f"ddot_{name}"], inst.head() + inst.spec_tail_terms()[name],
                    f"{source} ddot_{name} vs head + SPEC tail term", inst)


def _witness_inexact(check: Checker, name: str, insts: list[Instance], rows: list[dict]) -> None:
    """Outside the exactness condition the estimator is not exact (the condition is not vacuous)."""
    gap = max(abs(mp.mpf(row[f"ddot_{name}"]) - inst.ddot_by_derivative()) for inst, row in zip(insts, rows))
    check.that(gap > 1e-9, f"some generic instance with t ≥ 2 has ddot_{name} ≠ Ḋ (largest gap "
                           f"{mp.nstr(gap, 3)})")


def _with_pi_logits(inst: Instance, logits: list[float], label: str) -> Instance:
    return Instance(inst.mu_logp, log_softmax_float64(logits), inst.k, inst.K, inst.convention,
                    inst.advantage, label)


@claim("agg_exact_when_tail_at_most_one", method="sympy + diagnose with t ∈ {0, 1} and generic t")
def agg_exact_when_tail_at_most_one(check: Checker) -> None:
    """Ḋ_agg = head + π_T(μ_T − π_T) is exact when t ≤ 1 (the tail is one atom or empty), and
    in general not for t ≥ 2."""
    mu_j, pi_j = sp.symbols("mu_j pi_j", positive=True)
    check.zero(residual(pi_j * (mu_j - pi_j) - pi_j * (mu_j - pi_j)), "t = 1: Σ_T π_i(μ_i − π_i) − agg")
    mu2, pi2 = sp.symbols("mu_a mu_b", positive=True), sp.symbols("pi_a pi_b", positive=True)
    gap = (sum(pi2) * (sum(mu2) - sum(pi2))) - sum(p * (a - p) for a, p in zip(mu2, pi2))
    check.that(sp.expand(gap) != 0 and gap.subs({mu2[0]: sp.Rational(1, 10), mu2[1]: sp.Rational(1, 10),
                                                  pi2[0]: sp.Rational(1, 5), pi2[1]: sp.Rational(1, 20)}) != 0,
               "t = 2: agg − exact tail is a nonzero polynomial (π_aμ_b + π_bμ_a − 2π_aπ_b)")

    small = []
    for size in (2, 3, 5, 12):
        for K, convention in ((size - 1, "union"), (size - 1, "kslot"), (max(size - 2, 1), "union"),
                              (size, "union"), (size + 3, "kslot")):
            small += [random_instance(check.rng, size, K, convention) for _ in range(3)]
    small = [inst for inst in small if inst.tail.count <= 1]
    check.that(any(inst.tail.count == 1 for inst in small) and any(inst.tail.count == 0 for inst in small),
               "instances cover t = 0 and t = 1")
    for inst, row in zip(small, impl.diagnose(small)):
        check.close(row["ddot_agg"], inst.ddot_by_derivative(), f"t = {inst.tail.count}: ddot_agg = Ḋ", inst)

    generic = _generic(check, 40)
    rows = impl.diagnose(generic)
    _check_against_formula(check, "agg", generic, rows, "diagnose")
    _check_against_formula(check, "agg", generic, impl.rollout_view(generic, temperature=0.8), "rollout view")
    _witness_inexact(check, "agg", generic, rows)


@claim("uniform_exact_when_pi_uniform_on_tail", method="sympy Σ (general t) + diagnose on built instances")
def uniform_exact_when_pi_uniform_on_tail(check: Checker) -> None:
    """Ḋ_uniform = head + π_T(μ_T − π_T)/t is exact when π is uniform on the tail, whatever μ's
    tail is: Σ_{i∉S} c(μ_i − c) = π_T(μ_T − π_T)/t with π_T = t·c."""
    c = sp.Symbol("c", positive=True)
    exact_tail = sp.Sum(c * (mu_[i] - c), (i, 1, t_sym))
    mu_tail = sp.Sum(mu_[i], (i, 1, t_sym))
    check.zero(general_residual(exact_tail, (t_sym * c) * (mu_tail - t_sym * c) / t_sym),
               "general t: Σ c(μ_i − c) − π_T(μ_T − π_T)/t")
    pa, pb, ma, mb = sp.symbols("pi_a pi_b mu_a mu_b", positive=True)
    gap = (pa + pb) * (ma + mb - pa - pb) / 2 - (pa * (ma - pa) + pb * (mb - pb))
    check.that(sp.factor(gap) != 0, f"t = 2, π not uniform: uniform − exact = {sp.factor(gap)} ≠ 0")

    built = []
    for inst in _generic(check, 40, sizes=(4, 7, 20, 45)):
        logits = list(inst.pi_logp)
        level = check.rng.gauss(-2.0, 1.5)
        for t in range(inst.n):
            if t not in inst.support:
                logits[t] = level
        built.append(_with_pi_logits(inst, logits, "π uniform on the tail"))
    for inst, row in zip(built, impl.diagnose(built)):
        check.that(set(inst.support) == set(row["support"]), "support as SPEC §2", inst)
        check.close(row["ddot_uniform"], inst.ddot_by_derivative(), "π uniform on T: ddot_uniform = Ḋ", inst)

    generic = _generic(check, 40)
    rows = impl.diagnose(generic)
    _check_against_formula(check, "uniform", generic, rows, "diagnose")
    _check_against_formula(check, "uniform", generic, impl.rollout_view(generic, temperature=1.2),
                           "rollout view")
    _witness_inexact(check, "uniform", generic, rows)


@claim("topk_exact_when_ratio_constant_on_tail", method="sympy Σ (general t) + diagnose on built instances")
def topk_exact_when_ratio_constant_on_tail(check: Checker) -> None:
    """Ḋ_topk = head + (μ_T/π_T − 1)·Σ_{i∉S} π_i² is exact when μ_i = ρ·π_i on the tail:
    Σ_{i∉S} π_i(ρπ_i − π_i) = (ρ − 1)Σπ_i² and μ_T/π_T = ρ."""
    rho = sp.Symbol("rho", positive=True)
    exact_tail = sp.Sum(pi_[i] * (rho * pi_[i] - pi_[i]), (i, 1, t_sym))
    pi_tail = sp.Sum(pi_[i], (i, 1, t_sym))
    mu_tail = expand_sums(sp.Sum(rho * pi_[i], (i, 1, t_sym)))
    topk = (mu_tail / pi_tail - 1) * sp.Sum(pi_[i] ** 2, (i, 1, t_sym))
    check.zero(general_residual(exact_tail, sp.cancel(expand_sums(topk))),
               "general t: Σ π_i(ρπ_i − π_i) − (μ_T/π_T − 1)Σπ_i²")

    built = []
    for inst in _generic(check, 40, sizes=(4, 7, 20, 45)):
        logits = list(inst.pi_logp)
        shift = check.rng.gauss(0.0, 1.0)
        for t in range(inst.n):
            if t not in inst.support:
                logits[t] = inst.mu_logp[t] + shift
        built.append(_with_pi_logits(inst, logits, "μ/π constant on the tail"))
    for inst, row in zip(built, impl.diagnose(built)):
        check.close(row["ddot_topk"], inst.ddot_by_derivative(), "μ/π constant on T: ddot_topk = Ḋ", inst)
    generic = _generic(check, 30)
    _witness_inexact(check, "topk", generic, impl.diagnose(generic))


@claim("topk_is_derivative_of_topk_kl", method="sympy n=2..5 (every S∋k) + diagnose/rollout vs 50-digit d/dη D")
def topk_is_derivative_of_topk_kl(check: Checker) -> None:
    """Ḋ_topk = d/dη D(μ, softmax(z + ηv))|₀ exactly, for any fixed S ∋ k (so for both the
    `union` and the `kslot` support); finite as π_T → 0 (SPEC §8)."""
    for size in range(2, 6):
        w, mu = weights(size), simplex_point(size)
        pi = softmax_of(w)
        v = [(1 if t == 0 else 0) - pi[t] for t in range(size)]
        for s in range(1, size):
            support = list(range(s))                      # k = 0 ∈ S; any S ∋ k up to relabelling
            tail = range(s, size)
            head = (pi[0] - mu[0]) + sp.Add(*[pi[t] * (mu[t] - pi[t]) for t in support])
            mu_t, pi_t = sp.Add(*[mu[t] for t in tail]), sp.Add(*[pi[t] for t in tail])
            topk = head + (mu_t / pi_t - 1) * sp.Add(*[pi[t] ** 2 for t in tail])
            check.zero(residual(d_at_zero(topk_kl_along(mu, w, v, support)) - topk),
                       f"n={size}, |S|={s}: d/dη D − Ḋ_topk")

    insts = [random_instance(check.rng, size, check.rng.randint(1, size), convention)
             for size in (3, 6, 15, 40) for convention in ("union", "kslot") for _ in range(6)]
    rows = impl.diagnose(insts)
    rollout = impl.rollout_view(insts, temperature=0.7)
    for inst, row, roll in zip(insts, rows, rollout):
        want = inst.topk_kl_derivative()
        check.that(set(row["support"]) == set(inst.support), "diagnose support = SPEC §2 support", inst)
        check.close(row["ddot_topk"], want, "diagnose ddot_topk vs d/dη D (50 digits)", inst)
        check.close(roll["ddot_topk"], want, "rollout-view ddot_topk vs d/dη D (50 digits)", inst)
        check.close(row["topk_kl"], topk_kl(inst.mu, inst.pi, inst.support), "diagnose D", inst)

    # Tiny tails through the registered estimator itself: relative accuracy, finite, no NaN.
    for pi_tail in (mp.mpf("1e-30"), mp.mpf("1e-200"), mp.mpf("1e-300")):
        for _ in range(4):
            count = check.rng.randint(2, 1000)
            sumsq = pi_tail ** 2 * (1 / mp.mpf(count) + (1 - 1 / mp.mpf(count)) * check.rng.random())
            mu_tail = mp.mpf(check.rng.choice((1e-3, 0.3))) * check.rng.random()
            got = impl.estimator_tail_terms(float(mu_tail), float(pi_tail), count, float(mp.log(sumsq)))
            want = (mu_tail / pi_tail - 1) * sumsq
            check.that(all(map(mp.isfinite, got.values())), f"finite tail terms at π_T={pi_tail}")
            check.close(got["topk"], want, f"topk tail term at π_T = {mp.nstr(pi_tail, 3)}, t = {count}",
                        atol=0, rtol=1e-9)


def _eps_family(check: Checker, eps: mp.mpf, shares: dict, convention: str) -> Instance:
    """Head shares fixed, tail mass ε (k in the tail of μ's top-K): μ = ((1−ε)α, εγ), π likewise."""
    mu = [(1 - eps) * a for a in shares["mu_head"]] + [eps * g for g in shares["mu_tail"]]
    pi = [(1 - eps) * a for a in shares["pi_head"]] + [eps * g for g in shares["pi_tail"]]
    K = len(shares["mu_head"])
    k = K + shares["k_in_tail"]
    return Instance(tuple(float(mp.log(x)) for x in mu), tuple(float(mp.log(x)) for x in pi), k, K,
                    convention, label=f"tail mass ε = {mp.nstr(eps, 2)}")


def _shares(check: Checker, count: int) -> list:
    out = [check.rng.uniform(0.5, 1.5) for _ in range(count)]
    return [x / sum(out) for x in out]


@claim("k_must_be_in_support", method="sympy ε-series + pdm_lab supports + ε-scaling at 50 digits")
def k_must_be_in_support(check: Checker) -> None:
    """k must be in S: with k in the tail the derivative of D misses Ḋ at first order in the tail
    mass ε (coefficient μ_k/μ_T − π_k/π_T), while with k ∈ S every estimator errs at O(ε²)."""
    eps = sp.Symbol("epsilon", positive=True)
    al, be, ga, ka, la, nu = sp.symbols("alpha beta gamma kappa lambda nu", positive=True)
    mu = [(1 - eps) * al, (1 - eps) * (1 - al), eps * ga, eps * (1 - ga) * la, eps * (1 - ga) * (1 - la)]
    pi = [(1 - eps) * be, (1 - eps) * (1 - be), eps * ka, eps * (1 - ka) * nu, eps * (1 - ka) * (1 - nu)]
    k = 2
    v = [(1 if t == k else 0) - pi[t] for t in range(5)]
    exact = d_at_zero(kl_along(mu, pi, v))
    without_k = d_at_zero(topk_kl_along(mu, pi, v, [0, 1]))
    with_k = d_at_zero(topk_kl_along(mu, pi, v, [0, 1, 2]))
    first = sp.series(without_k - exact, eps, 0, 2).removeO()
    check.zero(residual(first.coeff(eps, 0)), "k ∉ S: zeroth-order error")
    check.zero(residual(first.coeff(eps, 1) - (ga - ka)), "k ∉ S: first-order error − (γ − κ)")
    check.zero(residual(sp.series(with_k - exact, eps, 0, 2).removeO()), "k ∈ S: Ḋ_topk error is O(ε²)")
    tail = [3, 4]
    mu_t, pi_t = sp.Add(*[mu[t] for t in tail]), sp.Add(*[pi[t] for t in tail])
    exact_tail = sp.Add(*[pi[t] * (mu[t] - pi[t]) for t in tail])
    for name, term in (("agg", pi_t * (mu_t - pi_t)), ("uniform", pi_t * (mu_t - pi_t) / 2)):
        check.zero(residual(sp.series(term - exact_tail, eps, 0, 2).removeO()), f"k ∈ S: {name} error is O(ε²)")

    # pdm_lab: the sampled token is always in the support, and a support without it is refused.
    insts = [random_instance(check.rng, size, K, convention)
             for size in (5, 12, 40) for K in (1, 3) for convention in ("union", "kslot") for _ in range(4)]
    for inst, row in zip(insts, impl.diagnose(insts)):
        check.that(inst.k in row["support"] and set(row["support"]) == set(inst.support),
                   "k ∈ pdm_lab's support, which is SPEC §2's", inst)
    try:
        support_from_slots(torch.tensor([[0, 1]]), torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64)),
                           torch.tensor([2]), vocab_size=4)
    except PDMInputError:
        check.that(True, "")
    else:
        check.that(False, "support_from_slots accepted a support without the sampled token")

    # ε-scaling (union, where the tail is exactly the small mass ε): pdm_lab's estimators
    # (k ∈ S) err at O(ε²); dropping k from S errs at O(ε).
    for _ in range(3):
        shares = {"mu_head": _shares(check, 3), "pi_head": _shares(check, 3),
                  "mu_tail": _shares(check, 4), "pi_tail": _shares(check, 4), "k_in_tail": 1}
        coefficient = abs(shares["mu_tail"][1] - shares["pi_tail"][1])
        for eps_value in (mp.mpf("1e-2"), mp.mpf("1e-3"), mp.mpf("1e-4")):
            inst = _eps_family(check, eps_value, shares, "union")
            row = impl.diagnose([inst])[0]
            exact_value = inst.ddot_by_derivative()
            top_k_only = tuple(sorted(range(inst.n), key=lambda t: (-inst.mu[t], t))[:inst.K])
            k_out = abs(inst.topk_kl_derivative(top_k_only) - exact_value)
            check.close(k_out / eps_value, coefficient, "k ∉ S: error/ε → |μ_k/μ_T − π_k/π_T|", inst,
                        atol=3 * float(eps_value), rtol=0)
            for name in ("agg", "uniform", "topk"):
                err = abs(mp.mpf(row[f"ddot_{name}"]) - exact_value)
                check.that(err <= 4 * eps_value ** 2 + 1e-13,
                           f"k ∈ S: |ddot_{name} − Ḋ| = {mp.nstr(err, 3)} ≤ 4ε²", inst)
