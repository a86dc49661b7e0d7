"""verl's top-K path (tested with verl 0.9.1): μ's top-K from vLLM to the actor's loss.

verl's rollout server asks vLLM for ``logprobs=0`` and the actor's loss sees one log-prob per
token, so the top-K rules (``pdm_*``, ``dppo_topk_*``) need data verl does not carry. The pieces,
each small and checked against verl's own utilities:

1. ``sampling_kwargs(k)`` — what the rollout asks vLLM for: ``logprobs=K`` in
   ``processed_logprobs`` mode (after temperature and top-k/top-p: μ is what was sampled).
2. ``topk_from_vllm(outputs, responses, k)`` — vLLM's per-position dicts → [B, T, K] ids and
   log-probs plus [B, T] log μ_k, at the *logit-aligned* position of each response token (entry t
   of a completion is the distribution that produced response token t), read by the core's parser
   (``pdm_lab.engine_topk``). These ride in the batch as ``rollout_topk_ids``/``rollout_topk_logp``
   beside verl's ``rollout_log_probs``.
3. ``topk_policy_loss(config, logits, data, temperature)`` — the actor side: the support's ids
   go to the row of the model's no-padding logits [nnz, V] that predicts each response token
   (found with verl's ``no_padding_2_padding``, the same left shift verl applies to log-probs),
   then π on the support through the chunked gather on those rows (no [B, T, V] copy) and the
   core's ``pdm_policy_loss``, normalised with verl's global batch counts as ``agg_loss`` does.

Wiring 1–3 into verl's server, agent loop and actor is ``pdm_lab.integrations.verl_patches``
(the versioned patch set); this module holds the parts whose numerics matter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdm_lab.engine_topk import EngineTopK, pad_responses, topk_from_dicts
from pdm_lab.loss import pdm_policy_loss
from pdm_lab.padding import PAD_ID, PAD_LOGP, pad_to_length, policy_with_padding_rows
from pdm_lab.policy_side import policy_on_support
from pdm_lab.sampling_mask import engine_kept, on_sampling_set
from pdm_lab.support import support_from_topk
from pdm_lab.integrations.versions import require_version

VERL_VERSION = require_version("verl")

from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from pdm_lab.integrations.verl_config import loss_setup, record_once, sampling_setup  # noqa: E402

TOPK_KEYS = ("rollout_topk_ids", "rollout_topk_logp")


def sampling_kwargs(k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vLLM ``SamplingParams`` fields, engine args) for μ's top-K of the sampled distribution."""
    return {"logprobs": k}, {"logprobs_mode": "processed_logprobs"}


def topk_from_vllm(position_logprobs: list[list[dict[int, Any]]], responses: Tensor,
                   k: int) -> tuple[Tensor, Tensor, Tensor]:
    """[B] lists of per-position ``{token_id: Logprob}`` (vLLM ``CompletionOutput.logprobs``) and
    the [B, T] right-padded responses → [B, T, K] ids (−1 pad), log μ (−inf pad), [B, T] log μ_k
    (0 pad): ``pdm_lab.engine_topk.topk_from_dicts`` per response, padded as it pads."""
    t = responses.shape[1]
    rows = [topk_from_dicts(seq[:t], responses[i, : len(seq[:t])], k, response=i)
            for i, seq in enumerate(position_logprobs)]
    batch = pad_responses(rows, t) if rows else EngineTopK(
        ids=torch.full((0, t, k), PAD_ID), logp=torch.full((0, t, k), PAD_LOGP),
        sampled=responses[:0], sampled_logp=torch.zeros(0, t))
    return batch.ids, batch.logp, batch.sampled_logp


def topk_rules() -> tuple[str, ...]:
    """Registered rules whose declared support is μ's top-K and that need nothing the stage must
    add (``needs``)."""
    from pdm_lab.masks import MASK_RULES

    return tuple(name for name, rec in MASK_RULES.items() if rec.support == "topk" and not rec.needs)


def pad_topk(ids: Any, logp: Any, length: int, k: int) -> tuple[Tensor, Tensor]:
    """[T', K] top-K of one response (the server's arrays) → [1, length, K] ids (−1 pad) and
    log μ (−inf pad): verl's agent loop pads ``rollout_log_probs`` the same way (right, to the
    configured response length, truncating a longer one)."""
    ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(-1, k)
    logp_t = torch.as_tensor(logp, dtype=torch.float32).reshape(-1, k)
    return pad_to_length(ids_t, length, PAD_ID)[None], pad_to_length(logp_t, length, PAD_LOGP)[None]


def _response_rows(data: Any, nnz: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[B, T] row of the no-padding logits that predicts each response token, and [B, T] bool
    (False at padding), both from verl's own ``no_padding_2_padding`` (its left shift by one)."""
    rows = no_padding_2_padding(torch.arange(nnz, device=device), data)
    valid = no_padding_2_padding(torch.ones(nnz, dtype=torch.bool, device=device), data)
    return rows, valid


def topk_policy_loss(config: Any, logits: Tensor, data: Any, *, rule: str, temperature: float = 1.0,
                     loss_agg_mode: str = "token-mean") -> tuple[Tensor, dict[str, float]]:
    """pdm_lab's loss on μ's top-K for a verl batch.

    Args:
        config: verl actor config (``policy_loss.mask``, ``global_batch_info``), or None.
        logits: [nnz, V] the actor's logits in verl's no-padding layout (grad flows), before the
            division by the rollout temperature.
        data: verl TensorDict with ``prompts``, ``responses``, ``attention_mask``,
            ``response_mask``, ``advantages``, ``rollout_log_probs`` and ``TOPK_KEYS`` ([B, T, K]).
        rule: the mask rule; temperature: the rollout's.

    π on the support is computed on the logits' own rows (the support's ids scattered to the row
    that predicts each response token, −1 elsewhere), chunked: no [B, T, V] copy of the logits;
    over the engine's sampling set when ``policy_loss.sampling_mask`` cuts (``pdm_lab.sampling_mask``).
    """
    cfg, dp = loss_setup(config, rule, loss_agg_mode)
    sampling = sampling_setup(config)
    record_once(cfg, sampling, "topk")
    rows, valid = _response_rows(data, logits.shape[0], logits.device)
    b, t = rows.shape
    v = logits.shape[1]
    resp = data["response_mask"].bool() & valid
    flat, valid_flat = resp.reshape(-1), valid.reshape(-1)
    topk_ids, topk_logp = (data[key] for key in TOPK_KEYS)
    if topk_ids.is_nested:  # micro-batches may carry response fields as jagged tensors
        topk_ids, topk_logp = topk_ids.to_padded_tensor(PAD_ID), topk_logp.to_padded_tensor(PAD_LOGP)
    topk_ids, topk_logp = topk_ids[:, :t], topk_logp[:, :t]
    if topk_ids.shape[:2] != (b, t):
        raise ValueError(f"{TOPK_KEYS[0]}: shape {tuple(topk_ids.shape)} does not cover the [B, T] = [{b}, {t}] "
                         "responses (was it padded to the rollout's response length?)")
    support = support_from_topk(
        topk_ids.reshape(b * t, -1), topk_logp.reshape(b * t, -1),
        data["responses"].reshape(-1), data["rollout_log_probs"].reshape(-1).float(), vocab_size=v,
        k=cfg.k, convention=cfg.convention, row_mask=flat)
    # π on the rows that have logits (scattered to the logits' own rows: no [B, T, V] copy);
    # padding positions take π := μ, the core's padding rule
    have = valid_flat.nonzero(as_tuple=True)[0]
    row_of = rows.reshape(-1)[have]
    ids_rows = torch.full((logits.shape[0], support.ids.shape[1]), PAD_ID, dtype=support.ids.dtype,
                          device=logits.device)
    ids_rows[row_of] = support.ids[have]
    keep_rows = None
    if sampling is not None:
        keep_rows = torch.zeros(ids_rows.shape, dtype=torch.bool, device=logits.device)
        keep_rows[row_of] = engine_kept(support)[have].to(logits.device)
    on_rows = policy_on_support(logits, ids_rows, temperature=temperature, sampling=sampling,
                                keep_on_support=keep_rows)
    pi_have = type(on_rows)(logp=on_rows.logp[row_of], tail_logp=on_rows.tail_logp[row_of],
                            tail_log_sumsq=on_rows.tail_log_sumsq[row_of])
    pi = policy_with_padding_rows(support, have, pi_have)
    if sampling is not None:
        count = support.tail_count.index_put((have,), on_rows.tail_count[row_of].to(support.tail_count.device))
        support = on_sampling_set(support, count)
    out = pdm_policy_loss(pi, support, data["advantages"].to(pi.logp.dtype), resp, cfg, dp=dp)
    return out.loss, {f"actor/pdm/{key}": float(val) for key, val in out.metrics.items()}
