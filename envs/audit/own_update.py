"""SPEC §6d on a toy's audited batch: the own-update probe, the step decomposition and the step sizes.

The same core functions as the loop's live audit (``pdm_lab.audit.live``), so the records carry the
same keys: ``probe_with_kernel`` (``probe/…``) with a ``ToyKernel`` — the core's
``FunctionalKernel`` over the policy's ``torch.func.functional_call`` on the probed rows, exact
forward-mode J·u in float64 — ``decompose_live`` (``decomp/…``) from the rule's recorded step
(G, Adam's P and c), and ``step_scale_record`` (``steps/…``) at each audited step size.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from pdm_lab.audit.central_difference import adam_preconditioner
from pdm_lab.audit.probe import (FunctionalKernel, pool_decomposition, pool_probe, probe_rows, probe_with_kernel,
                           support_in_float64)
from pdm_lab.audit.probe_record import decompose_live, step_scale_record

from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.step import audit_optimizer
from pdm_lab.envs.train.update import TokenBatch


def head_names(model: nn.Module) -> tuple[str, ...]:
    """The output layer's own parameters (its share of K v): the table, W₂ and b₂, or an untied
    transformer's W and b; none for a tied unembedding (W is also the input embedding)."""
    names = dict(model.named_parameters())
    for group in (("table",), ("w2", "b2"), ("head", "bias")):
        if all(n in names for n in group):
            return group
    return ()


def unembedding_of(model: nn.Module) -> Tensor | None:
    """W [n, d] float64 the hidden state is read out with (None: the tabular policy has none)."""
    if hasattr(model, "unembedding"):
        return model.unembedding().detach().double()
    if hasattr(model, "w2"):
        return model.w2.detach().double().T
    return None


class ToyKernel(FunctionalKernel):
    """``FunctionalKernel`` of `model` on the observations `obs` (the probed rows, in order).

    ``kernel_v``'s ``precondition`` and ``directional``'s direction may also be per-parameter lists
    in ``model.parameters()`` order, as ``decompose_live`` passes them."""

    def __init__(self, model: nn.Module, obs: Tensor, *, preconditioner: list[Tensor] | None = None):
        self.names = [n for n, _ in model.named_parameters()]
        params = {n: p.detach() for n, p in model.named_parameters()}
        super().__init__(lambda p: torch.func.functional_call(model, p, (obs,)), params,
                         preconditioner=None if preconditioner is None else dict(zip(self.names, preconditioner)),
                         head_names=head_names(model))
        self._w = unembedding_of(model)

    def _named(self, xs):
        return dict(zip(self.names, xs)) if isinstance(xs, (list, tuple)) else xs

    def directional(self, u) -> Tensor:
        return super().directional(self._named(u))

    def kernel_v(self, rows: Tensor, v: Tensor, *, precondition=False) -> Tensor:
        if isinstance(precondition, (list, tuple)):
            kept, self.preconditioner = self.preconditioner, self._named(precondition)
            try:
                return super().kernel_v(rows, v, precondition=True)
            finally:
                self.preconditioner = kept
        return super().kernel_v(rows, v, precondition=precondition)

    def unembedding(self) -> Tensor | None:
        return self._w


def step_inputs(rules, steps: dict, memory: dict, focus: Tensor, before: dict[str, Tensor]) -> dict:
    """What ``step_scale_record`` reads, on the focus rows (kept per seed, pooled over seeds)."""
    return {"keep": {r: steps[r][1.0].keep[focus] for r in rules},
            "dd": {f"{s:g}": {r: steps[r][s].delta["topk_kl"][focus] for r in rules} for s in memory},
            "memory": {f"{s:g}": m["topk_kl"][focus] for s, m in memory.items()}, "d": before["topk_kl"]}


def step_scales(cfg: AuditConfig, inputs: list[dict]) -> dict:
    """``steps/…`` per step size over every seed's outside tokens (scale → ``step_scale_record``)."""
    inputs = [i for i in inputs if i]
    if not inputs:
        return {}
    rules = list(cfg.rules)
    cat = lambda f: torch.cat([f(i) for i in inputs])  # noqa: E731
    d = cat(lambda i: i["d"])
    out = {}
    for scale in cfg.scales:
        key = f"{scale:g}"
        out[key] = step_scale_record(rules, {r: cat(lambda i: i["keep"][r]) for r in rules},
                                     {r: cat(lambda i: i["dd"][key][r]) for r in rules},
                                     cat(lambda i: i["memory"][key]), d, torch.ones_like(d, dtype=torch.bool),
                                     cfg.tolerance, scale)
    return out


def probe_and_decompose(cfg: AuditConfig, model: nn.Module, tokens: TokenBatch, focus: Tensor, steps: dict,
                        memory: dict[str, Tensor], before: dict[str, Tensor], disagree: Tensor,
                        seed: int) -> tuple[dict | None, dict]:
    """The probe on up to ``cfg.probe_tokens`` focus rows (the main pair's disagreement tokens
    first) and, for each rule of the main pair, the decomposition of its step on the probed rows
    it kept. ``steps``: rule → its recorded ``RuleStep`` at the run's step; ``memory``: ΔD of the
    Â = 0 step; ``before``: D on the focus rows; ``disagree``: [N] bool."""
    pick = probe_rows(torch.ones(focus.numel(), dtype=torch.bool), disagree[focus], cfg.probe_tokens, seed=seed)
    if pick.numel() == 0:
        return None, {}
    rows = focus[pick]
    sub = tokens.rows(rows)
    params = list(model.parameters())
    pre = adam_preconditioner(audit_optimizer(model, cfg), params)  # P before the step, as the loop's probe
    kernel = ToyKernel(model, sub.obs, preconditioner=pre)
    with torch.no_grad():
        logits = model(sub.obs).double()
    support = support_in_float64(sub.support)
    logp = torch.log_softmax(logits, dim=-1)
    sampled = support.sampled.long()[:, None]
    ratio = (logp.gather(1, sampled) - sub.mu_full.double().gather(1, sampled)).exp()[:, 0]
    adv = sub.advantages.reshape(-1).double()
    probe = probe_with_kernel(kernel, torch.arange(rows.numel()), support, logits, adv, ratio,
                              precondition=pre is not None, rules=list(cfg.all_rules),
                              disagreement=disagree[rows], mu_full_logp=sub.mu_full.double(),
                              cfg=cfg.mask(cfg.rules[0]))  # pdm_kernel's λ (kernel_ratio)
    # w_t: how token t's surrogate enters the audited loss (``step.rule_steps``: token sum, or the
    # token mean for AdamW)
    weight = 1.0 / float(tokens.response_mask.sum()) if cfg.optimizer == "adamw" else 1.0
    decomp = {}
    for rule in cfg.rules:
        step = steps[rule]
        keep = step.keep[rows]
        if step.recorder is None or not bool(keep.any()):
            decomp[rule] = None
            continue
        decomp[rule] = decompose_live(kernel, params, step.recorder, support, logits, advantages=adv, ratio=ratio,
                                      weights=torch.full_like(adv, weight), keep=keep, clip_factor=1.0,
                                      d=before["topk_kl"][pick], realised=step.delta["topk_kl"][rows],
                                      memory=memory["topk_kl"][rows])
    return probe, decomp


def pooled_probe(cfg: AuditConfig, records: list[dict]) -> tuple[dict | None, dict]:
    """The probe and each main-pair rule's decomposition pooled token by token over seeds."""
    probes = [r["probe"] for r in records if r.get("probe") and r["probe"]["probe/tokens"]]
    decomp = {}
    for rule in cfg.rules:
        parts = [r["decomposition"][rule] for r in records
                 if r.get("decomposition") and r["decomposition"].get(rule) and r["decomposition"][rule]["decomp/tokens"]]
        decomp[rule] = pool_decomposition(parts) if parts else None
    return (pool_probe(probes) if probes else None), decomp

