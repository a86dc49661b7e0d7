"""SPEC §2: the top-K KL D is a KL divergence (so D ≥ 0) and never exceeds the full KL.

D is the KL between the coarsened pair (μ on S, μ_T) and (π on S, π_T). The chain rule gives

    KL(μ‖π) − D = μ_T · KL(μ|_T/μ_T ‖ π|_T/π_T) ≥ 0      (the log-sum inequality),

with either support convention, since the identity holds for any S.
"""
from __future__ import annotations

import sympy as sp
from mpmath import mp

from . import implementation as impl
from .reference import Instance, kl, random_instance, topk_kl
from .registry import Checker, claim
from .symbolic import general_residual, i, n, residual

p_, q_ = sp.IndexedBase("p", positive=True), sp.IndexedBase("q", positive=True)
x_sym = sp.Symbol("x", positive=True)
#: φ(x) = x − 1 − log x ≥ 0: KL(p‖q) = Σ p_i φ(q_i/p_i) when Σp = Σq = 1 (Gibbs).
PHI = x_sym - 1 - sp.log(x_sym)


def _gibbs_general(check: Checker) -> None:
    """General n: Σ p_i φ(q_i/p_i) = Σ p_i log(p_i/q_i) + Σq − Σp, and φ ≥ 0 with φ(1) = 0."""
    gibbs = sp.Sum(p_[i] * PHI.subs(x_sym, q_[i] / p_[i]), (i, 1, n))
    kl_sum = sp.Sum(p_[i] * sp.log(p_[i] / q_[i]), (i, 1, n))
    diff = general_residual(sp.expand_log(gibbs, force=True),
                            sp.expand_log(kl_sum, force=True) + sp.Sum(q_[i], (i, 1, n)) - sp.Sum(p_[i], (i, 1, n)))
    check.zero(diff, "general n: Σ p φ(q/p) − (KL(p‖q) + Σq − Σp)")
    check.that(sp.solve(sp.diff(PHI, x_sym), x_sym) == [1], "φ'(x) = 1 − 1/x vanishes only at x = 1")
    check.that(sp.diff(PHI, x_sym, 2).is_positive is True, "φ''(x) = 1/x² > 0: φ is convex")
    check.zero(PHI.subs(x_sym, 1), "φ(1) = 0, so φ ≥ 0 and KL ≥ 0")


def _instances(check: Checker, count: int) -> list[Instance]:
    return [random_instance(check.rng, size, check.rng.randint(1, size + 1), convention)
            for size in (3, 10, 60) for convention in ("union", "kslot") for _ in range(count)]


@claim("topk_kl_nonnegative", method="sympy Σ Gibbs (general n) + diagnose topk_kl/topk_tv")
def topk_kl_nonnegative(check: Checker) -> None:
    """D ≥ 0, with D = 0 when μ = π: D is the KL of the coarsened pair on S ∪ {tail}."""
    _gibbs_general(check)
    insts = _instances(check, 8)
    same = [Instance(inst.mu_logp, inst.mu_logp, inst.k, inst.K, inst.convention, label="π = μ")
            for inst in insts[::4]]
    rows = impl.diagnose(insts + same)
    lowest = 0.0
    for inst, row in zip(insts + same, rows):
        want = topk_kl(inst.mu, inst.pi, inst.support)
        check.close(row["topk_kl"], want, "diagnose topk_kl vs D (50 digits)", inst, atol=1e-14)
        check.that(row["topk_kl"] >= -1e-15, f"D = {row['topk_kl']!r} ≥ 0 (up to rounding)", inst)
        if row["topk_kl"] < 0:
            lowest = min(lowest, row["topk_kl"])
        inside = set(inst.support)
        tail = lambda p: mp.fsum(p[t] for t in range(inst.n) if t not in inside)  # noqa: E731
        tv = (mp.fsum(abs(inst.mu[t] - inst.pi[t]) for t in inst.support)
              + abs(tail(inst.mu) - tail(inst.pi))) / 2
        check.close(row["topk_tv"], tv, "diagnose topk_tv vs ½(Σ_S|μ − π| + |μ_T − π_T|)", inst)
    for inst, row in zip(same, rows[len(insts):]):
        check.that(abs(row["topk_kl"]) <= 1e-15 and abs(row["full_kl"]) <= 1e-15, "π = μ: D = 0", inst)
    if lowest < 0:
        check.note(f"topk_kl returned a rounding-level negative value ({lowest:.3g}) on some "
                   "instance; D ≥ 0 holds to 1e-15")


@claim("topk_kl_le_full_kl", method="sympy chain rule (general t) + exhaustive n≤5 + diagnose")
def topk_kl_le_full_kl(check: Checker) -> None:
    """D ≤ KL(μ‖π) for both conventions: KL − D = μ_T·KL(μ|_T/μ_T ‖ π|_T/π_T) ≥ 0."""
    t_sym = sp.Symbol("t", integer=True, positive=True)
    mu_t, pi_t = sp.symbols("mu_T pi_T", positive=True)
    tail_kl = sp.Sum(p_[i] * sp.log(p_[i] / q_[i]), (i, 1, t_sym)) - mu_t * sp.log(mu_t / pi_t)
    chained = mu_t * sp.Sum((p_[i] / mu_t) * sp.log((p_[i] / mu_t) / (q_[i] / pi_t)), (i, 1, t_sym))
    diff = general_residual(sp.expand_log(chained, force=True), sp.expand_log(tail_kl, force=True))
    diff = sp.expand(diff.subs(sp.Sum(p_[i], (i, 1, t_sym)), mu_t))
    check.zero(sp.simplify(diff), "general t: Σ_T μ log(μ/π) − μ_T log(μ_T/π_T) − μ_T·KL(cond.)")
    for t in range(2, 5):  # the same identity with explicit symbols, no Σ machinery
        mu = list(sp.symbols(f"a0:{t}", positive=True))
        pi = list(sp.symbols(f"b0:{t}", positive=True))
        mt, pt = sp.Add(*mu), sp.Add(*pi)
        lhs = sp.Add(*[a * sp.log(a / b) for a, b in zip(mu, pi)]) - mt * sp.log(mt / pt)
        rhs = mt * sp.Add(*[(a / mt) * sp.log((a / mt) / (b / pt)) for a, b in zip(mu, pi)])
        check.zero(residual(sp.expand_log(lhs - rhs, force=True)), f"t={t}: chain rule")

    # exhaustive small cases: every n ≤ 5, K ≤ n, k and convention
    small = []
    for size in range(2, 6):
        for _ in range(2):
            base = random_instance(check.rng, size, 1)
            small += [Instance(base.mu_logp, base.pi_logp, k, K, convention)
                      for K in range(1, size + 1) for k in range(size) for convention in ("union", "kslot")]
    insts = small + _instances(check, 6)
    for inst, row in zip(insts, impl.diagnose(insts)):
        check.that(set(row["support"]) == set(inst.support), "support = SPEC §2's", inst)
        check.that(row["topk_kl"] <= row["full_kl"] + 1e-15,
                   f"D = {row['topk_kl']!r} ≤ KL = {row['full_kl']!r}", inst)
        ts = inst.tail
        inside = set(inst.support)
        cond = lambda p, total: [p[t] / total for t in range(inst.n) if t not in inside]  # noqa: E731
        gap = ts.mu_tail * kl(cond(inst.mu, ts.mu_tail), cond(inst.pi, ts.pi_tail)) if ts.count else 0
        check.close(row["full_kl"] - row["topk_kl"], gap, "KL − D vs μ_T·KL(μ|_T ‖ π|_T)", inst, atol=1e-14)
        check.close(row["full_kl"], kl(inst.mu, inst.pi), "diagnose full_kl", inst, atol=1e-14)
