"""Validation of what ``pdm_policy_loss`` is given beyond shapes, and of what it makes: bad input
→ `PDMInputError` naming the argument and the first offending position; a non-finite loss is an
error naming the token; non-finite gradients are a metric naming the parameter. Each check is
one pass over an [N] or [B, T] tensor (the loss's own size), located only on failure."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from pdm_lab.errors import PDMInputError, check_not_nan, check_tensor, check_zero_one, first_position, raise_at
from pdm_lab.support import Support


def check_loss_inputs(support: Support, response_mask: Tensor, cfg: Any, coupled: Tensor | None,
                      kernel: Tensor | None = None) -> None:
    """The response mask is 0/1, the mask config's K is the support's, c_t has no NaN, the kernel
    term is finite.

    Args:
        support: μ's support; ``support.top_k`` None (ready slots) skips the K check.
        response_mask: [B, T] bool or 0/1 numbers.
        cfg: the mask config (``MaskConfig``: its ``k``).
        coupled: [N] c_t (SPEC §3b), or None.
        kernel: [N] h_t = ⟨Wᵀg, Wᵀv⟩ (``pdm_lab.kernel_direction``, rule ``pdm_kernel``), or None.
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
    if kernel is not None:
        check_tensor("kernel", kernel, floating=True)
        if kernel.numel() != support.ids.shape[0]:
            raise PDMInputError(f"kernel has shape {tuple(kernel.shape)} but the support has "
                                f"{support.ids.shape[0]} rows (one c_t per token)")
        flat = kernel.detach().reshape(-1)
        raise_at("kernel", ~torch.isfinite(flat), "non-finite kernel term", flat)


def check_loss_finite(loss: Tensor, per_token: Tensor, advantages: Tensor, log_ratio: Tensor) -> None:
    """A non-finite loss is an error naming the first token whose surrogate is not finite, with
    its advantage, log r and dtype (float16 holds |x| ≤ 65504: an advantage near 1e6 is inf
    there). Called after the loss is formed, so the happy path costs one ``isfinite`` of a scalar.

    Args:
        loss: the aggregated loss (0-d).
        per_token: [B, T] surrogate values −M·Â·min(r, c).
        advantages, log_ratio: [N] Â and log r of the same tokens.
    """
    if bool(torch.isfinite(loss.detach()).all()):
        return
    bad = ~torch.isfinite(per_token.detach())
    if not bool(bad.any()):  # every token finite, their aggregate not: the sum overflowed the dtype
        raise PDMInputError(f"loss: {float(loss)} in {loss.dtype}: the per-token surrogates are finite but "
                            "their aggregate overflows the dtype; compute the loss in float32 or wider")
    pos = first_position(bad)
    flat = int(torch.nonzero(bad.reshape(-1))[0, 0])
    raise PDMInputError(
        f"loss: non-finite surrogate at token position {list(pos)} (advantage {float(advantages[flat]):.6g}, "
        f"log r {float(log_ratio[flat]):.6g}, dtype {per_token.dtype}); {int(bad.sum())} such tokens: "
        "an advantage or ratio beyond the dtype's range (float16: 65504); compute the loss in float32, "
        "cap the ratio (mask.clip_ratio_c) or scale the advantages")


def gradient_flags(named_parameters: Iterable[tuple[str, Tensor]]) -> tuple[dict[str, Any], str | None]:
    """``{"grad/nonfinite": entries of NaN or ±inf gradient over the parameters}`` (a metric sum)
    and the first offending parameter's name and position (None when all are finite). Call after
    ``backward()``: the step that follows would write them into the weights."""
    from pdm_lab.metrics import metric

    total, first = 0, None
    for name, param in named_parameters:
        grad = param.grad
        if grad is None:
            continue
        bad = ~torch.isfinite(grad.detach())
        count = int(bad.sum())
        if count and first is None:
            first = f"{name} at position {list(first_position(bad))} (value {grad[first_position(bad)].item()!r})"
        total += count
    return {"grad/nonfinite": metric("sum", float(total))}, first
