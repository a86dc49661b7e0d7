"""The view of a batch when only the sampled token's log-probs are known (verl's bypass mode).

With S = {k} the reduced support is exact for every rule that reads only r = π_k/μ_k (ratio
tests, binary divergences, k1/k2/k3): the top-K KL on S = {k} *is* the binary KL. Rules whose
record declares ``support="topk"`` (top-K divergences, Ḋ estimators) need the top-K path instead.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.masks import MASK_RULES
from pdm_lab.numerics import log1mexp
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.support import Support, support_from_slots


def sampled_token_rules() -> tuple[str, ...]:
    """Registered rules whose declared support is the sampled token's one slot (they decide from
    its log-probs alone)."""
    return tuple(name for name, rec in MASK_RULES.items() if rec.support == "slot" and not rec.needs)


def sampled_token_view(mu_logp_k: Tensor, pi_logp_k: Tensor) -> tuple[Support, PolicyOnSupport]:
    """[N] log μ_k, log π_k (π_k carries grad) → a one-slot support and π on it.

    Every row's support is its own sampled token (stand-in id 0 of a 2-token vocabulary: the
    ids never reach the math). π's tail sum of squares is unknown; its upper bound π_T² is used,
    so only the Ḋ metrics (never a sampled-token rule's decision) depend on it.
    """
    n = mu_logp_k.shape[0]
    ids = torch.zeros(n, 1, dtype=torch.long, device=mu_logp_k.device)
    support = support_from_slots(ids, mu_logp_k.detach()[:, None], ids[:, 0], vocab_size=2)
    pi_tail = log1mexp(pi_logp_k.detach())
    pi = PolicyOnSupport(logp=pi_logp_k[:, None], tail_logp=pi_tail, tail_log_sumsq=2 * pi_tail)
    return support, pi
