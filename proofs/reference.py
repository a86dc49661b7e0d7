"""The independent reference: SPEC's definitions evaluated with mpmath at 50 digits.

Nothing here imports pdm_lab. Derivatives are taken of the *definitions* (mpmath numerical
differentiation of KL(μ‖softmax(z + ηv)) at 50 digits), not of the closed forms the code uses,
so the code is never compared with a copy of itself. Callers run inside ``mpmath.workdps``.

An ``Instance`` is one token: float64 log-probabilities of μ and π (exactly what the torch side
receives), the sampled token k, K and the support convention. The reference distributions are
the exact softmax of those float64 numbers, so both sides start from the same input.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property

import mpmath
from mpmath import mp

#: Decimal digits of every reference computation.
PRECISION = 50


def softmax(x: list) -> list:
    """softmax(x) at the working precision."""
    top = max(x)
    e = [mp.exp(mp.mpf(xi) - top) for xi in x]
    total = mp.fsum(e)
    return [ei / total for ei in e]


def log_softmax_float64(logits: list[float]) -> tuple[float, ...]:
    """log softmax(logits) computed at high precision, rounded once to float64."""
    lse = mp.log(mp.fsum(mp.exp(mp.mpf(x)) for x in logits))
    return tuple(float(mp.mpf(x) - lse) for x in logits)


def kl(p: list, q: list) -> mpmath.mpf:
    """KL(p‖q) = Σ p_i log(p_i/q_i) with 0·log 0 = 0."""
    return mp.fsum(pi * mp.log(pi / qi) for pi, qi in zip(p, q) if pi != 0)


def total_variation(p: list, q: list) -> mpmath.mpf:
    """½ Σ |p_i − q_i|."""
    return mp.fsum(abs(pi - qi) for pi, qi in zip(p, q)) / 2


def spec_support(mu: list, k: int, K: int, convention: str) -> tuple[int, ...]:
    """S of SPEC §2: μ's K most probable ids (ties: lower id first), then k by the convention."""
    order = sorted(range(len(mu)), key=lambda i: (-mu[i], i))
    top = order[:min(K, len(mu))]
    if k in top:
        return tuple(top)
    if convention == "union":
        return tuple(top + [k])
    if convention == "kslot":
        return tuple(top[:-1] + [k])
    raise ValueError(f"unknown convention {convention!r}")


def kth_largest(mu: list, K: int) -> mpmath.mpf:
    """μ_(K), the K-th largest probability of μ (K clipped to n)."""
    return sorted(mu, reverse=True)[min(K, len(mu)) - 1]


def coarsen(p: list, support: tuple[int, ...]) -> list:
    """p on S followed by its tail mass Σ_{i∉S} p_i (summed, never 1 − head)."""
    inside = set(support)
    return [p[i] for i in support] + [mp.fsum(p[i] for i in range(len(p)) if i not in inside)]


def topk_kl(mu: list, pi: list, support: tuple[int, ...]) -> mpmath.mpf:
    """D = Σ_{i∈S} μ_i log(μ_i/π_i) + μ_T log(μ_T/π_T): KL between the coarsened distributions."""
    return kl(coarsen(mu, support), coarsen(pi, support))


def topk_tv(mu: list, pi: list, support: tuple[int, ...]) -> mpmath.mpf:
    """½(Σ_{i∈S}|μ_i − π_i| + |μ_T − π_T|)."""
    return total_variation(coarsen(mu, support), coarsen(pi, support))


def direction(pi: list, k: int) -> list:
    """v = e_k − π, the logit gradient of log π_k."""
    return [(1 if i == k else 0) - p for i, p in enumerate(pi)]


def moved(z: list, v: list, eta) -> list:
    """softmax(z + ηv)."""
    return softmax([zi + eta * vi for zi, vi in zip(z, v)])


def derivative_at_zero(f) -> mpmath.mpf:
    """d f/dη at η = 0 by mpmath's high-precision numerical differentiation."""
    return mp.diff(f, 0)


def covariance(pi: list, a: list, b: list) -> mpmath.mpf:
    """Cov_π(a, b) = Σ π_i a_i b_i − (Σ π_i a_i)(Σ π_i b_i)."""
    ea = mp.fsum(p * x for p, x in zip(pi, a))
    eb = mp.fsum(p * y for p, y in zip(pi, b))
    return mp.fsum(p * x * y for p, x, y in zip(pi, a, b)) - ea * eb


@dataclass(frozen=True)
class TailSums:
    """Sums over the tail T = complement of S, all at high precision.

    mu_tail, pi_tail: μ_T, π_T. sumsq: Σ_{i∉S} π_i². cross: Σ_{i∉S} π_i μ_i. count: t.
    mu_max: max_{i∉S} μ_i (0 for an empty tail).
    """

    mu_tail: mpmath.mpf
    pi_tail: mpmath.mpf
    sumsq: mpmath.mpf
    cross: mpmath.mpf
    count: int
    mu_max: mpmath.mpf


@dataclass(frozen=True)
class Instance:
    """One token for both sides: float64 log μ and log π over the vocabulary, k, K, convention."""

    mu_logp: tuple[float, ...]
    pi_logp: tuple[float, ...]
    k: int
    K: int
    convention: str = "union"
    advantage: float = 1.0
    label: str = ""

    @property
    def n(self) -> int:
        return len(self.mu_logp)

    @cached_property
    def mu(self) -> list:
        """μ = softmax(log μ as given), at high precision."""
        return softmax([mp.mpf(x) for x in self.mu_logp])

    @cached_property
    def z(self) -> list:
        """π's logits (the float64 log π, exactly)."""
        return [mp.mpf(x) for x in self.pi_logp]

    @cached_property
    def pi(self) -> list:
        """π = softmax(z)."""
        return softmax(self.z)

    @cached_property
    def support(self) -> tuple[int, ...]:
        return spec_support(self.mu, self.k, self.K, self.convention)

    @cached_property
    def v(self) -> list:
        return direction(self.pi, self.k)

    @cached_property
    def tail(self) -> TailSums:
        inside = set(self.support)
        out = [i for i in range(self.n) if i not in inside]
        return TailSums(
            mu_tail=mp.fsum(self.mu[i] for i in out),
            pi_tail=mp.fsum(self.pi[i] for i in out),
            sumsq=mp.fsum(self.pi[i] ** 2 for i in out),
            cross=mp.fsum(self.pi[i] * self.mu[i] for i in out),
            count=len(out),
            mu_max=max((self.mu[i] for i in out), default=mp.mpf(0)),
        )

    @property
    def ratio(self) -> mpmath.mpf:
        """r = π_k/μ_k."""
        return self.pi[self.k] / self.mu[self.k]

    def ddot_by_derivative(self) -> mpmath.mpf:
        """Ḋ = d/dη KL(μ‖softmax(z + ηv)) at η = 0, by numerical differentiation (the definition)."""
        return derivative_at_zero(lambda eta: kl(self.mu, moved(self.z, self.v, eta)))

    def topk_kl_derivative(self, support: tuple[int, ...] | None = None) -> mpmath.mpf:
        """d/dη D(μ, softmax(z + ηv)) at η = 0 with S held fixed (S depends on μ and k only)."""
        s = self.support if support is None else support
        return derivative_at_zero(lambda eta: topk_kl(self.mu, moved(self.z, self.v, eta), s))

    def head(self) -> mpmath.mpf:
        """(π_k − μ_k) + Σ_{i∈S} π_i(μ_i − π_i)."""
        mu, pi = self.mu, self.pi
        return (pi[self.k] - mu[self.k]) + mp.fsum(pi[i] * (mu[i] - pi[i]) for i in self.support)

    def spec_tail_terms(self) -> dict[str, mpmath.mpf]:
        """The tail terms of SPEC §3's table, evaluated from the high-precision tail sums."""
        ts = self.tail
        if ts.count == 0 or ts.pi_tail == 0:
            zero = mp.mpf(0)
            return {"exact": ts.cross - ts.sumsq, "agg": zero, "uniform": zero, "topk": zero}
        agg = ts.pi_tail * (ts.mu_tail - ts.pi_tail)
        return {"exact": ts.cross - ts.sumsq, "agg": agg, "uniform": agg / ts.count,
                "topk": (ts.mu_tail / ts.pi_tail - 1) * ts.sumsq}

    def interval(self) -> tuple[mpmath.mpf, mpmath.mpf]:
        """SPEC §3's certified interval [head − π_T², head + π_T·min(μ_T, μ_(K)) − π_T²/t]."""
        ts, h = self.tail, self.head()
        if ts.count == 0:
            return h, h
        mu_k_th = kth_largest(self.mu, self.K)
        return (h - ts.pi_tail ** 2,
                h + ts.pi_tail * min(ts.mu_tail, mu_k_th) - ts.pi_tail ** 2 / ts.count)

    def describe(self) -> str:
        def short(xs: list) -> str:
            shown = ", ".join(mpmath.nstr(x, 6) for x in xs[:8])
            return f"[{shown}{', …' if len(xs) > 8 else ''}]"
        label = f"{self.label}: " if self.label else ""
        return (f"{label}n={self.n} K={self.K} k={self.k} convention={self.convention} "
                f"Â={self.advantage:g} S={list(self.support)} μ={short(self.mu)} π={short(self.pi)}")


# --------------------------------------------------------------------------- random instances

def random_logits(rng: random.Random, n: int, style: str | None = None) -> list[float]:
    """Float logits of one of several shapes: gauss, peaked, flat, zipf (LLM-like), ties, and
    extreme (log-probs down to −300, as float32 LLM logits give: tails far below rounding)."""
    style = style or rng.choice(("gauss", "peaked", "flat", "zipf", "ties", "extreme"))
    if style == "gauss":
        scale = rng.choice((0.3, 1.0, 3.0))
        return [rng.gauss(0.0, scale) for _ in range(n)]
    if style == "peaked":
        x = [rng.gauss(0.0, 1.0) for _ in range(n)]
        x[rng.randrange(n)] += rng.uniform(4.0, 12.0)
        return x
    if style == "flat":
        return [rng.gauss(0.0, 0.1) for _ in range(n)]
    if style == "zipf":
        ranks = list(range(1, n + 1))
        rng.shuffle(ranks)
        s = rng.uniform(0.8, 2.0)
        return [-s * math.log(r) + rng.gauss(0.0, 0.1) for r in ranks]
    if style == "extreme":
        live = rng.randint(1, max(1, n // 3))
        return [rng.gauss(0.0, 1.0) if t < live else -rng.uniform(30.0, 300.0) for t in range(n)]
    if style == "ties":
        levels = [rng.gauss(0.0, 1.5) for _ in range(max(1, n // 3))]
        return [rng.choice(levels) for _ in range(n)]
    raise ValueError(f"unknown style {style!r}")


def random_pair(rng: random.Random, n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(log μ, log π) in float64: π a perturbation of μ (near, far) or independent of it."""
    x = random_logits(rng, n)
    mode = rng.choice(("near", "far", "independent"))
    if mode == "independent":
        y = random_logits(rng, n)
    else:
        noise = 0.05 if mode == "near" else 1.0
        y = [xi + rng.gauss(0.0, noise) for xi in x]
    return log_softmax_float64(x), log_softmax_float64(y)


def random_instance(rng: random.Random, n: int, K: int, convention: str = "union", *,
                    k: int | None = None, label: str = "") -> Instance:
    """A random token; k uniform over the vocabulary unless given (so often outside the top-K)."""
    mu_logp, pi_logp = random_pair(rng, n)
    k = rng.randrange(n) if k is None else k
    advantage = rng.choice((-1.0, 1.0, 0.5, -2.0, 0.0))
    return Instance(mu_logp, pi_logp, k, K, convention, advantage, label)
