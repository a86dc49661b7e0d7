"""Validation of what ``pdm_policy_loss`` is given beyond shapes: bad input → `PDMInputError`
naming the argument and the first offending position. Each check is one pass over an [N] or
[B, T] tensor (the loss's own size), located only on failure."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from .errors import PDMInputError, check_not_nan, check_tensor, check_zero_one
from .support import Support


def check_loss_inputs(support: Support, response_mask: Tensor, cfg: Any, coupled: Tensor | None) -> None:
    """The response mask is 0/1, the mask config's K is the support's, c_t has no NaN.

    Args:
        support: μ's support; ``support.top_k`` None (ready slots) skips the K check.
        response_mask: [B, T] bool or 0/1 numbers.
        cfg: the mask config (``MaskConfig``: its ``k``).
        coupled: [N] c_t (SPEC §3b), or None.
    """
    check_zero_one("response_mask", response_mask)
    if support.top_k is not None and support.top_k != cfg.k:
        raise PDMInputError(f"mask.k: K = {cfg.k} in the mask config, but the support was built with "
                            f"K = {support.top_k} (support_from_topk / support_from_full k=…)")
    if coupled is not None:
        check_tensor("coupled", coupled, floating=True)
        if coupled.numel() != support.ids.shape[0]:
            raise PDMInputError(f"coupled has shape {tuple(coupled.shape)} but the support has "
                                f"{support.ids.shape[0]} rows (one c_t per token)")
        check_not_nan("coupled", coupled.detach().reshape(-1))
