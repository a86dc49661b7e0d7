"""One rule's audited step (SPEC §6): from a copy of the float64 model, one optimiser step with the
rule's mask, and ΔD per focus token for the top-K KL and the full KL."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from pdm_lab.audit.measure import MEASURED_DIVERGENCES
from pdm_lab.mask_config import MaskConfig
from pdm_lab.audit.probe_record import GradientRecorder

from pdm_lab.envs.audit.config import PRECISION, AuditConfig
from pdm_lab.envs.train.grpo import make_optimizer
from pdm_lab.envs.train.update import TokenBatch, current_stats, masked_loss


@dataclass(frozen=True)
class RuleStep:
    """What one rule's step did: its keep mask and the per-token change of each divergence."""

    keep: Tensor
    """[N] bool."""
    delta: dict[str, Tensor]
    """divergence name (``MEASURED_DIVERGENCES``) → [N] float64 ΔD (NaN off the focus rows)."""
    step: tuple[Tensor, ...] = ()
    """Δθ per parameter at step size η (θ_η − θ), for the flip decomposition."""
    recorder: object = None
    """the step's ``GradientRecorder`` (its G, Adam's P and c), for the step decomposition."""


def audit_optimizer(trial: nn.Module, cfg: AuditConfig):
    """The audited step's optimiser over `trial`: SGD, a fresh Adam, or AdamW carrying the trained
    run's state (``trained_optimizer_state``, cast to the model's dtype), so the audited step is an
    AdamW step with memory as in the loop. A model without that state gets a fresh AdamW."""
    opt = make_optimizer(cfg.optimizer, trial.parameters(), cfg.lr)
    memory = getattr(trial, "trained_optimizer_state", None)
    if cfg.optimizer == "adamw" and memory is not None:
        for p, state in zip(trial.parameters(), memory):
            if state:
                opt.state[p] = {k: v.to(p.dtype) if k != "step" else v.clone() for k, v in state.items()}
    return opt


def measure(model: nn.Module, tokens: TokenBatch) -> dict[str, Tensor]:
    """[N] top-K KL and full KL of μ‖π_model (float64 when model and tokens are)."""
    stats = current_stats(model, tokens, full=True)
    return {"topk_kl": stats.topk_kl, "full_kl": stats.full_kl}


def rule_step(model: nn.Module, tokens: TokenBatch, mask: MaskConfig, cfg: AuditConfig,
              focus: Tensor, before: dict[str, Tensor], cache: dict | None = None) -> RuleStep:
    """One optimiser step with `mask`'s rule from a copy of `model`; ΔD on the `focus` rows, for
    both divergences (``before``: their values there).

    The loss is the token sum of the core's masked surrogate (``masked_loss`` with token-mean,
    times the response-token count), so ``cfg.lr`` is the effective per-token step. Two rules
    with the same keep mask take the same step: ``cache`` (keep bytes → ΔD) reuses it.
    """
    return rule_steps(model, tokens, mask, cfg, focus, before, (1.0,), cache)[1.0]


def rule_steps(model: nn.Module, tokens: TokenBatch, mask: MaskConfig, cfg: AuditConfig,
               focus: Tensor, before: dict[str, Tensor], scales: tuple[float, ...],
               cache: dict | None = None, *, record: bool = False) -> dict[float, RuleStep]:
    """``rule_step`` at the step sizes η·s for each s in `scales`, from one forward and backward.

    The mask is decided before the step, so it does not depend on η; and the first step of
    either optimiser is linear in η (SGD: −η g; a fresh Adam: −η m̂/(√v̂ + ε), with m̂ = g and
    v̂ = g²; AdamW with memory and no weight decay: −η m̂/(√v̂ + ε) for the state after the
    gradient), so the step at η·s is s times the step at η: θ_s = θ + s (θ_η − θ). In float64 this
    equals a separate step at η·s to rounding (tested). ``cache`` is keyed by the keep mask and
    the scales; ``record``: keep the step's G, P and c (``GradientRecorder``).
    """
    if mask.aggregation != "token-mean":
        raise ValueError("rule_step: the audited step sums the token-mean loss back to a token sum")
    trial = copy.deepcopy(model)
    out = masked_loss(trial, tokens, mask)
    keep = out.keep.reshape(-1) > 0
    key = (keep.numpy().tobytes(), tuple(scales))
    if cache is not None and key in cache:
        step, deltas, recorder = cache[key]
        return {s: RuleStep(keep=keep, delta=d, step=step, recorder=recorder) for s, d in deltas.items()}
    start = [p.detach().clone() for p in trial.parameters()]
    opt = audit_optimizer(trial, cfg)
    if record:
        opt = GradientRecorder(opt, list(trial.parameters()))
    opt.zero_grad(set_to_none=True)
    # the token sum makes lr the per-token step; AdamW carries a trained state, so its step takes
    # the training loss's own normalisation (the token mean), or the new gradient would swamp it
    (out.loss * (1 if cfg.optimizer == "adamw" else tokens.response_mask.sum())).backward()
    opt.step()
    stepped = [p.detach().clone() for p in trial.parameters()]
    sub = tokens.rows(focus)
    deltas: dict[float, dict[str, Tensor]] = {}
    for scale in scales:
        with torch.no_grad():  # scale 1 is the optimiser's own step, bit for bit
            for p, p0, p1 in zip(trial.parameters(), start, stepped):
                p.copy_(p1 if scale == 1.0 else p0 + scale * (p1 - p0))
        after = measure(trial, sub)
        delta = {}
        for name in MEASURED_DIVERGENCES:
            full = torch.full((tokens.num_tokens,), float("nan"), dtype=PRECISION)
            full[focus] = after[name] - before[name]
            delta[name] = full
        deltas[scale] = delta
    step = tuple(p1 - p0 for p0, p1 in zip(start, stepped))
    recorder = opt if record else None
    if cache is not None:
        cache[key] = (step, deltas, recorder)
    return {s: RuleStep(keep=keep, delta=d, step=step, recorder=recorder) for s, d in deltas.items()}


def memory_steps(model: nn.Module, tokens: TokenBatch, cfg: AuditConfig, focus: Tensor,
                 before: dict[str, Tensor], scales: tuple[float, ...]) -> dict[float, dict[str, Tensor]]:
    """ΔD of the same step with every Â = 0 (SPEC §6d: the optimiser's memory alone — momentum and
    preconditioner; 0 for SGD and a fresh Adam), at each step size."""
    still = replace(tokens, advantages=torch.zeros_like(tokens.advantages))
    steps = rule_steps(model, still, cfg.mask(cfg.rules[0]), cfg, focus, before, scales)
    return {s: step.delta for s, step in steps.items()}

