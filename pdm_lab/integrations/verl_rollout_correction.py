"""verl's rollout correction in bypass mode for a pdm_lab loss, computed by verl's own function.

One home for both verl loss paths (``pdm_lab.integrations.verl``'s sampled-token losses and
``verl_patches``' top-K losses), so neither imports the other for it.
"""
from __future__ import annotations

from typing import Any

import torch

from pdm_lab.integrations.verl_config import LOSS_PREFIX


def verl_rollout_correction(rule: str, config: Any, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                            response_mask: torch.Tensor, *, rejection: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rollout correction in bypass mode, computed by verl, for a pdm_lab loss: (the
    response mask with verl's rejection applied, verl's ``rollout_corr/*`` metrics).

    With ``algorithm.rollout_correction.bypass_mode=true`` verl hands its config to the loss
    (``policy_loss.rollout_correction``), and its own bypass loss (``compute_policy_loss_bypass_mode``,
    ``loss_type=ppo_clip``) calls ``compute_rollout_correction_and_rejection_mask`` on π_current vs
    μ: the IS weights (``rollout_is``: token or sequence, ``rollout_is_threshold``: an upper cap or
    ``"lower_upper"``) are computed for the metrics only — the ratio r = π/μ already carries the
    correction — and the rejection mask (``rollout_rs``) removes tokens from the loss. This does the
    same with the same function, so verl's dashboards keep every key verl would log, and the mask
    then acts on the tokens verl's rejection kept. ``loss_type=reinforce`` multiplies the loss by
    the IS weights, which pdm_lab's rules replace: refused by name. Outside bypass mode verl's
    trainer computes the correction itself (its metrics are verl's; weights handed to the loss are
    refused by ``pdm_verl_loss``). Returns (``response_mask``, {}) when there is no such config.
    ``rejection=False`` (the top-K loss, whose mask comes from its kept batch): ``rollout_rs`` refused.
    """
    policy_loss = getattr(config, "policy_loss", None)
    corr = None if policy_loss is None else policy_loss.get("rollout_correction", None)
    if corr is None or not corr.get("bypass_mode", False):
        return response_mask, {}
    loss_type = corr.get("loss_type", "ppo_clip")
    if loss_type != "ppo_clip":
        raise ValueError(f"{LOSS_PREFIX}{rule}: algorithm.rollout_correction.loss_type={loss_type!r} multiplies the "
                         "loss by IS weights, which pdm_lab's rules replace; use loss_type=ppo_clip (the ratio "
                         "π/μ carries the correction, the weights are computed for verl's metrics only)")
    if not rejection and corr.get("rollout_rs", None) is not None:
        raise ValueError(f"{LOSS_PREFIX}{rule}: algorithm.rollout_correction.rollout_rs="
                         f"{corr.get('rollout_rs')!r}: the top-K loss does not apply verl's rejection mask; set "
                         "rollout_rs=null (mask.delta bounds the top-K divergence)")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    with torch.no_grad():
        _, kept, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(), rollout_log_prob=old_log_prob.detach(), response_mask=response_mask,
            rollout_is=corr.get("rollout_is", None), rollout_is_threshold=corr.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=corr.get("rollout_is_batch_normalize", False),
            rollout_rs=corr.get("rollout_rs", None), rollout_rs_threshold=corr.get("rollout_rs_threshold", None))
    return kept.to(response_mask.dtype), metrics
