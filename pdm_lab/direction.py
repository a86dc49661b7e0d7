"""Ḋ, the first-order change of KL(μ‖π) along a token's update (SPEC §3), and its estimators.

    Ḋ = (π_k − μ_k) + Σ_i π_i(μ_i − π_i) = head + Σ_{i∉S} π_i(μ_i − π_i)

Only the tail part is unknown from top-K data. Each estimator is one registered function that
returns the tail term; ``ddot`` adds the head. Adding an estimator is one decorated function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError
from pdm_lab.numerics import exp_per_use


@dataclass(frozen=True)
class TailView:
    """What an estimator may look at, all [N] (probabilities, not logs, except where named).

    mu_tail, pi_tail: μ_T, π_T. tail_count: t = n − |S| (int64). pi_tail_log_sumsq:
    log Σ_{i∉S} π_i². exact_tail: Σ_{i∉S} π_i(μ_i − π_i) from full distributions, or None.
    """

    mu_tail: Tensor
    pi_tail: Tensor
    pi_tail_logp: Tensor
    tail_count: Tensor
    pi_tail_log_sumsq: Tensor
    exact_tail: Tensor | None = None
    live: Tensor | None = None
    """[N] bool (t > 0) ∧ (π_T > 0), where a tail term counts; None: computed where needed."""


TailEstimator = Callable[[TailView], Tensor]
DDOT_ESTIMATORS: dict[str, TailEstimator] = {}


def register_ddot_estimator(name: str) -> Callable[[TailEstimator], TailEstimator]:
    """Decorator: register a tail-term estimator under `name`.

    Estimators registered after ``pdm_lab.masks`` is imported get their mask rule with
    ``register_mask("pdm_<name>", like="pdm_topk", estimator="<name>")(pdm_rule("<name>"))``
    (``pdm_lab.masks``): its record declares the estimator, and registration checks that Ḋ_name
    is what the rule reads.
    """
    def wrap(fn: TailEstimator) -> TailEstimator:
        if name in DDOT_ESTIMATORS:
            raise ValueError(f"Ḋ estimator {name!r} is already registered")
        DDOT_ESTIMATORS[name] = fn
        return fn
    return wrap


def get_ddot_estimator(name: str) -> TailEstimator:
    try:
        return DDOT_ESTIMATORS[name]
    except KeyError:
        raise PDMInputError(f"estimator: unknown Ḋ estimator {name!r}; valid: "
                            f"{', '.join(sorted(DDOT_ESTIMATORS))}") from None


def _where_tail(view: TailView, value: Tensor) -> Tensor:
    # An empty tail (t = 0) or a tail π never visits contributes exactly 0 (SPEC §8).
    live = tail_live(view.tail_count, view.pi_tail) if view.live is None else view.live
    return torch.where(live, value, torch.zeros_like(value))


def tail_live(tail_count: Tensor, pi_tail: Tensor) -> Tensor:
    """[N] bool: the tail is non-empty and π visits it, so its term is not exactly 0."""
    return (tail_count > 0) & (pi_tail > 0)


@register_ddot_estimator("exact")
def tail_exact(view: TailView) -> Tensor:
    """Σ_{i∉S} π_i(μ_i − π_i) from the full distributions: exact always."""
    if view.exact_tail is None:
        raise PDMInputError("estimator 'exact' needs the full distributions (mu_full and pi_full)")
    return view.exact_tail


@register_ddot_estimator("agg")
def tail_agg(view: TailView) -> Tensor:
    """Paper's aggregated tail, the tail as one atom: π_T(μ_T − π_T). Exact when t ≤ 1."""
    return _where_tail(view, view.pi_tail * (view.mu_tail - view.pi_tail))


@register_ddot_estimator("uniform")
def tail_uniform(view: TailView) -> Tensor:
    """Paper's uniform tail: π_T(μ_T − π_T)/t. Exact when π is uniform on the tail."""
    t = view.tail_count.clamp(min=1).to(view.pi_tail.dtype)
    return _where_tail(view, view.pi_tail * (view.mu_tail - view.pi_tail) / t)


@register_ddot_estimator("topk")
def tail_topk(view: TailView) -> Tensor:
    """(μ_T/π_T − 1)·Σ_{i∉S} π_i², written μ_T·(S_T/π_T) − S_T so it stays finite as π_T → 0.

    The exact first-order change of the top-K KL D itself; exact for Ḋ when μ/π is constant on
    the tail.
    """
    sumsq = torch.exp(view.pi_tail_log_sumsq)
    ratio = torch.exp(view.pi_tail_log_sumsq - view.pi_tail_logp.clamp(min=torch.finfo(sumsq.dtype).min))
    return _where_tail(view, view.mu_tail * ratio - sumsq)


def ddot_head(mu_logp: Tensor, pi_logp: Tensor, k_index: Tensor, *, mu: Tensor | None = None,
              pi: Tensor | None = None, diff: Tensor | None = None) -> Tensor:
    """(π_k − μ_k) + Σ_{i∈S} π_i(μ_i − π_i) from [N, m] log-probs on S (or the probs, and
    diff = μ − π when the caller has it); [N]."""
    at_k = k_index[:, None]
    if exp_per_use() and mu is None and pi is None and diff is None:  # fused, nothing written
        local = torch.exp(pi_logp.gather(1, at_k)[:, 0]) - torch.exp(mu_logp.gather(1, at_k)[:, 0])
        return local + (torch.exp(pi_logp) * (torch.exp(mu_logp) - torch.exp(pi_logp))).sum(dim=-1)
    mu = torch.exp(mu_logp) if mu is None else mu
    pi = torch.exp(pi_logp) if pi is None else pi
    diff = mu - pi if diff is None else diff
    local = pi.gather(1, at_k)[:, 0] - mu.gather(1, at_k)[:, 0]
    return local + (pi * diff).sum(dim=-1)


def ddot(head: Tensor, view: TailView, estimator: str) -> Tensor:
    """Ḋ by the named estimator: head + tail term. [N]."""
    return head + get_ddot_estimator(estimator)(view)


def ddot_interval(head: Tensor, view: TailView, mu_kth: Tensor) -> tuple[Tensor, Tensor]:
    """Certified bounds from top-K data alone (SPEC §3):

        Ḋ ∈ [head − π_T², head + π_T·min(μ_T, μ_(K)) − π_T²/t]

    The lower bound uses Σ_{i∉S} π_i² ≤ π_T², the upper one μ_i ≤ μ_(K) on the tail and
    Σ_{i∉S} π_i² ≥ π_T²/t. Where the interval excludes 0 the sign of Ḋ is certain.
    """
    t = view.tail_count.clamp(min=1).to(head.dtype)
    pi_t = view.pi_tail
    lower = head - _where_tail(view, pi_t * pi_t)
    upper = head + _where_tail(view, pi_t * torch.minimum(view.mu_tail, mu_kth) - pi_t * pi_t / t)
    return lower, upper
