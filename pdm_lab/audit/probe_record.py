"""What an audit records beside its rule pairs (SPEC §6d), framework-free, for the toy and live audits:

* ``step_scale_record`` — at one multiple of the step: each rule's unsafe-keep over its kept
  disagreement tokens, the controls (outside tokens every rule kept, under the reference rule's
  step; every outside token under the momentum-only step, Â = 0) and the median |ΔD|/D;
* ``token_weights`` — w_t, how token t's surrogate enters the loss (the core's aggregation);
* ``GradientRecorder`` — an optimiser proxy that keeps the step's gradient G, Adam's P and c
  (the gradient part of the step is −c·P·G; the rest is the optimiser's memory);
* ``decompose_live`` — the own / rest first-order terms of a recorded step for the probed rows.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from pdm_lab.aggregation import DPInfo, aggregate
from pdm_lab.audit.measure import delta_rates
from pdm_lab.audit.intervals import median_ci, wilson_ci
from pdm_lab.audit.central_difference import _local, adam_gradient_scale, adam_preconditioner
from pdm_lab.errors import check_same
from pdm_lab.audit.probe import divergence_grads, own_direction, step_decomposition
from pdm_lab.support import Support


def _with_ci(rates: dict) -> dict:
    lo, hi = wilson_ci(int(rates["grew"]), int(rates["count"]))
    return {**rates, "lo": lo, "hi": hi}


def _median_entry(x: Tensor) -> dict:
    med, lo, hi = median_ci(x.tolist())
    return {"value": med, "lo": lo, "hi": hi, "n": int(x.numel())}


@torch.no_grad()
def step_scale_record(rules: Sequence[str], keep: dict[str, Tensor], delta_d: dict[str, Tensor], memory: Tensor | None,
                      d: Tensor, outside: Tensor, tol: float, lr_scale: float) -> dict:
    """Keys ``steps/…`` at one step size (all tensors [N] over the audited tokens).

    Args:
        rules: the compared rules, the reference first (its step is the controls' step).
        keep: rule → keep mask; delta_d: rule → ΔD of its step at this size (float64).
        memory: ΔD of the same step with every Â = 0 (None where not run).
        d: D before the step; outside: D > δ ∧ Â ≠ 0.
        lr_scale: this size as a multiple of the run's step.

    Returns ``steps/lr_scale``, ``steps/disagreement``, ``steps/unsafe_keep/<rule>`` (``delta_rates``
    with a Wilson 95% ``lo``/``hi``), ``steps/control/kept_by_all``, ``steps/control/momentum_only``,
    ``steps/median_abs_dd_over_d`` and ``steps/median_abs_dd_over_d_momentum`` ({value, lo, hi, n}),
    and SPEC §6d's selection controls ``steps/selection/<rule>/reference_step`` and
    ``steps/selection/<rule>/momentum_only``: the same kept disagreement tokens of each rule scored
    under one common step (the reference rule's, and the momentum-only step). A rule whose kept
    tokens grow less often under the common step too keeps different tokens (selection); one whose
    kept tokens grow as often there as under the other rule's kept tokens changes the step itself.
    """
    outside = outside.bool()
    masks = [keep[r].bool() for r in rules]
    unanimous = torch.stack(masks).all(0) | ~torch.stack(masks).any(0)
    disagree = outside & ~unanimous
    ref = rules[0]
    out: dict[str, Any] = {"steps/lr_scale": float(lr_scale), "steps/disagreement": int(disagree.sum())}
    for rule, m in zip(rules, masks):
        out[f"steps/unsafe_keep/{rule}"] = _with_ci(delta_rates(delta_d[rule].double(), disagree & m, tol))
        out[f"steps/selection/{rule}/reference_step"] = _with_ci(delta_rates(delta_d[ref].double(), disagree & m, tol))
        if memory is not None:
            out[f"steps/selection/{rule}/momentum_only"] = _with_ci(delta_rates(memory.double(), disagree & m, tol))
    all_kept = outside & torch.stack(masks).all(0)
    out["steps/control/kept_by_all"] = _with_ci(delta_rates(delta_d[ref].double(), all_kept, tol))
    ratio = delta_d[ref].double().abs()[outside] / d.double()[outside].clamp(min=1e-300)
    out["steps/median_abs_dd_over_d"] = _median_entry(ratio)
    if memory is not None:
        out["steps/control/momentum_only"] = _with_ci(delta_rates(memory.double(), outside, tol))
        out["steps/median_abs_dd_over_d_momentum"] = _median_entry(
            memory.double().abs()[outside] / d.double()[outside].clamp(min=1e-300))
    return out


def token_weights(response_mask: Tensor, mode: str, *, horizon=None, dp: DPInfo | None = None) -> Tensor:
    """[B, T] w_t = ∂ loss/∂ l_t of the core's ``aggregate`` (over the ranks' averaged gradients:
    divided by ``dp.world``): token t's surrogate l_t = −ρ_t Â_t M_t enters the loss with weight w_t."""
    probe = torch.zeros(response_mask.shape, dtype=torch.float64, requires_grad=True)
    (w,) = torch.autograd.grad(aggregate(probe, response_mask.bool(), mode, horizon, dp=dp), probe)
    return w / (1.0 if dp is None else float(dp.world))


class GradientRecorder:
    """The optimiser, as ``step`` sees it: each ``step()`` first keeps a host copy of the gradients
    (after any clipping: the G the step uses), then steps, then keeps Adam's P and c."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor]):
        self._opt, self._params = optimizer, params
        self.grads: list[Tensor] | None = None
        self.preconditioner: list[Tensor] | None = None
        self.scale: float | None = None

    def __getattr__(self, name):
        return getattr(self._opt, name)

    def step(self, closure=None):
        self.grads = [torch.zeros_like(_local(p), device="cpu") if p.grad is None else _local(p.grad).detach().cpu()
                      for p in self._params]
        result = self._opt.step(closure)
        pre = adam_preconditioner(self._opt, self._params)
        self.preconditioner = None if pre is None else [_local(q).detach().cpu() for q in pre]
        scale = adam_gradient_scale(self._opt, self._params)
        self.scale = self._opt.param_groups[0]["lr"] if scale is None else scale
        return result

    def zero_grad(self, set_to_none: bool = True):
        return self._opt.zero_grad(set_to_none=set_to_none)

    def direction(self, params: list[Tensor]) -> list[Tensor]:
        """−c·P·G on each parameter's device and placement: the step's gradient part."""
        pre = self.preconditioner or [None] * len(self.grads)
        return self._on(params, [-self.scale * (g if q is None else g * q) for g, q in zip(self.grads, pre)])

    def device_preconditioner(self, params: list[Tensor]) -> list[Tensor] | None:
        """Adam's P after the recorded step, on the parameters' devices (None: P = I)."""
        return None if self.preconditioner is None else self._on(params, self.preconditioner)

    @staticmethod
    def _on(params, tensors):
        out = []
        for p, t in zip(params, tensors):
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import DTensor

                out.append(DTensor.from_local(t.to(_local(p).device, p.dtype), p.device_mesh, p.placements))
            else:
                out.append(t.to(p.device, p.dtype))
        return out


def decompose_live(kernel, params: list[Tensor], recorder: GradientRecorder, support: Support, logits: Tensor, *,
                   advantages: Tensor, ratio: Tensor, weights: Tensor, keep: Tensor, clip_factor: float,
                   d: Tensor, realised: Tensor, memory: Tensor) -> dict:
    """SPEC §6d's decomposition of one recorded step on this rank's M probed rows (collective).

    own_t = c·κ·w_t·M_t·r_t·Â_t·⟨∇_z D_t, J P Jᵀ v_t⟩ (κ the clip factor, P Adam's preconditioner
    after the step); the gradient part ⟨∇_z D_t, J(−c·P·G)⟩ minus own_t is the rest of the batch;
    memory is the measured Â = 0 step; ``step_decomposition`` over the rows the rule kept.
    """
    for name, x in (("advantages", advantages), ("ratio", ratio), ("weights", weights), ("keep", keep)):
        check_same((name, "d"), x, d)
    grads, _ = divergence_grads(support, logits, None)
    g = grads["topk_kl"]
    v = own_direction(logits, support.sampled)
    rows = torch.arange(logits.shape[0])
    jpj = kernel.kernel_v(rows, v, precondition=recorder.device_preconditioner(params) or False)
    grad_part = (g * kernel.directional(recorder.direction(params)).cpu()).sum(-1)
    coeff = recorder.scale * clip_factor * weights.double() * keep.double() * ratio.double() * advantages.double()
    own = coeff * (g * jpj).sum(-1)
    kept = keep.bool()
    out = step_decomposition(d.double()[kept], realised.double()[kept], own[kept], (grad_part - own)[kept],
                             memory.double()[kept])
    out["decomp/note"] = ("own and rest are first order with Adam's P and c after the step; memory is the "
                          "measured Â = 0 step; kept probed tokens only")
    return out
