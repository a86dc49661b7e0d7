"""What a sweep's table can support: when a run is long enough for its ``collapsed`` flag to mean
something, and when one configuration is separated from the runner-up at 95%.

Read by the sweep's report (``pdm_lab.envs``) and by ``pdm-lab promote`` (``pdm_lab.scaling``),
so both name a winner by the same rule and neither stage imports the other.

Separation: the 95% Welch interval of the difference of mean outcomes over runs,
best − runner-up, excludes 0 on the better side. Welch (unequal variances, Student-t quantile at
the Welch–Satterthwaite degrees of freedom) because a cell holds a handful of seeds: a bootstrap
of two or three values is no wider than their range and would call noise a winner.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

#: The collapse flag smooths the batch-reward curve over a window of a tenth of the run.
COLLAPSE_WINDOW_FRACTION = 10
#: Batches each smoothed point must average for the flag to mean anything: with fewer, "best"
#: is the luckiest batch and "end" the unluckiest, and batch noise alone passes the 50% drop test.
COLLAPSE_MIN_WINDOW = 3
#: Seeds per configuration a winner needs: with two, each variance has one degree of freedom and
#: one outlying seed decides the interval.
MIN_SEEDS = 3
LEVEL = 0.95


def collapse_window(steps: int) -> int:
    """Batches the collapse flag averages per smoothed point, for a run of ``steps`` steps."""
    return max(1, steps // COLLAPSE_WINDOW_FRACTION)


def _min_steps() -> int:
    steps = 1
    while collapse_window(steps) < COLLAPSE_MIN_WINDOW:
        steps += 1
    return steps


#: The shortest run whose ``collapsed`` flag means anything (window ≥ COLLAPSE_MIN_WINDOW).
COLLAPSE_MIN_STEPS = _min_steps()


def collapse_measurable(steps: int) -> bool:
    return steps >= COLLAPSE_MIN_STEPS


def shortfalls(*, steps: int | None, seeds: int) -> list[str]:
    """Why runs of ``steps`` steps over ``seeds`` seeds cannot name a winner (empty: they can)."""
    out = []
    if steps is not None and not collapse_measurable(steps):
        out.append(f"runs of {steps} steps < {COLLAPSE_MIN_STEPS}, the collapse definition's minimum")
    if seeds < MIN_SEEDS:
        out.append(f"{seeds} seed{'s' if seeds != 1 else ''} < {MIN_SEEDS} per configuration")
    return out


# ---- Student-t quantiles (no SciPy in the core): the regularised incomplete beta by its
#      continued fraction (Lentz), inverted by bisection.

def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b), 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` > 0 degrees of freedom."""
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (0.5 < p < 1), to ~1e-12."""
    if not 0.5 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0.5, 1), got {p!r}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A configuration's mean outcome over its runs and its 95% Student-t interval (NaN: < 2 runs)."""

    mean: float
    lo: float
    hi: float
    n: int

    def text(self, digits: int = 3) -> str:
        if self.n == 0:
            return "n/a"
        ci = "no CI" if math.isnan(self.lo) else f"[{self.lo:.{digits}f}, {self.hi:.{digits}f}]"
        return f"{self.mean:.{digits}f} {ci} over {self.n} run{'s' if self.n != 1 else ''}"


def _moments(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan
    return mean, var


def mean_t_ci(values: Iterable, *, level: float = LEVEL) -> Estimate:
    xs = _finite(values)
    if not xs:
        return Estimate(math.nan, math.nan, math.nan, 0)
    mean, var = _moments(xs)
    if len(xs) < 2:
        return Estimate(mean, math.nan, math.nan, 1)
    half = t_quantile(0.5 + level / 2, len(xs) - 1) * math.sqrt(var / len(xs)) if var > 0 else 0.0
    return Estimate(mean, mean - half, mean + half, len(xs))


def welch_diff_ci(a: Iterable, b: Iterable, *, level: float = LEVEL) -> tuple[float, float, float, float]:
    """mean(a) − mean(b), its Welch ``level`` interval and degrees of freedom (NaN interval: a
    side with < 2 finite values; both variances 0: a zero-width interval)."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        return math.nan, math.nan, math.nan, math.nan
    (ma, va), (mb, vb) = _moments(xa), _moments(xb)
    diff = ma - mb
    if len(xa) < 2 or len(xb) < 2:
        return diff, math.nan, math.nan, math.nan
    sa, sb = va / len(xa), vb / len(xb)
    se2 = sa + sb
    if se2 == 0.0:
        return diff, diff, diff, math.inf
    ra, rb = sa / se2, sb / se2  # Welch–Satterthwaite in shares: no underflow of se2² at tiny variances
    df = 1.0 / (ra ** 2 / (len(xa) - 1) + rb ** 2 / (len(xb) - 1))
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(se2)
    return diff, diff - half, diff + half, df


@dataclasses.dataclass(frozen=True)
class Separation:
    """The best configuration against the runner-up on one outcome over runs."""

    best: Estimate
    runner_up: Estimate
    diff: float
    """mean(best) − mean(runner-up)."""
    lo: float
    hi: float
    df: float
    higher: bool
    """True: a higher outcome is better."""

    @property
    def separated(self) -> bool:
        """The 95% interval of the difference excludes 0 on the better side."""
        if math.isnan(self.lo):
            return False
        return self.lo > 0 if self.higher else self.hi < 0

    def text(self, digits: int = 3) -> str:
        if math.isnan(self.lo):
            return f"difference {self.diff:+.{digits}f}, no interval (a side has fewer than 2 runs)"
        return (f"difference {self.diff:+.{digits}f}, 95% Welch CI [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"
                + ("" if self.separated else " includes 0"))


def separation(best: Iterable, runner_up: Iterable, *, higher: bool = True, level: float = LEVEL) -> Separation:
    """Per-run outcomes of the best configuration and of the runner-up → their ``Separation``."""
    best, runner_up = list(best), list(runner_up)
    diff, lo, hi, df = welch_diff_ci(best, runner_up, level=level)
    return Separation(mean_t_ci(best, level=level), mean_t_ci(runner_up, level=level), diff, lo, hi, df, higher)


#: The rule both stages state beside a verdict.
CRITERION = (f"a winner is named only when the {int(LEVEL * 100)}% Welch interval of its difference from the "
             f"runner-up (over runs) excludes 0, with ≥ {MIN_SEEDS} seeds per configuration")


#: The power a minimal detectable difference is stated at.
POWER = 0.80


def minimal_detectable_difference(groups: Iterable[Iterable], *, level: float = LEVEL, power: float = POWER) -> float:
    """The smallest difference of means between two configurations of this point that a two-sided
    ``level`` Welch test detects with probability ``power``: (t_{1−α/2} + t_{power}) · s · √(2/n),
    s the pooled within-configuration standard deviation over ``groups`` (per-run outcomes of each
    configuration), n the median runs per configuration, df = Σ (nᵢ − 1). NaN: fewer than two
    runs in every configuration."""
    samples = [_finite(g) for g in groups]
    samples = [xs for xs in samples if len(xs) >= 2]
    if not samples:
        return math.nan
    df = sum(len(xs) - 1 for xs in samples)
    pooled = sum(_moments(xs)[1] * (len(xs) - 1) for xs in samples) / df
    n = sorted(len(xs) for xs in samples)[len(samples) // 2]
    return (t_quantile(0.5 + level / 2, df) + t_quantile(power, df)) * math.sqrt(pooled * 2.0 / n)
