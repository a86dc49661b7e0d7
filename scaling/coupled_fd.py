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
from torch import Tensor

from pdm_lab.audit.central_difference import (_all_sum, _local, _world, adam_preconditioner,  # noqa: F401
                                        central_difference, central_difference_eps, choose_eps, global_norm)
from pdm_lab.coupled import coupled_contribution, differentiable_topk_kl, outside_set
from pdm_lab.tokenwise import token_stats


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
