"""The one high-precision oracle: SPEC's definitions evaluated with mpmath at 50 digits.

It imports nothing else of pdm_lab: derivatives are taken of the *definitions* (mpmath numerical
differentiation of KL(μ‖softmax(z + ηv)) at 50 digits), not of the closed forms the code uses,
so the code is never compared with a copy of itself. ``pdm_lab.proofs`` checks its claims
against it and ``pdm_lab.testing`` checks a user's code against it (``Instance.token_values``).
Callers run inside ``mpmath.workdps(PRECISION)``.

An ``Instance`` is one token: float64 log-probabilities of μ and π (exactly what the torch side
receives), the sampled token k, K and the support convention. The reference distributions are
the exact softmax of those float64 numbers, so both sides start from the same input; a
log-probability of −inf is a probability of exactly 0 (a token the engine cut, SPEC §8).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

try:
    import mpmath
    from mpmath import mp
except ImportError as err:  # the core installs without it
    raise ImportError(f"pdm_lab.oracle needs mpmath: pip install 'pdm_lab[test]' ({err})") from None

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


def binary_kl(mu: list, pi: list, k: int) -> mpmath.mpf:
    """DPPO's binary KL: KL between (μ_k, 1 − μ_k) and (π_k, 1 − π_k), each rest summed (never 1 − p_k)."""
    return topk_kl(mu, pi, (k,))


def binary_tv(mu: list, pi: list, k: int) -> mpmath.mpf:
    """DPPO's binary TV |π_k − μ_k| (= ½(|π_k − μ_k| + |rest_π − rest_μ|))."""
    return topk_tv(mu, pi, (k,))


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

    def token_values(self) -> dict[str, mpmath.mpf]:
        """Every per-token quantity a mask reads (SPEC §2–4): ``topk_kl``, ``topk_tv``,
        ``binary_kl``, ``binary_tv``, ``log_ratio`` and ``ddot_<estimator>`` for each estimator
        of SPEC §3's table (head plus its tail term)."""
        mu, pi, k, s = self.mu, self.pi, self.k, self.support
        head = self.head()
        return {"topk_kl": topk_kl(mu, pi, s), "topk_tv": topk_tv(mu, pi, s),
                "binary_kl": binary_kl(mu, pi, k), "binary_tv": binary_tv(mu, pi, k),
                "log_ratio": mp.log(pi[k]) - mp.log(mu[k]),
                **{f"ddot_{name}": head + tail for name, tail in self.spec_tail_terms().items()}}

    def describe(self) -> str:
        def short(xs: list) -> str:
            shown = ", ".join(mpmath.nstr(x, 6) for x in xs[:8])
            return f"[{shown}{', …' if len(xs) > 8 else ''}]"
        label = f"{self.label}: " if self.label else ""
        return (f"{label}n={self.n} K={self.K} k={self.k} convention={self.convention} "
                f"Â={self.advantage:g} S={list(self.support)} μ={short(self.mu)} π={short(self.pi)}")
