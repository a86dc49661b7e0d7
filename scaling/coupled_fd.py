"""The scaling loop's side of ``pdm_coupled`` (SPEC §3b), for any model, FSDP2 included.

Per mini-batch, before the loss:

1. u = P ∇_θ D_O: one forward (with grad) and one backward of D_O = Σ_{t∈O} D_t over the
   mini-batch's micro-batches (μ fixed, D from ``pdm_lab.coupled.differentiable_topk_kl``); the
   same forward gives D and r, hence O (``pdm_lab.coupled.outside_set``). FSDP averages gradients
   over ranks, so the accumulated gradient is multiplied by the world size (D_O sums over every
   rank's tokens). P is AdamW's current diagonal 1/(√v̂ + ε), v̂ = exp_avg_sq/(1 − β₂^step),
   bias-corrected, and the identity before the first step (or for SGD).
2. g_t = d/dε log π_t(k_t)(θ + εu) by a central difference of two no-grad forward passes at
   θ ± εu (the parameters are perturbed in place, shard by shard, then restored bit-exactly
   from a copy). No forward-mode AD is needed, so it runs under FSDP and for any model.
3. c_t = Â_t r_t g_t (``pdm_lab.coupled.coupled_contribution``, the one implementation).

The step ε (``choose_eps``), in two stages. The classic central-difference optimum balances the
O(ε²) truncation against the rounding of log π (eps_dtype/ε); with τ = eps_dtype^(1/3) (float32:
4.9e-3) that means moving every token's log π by about τ, i.e. ε ≈ τ / max_t |g_t|:

1. a cap and a pilot, ε_θ = τ·max(‖θ‖, 1)/‖u‖ (the perturbation is a fraction τ of the
   parameters, well above the rounding of θ itself, eps_dtype·|θ_i|): one forward at θ + ε_θ u
   and the unperturbed log π from step 1 give a secant estimate s of max_t |g_t|;
2. ε = min(ε_θ, τ/s), then the central difference at ±ε.

ε_θ alone, the usual Jacobian-free rule, is far too large for a language model: the measured
error on the tiny Qwen3 test model is 18–51% (u concentrates on few weights, the log-probs bend
within ε_θ); the two-stage ε is within 1e-3 of the float64 reference (``tests/test_scaling_coupled.py``).
In bf16 compute τ = 0.2: use ``trainer.param_dtype: fp32`` with this rule (the loop warns).

Cost: one extra forward + backward and three extra forwards per mini-batch, logged as
``time/coupled_s``. Collective: every rank runs every pass, even with an empty local O.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from pdm_lab.coupled import coupled_contribution, differentiable_topk_kl, outside_set
from pdm_lab.stats import token_stats


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


def coupled_for_minibatch(policy, optimizer, micros: list, supports: list, policy_fn: Callable,
                          mask_cfg, *, compute_dtype: torch.dtype = torch.float32) -> tuple[list[Tensor], dict]:
    """c_t for every micro-batch of one mini-batch at the current θ (steps 1–3 above; ε by ``choose_eps``).

    Args:
        policy: the (FSDP) policy; its ``parameters()`` are perturbed and restored.
        optimizer: the optimiser whose state gives P.
        micros: the mini-batch's micro-batches (``train_step.MicroBatch``).
        supports: μ's support per micro-batch.
        policy_fn: ``(mb, support) -> PolicyOnSupport`` (``train_step.micro_batch_policy`` bound
            to the policy, temperature and chunking).
        mask_cfg: δ, δ_neg.
        compute_dtype: the trainer's compute dtype (sets τ).

    Returns:
        ([N_i] c per micro-batch, info: ``coupled/outside`` count, ``coupled/eps``, ``coupled/u_norm``).
    """
    if compute_dtype != torch.float32 and compute_dtype != torch.float64:
        warnings.warn(f"pdm_coupled: central difference in {compute_dtype} is mostly rounding; "
                      "use trainer.param_dtype: fp32", stacklevel=2)
    params = [p for p in policy.parameters()]
    world = _world()
    advs, ratios, bases, n_out = [], [], [], 0
    # 1. D, r, O and u = P∇D_O in one forward + backward per micro-batch
    for mb, support in zip(micros, supports):
        pi = policy_fn(mb, support)
        stats = token_stats(support, pi)
        adv = mb.advantages.reshape(-1).to(stats.ratio.dtype)
        adv = torch.where(mb.response_mask.reshape(-1), adv, torch.zeros_like(adv))
        outside = outside_set(stats.topk_kl, adv, mask_cfg)
        n_out += int(outside.sum())
        d_o = differentiable_topk_kl(support, pi)[outside].sum()
        (d_o * world).backward()  # every rank, even with an empty O: FSDP's reduce-scatter is collective
        advs.append(adv)
        ratios.append(stats.ratio)
        bases.append(pi.logp.detach().gather(1, support.k_index[:, None])[:, 0])
    device = _local(params[0]).device
    n_out_global = int(_all_sum(torch.tensor(float(n_out), dtype=torch.float64, device=device)))
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    if n_out_global == 0:
        return [torch.zeros_like(a) for a in advs], {"coupled/outside": 0.0, "coupled/eps": 0.0,
                                                       "coupled/u_norm": 0.0}
    precond = adam_preconditioner(optimizer, params)
    u = grads if precond is None else [g * q for g, q in zip(grads, precond)]
    u_norm = global_norm(u)
    sizes = [int(a.numel()) for a in advs]

    def logp_k() -> Tensor:
        out = []
        for mb, support in zip(micros, supports):
            pi = policy_fn(mb, support)
            out.append(pi.logp.gather(1, support.k_index[:, None])[:, 0])
        return torch.cat(out)

    eps = choose_eps(params, u, logp_k, torch.cat(bases), compute_dtype)
    if eps == 0.0:  # D_O has no gradient: nothing moves it to first order
        return [torch.zeros_like(a) for a in advs], {"coupled/outside": float(n_out_global),
                                                       "coupled/eps": 0.0, "coupled/u_norm": 0.0}

    # 2. g by a central difference of two forward passes at θ ± εu
    g = central_difference(params, u, logp_k, eps)
    # 3. the core's formula
    cs = [coupled_contribution(a, r, gi.to(r.dtype)) for a, r, gi in zip(advs, ratios, g.split(sizes))]
    return cs, {"coupled/outside": float(n_out_global), "coupled/eps": eps, "coupled/u_norm": u_norm}
