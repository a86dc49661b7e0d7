"""Conformance kit: check *your* mask or divergence code against a high-precision oracle.

For a user's own test suite (needs ``hypothesis`` and ``mpmath``: ``pip install 'pdm_lab[test]'``)::

    from pdm_lab.testing import check_divergence, check_mask

    def my_topk_kl(mu_logp, pi_logp, sampled, k, convention):   # [N, n] float64 → [N]
        ...

    def test_my_topk_kl():
        check_divergence(my_topk_kl, "topk_kl")          # raises with the smallest failing case

    def test_my_mask():
        check_mask(my_mask, "dppo_topk_kl", delta=0.15)   # my_mask(mu, pi, k_ids, adv, k, delta, conv) → [N] keep

The cases (``llm_cases``) crowd the edges where implementations go wrong: peaked and flat
rows, ties at the top-K boundary, near-certain tokens (1 − 1e-17), tails down to 1e-300 (on one
side only, where 1 − Σ head loses every digit), the sampled token inside and outside the top-K,
both support conventions (SPEC §2), and μ cut by the engine's top-k or top-p (cut tokens at −inf,
a legal zero probability, SPEC §8: inside S when K exceeds the kept tokens, or the whole tail so
that μ_T = 0). The oracle is ``pdm_lab.oracle`` (the one ``pdm_lab.proofs`` checks its claims
against): SPEC §2–4 in ``mpmath`` at 50 digits from the same float64 inputs, with the support
chosen by SPEC's tie rule. ``check_mask`` takes a rule's divergence and direction from its
registry record (``oracle_mask_rules``); it skips only tokens that sit on a decision boundary
within rounding (D ≈ δ, Ḋ ≈ 0, r ≈ 1).
tests/test_testing_kit.py shows it catching a 1 − Σ tail implementation and a μ·(log μ − log π)
one that turns a cut token into NaN, and passing pdm_lab's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

try:
    import mpmath
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError as err:  # the core installs without them
    raise ImportError(f"pdm_lab.testing needs hypothesis and mpmath: pip install 'pdm_lab[test]' ({err})") from None

from pdm_lab.oracle import PRECISION, Instance, spec_support

#: Regimes of ``llm_cases`` (each a way real logits break naive code).
REGIMES = ("peaked", "flat", "ties", "near_certain", "deep_tail")
#: Engine truncations of μ in ``llm_cases``: none, top-k, top-p (cut tokens come back as −inf).
CUTS = ("none", "top_k", "top_p")
#: Divergences ``check_divergence`` knows, and the Ḋ estimators the oracle evaluates.
ORACLE_DIVERGENCES = ("topk_kl", "topk_tv", "binary_kl", "binary_tv")
ORACLE_ESTIMATORS = ("exact", "agg", "uniform", "topk")


@dataclass(frozen=True)
class Case:
    """One batch: [N, n] float64 full log-probabilities, [N] sampled ids and Â, K, convention."""

    mu_logp: Tensor
    pi_logp: Tensor
    sampled: Tensor
    advantages: Tensor
    k: int
    convention: str
    regime: str

    def __repr__(self) -> str:  # what hypothesis prints for a failing case
        return (f"Case(regime={self.regime!r}, k={self.k}, convention={self.convention!r}, "
                f"sampled={self.sampled.tolist()}, advantages={self.advantages.tolist()},\n"
                f"  mu_logp={self.mu_logp.tolist()},\n  pi_logp={self.pi_logp.tolist()})")


def _logits(regime: str, rows: int, n: int, gen: torch.Generator, k: int) -> Tensor:
    z = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    if regime == "peaked":
        z = 2.0 * z
        z[torch.arange(rows), torch.randint(n, (rows,), generator=gen)] += 9.0
    elif regime == "flat":
        z = 0.05 * z
    elif regime == "ties":
        z = torch.round(z)  # few distinct values: ties everywhere, also at the K-th place
        if 0 < k < n:
            order = torch.argsort(-z, dim=1, stable=True)
            z[torch.arange(rows), order[:, k]] = z[torch.arange(rows), order[:, k - 1]]
    elif regime == "near_certain":
        z[torch.arange(rows), torch.randint(n, (rows,), generator=gen)] += 40.0  # p ≈ 1 − 1e-17
    elif regime == "deep_tail":
        keep = max(1, min(k, n))  # the head holds everything; the rest at 1e-260 … 1e-300
        order = torch.argsort(-z, dim=1, stable=True)
        deep = -600.0 - 90.0 * torch.rand(rows, n, generator=gen, dtype=torch.float64)
        tail = torch.zeros_like(z, dtype=torch.bool).scatter_(1, order[:, keep:], True)
        z = torch.where(tail, deep, z)
    return z


def _cut(mu: Tensor, cut: str, top_k: int, top_p: float) -> Tensor:
    """μ as a sampling engine returns it after top-k or top-p truncation (processed log-probs):
    the cut tokens at −inf, the kept ones renormalised (SPEC §8: a legal zero probability)."""
    order = torch.argsort(-mu, dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(mu.shape[1]).expand_as(order))
    if cut == "top_k":
        kept = rank < top_k
    else:  # top-p: the smallest head holding ≥ p, always at least the most likely token
        before = torch.logcumsumexp(mu.gather(1, order), 1).exp() - mu.gather(1, order).exp()
        kept = torch.zeros_like(mu, dtype=torch.bool).scatter_(1, order, before < top_p)
    cut_mu = mu.masked_fill(~kept, float("-inf"))
    return cut_mu - torch.logsumexp(cut_mu, 1, keepdim=True)


@st.composite
def llm_cases(draw, *, max_vocab: int = 48, max_rows: int = 6, regimes: tuple[str, ...] = REGIMES,
              conventions: tuple[str, ...] = ("union", "kslot"), cuts: tuple[str, ...] = CUTS) -> Case:
    """Hypothesis strategy of LLM-like cases (module docstring). μ and π each draw a regime, so a
    deep tail or a near-certain token can sit on one side only, as in a real mismatch. μ may then
    be cut by the engine's top-k or top-p (``cuts``): cut tokens are −inf in μ (never the sampled
    one) and keep their probability under π, so they can sit inside S (K beyond the kept tokens,
    ties among them to the lower id) or in the tail (μ_T may be exactly 0)."""
    n = draw(st.integers(2, max_vocab))
    rows = draw(st.integers(1, max_rows))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**31 - 1))
    mu_regime, pi_regime = draw(st.sampled_from(regimes)), draw(st.sampled_from(regimes))
    noise = draw(st.sampled_from((0.0, 0.01, 0.3, 1.0)))
    gen = torch.Generator().manual_seed(seed)
    z_mu = _logits(mu_regime, rows, n, gen, k)
    z_pi = _logits(pi_regime, rows, n, gen, k) if pi_regime != mu_regime else z_mu + noise * torch.randn(
        rows, n, generator=gen, dtype=torch.float64)
    mu, pi = torch.log_softmax(z_mu, -1), torch.log_softmax(z_pi, -1)
    cut = draw(st.sampled_from(cuts))
    if cut != "none":
        mu = _cut(mu, cut, draw(st.integers(1, n)), draw(st.sampled_from((0.5, 0.9, 0.99))))
    probs = torch.exp(mu)
    sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
    if draw(st.booleans()) and k < n:  # force k outside μ's top-K (μ's least likely token not cut)
        order = torch.argsort(-mu, dim=1, stable=True)
        last_kept = torch.isfinite(mu).sum(1) - 1
        sampled = order[torch.arange(rows), last_kept]
    advantages = torch.tensor(draw(st.lists(st.sampled_from((-1.0, 0.0, 1.0)), min_size=rows, max_size=rows)),
                              dtype=torch.float64)
    convention = draw(st.sampled_from(conventions))
    regime = f"{mu_regime}/{pi_regime}" + ("" if cut == "none" else f"/{cut}")
    return Case(mu, pi, sampled, advantages, k, convention, regime)


# --- the oracle ---------------------------------------------------------------------------------

def oracle_support(mu_row: list[float], sampled: int, k: int, convention: str) -> list[int]:
    """SPEC §2: μ's K most probable ids (ties: lower id first), plus or in place of k."""
    return list(spec_support(mu_row, sampled, k, convention))  # log μ orders S as μ does


def oracle_row(mu_row: list[float], pi_row: list[float], sampled: int, k: int, convention: str) -> dict:
    """Every SPEC §2–4 quantity of one token from ``pdm_lab.oracle`` (mpf values at
    ``PRECISION`` digits): ``Instance.token_values``."""
    with mpmath.workdps(PRECISION):
        return Instance(tuple(mu_row), tuple(pi_row), sampled, k, convention).token_values()


def oracle(case: Case) -> list[dict]:
    """``oracle_row`` for every token of `case`."""
    mu, pi = case.mu_logp.tolist(), case.pi_logp.tolist()
    return [oracle_row(mu[i], pi[i], int(case.sampled[i]), case.k, case.convention) for i in range(len(mu))]


def oracle_mask_rules() -> tuple[str, ...]:
    """The registered rules ``check_mask`` decides from the oracle: SPEC §4's trust-region rules,
    M = 0 iff divergence > δ ∧ Â·direction > 0, read from each record — token level, a divergence
    the oracle computes, δ, the ratio test (no estimator) or a Ḋ estimator of SPEC §3's table, and
    no input beyond full distributions."""
    from pdm_lab.masks import MASK_RULES

    return tuple(sorted(name for name, rec in MASK_RULES.items()
                        if rec.level == "token" and rec.divergence in ORACLE_DIVERGENCES and rec.uses_delta
                        and set(rec.needs) <= {"full"} and (rec.estimator is None or rec.estimator in ORACLE_ESTIMATORS)))


def oracle_keep(row: dict, advantage: float, rule: str, delta: float, tol: float) -> bool | None:
    """SPEC §4 decision of `rule` for one token (True: keep), from its record: the divergence it
    thresholds, the direction its estimator gives (the ratio test without one). None when the
    token is on a boundary within `tol` (a correct float implementation may go either way there)."""
    from pdm_lab.masks import get_mask_rule

    record = get_mask_rule(rule)
    d = row[record.divergence]
    direction = row["log_ratio"] if record.estimator is None else row[f"ddot_{record.estimator}"]
    if advantage == 0:
        return True
    if abs(d - delta) <= tol * max(1.0, delta) or abs(direction) <= tol:
        return None
    return not (d > delta and advantage * direction > 0)


# --- the checks ---------------------------------------------------------------------------------

def _run(check: Callable[[Case], None], cases, max_examples: int, derandomize: bool) -> None:
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(cases)
    def run(case):
        check(case)
    run()


def check_divergence(fn: Callable[..., Tensor], divergence: str = "topk_kl", *, rtol: float = 1e-6,
                     atol: float = 1e-12, max_examples: int = 100, cases=None, derandomize: bool = True) -> None:
    """Assert ``fn(mu_logp, pi_logp, sampled, k, convention) -> [N]`` matches the oracle's
    `divergence` (|got − true| ≤ atol + rtol·true) on ``llm_cases``; raises ``AssertionError``
    naming the token, both values and the (shrunk) case. ``derandomize``: the same cases every
    run (reproducible CI); False explores new ones each run."""
    if divergence not in ORACLE_DIVERGENCES:
        raise ValueError(f"divergence: unknown {divergence!r}; valid: {', '.join(ORACLE_DIVERGENCES)}")

    def check(case: Case) -> None:
        got = fn(case.mu_logp, case.pi_logp, case.sampled, case.k, case.convention)
        rows = oracle(case)
        for i, row in enumerate(rows):
            value, true = float(got[i]), row[divergence]
            if not (abs(value - true) <= atol + rtol * abs(true)):  # NaN fails too
                raise AssertionError(f"{divergence} of token {i}: got {value!r}, true {mpmath.nstr(true, 17)} "
                                     f"(regime {case.regime}, K={case.k}, {case.convention})")
    _run(check, cases if cases is not None else llm_cases(), max_examples, derandomize)


def check_mask(fn: Callable[..., Tensor], rule: str = "dppo_topk_kl", *, delta: float = 0.15,
               tol: float = 1e-9, max_examples: int = 100, cases=None, derandomize: bool = True) -> None:
    """Assert ``fn(mu_logp, pi_logp, sampled, advantages, k, delta, convention) -> [N]`` keep
    (1 keep, 0 drop) equals SPEC §4's `rule` from the oracle on every token not on a boundary."""
    valid = oracle_mask_rules()
    if rule not in valid:
        raise ValueError(f"rule: {rule!r} is not a rule the oracle decides; valid: {', '.join(valid)}")

    def check(case: Case) -> None:
        got = fn(case.mu_logp, case.pi_logp, case.sampled, case.advantages, case.k, delta, case.convention)
        for i, row in enumerate(oracle(case)):
            want = oracle_keep(row, float(case.advantages[i]), rule, delta, tol)
            if want is not None and bool(got[i] > 0.5) != want:
                raise AssertionError(f"{rule} token {i}: got {'keep' if got[i] > 0.5 else 'drop'}, true "
                                     f"{'keep' if want else 'drop'} (D={mpmath.nstr(row['topk_kl'], 10)}, "
                                     f"regime {case.regime}, K={case.k}, {case.convention})")
    _run(check, cases if cases is not None else llm_cases(), max_examples, derandomize)


# --- pdm_lab's own functions in the kit's signatures (what its tests check) ------------------

def pdm_lab_divergence(divergence: str) -> Callable[..., Tensor]:
    """pdm_lab's `divergence` as ``fn(mu_logp, pi_logp, sampled, k, convention)``."""
    from pdm_lab.policy_side import policy_on_support
    from pdm_lab.tokenwise import token_stats
    from pdm_lab.support import support_from_full

    def fn(mu_logp, pi_logp, sampled, k, convention):
        support = support_from_full(mu_logp, sampled, k=k, convention=convention)
        return getattr(token_stats(support, policy_on_support(pi_logp, support.ids)), divergence)
    return fn


def pdm_lab_mask(rule: str) -> Callable[..., Tensor]:
    """pdm_lab's `rule` as ``fn(mu_logp, pi_logp, sampled, advantages, k, delta, convention)``."""
    from pdm_lab.mask_config import MaskConfig
    from pdm_lab.masks import compute_mask
    from pdm_lab.policy_side import policy_on_support
    from pdm_lab.tokenwise import token_stats
    from pdm_lab.support import support_from_full

    def fn(mu_logp, pi_logp, sampled, advantages, k, delta, convention):
        support = support_from_full(mu_logp, sampled, k=k, convention=convention)
        stats = token_stats(support, policy_on_support(pi_logp, support.ids), mu_full=mu_logp, pi_full=pi_logp)
        return compute_mask(MaskConfig(rule=rule, k=k, delta=delta, convention=convention), stats, advantages)
    return fn
