"""Central differences of a model's outputs along a parameter direction, for any model (FSDP2 shards
included): the parameters are perturbed in place and restored bit-exactly, so no forward-mode AD is
needed. Used by ``pdm_coupled``'s stage side (SPEC §3b) and the own-update probe's live kernel
(SPEC §6d); the step ε and its two-stage choice are documented in ``choose_eps``.

ε_θ = τ·max(‖θ‖, 1)/‖u‖ (τ = eps_dtype^(1/3)) alone, the usual Jacobian-free rule, is far too
large for a language model (u concentrates on few weights, the outputs bend within ε_θ): a pilot
forward at ε_θ gives the secant slope s = max_t |f(θ + ε_θ u) − f(θ)|/ε_θ and ε = min(ε_θ, τ/s)
moves every output by about τ, balancing truncation against rounding.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shard → its local tensor


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_sum(x: Tensor) -> Tensor:
    if _world() > 1:
        dist.all_reduce(x)
    return x


def global_norm(tensors: list[Tensor]) -> float:
    """‖x‖ over a list of (possibly sharded) tensors, summed over ranks, in float64."""
    device = _local(tensors[0]).device if tensors else "cpu"  # nccl reduces device tensors only
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        sq += _local(t).detach().double().pow(2).sum()
    return float(_all_sum(sq).sqrt())


def central_difference_eps(theta_norm: float, u_norm: float, dtype: torch.dtype) -> float:
    """ε_θ = τ·max(‖θ‖, 1)/‖u‖ with τ = eps_dtype^(1/3): the cap and pilot of ``choose_eps``; 0 when u = 0.

    ‖θ‖ is floored at 1 so that a model near θ = 0 still gets a step well above rounding."""
    if u_norm == 0.0:
        return 0.0
    tau = torch.finfo(dtype).eps ** (1.0 / 3.0)
    return tau * max(theta_norm, 1.0) / u_norm


@torch.no_grad()
def _forward_at(params: list[Tensor], direction: list[Tensor], forward: Callable[[], Tensor],
                eps: float) -> Tensor:
    """f(θ + εu), θ restored bit-exactly afterwards."""
    saved = [p.detach().clone() for p in params]
    try:
        for p, u in zip(params, direction):
            p.add_(u.to(p.dtype), alpha=eps)
        return forward()
    finally:
        for p, s in zip(params, saved):
            p.copy_(s)


def choose_eps(params: list[Tensor], direction: list[Tensor], forward: Callable[[], Tensor], base: Tensor,
               dtype: torch.dtype) -> float:
    """ε = min(ε_θ, τ/s): s the secant slope max_t |f(θ + ε_θ u) − f(θ)|/ε_θ (module docstring).

    Args:
        base: [N] f(θ), already computed (the loop's own forward). Collective under FSDP.
    """
    cap = central_difference_eps(global_norm(params), global_norm(direction), dtype)
    if cap == 0.0:
        return 0.0
    slope = (_forward_at(params, direction, forward, cap).double() - base.double()).abs()
    slope = slope.max() if slope.numel() else slope.new_zeros(())
    if _world() > 1:
        dist.all_reduce(slope, op=dist.ReduceOp.MAX)
    tau = torch.finfo(dtype).eps ** (1.0 / 3.0)
    slope = float(slope) / cap
    return min(cap, tau / slope) if slope > 0 else cap


def central_difference(params: list[Tensor], direction: list[Tensor], forward: Callable[[], Tensor],
                       eps: float) -> Tensor:
    """(f(θ + εu) − f(θ − εu)) / 2ε in float64, θ restored bit-exactly after each pass.

    Args:
        params: the model's parameters (plain or FSDP DTensor shards), perturbed in place.
        direction: u, one tensor per parameter, same shapes/placements.
        forward: runs the model at the current θ and returns [N] (collective under FSDP).
        eps: the step ε (> 0).
    """
    if eps <= 0:
        raise ValueError(f"central_difference: eps must be > 0, got {eps}")
    plus = _forward_at(params, direction, forward, eps).double()
    minus = _forward_at(params, direction, forward, -eps).double()
    return (plus - minus) / (2.0 * eps)


def adam_preconditioner(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> list[Tensor] | None:
    """AdamW's diagonal 1/(√v̂ + ε) per parameter; None (identity) before its first step or for SGD."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    hyper = {id(p): (g["betas"][1], g["eps"]) for g in optimizer.param_groups for p in g["params"]}
    out, seen = [], False
    for p in params:
        state = optimizer.state.get(p, {})
        step = float(state["step"]) if "step" in state else 0.0
        if step == 0:
            out.append(torch.ones_like(p))
            continue
        seen = True
        beta2, eps = hyper[id(p)]
        out.append(1.0 / ((state["exp_avg_sq"] / (1.0 - beta2 ** step)).sqrt() + eps))
    return out if seen else None


def adam_gradient_scale(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> float | None:
    """c = lr·(1 − β₁)/(1 − β₁^s) right after Adam's s-th step: the current gradient G enters that
    step as −c·P·G (P = ``adam_preconditioner`` then), the rest of the step being the optimiser's
    memory (β₁·m and weight decay). None for another optimiser or before any step."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                s, beta1 = float(state["step"]), group["betas"][0]
                return group["lr"] * (1.0 - beta1) / (1.0 - beta1 ** s)
    return None
