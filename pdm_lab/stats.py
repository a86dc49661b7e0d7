"""Per-token statistics every mask rule and metric reads: divergences, ratio, Ḋ, its interval."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .direction import DDOT_ESTIMATORS, TailView, ddot, ddot_head, ddot_interval
from .divergence import binary_kl, binary_tv, full_kl, topk_kl, topk_tv
from .errors import PDMInputError, check_same
from .policy_side import PolicyOnSupport, exact_tail_term
from .support import Support


@dataclass(frozen=True)
class TokenStats:
    """All [N]. ``ddot`` maps estimator name → Ḋ (``exact`` only when full distributions were given);
    ``full_kl`` is None without them."""

    topk_kl: Tensor
    topk_tv: Tensor
    binary_kl: Tensor
    binary_tv: Tensor
    full_kl: Tensor | None
    log_ratio: Tensor
    ratio: Tensor
    mu_tail: Tensor
    pi_tail: Tensor
    ddot: dict[str, Tensor]
    ddot_lower: Tensor
    ddot_upper: Tensor


@torch.no_grad()
def token_stats(support: Support, pi: PolicyOnSupport, *, mu_full: Tensor | None = None,
                pi_full: Tensor | None = None) -> TokenStats:
    """Every per-token quantity of SPEC §2–3 for one batch.

    Args:
        support: μ on the reduced support (``support_from_topk`` / ``support_from_full``).
        pi: π on the same support (``policy_on_support``).
        mu_full, pi_full: [N, n] full log-probabilities, toys only: enable ``exact`` and full KL.
    """
    check_same(("pi.logp", "support.ids"), pi.logp, support.ids)
    if (mu_full is None) != (pi_full is None):
        raise PDMInputError("mu_full and pi_full: give both full distributions or neither")
    pi_logp = pi.logp.detach()
    mu_logp = support.mu_logp.to(pi_logp.dtype)
    mu_tail_logp = support.mu_tail_logp.to(pi_logp.dtype)
    k_index = support.k_index
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    pi_logp_k = pi_logp.gather(1, k_index[:, None])[:, 0]
    exact = full = None
    if mu_full is not None:
        exact = exact_tail_term(mu_full, pi_full, support.ids).to(pi_logp.dtype)
        full = full_kl(mu_full, pi_full).to(pi_logp.dtype)
    view = TailView(mu_tail=torch.exp(mu_tail_logp), pi_tail=torch.exp(pi.tail_logp),
                    pi_tail_logp=pi.tail_logp, tail_count=support.tail_count,
                    pi_tail_log_sumsq=pi.tail_log_sumsq, exact_tail=exact)
    mu, pi_p = torch.exp(mu_logp), torch.exp(pi_logp)  # once, shared by D, TV and the head
    head = ddot_head(mu_logp, pi_logp, k_index, mu=mu, pi=pi_p)
    names = [name for name in DDOT_ESTIMATORS if name != "exact" or exact is not None]
    lower, upper = ddot_interval(head, view, torch.exp(support.mu_kth_logp.to(pi_logp.dtype)))
    log_ratio = pi_logp_k - mu_logp_k
    return TokenStats(
        topk_kl=topk_kl(mu_logp, pi_logp, mu_tail_logp, pi.tail_logp, mu=mu),
        topk_tv=topk_tv(mu_logp, pi_logp, mu_tail_logp, pi.tail_logp, mu=mu, pi=pi_p),
        binary_kl=binary_kl(mu_logp_k, pi_logp_k),
        binary_tv=binary_tv(mu_logp_k, pi_logp_k),
        full_kl=full,
        log_ratio=log_ratio,
        ratio=torch.exp(log_ratio),
        mu_tail=view.mu_tail,
        pi_tail=view.pi_tail,
        ddot={name: ddot(head, view, name) for name in names},
        ddot_lower=lower,
        ddot_upper=upper,
    )
