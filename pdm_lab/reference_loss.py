"""The loss to read first: SPEC §2–§5 for one batch, top to bottom, in plain eager torch.

``pdm_policy_loss`` computes the same loss chunked, fused, validated and with its metrics; this
one materialises [N, n] and checks nothing, so that every step is one line of the SPEC. It is
the naive equivalent the fast path is tested against (eager and compiled, float64: loss,
gradient, keep mask).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.mask_config import MaskConfig
from pdm_lab.errors import PDMInputError
from pdm_lab.masks import get_mask_rule, mask_icepop, mask_none, mask_ppo_clip


def pdm_policy_loss_reference(logits: Tensor, topk_ids: Tensor, topk_logp: Tensor, sampled: Tensor,
                              sampled_logp: Tensor, advantages: Tensor, response_mask: Tensor, cfg: MaskConfig,
                              *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(loss, keep [B, T]) of rule ``cfg.rule`` from the engine's and the trainer's tensors.

    logits [N, n] (the trainer's, before the temperature); topk_ids, topk_logp [N, K'] μ's top-K
    ordered by log-prob (ties: lower id; −1 / −inf padding: ``pdm_lab.engine_topk``); sampled,
    sampled_logp [N]; advantages, response_mask [B, T] with N = B·T. Covers the rules of SPEC §4
    that read the token's own statistics (a rule that needs more, or judges whole sequences, is
    refused).
    """
    rule = get_mask_rule(cfg.rule)
    if rule.needs or rule.level != "token" or (rule.divergence is None and rule.drop not in _RATIO_ONLY):
        raise PDMInputError(f"pdm_policy_loss_reference: rule {cfg.rule!r} is not covered (it needs "
                            f"{rule.needs or 'a sequence or band test'}); use pdm_policy_loss")
    n, vocab = logits.shape
    rows, k, resp = torch.arange(n), sampled.long(), response_mask.reshape(-1).bool()
    # SPEC §2: S = μ's top-K plus k (union), or k in the K-th slot (kslot); μ on S, μ_T from the head
    K = cfg.k  # SPEC's K (the support size); k below is the sampled token, as in SPEC
    top_ids, top_logp = topk_ids[:, :K].long(), topk_logp[:, :K].double()
    real = top_ids >= 0  # padding (−1) adds nothing below
    in_s = torch.zeros(n, vocab, dtype=torch.float64).scatter_add(1, top_ids.clamp(min=0), real.double()) > 0
    mu = torch.zeros(n, vocab, dtype=torch.float64).scatter_add(1, top_ids.clamp(min=0), real * top_logp.exp())
    if cfg.convention == "kslot":  # k replaces the K-th (last real) top slot when it is not in the top-K
        last = top_ids.gather(1, (real.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0].clamp(min=0)
        in_s[rows, last] &= in_s[rows, k]
    in_s[rows, k], mu[rows, k] = True, sampled_logp.double().exp()
    mu = torch.where(in_s, mu, 0.0)
    t = vocab - in_s.sum(1)
    # μ_T = 1 − e^{log Σ_S μ} without the cancellation of 1 − Σ_S μ (SPEC §8); 0 for an empty tail
    mu_t = torch.where(t > 0, -torch.expm1(torch.logsumexp(mu.log(), 1)), 0.0).clamp(min=0)
    # the trainer's π over the whole vocabulary, at the rollout's temperature
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    pi = logp.exp()
    pi_t, sq_t = torch.where(in_s, 0.0, pi).sum(1), torch.where(in_s, 0.0, pi * pi).sum(1)
    # SPEC §2: top-K KL and TV (0·log 0 = 0), binary KL and TV on k
    kl = lambda p, q: torch.xlogy(p, p) - torch.xlogy(p, q)  # noqa: E731
    topk_kl = torch.where(in_s, kl(mu, pi), 0.0).sum(1) + kl(mu_t, pi_t)
    topk_tv = 0.5 * (torch.where(in_s, (mu - pi).abs(), 0.0).sum(1) + (mu_t - pi_t).abs())
    mu_k, pi_k = mu[rows, k], pi[rows, k]
    binary_kl, binary_tv = kl(mu_k, pi_k) + kl(1 - mu_k, 1 - pi_k), (pi_k - mu_k).abs()
    # SPEC §3: Ḋ = head + tail term, the tail term as the estimator assumes it
    head = (pi_k - mu_k) + torch.where(in_s, pi * (mu - pi), 0.0).sum(1)
    ddot = {"agg": pi_t * (mu_t - pi_t), "uniform": pi_t * (mu_t - pi_t) / t.clamp(min=1),
            "topk": torch.where(pi_t > 0, mu_t * sq_t / pi_t.clamp(min=1e-300) - sq_t, 0.0)}
    # SPEC §4: drop = outside the region ∧ the rule's direction test says outward
    adv = torch.where(resp, advantages.reshape(-1).double(), 0.0)
    log_r = logp[rows, k] - sampled_logp.double()
    r = log_r.detach().exp()
    if rule.drop is mask_none:
        drop = torch.zeros(n, dtype=torch.bool)
    elif rule.drop is mask_ppo_clip:
        drop = ((adv > 0) & (r > 1 + cfg.eps_high)) | ((adv < 0) & (r < 1 - cfg.eps_low))
    elif rule.drop is mask_icepop:
        drop = ((r < cfg.icepop_low) | (r > cfg.icepop_high)) & (adv != 0)
    else:
        divergence = {"topk_kl": topk_kl, "topk_tv": topk_tv, "binary_kl": binary_kl, "binary_tv": binary_tv}
        delta = torch.where(adv < 0, cfg.delta_for_negative, cfg.delta)
        direction = (head + ddot[rule.estimator]) if rule.estimator else log_r.detach()
        drop = (divergence[rule.divergence].detach() > delta) & (adv * direction.detach() > 0)
    keep = ~drop & resp & (adv != 0)
    # SPEC §5: surrogate −M·Â·r with the ratio factor capped at c (a constant), then aggregated
    ratio = torch.where(keep, log_r, 0.0).exp()
    if cfg.clip_ratio_c is not None:
        ratio = ratio * (ratio.detach().clamp(max=cfg.clip_ratio_c) / ratio.detach())
    per_token = torch.where(keep, -adv * ratio, 0.0).reshape(response_mask.shape)
    count = response_mask.sum(1)
    seq = {"seq-mean-token-mean": per_token.sum(1) / count.clamp(min=1), "seq-mean-token-sum": per_token.sum(1),
           "seq-mean-token-sum-norm": per_token.sum(1) / (cfg.horizon or response_mask.shape[1])}
    loss = per_token.sum() / count.sum().clamp(min=1) if cfg.aggregation == "token-mean" else \
        seq[cfg.aggregation][count > 0].sum() / (count > 0).sum().clamp(min=1)
    return loss, (~drop).reshape(response_mask.shape)


#: SPEC §4's rules that test the ratio alone: no divergence in their record, so named by function.
_RATIO_ONLY = (mask_none, mask_ppo_clip, mask_icepop)

__all__ = ["pdm_policy_loss_reference"]
