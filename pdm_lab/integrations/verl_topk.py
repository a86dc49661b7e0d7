"""verl's top-K path (tested with verl 0.9.1): μ's top-K from vLLM to the actor's loss.

verl's rollout server asks vLLM for ``logprobs=0`` and the actor's loss sees one log-prob per
token, so the top-K rules (``pdm_*``, ``dppo_topk_*``) need data verl does not carry. The pieces,
each small and checked against verl's own utilities:

1. ``sampling_kwargs(k)`` — what the rollout asks vLLM for: ``logprobs=K`` in
   ``processed_logprobs`` mode (after temperature and top-k/top-p: μ is what was sampled).
2. ``topk_from_vllm(outputs, responses, k)`` — vLLM's per-position dicts → [B, T, K] ids and
   log-probs plus [B, T] log μ_k, at the *logit-aligned* position of each response token (entry t
   of a completion is the distribution that produced response token t), the sampled token re-
   picked by id (vLLM adds it as a (K+1)-th entry when it is outside the top-K). These ride in
   the batch as ``rollout_topk_ids``/``rollout_topk_logp`` beside verl's ``rollout_log_probs``.
3. ``topk_policy_loss(config, logits, data, temperature)`` — the actor side: the model's
   no-padding logits [nnz, V] are cut to the response positions with verl's
   ``no_padding_2_padding`` (the same left shift verl applies to log-probs), then π on the support
   through the chunked gather and ``pdm_policy_loss``'s per-token surrogate, aggregated with
   verl's ``agg_loss``.

Wiring 1–3 into verl's agent loop and actor is the versioned patch set's job; this module holds
the parts whose numerics matter and the tests run them through verl's utilities.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..loss import token_surrogate
from ..masks import compute_mask
from ..metrics import step_metrics
from ..policy_side import policy_on_support
from ..stats import token_stats
from ..support import support_from_topk
from .versions import require_version

VERL_VERSION = require_version("verl")

from verl.trainer.ppo.core_algos import agg_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from .verl import mask_config  # noqa: E402

TOPK_KEYS = ("rollout_topk_ids", "rollout_topk_logp")


def sampling_kwargs(k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vLLM ``SamplingParams`` fields, engine args) for μ's top-K of the sampled distribution."""
    return {"logprobs": k}, {"logprobs_mode": "processed_logprobs"}


def _logprob(value: Any) -> float:
    lp = getattr(value, "logprob", value)
    return -math.inf if lp is None or (isinstance(lp, float) and math.isnan(lp)) else float(lp)


def topk_from_vllm(position_logprobs: list[list[dict[int, Any]]], responses: Tensor,
                   k: int) -> tuple[Tensor, Tensor, Tensor]:
    """[B] lists of per-position ``{token_id: Logprob}`` (vLLM ``CompletionOutput.logprobs``) and
    the [B, T] right-padded responses → [B, T, K] ids (−1 pad), log μ (−inf pad), [B, T] log μ_k."""
    b, t = responses.shape
    ids = torch.full((b, t, k), -1, dtype=torch.long)
    logp = torch.full((b, t, k), -math.inf, dtype=torch.float32)
    mu_k = torch.zeros(b, t, dtype=torch.float32)
    for i, seq in enumerate(position_logprobs):
        for j, entry in enumerate(seq[:t]):
            ranked = sorted(entry.items(), key=lambda kv: (-_logprob(kv[1]), kv[0]))
            sampled = int(responses[i, j])
            if sampled not in entry:
                raise ValueError(f"vLLM logprobs of response {i}, position {j} lack the sampled token {sampled}")
            mu_k[i, j] = _logprob(entry[sampled])
            for slot, (tok, value) in enumerate(ranked[:k]):
                ids[i, j, slot] = int(tok)
                logp[i, j, slot] = _logprob(value)
    return ids, logp, mu_k


def topk_policy_loss(config: Any, logits: Tensor, data: Any, *, rule: str, temperature: float = 1.0,
                     loss_agg_mode: str = "token-mean") -> tuple[Tensor, dict[str, float]]:
    """pdm_lab's loss on μ's top-K for a verl batch.

    Args:
        config: verl actor config (``policy_loss.mask``, ``global_batch_info``), or None.
        logits: [nnz, V] the actor's logits in verl's no-padding layout (grad flows).
        data: verl TensorDict with ``prompts``, ``responses``, ``attention_mask``,
            ``response_mask``, ``advantages``, ``rollout_log_probs`` and ``TOPK_KEYS`` ([B, T, K]).
        rule: the mask rule; temperature: the rollout's.
    """
    cfg = mask_config(config, rule)
    per_position = no_padding_2_padding(logits, data)  # [B, T, V], response-aligned (left shift)
    b, t, v = per_position.shape
    resp = data["response_mask"].bool()
    flat = resp.reshape(-1)
    support = support_from_topk(
        data["rollout_topk_ids"].reshape(b * t, -1), data["rollout_topk_logp"].reshape(b * t, -1),
        data["responses"].reshape(-1), data["rollout_log_probs"].reshape(-1).float(), vocab_size=v,
        k=cfg.k, convention=cfg.convention, row_mask=flat)
    pi = policy_on_support(per_position.reshape(b * t, v), support.ids, temperature=temperature)
    stats = token_stats(support, pi)
    adv = torch.where(flat, data["advantages"].reshape(-1).to(pi.logp.dtype), torch.zeros_like(flat, dtype=pi.logp.dtype))
    keep = compute_mask(cfg, stats, adv, resp)
    logp_k = pi.logp.gather(1, support.k_index[:, None])[:, 0]
    per_token = token_surrogate(logp_k, support.mu_logp_k.to(logp_k.dtype), adv, keep, cfg.clip_ratio_c)
    info = dict(getattr(config, "global_batch_info", None) or {})
    loss = agg_loss(loss_mat=per_token.reshape(b, t), loss_mask=resp, loss_agg_mode=loss_agg_mode, **info)
    metrics = step_metrics(stats, keep, adv, flat, cfg)
    return loss, {f"actor/pdm/{key}": float(val) for key, val in metrics.items()}
