"""GRPO group advantages: each response's reward against the other responses to its prompt.

    Â_i = (R_i − mean_g R) / (std_g R + ε)      (``algo.norm_by_std``; Dr. GRPO: no division)

over the valid samples of the group g (a sample whose verifier failed is left out of its group's
statistics and gets Â = 0). A group whose rewards are all equal carries no signal: Â = 0.
The standard deviation is the unbiased one, as in the GRPO reference implementations.
"""
from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group: Tensor, valid: Tensor, *, norm_by_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """Per-sequence advantages.

    Args:
        rewards: [B] float rewards.
        group: [B] int64 group (prompt) index of each sequence.
        valid: [B] bool, False for samples to leave out (they get 0).
        norm_by_std: divide by the group's standard deviation.
        eps: added to the standard deviation.

    Returns:
        [B] float32 advantages.
    """
    if not (rewards.shape == group.shape == valid.shape and rewards.dim() == 1):
        raise ValueError(f"rewards {tuple(rewards.shape)}, group {tuple(group.shape)} and valid "
                         f"{tuple(valid.shape)} must be equal 1-D shapes")
    r = rewards.to(torch.float64)
    out = torch.zeros_like(r)
    for g in torch.unique(group):
        sel = (group == g) & valid
        n = int(sel.sum())
        if n < 2:
            continue
        vals = r[sel]
        centred = vals - vals.mean()
        if norm_by_std:
            centred = centred / (vals.std(unbiased=True) + eps)
        out[sel] = centred
    return out.to(torch.float32)
