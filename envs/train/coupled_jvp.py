"""The toys' side of ``pdm_coupled`` (SPEC §3b): u = P∇_θ D_O by autograd, g by forward-mode JVP.

``JVPDirection`` implements ``pdm_lab.coupled.CoupledDirection`` for any toy policy (tabular or
neural, ``envs/policies/models.py``): one backward of D_O = Σ_{t∈O} D_t (μ fixed) through
``functional_call``, scaled by the preconditioner, then ``torch.func.jvp`` of every token's
log π_t(k_t) along u — exact to rounding, every token at once. The formula c = Â·r·g and the set O
come from the core (``pdm_lab.coupled``).

Preconditioners (``preconditioner``): SGD is the identity; Adam is the optimiser's current
diagonal 1/(√v̂ + ε), v̂ = v/(1 − β₂^step), identity before its first step. Adam's realised step
also carries momentum and updates v̂ with this gradient; P is the diagonal this gradient is about
to be scaled by to first order, which is what the sign of c needs.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call, jvp

from pdm_lab.mask_config import MaskConfig
from pdm_lab.coupled import CoupledScores, coupled_scores, differentiable_topk_kl
from pdm_lab.policy_side import policy_on_support
from pdm_lab.tokenwise import token_stats


Direction = dict[str, Tensor]


def preconditioner(optimizer: torch.optim.Optimizer | None, policy: torch.nn.Module) -> Direction | None:
    """P as a diagonal per parameter name; None for the identity (no optimiser, SGD, fresh Adam)."""
    if optimizer is None or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    diag, seen = {}, False
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        ids = {id(p) for p in group["params"]}
        for name, p in policy.named_parameters():
            if id(p) not in ids:
                continue
            state = optimizer.state.get(p, {})
            step = float(state["step"]) if "step" in state else 0.0
            if step == 0:
                diag[name] = torch.ones_like(p)
                continue
            seen = True
            v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** step)
            diag[name] = 1.0 / (v_hat.sqrt() + eps)
    return diag if seen else None  # before Adam's first step: the identity


class JVPDirection:
    """``CoupledDirection`` of a toy policy on one token batch (see the module docstring).

    Args:
        policy: ``TabularPolicy`` / ``NeuralPolicy`` (any module mapping obs [N, D] → logits [N, n]).
        tokens: the batch (support, obs).
        precond: P per parameter name (``preconditioner``), None for the identity.
    """

    def __init__(self, policy: torch.nn.Module, tokens, precond: Direction | None = None):
        self.policy, self.tokens, self.precond = policy, tokens, precond
        self.params = {name: p.detach() for name, p in policy.named_parameters()}
        support = tokens.support
        self.k_ids = support.ids.gather(1, support.k_index[:, None])  # [N, 1] sampled token ids

    def _logits(self, params: Direction) -> Tensor:
        return functional_call(self.policy, params, (self.tokens.obs,))

    def grad_of_outside_divergence(self, outside: Tensor) -> Direction:
        params = {name: p.clone().requires_grad_(True) for name, p in self.params.items()}
        pi = policy_on_support(self._logits(params), self.tokens.support.ids)
        d_o = differentiable_topk_kl(self.tokens.support, pi)[outside].sum()
        grads = torch.autograd.grad(d_o, list(params.values()), allow_unused=True)
        u = {}
        for (name, p), grad in zip(params.items(), grads):
            grad = torch.zeros_like(p) if grad is None else grad
            u[name] = grad if self.precond is None else self.precond[name].to(grad.dtype) * grad
        return u

    def directional_logp(self, direction: Direction) -> Tensor:
        def logp_k(params: Direction) -> Tensor:
            logits = self._logits(params)
            return torch.log_softmax(logits, dim=-1).gather(1, self.k_ids)[:, 0]
        tangent = {name: direction[name].to(p.dtype) for name, p in self.params.items()}
        _, g = jvp(logp_k, (self.params,), (tangent,))
        return g


def toy_coupled_scores(policy: torch.nn.Module, tokens, cfg: MaskConfig,
                       optimizer: torch.optim.Optimizer | None = None) -> CoupledScores:
    """c_t for every token row of ``tokens`` at the policy's current θ (``pdm_lab.coupled``)."""
    with torch.no_grad():  # D, r on the support (``update.current_stats`` without the full KL)
        stats = token_stats(tokens.support, policy_on_support(policy(tokens.obs), tokens.support.ids))
    adv = tokens.advantages.reshape(-1).to(stats.ratio.dtype)
    adv = torch.where(tokens.response_mask.reshape(-1), adv, torch.zeros_like(adv))
    direction = JVPDirection(policy, tokens, preconditioner(optimizer, policy))
    return coupled_scores(direction, stats.topk_kl, adv, stats.ratio, cfg)
