"""Per-token statistics every mask rule and metric reads: divergences, ratio, Ḋ, its interval."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.fast.compiled import maybe_compiled
from pdm_lab.direction import DDOT_ESTIMATORS, TailView, ddot, ddot_head, ddot_interval, tail_live
from pdm_lab.divergence import binary_kl, binary_tv, full_kl, topk_kl, topk_tv
from pdm_lab.errors import PDMInputError, check_same
from pdm_lab.numerics import exp_per_use, rest_logmass, rest_logmass_from_probs
from pdm_lab.policy_side import PolicyOnSupport, exact_tail_term
from pdm_lab.fast.rowops import any_true
from pdm_lab.support import Support


@dataclass(frozen=True)
class TokenStats:
    """All [N]. ``ddot`` maps estimator name → Ḋ (``exact`` only when full distributions were given);
    ``full_kl`` is None without them; ``binary_kl`` and ``binary_tv`` (DPPO's divergences on the
    sampled token) are None where ``token_stats(binary=False)`` skipped them; ``coupled`` and
    ``kernel`` are None unless the stage supplied them."""

    topk_kl: Tensor
    topk_tv: Tensor
    binary_kl: Tensor | None
    binary_tv: Tensor | None
    full_kl: Tensor | None
    log_ratio: Tensor
    ratio: Tensor
    mu_tail: Tensor
    pi_tail: Tensor
    ddot: dict[str, Tensor]
    ddot_lower: Tensor
    ddot_upper: Tensor
    coupled: Tensor | None = None
    """c_t of SPEC §3b (``pdm_lab.coupled``), supplied by the stage for ``pdm_coupled``; else None."""
    kernel: Tensor | None = None
    """h_t = ⟨Wᵀg, Wᵀv⟩ of SPEC §6d's head kernel (``pdm_lab.kernel_direction``), supplied by the stage
    for ``pdm_kernel``; else None."""


def _token_stats_math(mu_logp: Tensor, pi_logp: Tensor, mu_tail_logp: Tensor, pi_tail_logp: Tensor,
                  pi_tail_log_sumsq: Tensor, k_index: Tensor, tail_count: Tensor, mu_kth_logp: Tensor,
                  exact_tail: Tensor | None, binary: bool = True) -> dict[str, Tensor]:
    """The tensor math of ``token_stats``: pure, so ``torch.compile`` can fuse it unchanged."""
    mu_logp_k = mu_logp.gather(1, k_index[:, None])[:, 0]
    pi_logp_k = pi_logp.gather(1, k_index[:, None])[:, 0]
    pi_tail = torch.exp(pi_tail_logp)
    view = TailView(mu_tail=torch.exp(mu_tail_logp), pi_tail=pi_tail,
                    pi_tail_logp=pi_tail_logp, tail_count=tail_count,
                    pi_tail_log_sumsq=pi_tail_log_sumsq, exact_tail=exact_tail,
                    live=tail_live(tail_count, pi_tail))
    mu = pi = diff = None  # compiled: each use exponentiates afresh (``numerics.exp_per_use``)
    if not exp_per_use():  # eagerly once, shared by D, TV, the head and the rests
        mu, pi = torch.exp(mu_logp), torch.exp(pi_logp)
        diff = mu - pi
    head = ddot_head(mu_logp, pi_logp, k_index, mu=mu, pi=pi, diff=diff)
    lower, upper = ddot_interval(head, view, torch.exp(mu_kth_logp))
    log_ratio = pi_logp_k - mu_logp_k
    out = {
        "topk_kl": topk_kl(mu_logp, pi_logp, mu_tail_logp, pi_tail_logp, mu=mu),
        "topk_tv": topk_tv(mu_logp, pi_logp, mu_tail_logp, pi_tail_logp, diff=diff),
        "log_ratio": log_ratio,
        "ratio": torch.exp(log_ratio),
        "mu_tail": view.mu_tail,
        "pi_tail": view.pi_tail,
        "ddot_lower": lower,
        "ddot_upper": upper,
    }
    for name in DDOT_ESTIMATORS:
        if name != "exact" or exact_tail is not None:
            out[f"ddot_{name}"] = ddot(head, view, name)
    if binary:  # the rests' two passes over [N, m] are a third of this function's work (eager)
        mu_rest, mu_rescue = rest_logmass_from_probs(mu_logp_k, torch.exp(mu_logp) if mu is None else mu,
                                                     view.mu_tail, k_index)
        pi_rest, pi_rescue = rest_logmass_from_probs(pi_logp_k, torch.exp(pi_logp) if pi is None else pi,
                                                     pi_tail, k_index)
        out["binary_kl"] = binary_kl(mu_logp_k, pi_logp_k, mu_rest_logp=mu_rest, pi_rest_logp=pi_rest)
        out["rest_rescue"] = mu_rescue | pi_rescue
        out["binary_tv"] = binary_tv(mu_logp_k, pi_logp_k)
    return out


def _binary_kl_exact(mu_logp: Tensor, pi_logp: Tensor, mu_tail_logp: Tensor, pi_tail_logp: Tensor,
                     k_index: Tensor) -> Tensor:
    """DPPO's binary KL with the rests from ``rest_logmass`` (log-sum-exps): rows it rescues."""
    at_k = k_index[:, None]
    return binary_kl(mu_logp.gather(1, at_k)[:, 0], pi_logp.gather(1, at_k)[:, 0],
                     mu_rest_logp=rest_logmass(mu_logp, mu_tail_logp, k_index),
                     pi_rest_logp=rest_logmass(pi_logp, pi_tail_logp, k_index))


@torch.no_grad()
def token_stats(support: Support, pi: PolicyOnSupport, *, mu_full: Tensor | None = None,
                pi_full: Tensor | None = None, compiled: bool | None = None, binary: bool = True) -> TokenStats:
    """Every per-token quantity of SPEC §2–3 for one batch.

    Args:
        support: μ on the reduced support (``support_from_topk`` / ``support_from_full``).
        pi: π on the same support (``policy_on_support``).
        mu_full, pi_full: [N, n] full log-probabilities, toys only: enable ``exact`` and full KL.
        compiled: run the same math through ``torch.compile`` (one fused kernel instead of ~20
            passes over [N, m]); default from ``PDM_LAB_COMPILE``. Eager runs it by cache-sized
            row blocks (``compiled.by_row_blocks``). Tested equal.
        binary: also DPPO's binary KL and TV on the sampled token (their rest masses read all of
            S). ``pdm_policy_loss`` asks for them only for a rule that reads them
            (``MaskRule.binary_stats``); with False, ``binary_kl`` and ``binary_tv`` are None.
    """
    check_same(("pi.logp", "support.ids"), pi.logp, support.ids)
    if (mu_full is None) != (pi_full is None):
        raise PDMInputError("mu_full and pi_full: give both full distributions or neither")
    pi_logp = pi.logp.detach()
    dtype = pi_logp.dtype
    exact = full = None
    if mu_full is not None:
        exact = exact_tail_term(mu_full, pi_full, support.ids).to(dtype)
        full = full_kl(mu_full, pi_full).to(dtype)
    if pi_logp.shape[0] == 0:
        compiled = False  # nothing to fuse; skip the compile
    math = maybe_compiled(_token_stats_math, compiled, row_blocks=True)
    out = math(support.mu_logp.to(dtype), pi_logp, support.mu_tail_logp.to(dtype),
               pi.tail_logp.to(dtype), pi.tail_log_sumsq.to(dtype), support.k_index,
               support.tail_count, support.mu_kth_logp.to(dtype), exact, binary)
    rescue = out.pop("rest_rescue", None)
    if rescue is not None and bool(any_true(rescue)):  # a rest near underflow: those rows exactly
        rows = torch.nonzero(rescue)[:, 0]
        out["binary_kl"][rows] = _binary_kl_exact(support.mu_logp[rows].to(dtype), pi_logp[rows],
                                                  support.mu_tail_logp[rows].to(dtype), pi.tail_logp[rows].to(dtype),
                                                  support.k_index[rows])
    ddot_values = {name: out.pop(f"ddot_{name}") for name in DDOT_ESTIMATORS if f"ddot_{name}" in out}
    return TokenStats(full_kl=full, ddot=ddot_values, binary_kl=out.pop("binary_kl", None),
                      binary_tv=out.pop("binary_tv", None), **out)
