"""The audit on one seed's batch (SPEC §6): every rule's step, the pairs' disagreement sets and
each kept token's ΔD class, the regime inputs (SPEC §6b) and the batch's coupling."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pdm_lab.audit.measure import MEASURED_DIVERGENCES, delta_rates, predicted_divergence, regime_table
from pdm_lab.masks import get_mask_rule, outside_region

from pdm_lab.envs.audit import step as audit_step
from pdm_lab.envs.audit.batch import audit_batch, audit_model, float64_tokens
from pdm_lab.envs.audit.config import PRECISION, QUANTILES, AuditConfig
from pdm_lab.envs.audit.flips import decompose, distinct_rows, group_ids
from pdm_lab.envs.audit.own_update import probe_and_decompose, step_inputs
from pdm_lab.envs.audit.points import TrainedPolicies
from pdm_lab.envs.train.update import TokenBatch, current_stats


def tokens_per_state(tokens: TokenBatch, resp: Tensor) -> float:
    """Response tokens per distinct observation (context) among the `resp` rows."""
    obs = tokens.obs[resp]
    return float(obs.shape[0]) / max(1, distinct_rows(obs))


def regime_inputs(tokens: TokenBatch, d: Tensor, outside: Tensor, considered: Tensor, k: int,
                   resp: Tensor) -> tuple:
    """(D, outside, Â ≠ 0, μ's top-K mass, μ's entropy) over response tokens, tokens per state."""
    mu = tokens.mu_full[resp]
    topk_mass = torch.topk(mu, min(k, mu.shape[1]), dim=1).values.exp().sum(dim=1)
    entropy = -(mu.exp() * mu).nan_to_num(0.0).sum(dim=1)  # 0·log 0 = 0
    return (d[resp], outside[resp], considered[resp], topk_mass, entropy,
            tokens_per_state(tokens, resp))


def regime_of(inputs: tuple) -> dict:
    d, outside, considered, mass, entropy, tps = inputs
    return regime_table(d, outside, considered, topk_mass=mass, entropy=entropy, tokens_per_state=tps)


def coupling(model: nn.Module, tokens: TokenBatch, focus: Tensor) -> dict:
    """How many batch tokens share trainable parameters with an outside token, beside tokens per
    context and per trainable state (the input the trainable part reads).

    ``same_state_per_outside``: per outside token, the other batch tokens with its trainable state
    (mean); ``same_state_tokens``: batch tokens sharing a trainable state with some outside token;
    ``share_feature_tokens``: batch tokens sharing ≥ 1 active input feature with some outside token
    (the neural policy: one input row of W₁ serves all of them; the output head serves every token)."""
    context, state = group_ids(model, tokens)
    n = tokens.num_tokens
    out = {"tokens": n, "tokens_per_context": n / max(1, int(context.max()) + 1 if n else 1),
           "tokens_per_trainable_state": n / max(1, int(state.max()) + 1 if n else 1),
           "outside": int(focus.numel())}
    if focus.numel() == 0:
        return {**out, "same_state_per_outside": float("nan"), "same_state_tokens": 0, "share_feature_tokens": 0}
    sizes = torch.bincount(state, minlength=int(state.max()) + 1)
    hit = torch.zeros_like(sizes, dtype=torch.bool)
    hit[state[focus]] = True
    out["same_state_per_outside"] = float((sizes[state[focus]] - 1).double().mean())
    out["same_state_tokens"] = int(hit[state].sum())
    if hasattr(model, "input_key"):
        key = model.input_key(tokens.obs)  # active input features, −1 for none
        active = torch.unique(key[focus])
        out["share_feature_tokens"] = int(torch.isin(key, active[active >= 0]).any(dim=1).sum())
    else:
        out["share_feature_tokens"] = out["same_state_tokens"]
    return out


def study(cfg: AuditConfig, model: nn.Module, tokens: TokenBatch, focus: Tensor,
          k: int | None = None, *, flips: bool = False, probe: bool = False, seed: int = 0) -> dict:
    """Every rule's step on one float64 model; per pair, the disagreement and each rule's rates.

    ``focus``: the rows outside the region with Â ≠ 0 (the only tokens the pairs score). Per rule
    also the interference-only rate (its dropped outside tokens whose D grew anyway) and, with
    `flips` (SGD), the cause split of its grown kept disagreement tokens in the main pair. With
    `probe` (SPEC §6d): the main pair at every step size of ``cfg.scales`` beside the Â = 0 step
    (``step_inputs``), and the own-update probe and step decomposition (``probe_and_decompose``)."""
    before = audit_step.measure(model, tokens.rows(focus))
    cache: dict = {}
    scaled = probe and (len(cfg.scales) > 1 or cfg.probe_tokens > 0)
    multi = {rule: audit_step.rule_steps(model, tokens, cfg.mask(rule, k), cfg, focus, before,
                                         cfg.scales if scaled else (1.0,), cache, record=scaled and cfg.probe_tokens > 0)
             for rule in cfg.all_rules}
    steps = {rule: multi[rule][1.0] for rule in cfg.all_rules}
    outside = torch.zeros(tokens.num_tokens, dtype=torch.bool)
    outside[focus] = True
    record = {"outside": int(focus.numel()), "distinct_steps": len(cache), "pairs": {}, "interference": {},
              "flips": {}}
    for rule in cfg.all_rules:
        scored = predicted_divergence(get_mask_rule(rule))
        record["interference"][rule] = delta_rates(steps[rule].delta[scored], outside & ~steps[rule].keep,
                                                   cfg.tolerance)
    for a, b in cfg.pairs:
        disagree = outside & (steps[a].keep != steps[b].keep)
        entry = {"disagreement": int(disagree.sum())}
        for rule in (a, b):
            kept = disagree & steps[rule].keep
            entry[rule] = {name: delta_rates(steps[rule].delta[name], kept, cfg.tolerance)
                           for name in MEASURED_DIVERGENCES}
            if flips and (a, b) == tuple(cfg.rules) and cfg.optimizer == "sgd" and cfg.flip_tokens:
                scored = predicted_divergence(get_mask_rule(rule))
                grew = torch.nonzero(kept & (steps[rule].delta[scored] > cfg.tolerance))[:, 0][:cfg.flip_tokens]
                record["flips"][rule] = decompose(model, tokens, cfg.mask(rule, k), cfg.lr, steps[rule].keep,
                                                  grew, scored, audit_step.measure, everything=list(steps[rule].step))
        record["pairs"][f"{a}|{b}"] = entry
    if scaled:
        memory = audit_step.memory_steps(model, tokens, cfg, focus, before, cfg.scales)
        record["step_inputs"] = step_inputs(cfg.rules, multi, memory, focus, before)
        if cfg.probe_tokens:
            a, b = cfg.rules
            disagree = outside & (steps[a].keep != steps[b].keep)
            record["probe"], record["decomposition"] = probe_and_decompose(
                cfg, model, tokens, focus, steps, memory[1.0], before, disagree, seed)
    return record


def audit_seed(cfg: AuditConfig, seed: int, *, k: int | None = None, mismatch: str | None = None,
               contexts: tuple[str, ...] | None = None, keep_d: list | None = None, step: int | None = None,
               policies: TrainedPolicies | None = None) -> dict:
    """The audit on one seed's batch at training step `step` (default: the main study's), for
    each contexts setting; appends the regime inputs to `keep_d` if given. With ``mini_batches``
    M > 1 the batch is mini-batch j of the seed's rollout batch (``batch.stale_mini_batch``) and
    the record carries ``mini_batch``, ``mini_batches`` and ``optimizer_steps_before`` (the steps
    π took on that batch's earlier mini-batches)."""
    step = cfg.main_step if step is None else step
    _, policy, batch, adv = audit_batch(cfg, seed, mismatch, step=step, policies=policies)
    ref_mask = cfg.mask(cfg.rules[0], k)
    tokens = float64_tokens(batch, adv, ref_mask)
    resp = tokens.response_mask.reshape(-1)
    considered = resp & (tokens.advantages.reshape(-1) != 0)
    with torch.no_grad():
        stats = current_stats(copy.deepcopy(policy).to(PRECISION), tokens, full=False)
    outside = outside_region(stats.topk_kl, tokens.advantages.reshape(-1), ref_mask) & considered
    focus = torch.nonzero(outside)[:, 0]
    inputs = regime_inputs(tokens, stats.topk_kl, outside, considered, ref_mask.k, resp)
    if keep_d is not None:
        keep_d.append(inputs)
    record = {"seed": seed, "step": step, "train_run": seed % cfg.train_runs, "tokens": int(resp.sum()),
              "zero_advantage": int((resp & ~considered).sum()),
              "outside": int(focus.numel()), "mu_tail": _quantiles(stats.mu_tail[resp]),
              "regime": regime_of(inputs), "contexts": {}}
    # SPEC §6b/§6c: the audited mini-batch j of M, and the optimiser steps π took on 0 … j − 1
    stale = getattr(policy, "audit_mini_batch", None) or {"mini_batch": 0, "mini_batches": 1, "optimizer_steps": 0}
    record.update(mini_batch=stale["mini_batch"], mini_batches=stale["mini_batches"],
                  optimizer_steps_before=stale["optimizer_steps"])
    for i, ctx in enumerate(contexts or cfg.contexts):
        model, tok, foc = audit_model(policy, tokens, ctx, focus)
        rec = study(cfg, model, tok, foc, k, flips=ctx == "shared" and i == 0, probe=ctx == "shared" and i == 0,
                    seed=seed)
        rec["tokens_per_state"] = inputs[5] if ctx == "shared" else 1.0
        if ctx == "shared":
            rec["coupling"] = coupling(model, tok, foc)
        record["contexts"][ctx] = rec
    return record


def _quantiles(x: Tensor) -> dict:
    if x.numel() == 0:
        return {"count": 0}
    q = torch.quantile(x.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {"count": int(x.numel()), "mean": float(x.mean()),
            **{f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}}

