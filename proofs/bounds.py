"""SPEC §3's inequalities: the tail sum of squares, the estimators' error bounds, the certified
interval. Each is proved for t = 1..6 by a sum-of-nonnegative-terms certificate (sympy checks the
identity exactly and that every term is manifestly ≥ 0), and checked on pdm_lab's float64 output.

Tail notation: π_i, μ_i for i ∉ S (t of them), π_T = Σπ_i, μ_T = Σμ_i, S_T = Σπ_i², X_T = Σπ_iμ_i.
The exact tail term is X_T − S_T; Ḋ = head + X_T − S_T.
"""
from __future__ import annotations

from itertools import combinations

import sympy as sp
from mpmath import mp

from . import implementation as impl
from .reference import Instance, kth_largest, log_softmax_float64, random_instance, spec_support
from .registry import Checker, claim
from .symbolic import general_residual, i, j

#: Tail sizes of the certificates.
CERTIFIED_TAILS = range(1, 7)
#: Slack for float64 comparisons against bounds computed at 50 digits.
SLACK = 1e-13


class Tail:
    """Symbols of a tail of t tokens: π_i, μ_i > 0 and their sums."""

    def __init__(self, t: int) -> None:
        self.t = t
        self.pi = list(sp.symbols(f"p0:{t}", positive=True))
        self.mu = list(sp.symbols(f"a0:{t}", positive=True))
        self.pi_tail, self.mu_tail = sp.Add(*self.pi), sp.Add(*self.mu)
        self.sumsq = sp.Add(*[p ** 2 for p in self.pi])
        self.cross = sp.Add(*[p * a for p, a in zip(self.pi, self.mu)])

    def spread(self) -> list:
        """(1/t)·(π_i − π_j)² for i < j: Σ = S_T − π_T²/t."""
        return [(self.pi[a] - self.pi[b]) ** 2 / self.t for a, b in combinations(range(self.t), 2)]

    def off_diagonal_pi(self) -> list:
        """2π_iπ_j for i < j: Σ = π_T² − S_T."""
        return [2 * self.pi[a] * self.pi[b] for a, b in combinations(range(self.t), 2)]

    def off_diagonal_cross(self) -> list:
        """π_jμ_i for i ≠ j: Σ = π_Tμ_T − X_T."""
        return [self.pi[b] * self.mu[a] for a in range(self.t) for b in range(self.t) if a != b]


def certify(check: Checker, difference, terms: list, what: str) -> None:
    """difference = Σ terms exactly, and every term is manifestly ≥ 0 ⇒ difference ≥ 0."""
    check.zero(sp.expand(difference - sp.Add(*terms)), f"{what}: certificate identity")
    for term in terms:
        check.that(term.is_nonnegative is True, f"{what}: certificate term {term} ≥ 0")


def _instances(check: Checker, count: int, *, sizes=(5, 12, 40, 120)) -> list[Instance]:
    """Random instances with a nonempty tail, often heavy (small K, flat distributions)."""
    out = []
    while len(out) < count:
        size = check.rng.choice(sizes)
        inst = random_instance(check.rng, size, check.rng.choice((1, 2, 3, size // 2)),
                               check.rng.choice(("union", "kslot")))
        if inst.tail.count >= 1:
            out.append(inst)
    return out


@claim("tail_sumsq_ordering", method="certificates t=1..6, sympy Σ (general t) + policy_on_support")
def tail_sumsq_ordering(check: Checker) -> None:
    """π_T²/t ≤ Σ_{i∉S} π_i² ≤ π_T², equal on the left iff π is uniform on the tail, on the right
    iff the tail has one token with mass (t = 1 or a single live tail token)."""
    t_sym = sp.Symbol("t", integer=True, positive=True)
    x = sp.IndexedBase("pi")
    pairs = sp.Sum(sp.Sum((x[i] - x[j]) ** 2, (i, 1, t_sym)), (j, 1, t_sym))
    identity = 2 * t_sym * sp.Sum(x[i] ** 2, (i, 1, t_sym)) - 2 * sp.Sum(x[i], (i, 1, t_sym)) ** 2
    check.zero(general_residual(pairs, identity), "general t: Σ_iΣ_j(π_i − π_j)² = 2(tS_T − π_T²)")
    for t in CERTIFIED_TAILS:
        tail = Tail(t)
        certify(check, tail.sumsq - tail.pi_tail ** 2 / t, tail.spread(), f"t={t}: S_T − π_T²/t")
        certify(check, tail.pi_tail ** 2 - tail.sumsq, tail.off_diagonal_pi(), f"t={t}: π_T² − S_T")

    insts = _instances(check, 60)
    for inst, row in zip(insts, impl.rollout_view(insts, temperature=0.9)):
        ts = inst.tail
        got = mp.mpf(row["pi_tail_sumsq"])
        check.close(got, ts.sumsq, "policy_on_support tail_log_sumsq vs Σ_{i∉S} π_i²", inst, atol=0, rtol=1e-11)
        check.that(ts.pi_tail ** 2 / ts.count * (1 - 1e-12) <= got <= ts.pi_tail ** 2 * (1 + 1e-12),
                   f"π_T²/t ≤ S_T ≤ π_T² with pdm_lab's S_T = {mp.nstr(got, 8)}", inst)
    # equality cases: π uniform on the tail (left), one tail token (right)
    for inst in insts[:20]:
        logits = [(-1.0 if t not in inst.support else x) for t, x in enumerate(inst.pi_logp)]
        uniform = Instance(inst.mu_logp, log_softmax_float64(logits), inst.k, inst.K, inst.convention)
        row = impl.rollout_view([uniform])[0]
        check.close(row["pi_tail_sumsq"], uniform.tail.pi_tail ** 2 / uniform.tail.count,
                    "π uniform on T: S_T = π_T²/t", uniform, atol=0, rtol=1e-11)
    single = [random_instance(check.rng, size, size - 1, "kslot") for size in (2, 4, 9) for _ in range(3)]
    for inst, row in zip(single, impl.rollout_view(single)):
        check.close(row["pi_tail_sumsq"], inst.tail.pi_tail ** 2, "t = 1: S_T = π_T²", inst, atol=0, rtol=1e-11)


@claim("estimators_ordered_by_q", method="sympy + diagnose estimator differences")
def estimators_ordered_by_q(check: Checker) -> None:
    """The top-K estimators share the tail term (μ_T/π_T − 1)·Q with Q = π_T²/t (uniform) ≤
    Σ_{i∉S}π_i² (topk) ≤ π_T² (agg), so Ḋ_uniform ≤ Ḋ_topk ≤ Ḋ_agg when μ_T ≥ π_T, reversed
    when μ_T < π_T."""
    mu_t, pi_t, t_sym = sp.symbols("mu_T pi_T t", positive=True)
    factor = mu_t / pi_t - 1
    check.zero(sp.cancel(pi_t * (mu_t - pi_t) - factor * pi_t ** 2), "agg = (μ_T/π_T − 1)·π_T²")
    check.zero(sp.cancel(pi_t * (mu_t - pi_t) / t_sym - factor * pi_t ** 2 / t_sym),
               "uniform = (μ_T/π_T − 1)·π_T²/t")

    insts = _instances(check, 80)
    for inst, row in zip(insts, impl.diagnose(insts)):
        ts = inst.tail
        f = ts.mu_tail / ts.pi_tail - 1
        check.close(row["ddot_agg"] - row["ddot_uniform"], f * ts.pi_tail ** 2 * (1 - mp.mpf(1) / ts.count),
                    "Ḋ_agg − Ḋ_uniform = (μ_T/π_T − 1)π_T²(1 − 1/t)", inst)
        check.close(row["ddot_topk"] - row["ddot_uniform"], f * (ts.sumsq - ts.pi_tail ** 2 / ts.count),
                    "Ḋ_topk − Ḋ_uniform = (μ_T/π_T − 1)(S_T − π_T²/t)", inst)
        lo, mid, hi = row["ddot_uniform"], row["ddot_topk"], row["ddot_agg"]
        if ts.mu_tail < ts.pi_tail:
            lo, hi = hi, lo
        check.that(lo - SLACK <= mid <= hi + SLACK,
                   f"ordering by Q (μ_T {'≥' if ts.mu_tail >= ts.pi_tail else '<'} π_T): "
                   f"uniform {lo:.17g}, topk {mid:.17g}, agg {hi:.17g}", inst)


@claim("agg_error_bound", method="certificates t=1..6 (tight) + diagnose")
def agg_error_bound(check: Checker) -> None:
    """Ḋ_agg − Ḋ ∈ [−(1 − 1/t)π_T², π_T μ_T]; both ends are attained in the closure."""
    for t in CERTIFIED_TAILS:
        tl = Tail(t)
        err = tl.pi_tail * (tl.mu_tail - tl.pi_tail) - (tl.cross - tl.sumsq)
        lower = -(1 - sp.Rational(1, t)) * tl.pi_tail ** 2
        upper = tl.pi_tail * tl.mu_tail
        certify(check, err - lower, tl.off_diagonal_cross() + tl.spread(), f"t={t}: agg error ≥ lower")
        certify(check, upper - err, [p * a for p, a in zip(tl.pi, tl.mu)] + tl.off_diagonal_pi(),
                f"t={t}: agg error ≤ upper")
        if t >= 2:  # lower end: π uniform, μ_T → 0; upper end: π on one token, μ on the others
            c = sp.Symbol("c", positive=True)
            at_lower = {**{p: c for p in tl.pi}, **{a: 0 for a in tl.mu}}
            at_upper = {**{p: (c if n == 0 else 0) for n, p in enumerate(tl.pi)},
                        **{a: (0 if n == 0 else c) for n, a in enumerate(tl.mu)}}
            check.zero(sp.expand((err - lower).subs(at_lower)), f"t={t}: lower end attained")
            check.zero(sp.expand((upper - err).subs(at_upper)), f"t={t}: upper end attained")
    _check_error_bound(check, "agg", lambda ts: (-(1 - mp.mpf(1) / ts.count) * ts.pi_tail ** 2,
                                                 ts.pi_tail * ts.mu_tail))


@claim("uniform_error_bound", method="certificates t=1..6 + diagnose")
def uniform_error_bound(check: Checker) -> None:
    """Ḋ_uniform − Ḋ ∈ [−(1 − 1/t)π_T μ_T, π_T μ_T/t + (1 − 1/t)π_T²]."""
    for t in CERTIFIED_TAILS:
        tl = Tail(t)
        err = tl.pi_tail * (tl.mu_tail - tl.pi_tail) / t - (tl.cross - tl.sumsq)
        lower = -(1 - sp.Rational(1, t)) * tl.pi_tail * tl.mu_tail
        upper = tl.pi_tail * tl.mu_tail / t + (1 - sp.Rational(1, t)) * tl.pi_tail ** 2
        certify(check, err - lower, tl.off_diagonal_cross() + tl.spread(), f"t={t}: uniform error ≥ lower")
        certify(check, upper - err, [p * a for p, a in zip(tl.pi, tl.mu)] + tl.off_diagonal_pi(),
                f"t={t}: uniform error ≤ upper")
    _check_error_bound(check, "uniform", lambda ts: (
        -(1 - mp.mpf(1) / ts.count) * ts.pi_tail * ts.mu_tail,
        ts.pi_tail * ts.mu_tail / ts.count + (1 - mp.mpf(1) / ts.count) * ts.pi_tail ** 2))


def _check_error_bound(check: Checker, name: str, bounds) -> None:
    """pdm_lab's Ḋ_<name> − Ḋ_exact equals the reference error and lies within the bounds."""
    insts = _instances(check, 80)
    for inst, row in zip(insts, impl.diagnose(insts)):
        ts = inst.tail
        lower, upper = bounds(ts)
        spec = inst.spec_tail_terms()
        got = row[f"ddot_{name}"] - row["ddot_exact"]
        check.close(got, spec[name] - spec["exact"], f"Ḋ_{name} − Ḋ_exact", inst)
        check.that(lower - SLACK <= got <= upper + SLACK,
                   f"Ḋ_{name} − Ḋ = {got:.17g} in [{mp.nstr(lower, 10)}, {mp.nstr(upper, 10)}]", inst)


@claim("certified_interval", method="certificates t=1..6, exhaustive supports n≤6 + diagnose/rollout")
def certified_interval(check: Checker) -> None:
    """Ḋ ∈ [head − π_T², head + π_T·min(μ_T, μ_(K)) − π_T²/t] from top-K data alone; where the
    interval excludes 0 the sign of Ḋ is certain. Empty tail: the interval is the point Ḋ."""
    for t in CERTIFIED_TAILS:
        tl = Tail(t)
        m_sym = sp.Symbol("m", positive=True)              # any m ≥ max_{i∉S} μ_i
        gaps = list(sp.symbols(f"d0:{t}", nonnegative=True))
        at_gap = {a: m_sym - d for a, d in zip(tl.mu, gaps)}
        tail_part = tl.cross - tl.sumsq                    # Ḋ − head
        certify(check, tail_part + tl.pi_tail ** 2, [p * a for p, a in zip(tl.pi, tl.mu)] + tl.off_diagonal_pi(),
                f"t={t}: Ḋ ≥ head − π_T²")
        certify(check, (tl.pi_tail * m_sym - tl.pi_tail ** 2 / t - tail_part).subs(at_gap),
                [p * d for p, d in zip(tl.pi, gaps)] + tl.spread(),
                f"t={t}: Ḋ ≤ head + π_T·m − π_T²/t with μ_i = m − d_i")
    # m = min(μ_T, μ_(K)) bounds every tail μ_i: exhaustive over supports for n ≤ 6, with ties
    for size in range(2, 7):
        for _ in range(3):
            inst = random_instance(check.rng, size, 1)
            for K in range(1, size + 1):
                for k in range(size):
                    for convention in ("union", "kslot"):
                        support = spec_support(inst.mu, k, K, convention)
                        tail_mu = [inst.mu[x] for x in range(size) if x not in support]
                        check.that(all(x <= kth_largest(inst.mu, K) for x in tail_mu),
                                   f"max_(i∉S) μ_i ≤ μ_(K) (K={K}, k={k}, {convention})", inst)

    insts = _instances(check, 60) + [random_instance(check.rng, size, size + 1) for size in (3, 8)]
    rows = impl.diagnose(insts)
    rollout = impl.rollout_view(insts, temperature=1.1)
    certified = 0
    for inst, row, roll in zip(insts, rows, rollout):
        lower, upper = inst.interval()
        truth = inst.ddot_by_derivative()
        for source, values in (("diagnose", row), ("rollout view", roll)):
            check.close(values["ddot_lower"], lower, f"{source} ddot_lower", inst)
            check.close(values["ddot_upper"], upper, f"{source} ddot_upper", inst)
            check.that(values["ddot_lower"] - SLACK <= truth <= values["ddot_upper"] + SLACK,
                       f"{source}: Ḋ = {mp.nstr(truth, 12)} in [{values['ddot_lower']:.12g}, "
                       f"{values['ddot_upper']:.12g}]", inst)
            if values["ddot_lower"] > SLACK or values["ddot_upper"] < -SLACK:
                certified += 1
                check.that((truth > 0) == (values["ddot_lower"] > 0), f"{source}: certified sign", inst)
    check.that(certified > 0, "some instances have a certified sign")
