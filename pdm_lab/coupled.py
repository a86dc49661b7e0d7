"""The coupled direction of SPEC §3b: what the whole batch step does to the out-of-region divergence.

Ḋ (SPEC §3) judges a token's update in its own state's logit space. A real step moves shared
parameters θ with every kept token at once. With O = {t : D_t > δ (δ_neg for Â < 0), Â_t ≠ 0},
D_O(θ) = Σ_{s∈O} D_s(θ) (μ fixed) and one step with preconditioner P,

    ΔD_O = (η/N) Σ_t M_t c_t + O(η²),   c_t = Â_t r_t ⟨P ∇_θ D_O, ∇_θ log π_t(k_t)⟩ = Â_t r_t g_t,

where g_t = d/dε log π_t(k_t)(θ + ε u) at ε = 0 along u = P ∇_θ D_O. Rule ``pdm_coupled`` drops
t ∈ O with c_t > 0.

Division of labour: the core owns O, the formula c = Â·r·g and a differentiable D for the
backward of D_O; the stage owns the model, so it supplies u and g through ``CoupledDirection``:

* ``grad_of_outside_divergence(outside)`` → u: one backward of D_O = Σ_{t∈outside} D_t, times P
  (SGD: identity; Adam: the optimiser's current diagonal 1/(√v̂ + ε), identity before its first
  step). The direction is opaque to the core (a list of tensors, DTensor shards, …).
* ``directional_logp(u)`` → g [N]: the directional derivative of every token's log π_t(k_t) along
  u, by forward-mode JVP (toys: ``envs/train/coupled_jvp.py``) or a central difference of two forward
  passes at θ ± εu (any model, FSDP included: ``scaling/coupled_fd.py``).

``coupled_scores`` runs both and returns c; the stage passes c to ``pdm_policy_loss(coupled=c)``,
which puts it on ``TokenStats.coupled`` for the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from pdm_lab.divergence import topk_kl
from pdm_lab.errors import PDMInputError, check_same, check_tensor, raise_at
from pdm_lab.masks import outside_region
from pdm_lab.policy_side import PolicyOnSupport
from pdm_lab.support import Support


@runtime_checkable
class CoupledDirection(Protocol):
    """What a stage supplies for ``pdm_coupled``: u = P∇_θ D_O, then g_t along u for every token."""

    def grad_of_outside_divergence(self, outside: Tensor) -> Any:
        """u = P ∇_θ Σ_{t∈outside} D_t (μ fixed; ``outside`` [N] bool); any stage-side form."""
        ...

    def directional_logp(self, direction: Any) -> Tensor:
        """g [N]: d/dε log π_t(k_t)(θ + ε·direction) at ε = 0, for every token row."""
        ...


@dataclass(frozen=True)
class CoupledScores:
    """c [N] (0 on Â = 0 rows), g [N] and the out-of-region set O [N] bool."""

    c: Tensor
    g: Tensor
    outside: Tensor


def outside_set(divergence: Tensor, advantages: Tensor, cfg: Any) -> Tensor:
    """[N] bool O = {t : D_t > δ (δ_neg for Â < 0), Â_t ≠ 0} (SPEC §3b)."""
    return outside_region(divergence, advantages, cfg) & (advantages != 0)


def coupled_contribution(advantages: Tensor, ratio: Tensor, g: Tensor) -> Tensor:
    """c_t = Â_t r_t g_t: token t's share of the first-order change of D_O (SPEC §3b).

    Args:
        advantages: [N] Â (0 on padding).
        ratio: [N] r = π_k/μ_k.
        g: [N] ⟨P ∇_θ D_O, ∇_θ log π_t(k_t)⟩, from the stage.
    """
    check_same(("advantages", "g"), advantages, g)
    check_same(("ratio", "g"), ratio, g)
    raise_at("g", ~torch.isfinite(g), "non-finite directional derivative", g)
    c = advantages.to(g.dtype) * ratio.to(g.dtype) * g
    return torch.where(advantages != 0, c, torch.zeros_like(c))  # Â = 0: no gradient, no share


def differentiable_topk_kl(support: Support, pi: PolicyOnSupport) -> Tensor:
    """[N] top-K KL D whose value is the stats' D and whose gradient w.r.t. ``pi.logp`` is exact.

    ``PolicyOnSupport.tail_logp`` carries no gradient, but log π_T = log(1 − Σ_{i∈S} π_i) is a
    function of the support log-probabilities: d log π_T = −Σ_{i∈S} (π_i/π_T) d log π_i. The
    value comes from the accurate tail (SPEC §8); only the gradient uses the identity. With μ
    fixed, dD = −Σ_{i∈S} μ_i d log π_i − μ_T d log π_T.
    """
    check_same(("pi.logp", "support.ids"), pi.logp, support.ids)
    logp = pi.logp
    dtype = logp.dtype
    real = support.ids >= 0
    # −inf at padding: route those entries to 0 so neither value nor gradient sees −inf − (−inf)
    lp = torch.where(real, logp, torch.zeros_like(logp))
    moved = lp - lp.detach()  # zero value, gradient of log π_i
    tail = pi.tail_logp.detach().to(dtype)
    share = torch.where(real, torch.exp(lp.detach() - tail[:, None]), torch.zeros_like(lp))
    share = torch.nan_to_num(share, posinf=0.0)  # π_T = 0: the tail term μ_T·log π_T is then ±inf/0
    d_tail = -(share * moved).sum(dim=-1)
    mu = torch.where(real, torch.exp(support.mu_logp.to(dtype)), torch.zeros_like(lp))
    mu_tail = torch.exp(support.mu_tail_logp.to(dtype))
    value = topk_kl(support.mu_logp.to(dtype), logp.detach(), support.mu_tail_logp.to(dtype), tail)
    return value - (mu * moved).sum(dim=-1) - mu_tail * d_tail


def coupled_scores(direction: CoupledDirection, divergence: Tensor, advantages: Tensor,
                   ratio: Tensor, cfg: Any) -> CoupledScores:
    """The core driver: O from D and Â, u from the stage, g from the stage, c = Â·r·g.

    Args:
        direction: the stage's ``CoupledDirection``.
        divergence: [N] top-K KL D at the current θ.
        advantages: [N] Â (0 on padding).
        ratio: [N] r.
        cfg: the mask config (δ, δ_neg).

    An empty O gives u = 0 and c = 0 without calling the stage (D_O ≡ 0 has no gradient).
    """
    check_tensor("advantages", advantages, ndim=1, floating=True)
    check_same(("divergence", "advantages"), divergence, advantages)
    outside = outside_set(divergence, advantages, cfg)
    if not bool(outside.any()):
        zeros = torch.zeros_like(ratio)
        return CoupledScores(c=zeros, g=zeros, outside=outside)
    u = direction.grad_of_outside_divergence(outside)
    g = direction.directional_logp(u)
    if g.shape != advantages.shape:
        raise PDMInputError(f"directional_logp returned shape {tuple(g.shape)}, expected "
                            f"{tuple(advantages.shape)} (one g per token row)")
    return CoupledScores(c=coupled_contribution(advantages, ratio, g.to(ratio.dtype)), g=g, outside=outside)
