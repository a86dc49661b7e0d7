"""The side under test: pdm_lab's own torch functions run in float64 on reference instances.

Each helper only feeds an ``Instance``'s float64 log-probabilities to pdm_lab and reads the
results back as Python floats; none computes a formula of SPEC §2–3 itself. The claims compare
these numbers with the mpmath reference (``reference.py``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
from torch import Tensor

import pdm_lab
from pdm_lab import direction, divergence
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats
from pdm_lab.support import support_from_topk

from .reference import Instance

DTYPE = torch.float64


def _grouped(instances: Sequence[Instance]) -> dict[tuple[int, int, str], list[int]]:
    """Row indices grouped by (n, K, convention): one batched pdm_lab call per group."""
    groups: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for row, inst in enumerate(instances):
        groups[(inst.n, inst.K, inst.convention)].append(row)
    return groups


def _rows(values: dict[str, Tensor], count: int) -> list[dict]:
    out: list[dict] = [{} for _ in range(count)]
    for key, tensor in values.items():
        for row in range(count):
            if key == "support":
                out[row][key] = tuple(int(i) for i in tensor[row] if int(i) >= 0)
            elif tensor.dtype == torch.bool:
                out[row][key] = bool(tensor[row])
            else:
                out[row][key] = float(tensor[row])
    return out


def log_probs(instances: Sequence[Instance]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[N, n] log μ, [N, n] log π, [N] k, [N] Â as float64/int64 tensors (one n for all rows)."""
    mu = torch.tensor([inst.mu_logp for inst in instances], dtype=DTYPE)
    pi = torch.tensor([inst.pi_logp for inst in instances], dtype=DTYPE)
    sampled = torch.tensor([inst.k for inst in instances], dtype=torch.int64)
    adv = torch.tensor([inst.advantage for inst in instances], dtype=DTYPE)
    return mu, pi, sampled, adv


def diagnose(instances: Sequence[Instance], *, delta: float = 0.15) -> list[dict]:
    """``pdm_lab.diagnosis`` on full distributions, one dict of floats per instance.

    Keys as ``diagnose`` returns them (``ddot_exact``, ``topk_kl``, ``mask_pdm_topk``, …);
    ``support`` is the tuple of support ids.
    """
    results: list[dict] = [{} for _ in instances]
    for (_, K, convention), rows in _grouped(instances).items():
        mu, pi, sampled, adv = log_probs([instances[r] for r in rows])
        out = pdm_lab.diagnose(mu, pi, sampled, adv, k=K, delta=delta, convention=convention)
        for r, values in zip(rows, _rows(out, len(rows))):
            results[r] = values
    return results


def rollout_view(instances: Sequence[Instance], *, temperature: float = 1.0,
                 engine_order_seed: int = 0) -> list[dict]:
    """The production path that sees only top-K data: what the trainer computes at scale.

    μ enters as a rollout engine returns it (its K most probable ids and log-probs, in a
    shuffled order, plus the sampled id and its log-prob) through ``support_from_topk``; π as
    raw logits T·log π at temperature T through ``policy_on_support``; then ``token_stats``
    without full distributions. Returns per instance: ``ddot_<agg|uniform|topk>``,
    ``ddot_lower``, ``ddot_upper``, ``topk_kl``, ``topk_tv``, ``mu_tail``, ``pi_tail``,
    ``tail_count``, ``ratio``, ``support``.
    """
    gen = torch.Generator().manual_seed(engine_order_seed)
    results: list[dict] = [{} for _ in instances]
    for (n, K, convention), rows in _grouped(instances).items():
        insts = [instances[r] for r in rows]
        mu, pi, sampled, _ = log_probs(insts)
        kk = min(K, n)
        # the engine's top-K: most probable first, ties to the lower id (SPEC §2), then shuffled
        order = torch.stack([torch.tensor(sorted(range(n), key=lambda i: (-inst.mu_logp[i], i))[:kk])
                             for inst in insts])
        perm = torch.stack([torch.randperm(kk, generator=gen) for _ in insts])
        top_ids = order.gather(1, perm)
        top_logp = mu.gather(1, top_ids)
        sampled_logp = mu.gather(1, sampled[:, None])[:, 0]
        support = support_from_topk(top_ids, top_logp, sampled, sampled_logp, vocab_size=n, k=K,
                                    convention=convention)
        policy = policy_on_support(pi * temperature, support.ids, temperature=temperature)
        stats = token_stats(support, policy)
        values = {f"ddot_{name}": value for name, value in stats.ddot.items()}
        values.update(ddot_lower=stats.ddot_lower, ddot_upper=stats.ddot_upper,
                      topk_kl=stats.topk_kl, topk_tv=stats.topk_tv, mu_tail=stats.mu_tail,
                      pi_tail=stats.pi_tail, tail_count=support.tail_count.to(DTYPE),
                      ratio=stats.ratio, support=support.ids,
                      pi_tail_sumsq=torch.exp(policy.tail_log_sumsq))
        for r, row in zip(rows, _rows(values, len(rows))):
            results[r] = row
    return results


def estimator_tail_terms(mu_tail: float, pi_tail: float, tail_count: int,
                         pi_tail_log_sumsq: float) -> dict[str, float]:
    """The registered tail-term estimators of ``pdm_lab.direction`` on one hand-made TailView.

    Lets a claim probe magnitudes no softmax produces conveniently (π_T = 1e-30, say).
    """
    t = lambda x, dt=DTYPE: torch.tensor([x], dtype=dt)  # noqa: E731
    view = direction.TailView(mu_tail=t(mu_tail), pi_tail=t(pi_tail),
                              pi_tail_logp=torch.log(t(pi_tail)), tail_count=t(tail_count, torch.int64),
                              pi_tail_log_sumsq=t(pi_tail_log_sumsq))
    return {name: float(fn(view)[0]) for name, fn in direction.DDOT_ESTIMATORS.items()
            if name != "exact"}


def full_log_policy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Differentiable [N, n] log π from ``policy_on_support`` with every token in the support."""
    ids = torch.arange(logits.shape[1]).expand(logits.shape[0], -1).contiguous()
    return policy_on_support(logits, ids, temperature=temperature).logp


def logit_gradient(measure: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """∇_z of a per-row measure [N, n] → [N], by torch autograd (float64)."""
    z = logits.detach().clone().to(DTYPE).requires_grad_(True)
    (grad,) = torch.autograd.grad(measure(z).sum(), z)
    return grad


def directional_derivative(measure: Callable[[Tensor], Tensor], logits: Tensor, v: Tensor) -> Tensor:
    """d/dη measure(z + ηv) at η = 0 = ⟨∇_z measure, v⟩, by autograd. [N]."""
    return (logit_gradient(measure, logits) * v).sum(dim=-1)


#: Re-exported so claims name the code they exercise as ``implementation.divergence.full_kl`` etc.
__all__ = ["diagnose", "direction", "directional_derivative", "divergence", "estimator_tail_terms",
           "full_log_policy", "log_probs", "logit_gradient", "rollout_view"]
