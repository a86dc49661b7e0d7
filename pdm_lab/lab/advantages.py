"""GRPO group advantages, shared by the toys and the scaling loop (the mask takes Â as given)."""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_same, check_tensor


def group_advantages(rewards: Tensor, groups: Tensor, valid: Tensor | None = None, *,
                     scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Â_i = (R_i − mean_g R) / (std_g R + ε) over the valid samples of each group g.

    Args:
        rewards: [B] rewards.
        groups: [B] int64 group (prompt) index ≥ 0 of each sample.
        valid: [B] bool; False samples (a verifier failed) are left out of their group's
            statistics and get Â = 0. Default: all valid.
        scale_by_std: divide by the group's unbiased standard deviation (GRPO); False gives
            Dr. GRPO's mean-centred advantage.
        eps: added to the standard deviation.

    Returns:
        [B] advantages in the rewards' float dtype (float32 for integer rewards). A group with
        fewer than two valid samples, or whose rewards are all equal, carries no signal: Â = 0.
        Vectorised with ``index_add_``: no loop over groups.
    """
    check_tensor("rewards", rewards, ndim=1)
    check_tensor("groups", groups, ndim=1, integer=True)
    check_same(("rewards", "groups"), rewards, groups)
    if groups.numel() and int(groups.min()) < 0:
        raise PDMInputError(f"groups: negative group index {int(groups.min())}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    keep = torch.ones_like(groups, dtype=torch.bool) if valid is None else valid.bool()
    check_same(("rewards", "valid"), rewards, keep)
    r, w = rewards.to(torch.float64), keep.to(torch.float64)
    num = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(num, dtype=torch.float64).index_add_(0, groups, w)
    mean = torch.zeros(num, dtype=torch.float64).index_add_(0, groups, r * w) / count.clamp(min=1)
    centred = (r - mean[groups]) * w
    if scale_by_std:
        var = torch.zeros(num, dtype=torch.float64).index_add_(0, groups, centred ** 2)
        centred = centred / ((var / (count - 1).clamp(min=1)).sqrt()[groups] + eps)
    centred = torch.where(keep & (count[groups] >= 2), centred, torch.zeros_like(centred))
    return centred.to(out_dtype)
