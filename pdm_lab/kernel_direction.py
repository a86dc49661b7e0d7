"""The head-kernel term of the kernel-aware direction test (SPEC §6d), for rule ``pdm_kernel``.

A network moves a token's own logits along K v, not v (v = e_k − π). The own-update probe
(``pdm_lab.audit.probe``) fits K v ≈ a·v + b·W Wᵀ v (W [V, d] the unembedding: the hidden state's part
of the kernel) and scores the kernel-aware test Â·⟨g, (a·I + b·W Wᵀ) v⟩, g = ∇_z D the gradient
of the top-K KL over the processed logits. With λ = b/a (a > 0),

    Â·⟨g, (a·I + b·W Wᵀ) v⟩ > 0  ⟺  Â·(Ḋ_topk + λ·h_t) > 0,
    h_t = ⟨Wᵀ g_t, Wᵀ v_t⟩ = (Wᵀ g_t)·(w_{k_t} − Wᵀ π_t),

because ⟨g, v⟩ is PDM's Ḋ_topk (SPEC §3: the exact first-order change of the top-K KL along v).
Rule ``pdm_kernel`` drops D > δ ∧ Â ≠ 0 ∧ Â·(Ḋ_topk + λ·h_t) > 0 with λ = ``MaskConfig.kernel_ratio``.

The gradient of the top-K KL in closed form: with μ fixed,
dD = −Σ_{i∈S} μ_i d log π_i − μ_T d log π_T and d log π_T = Σ_{j∉S} (π_j/π_T) dz_j − ⟨π, dz⟩, so

    g = π − μ̃,   μ̃_i = μ_i (i ∈ S),   μ̃_i = μ_T·π_i/π_T (i ∉ S):

the tail's μ mass spread over the tail in π's proportions. ``topk_kl_logit_grad`` takes g by autograd
of the core's one differentiable D (``coupled.differentiable_topk_kl``), so the formula lives in one
place; the closed form above is checked against it in float64 (tests). The trainer holds W and π;
a stage computes c with ``kernel_scores`` and passes ``pdm_policy_loss(kernel=c)``, which puts it
on ``TokenStats.kernel`` for the rule.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.coupled import differentiable_topk_kl
from pdm_lab.errors import PDMInputError, check_tensor
from pdm_lab.policy_side import policy_on_support
from pdm_lab.support import Support

__all__ = ["kernel_scores", "own_direction", "topk_kl_logit_grad"]


def own_direction(logits: Tensor, sampled: Tensor) -> Tensor:
    """v = e_k − softmax(z) [M, V] float64: the logit gradient of log π_k (SPEC §3)."""
    v = -torch.softmax(logits.detach().double(), dim=-1)
    return v.scatter_add(1, sampled.long()[:, None], torch.ones_like(v[:, :1]))


def topk_kl_logit_grad(logits: Tensor, support: Support) -> Tensor:
    """g = ∇_z D_topk [N, V] float64 at the processed logits ``logits``: autograd of the core's one
    differentiable top-K KL (``coupled.differentiable_topk_kl``); equal to π − μ̃ (module docstring)."""
    with torch.enable_grad():
        z = logits.detach().double().requires_grad_(True)
        d = differentiable_topk_kl(support, policy_on_support(z, support.ids))
        return torch.autograd.grad(d.sum(), z)[0]


@torch.no_grad()
def kernel_scores(logits: Tensor, unembedding: Tensor, support: Support) -> Tensor:
    """[N] h_t = ⟨Wᵀ g_t, Wᵀ v_t⟩ in float64 (module docstring), for rule ``pdm_kernel``.

    Args:
        logits: [N, V] π's processed logits (after temperature), one row per token.
        unembedding: W [V, d], the policy's output layer (logits = h Wᵀ + b).
        support: μ's reduced support of the same rows (``support.ids`` < V).
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("unembedding", unembedding, ndim=2, floating=True)
    if unembedding.shape[0] != logits.shape[1]:
        raise PDMInputError(f"unembedding has shape {tuple(unembedding.shape)}, expected [V, d] with V = "
                            f"{logits.shape[1]} (the logits' vocabulary)")
    if support.ids.shape[0] != logits.shape[0]:
        raise PDMInputError(f"support has {support.ids.shape[0]} rows but logits {tuple(logits.shape)}")
    w = unembedding.detach().double().to(logits.device)
    g = topk_kl_logit_grad(logits, support)
    v = own_direction(logits, support.sampled)
    return ((g @ w) * (v @ w)).sum(dim=-1)
