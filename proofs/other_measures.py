"""SPEC §3, other proximity measures: all follow from d/dη E_π[h] = Cov_π(v, h).

    reverse KL  KL(π‖μ)            →  Cov_π(v, log(π/μ))
    f-divergence Σ π_i f(μ_i/π_i)  →  Cov_π(v, f(ρ) − ρf′(ρ)),  ρ = μ/π   (f = ρ log ρ gives Ḋ)
    TV  ½Σ|π_i − μ_i|               →  ½Cov_π(v, sign(π − μ)) away from ties (one-sided at ties)
    |log r|                          →  d log r/dη = ‖v‖² > 0: the ratio test's first-order rule

The torch side differentiates pdm_lab's own measures (``divergence.full_kl``, ``topk_tv``,
``policy_on_support``'s log π) with autograd along v and compares with the covariance at 50 digits.
"""
from __future__ import annotations

import itertools

import sympy as sp
import torch
from mpmath import mp

from . import implementation as impl
from .reference import Instance, covariance, derivative_at_zero, kl, moved, random_instance, softmax
from .registry import Checker, claim
from .symbolic import (Z_SYMBOL, d_at_zero, eta, expand_sums, general_residual, i, in_vocabulary,
                       m, n, on_simplex, pi_, residual, simplex_point, softmax_of, v_, weights, z_)


def _moved_symbolic(w: list, v: list) -> list:
    """softmax(z + ηv) with exp z = w."""
    moved_w = [wi * sp.exp(eta * vi) for wi, vi in zip(w, v)]
    total = sp.Add(*moved_w)
    return [x / total for x in moved_w]


def _cov_symbolic(pi: list, a: list, b: list) -> sp.Expr:
    ea = sp.Add(*[p * x for p, x in zip(pi, a)])
    eb = sp.Add(*[p * y for p, y in zip(pi, b)])
    return sp.Add(*[p * x * y for p, x, y in zip(pi, a, b)]) - ea * eb


def _random_rows(check: Checker, sizes=(2, 3, 7, 30), per_size: int = 4) -> list[Instance]:
    return [random_instance(check.rng, size, size) for size in sizes for _ in range(per_size)]


def _v_tensor(insts: list[Instance]) -> torch.Tensor:
    """v = e_k − π per row, from torch's own softmax of the float64 log π (the code's input)."""
    _, pi, sampled, _ = impl.log_probs(insts)
    v = -torch.exp(pi)
    v[torch.arange(len(insts)), sampled] += 1.0
    return v


@claim("covariance_rule", method="sympy Σ (general n) + autograd of E_π[h] via policy_on_support")
def covariance_rule(check: Checker) -> None:
    """d/dη E_{softmax(z+ηv)}[h] = Cov_π(v, h) for a fixed h: the rule behind every measure."""
    h_ = sp.IndexedBase("h")
    expectation = sp.Sum(h_[i] * sp.exp(z_[i] + eta * v_[i]), (i, 1, n)) / \
        sp.Sum(sp.exp(z_[i] + eta * v_[i]), (i, 1, n))
    derivative = on_simplex(d_at_zero(expectation).doit(), Z_SYMBOL)
    cov = sp.Sum(pi_[i] * v_[i] * h_[i], (i, 1, n)) - \
        sp.Sum(pi_[i] * v_[i], (i, 1, n)) * sp.Sum(pi_[i] * h_[i], (i, 1, n))
    check.zero(general_residual(derivative, cov), "general n: d/dη E_π[h] − Cov_π(v, h)")

    insts = _random_rows(check)
    h = [[check.rng.gauss(0.0, 2.0) for _ in range(inst.n)] for inst in insts]
    for size in sorted({inst.n for inst in insts}):
        rows = [r for r, inst in enumerate(insts) if inst.n == size]
        group = [insts[r] for r in rows]
        _, pi, _, _ = impl.log_probs(group)
        h_t = torch.tensor([h[r] for r in rows], dtype=impl.DTYPE)
        got = impl.directional_derivative(lambda z: (torch.exp(impl.full_log_policy(z)) * h_t).sum(-1),
                                          pi, _v_tensor(group))
        for r, inst, value in zip(rows, group, got):
            check.close(value, covariance(inst.pi, inst.v, h[r]), "d/dη E_π[h] by autograd vs Cov_π(v, h)", inst)


@claim("reverse_kl_derivative", method="sympy n=2..5 + autograd of full_kl(π, μ)")
def reverse_kl_derivative(check: Checker) -> None:
    """d/dη KL(π‖μ) = Cov_π(v, log(π/μ)) (the log π part has E_π[d log π/dη] = 0)."""
    for size in range(2, 6):
        w, mu = weights(size), simplex_point(size)
        pi = softmax_of(w)
        v = [(1 if t == 0 else 0) - pi[t] for t in range(size)]
        along = _moved_symbolic(w, v)
        reverse = sp.Add(*[p * (sp.log(p) - sp.log(a)) for p, a in zip(along, mu)])
        target = _cov_symbolic(pi, v, [sp.log(p / a) for p, a in zip(pi, mu)])
        check.zero(residual(sp.expand_log(d_at_zero(reverse) - target, force=True)),
                   f"n={size}: d/dη KL(π‖μ) − Cov_π(v, log(π/μ))")

    insts = _random_rows(check)
    for size in sorted({inst.n for inst in insts}):
        group = [inst for inst in insts if inst.n == size]
        mu, pi, _, _ = impl.log_probs(group)
        got = impl.directional_derivative(lambda z: impl.divergence.full_kl(impl.full_log_policy(z), mu),
                                          pi, _v_tensor(group))
        for inst, value in zip(group, got):
            h = [mp.log(p / a) for p, a in zip(inst.pi, inst.mu)]
            want = covariance(inst.pi, inst.v, h)
            check.close(want, derivative_at_zero(lambda e: kl(moved(inst.z, inst.v, e), inst.mu)),
                        "Cov_π(v, log(π/μ)) vs 50-digit d/dη KL(π‖μ)", inst, atol=1e-30)
            check.close(value, want, "autograd d/dη full_kl(π, μ) vs Cov_π(v, log(π/μ))", inst)


def _generic_f_residual(size: int) -> sp.Expr:
    """d/dη Σπ_i f(μ_i/π_i) − Cov_π(v, f(ρ) − ρf′(ρ)) for n = size, k = 0, generic f.

    f(ρ_i) and f′(ρ_i) become free symbols F_i, G_i (the identity must hold for every f), so the
    residual is a rational function that ``cancel`` reduces exactly.
    """
    f = sp.Function("f")
    w, mu = weights(size), simplex_point(size)
    pi = softmax_of(w)
    v = [(1 if t == 0 else 0) - pi[t] for t in range(size)]
    rho = [a / p for a, p in zip(mu, pi)]
    values, slopes = sp.symbols(f"F0:{size}"), sp.symbols(f"G0:{size}")

    def freeze(expr: sp.Expr) -> sp.Expr:
        for r, F, G in zip(rho, values, slopes):
            expr = expr.replace(lambda e: isinstance(e, sp.Subs) and sp.cancel(e.point[0] - r) == 0,
                                lambda e: G)
            expr = expr.subs(f(r), F)
        return expr

    derivative = freeze(d_at_zero(sp.Add(*[p * f(a / p) for p, a in zip(_moved_symbolic(w, v), mu)])))
    target = _cov_symbolic(pi, v, [F - r * G for r, F, G in zip(rho, values, slopes)])
    if derivative.has(f) or derivative.atoms(sp.Subs):
        raise AssertionError(f"f terms left unfrozen: {derivative.atoms(sp.Subs)}")
    return residual(derivative - target)


@claim("f_divergence_derivative", method="sympy generic f n=2..4 + diagnose Ḋ / autograd (KL, χ²)")
def f_divergence_derivative(check: Checker) -> None:
    """d/dη Σπ_i f(μ_i/π_i) = Cov_π(v, f(ρ) − ρf′(ρ)), ρ = μ/π; f = ρ log ρ (forward KL) gives
    Ḋ, f = −log ρ the reverse KL, f = (ρ − 1)² Pearson χ²(μ‖π)."""
    for size in range(2, 5):
        check.zero(_generic_f_residual(size), f"n={size}, generic f: d/dη D_f − Cov_π(v, f(ρ) − ρf′(ρ))")
    x = sp.Symbol("x", positive=True)
    for name, f, g in (("ρ log ρ", x * sp.log(x), -x), ("−log ρ", -sp.log(x), 1 - sp.log(x)),
                       ("(ρ − 1)²", (x - 1) ** 2, 1 - x ** 2)):
        check.zero(sp.simplify(f - x * sp.diff(f, x) - g), f"f = {name}: f − ρf′ = {g}")

    insts = _random_rows(check, sizes=(2, 5, 24))
    rows = impl.diagnose(insts)
    for size in sorted({inst.n for inst in insts}):
        idx = [r for r, inst in enumerate(insts) if inst.n == size]
        group = [insts[r] for r in idx]
        mu, pi, _, _ = impl.log_probs(group)
        mu_p = torch.exp(mu)
        chi2 = impl.directional_derivative(   # Σ (μ − π)²/π, π from policy_on_support
            lambda z: ((mu_p - torch.exp(impl.full_log_policy(z))) ** 2
                       * torch.exp(-impl.full_log_policy(z))).sum(-1), pi, _v_tensor(group))
        for r, inst, chi in zip(idx, group, chi2):
            rho = [a / p for a, p in zip(inst.mu, inst.pi)]
            check.close(rows[r]["ddot_exact"], covariance(inst.pi, inst.v, [-x_ for x_ in rho]),
                        "f = ρ log ρ: diagnose ddot_exact vs Cov_π(v, −ρ)", inst)
            check.close(chi, covariance(inst.pi, inst.v, [1 - x_ ** 2 for x_ in rho]),
                        "f = (ρ − 1)²: autograd d/dη χ² vs Cov_π(v, 1 − ρ²)", inst, atol=1e-10, rtol=1e-9)


@claim("tv_derivative", method="sympy sign patterns n=2..4 + autograd of topk_tv; ties at 50 digits")
def tv_derivative(check: Checker) -> None:
    """d/dη ½Σ|π_i − μ_i| = ½Cov_π(v, sign(π − μ)) away from ties; at a tie π_i = μ_i the
    derivative is one-sided, sign(π_i − μ_i) replaced by ±sign(dπ_i/dη)."""
    for size in range(2, 5):
        w, mu = weights(size), simplex_point(size)
        pi = softmax_of(w)
        v = [(1 if t == 0 else 0) - pi[t] for t in range(size)]
        along = _moved_symbolic(w, v)
        for signs in itertools.product((-1, 1), repeat=size):
            tv = sp.Add(*[s * (p - a) for s, p, a in zip(signs, along, mu)]) / 2
            target = _cov_symbolic(pi, v, list(signs)) / 2
            check.zero(residual(d_at_zero(tv) - target), f"n={size}, signs {signs}: d/dη TV − ½Cov")

    insts = _random_rows(check, sizes=(2, 4, 9, 40))
    for size in sorted({inst.n for inst in insts}):
        group = [inst for inst in insts if inst.n == size]
        mu, pi, _, _ = impl.log_probs(group)
        empty = torch.full((len(group),), float("-inf"), dtype=impl.DTYPE)
        got = impl.directional_derivative(   # K ≥ n: the top-K TV is the full TV
            lambda z: impl.divergence.topk_tv(mu, impl.full_log_policy(z), empty, empty), pi, _v_tensor(group))
        for inst, value in zip(group, got):
            signs = [mp.sign(p - a) for p, a in zip(inst.pi, inst.mu)]
            if min(abs(p - a) for p, a in zip(inst.pi, inst.mu)) > 1e-12:
                check.close(value, covariance(inst.pi, inst.v, signs) / 2,
                            "autograd d/dη topk_tv (K ≥ n) vs ½Cov_π(v, sign(π − μ))", inst)

    # ties (reference only: a float64 input cannot hold π_i = μ_i exactly after normalisation)
    for size in (3, 6):
        z = [mp.mpf(check.rng.gauss(0, 1)) for _ in range(size)]
        pi = softmax(z)
        mu = list(pi)
        shift = pi[2] / 3                                  # μ_0 = π_0 (tie), mass moved 2 → 1
        mu[1], mu[2] = mu[1] + shift, mu[2] - shift
        for k in range(size):
            v = [(1 if t == k else 0) - p for t, p in enumerate(pi)]
            tv = lambda e: sum(abs(a - b) for a, b in zip(moved(z, v, e), mu)) / 2  # noqa: E731
            speed = [p * (vi - sum(q * u for q, u in zip(pi, v))) for p, vi in zip(pi, v)]  # dπ_i/dη
            base = [mp.sign(p - a) for p, a in zip(pi, mu)]
            right = [s if s != 0 else mp.sign(sp_) for s, sp_ in zip(base, speed)]
            left = [s if s != 0 else -mp.sign(sp_) for s, sp_ in zip(base, speed)]
            h = mp.mpf("1e-25")                            # one-sided quotients, error O(h)
            check.that(abs(covariance(pi, v, right) - covariance(pi, v, left)) > 1e-6,
                       f"tie at token 0, k={k}: the two one-sided derivatives differ")
            check.close((tv(h) - tv(0)) / h, covariance(pi, v, right) / 2,
                        f"tie at token 0, k={k}: right derivative = ½Cov(v, s⁺)", atol=1e-20)
            check.close((tv(0) - tv(-h)) / h, covariance(pi, v, left) / 2,
                        f"tie at token 0, k={k}: left derivative = ½Cov(v, s⁻)", atol=1e-20)


@claim("ratio_test_first_order", method="sympy Σ (general n) + autograd of policy_on_support log π_k")
def ratio_test_first_order(check: Checker) -> None:
    """d log r/dη = ‖v‖² > 0 along v = e_k − π, so Â·(r − 1) > 0 is exactly the first-order
    test that the step Â·r·v grows |log r|: the ratio test is PDM's rule for the measure |log r|."""
    log_pi_m = z_[m] + eta * v_[m] - sp.log(sp.Sum(sp.exp(z_[i] + eta * v_[i]), (i, 1, n)))
    slope = on_simplex(d_at_zero(log_pi_m).doit(), Z_SYMBOL)
    check.zero(general_residual(slope, v_[m] - sp.Sum(pi_[i] * v_[i], (i, 1, n))),
               "general n: d log π_m/dη − (v_m − ⟨π, v⟩)")
    plugged = 1 - pi_[m] - sp.Sum(pi_[i] * (sp.KroneckerDelta(i, m) - pi_[i]), (i, 1, n))
    norm = sp.Sum((sp.KroneckerDelta(i, m) - pi_[i]) ** 2, (i, 1, n))
    check.zero(general_residual(in_vocabulary(expand_sums(plugged)), in_vocabulary(expand_sums(norm))),
               "general n: v = e_m − π gives d log r/dη = ‖e_m − π‖²")
    p_m = sp.Symbol("pi_m", positive=True)
    check.that(sp.solve(sp.Eq((1 - p_m) ** 2, 0), p_m) == [1],
               "‖v‖² ≥ (1 − π_m)² > 0 unless π_m = 1, impossible for softmax with n ≥ 2")

    insts = _random_rows(check, sizes=(2, 6, 50))
    diag = impl.diagnose(insts)
    for size in sorted({inst.n for inst in insts}):
        idx = [r for r, inst in enumerate(insts) if inst.n == size]
        group = [insts[r] for r in idx]
        mu, pi, sampled, adv = impl.log_probs(group)
        mu_k = mu.gather(1, sampled[:, None])[:, 0]
        log_r = lambda z: impl.full_log_policy(z).gather(1, sampled[:, None])[:, 0] - mu_k  # noqa: E731
        v = _v_tensor(group)
        slope = impl.directional_derivative(log_r, pi, v)
        grow = impl.directional_derivative(lambda z: log_r(z).abs(), pi, adv[:, None] * v)
        for r, inst, s, g in zip(idx, group, slope, grow):
            check.close(s, mp.fsum(x ** 2 for x in inst.v), "autograd d log r/dη vs ‖v‖²", inst)
            check.that(float(s) > 0, "d log r/dη > 0", inst)
            if inst.advantage != 0 and abs(mp.log(inst.ratio)) > 1e-12:
                check.that((float(g) > 0) == (inst.advantage * (diag[r]["ratio"] - 1) > 0),
                           "Â·d|log r|/dη > 0 ⟺ Â(r − 1) > 0 (diagnose ratio)", inst)
