"""The direction audit (SPEC §6, §6c) inside ``PDMGRPOTrainer``: TRL's live generation batch.

``PDMGRPOTrainer(..., audit=LiveAuditConfig(every=N, rules=(A, B, …), delta=δ))`` audits every
N-th training generation batch right after it is generated and scored (the parameters that
generated μ, the optimiser state the next real step will use):

1. snapshot the parameters, the optimiser's state and settings, any gradients and the RNG to host
   memory (``pdm_lab.audit_live.HostSnapshot``);
2. D per completion token at θ₀ in float64 (the logits cast to float64 before the softmax);
3. per rule: one optimiser step over the whole generation batch (micro-batches of
   ``per_device_train_batch_size``, each loss weighted by its share of the batch's tokens, TRL's
   ``max_grad_norm`` clip, the wrapped torch optimiser at its current learning rate) with that
   rule's mask from ``pdm_policy_loss``; D recomputed; ΔD; the snapshot restored bit for bit;
4. the record (``pdm_lab.audit_live.step_record``: the scaling loop's ``audit.jsonl`` keys)
   appended to ``output_dir/audit.jsonl`` by the main process, and its per-rule rates added to
   TRL's logs as ``pdm/audit/...``.

Only the top-K KL is measured (``full_kl`` null), as in the scaling loop. Tested in one process
(HF generate); under several processes the records are merged over ranks, but the audited
backward runs outside Accelerate's gradient synchronisation, so each rank steps on its own batch.
"""
from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from ..audit import regime_table
from ..audit_live import (HostSnapshot, distinct_contexts, flat_metrics, gather_objects, json_safe, merge_records,
                          step_record, support_in_float64)
from ..masks import outside_region
from ..policy_side import policy_on_support
from ..stats import token_stats
from ..support import support_from_topk

BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
              "pdm_topk_ids", "pdm_topk_logp", "pdm_mu_logp")


def _rows(batch: dict, lo: int, hi: int) -> dict:
    return {key: batch[key][lo:hi] for key in BATCH_KEYS}


@torch.no_grad()
def measured_divergence(trainer, model, inputs: dict) -> Tensor:
    """[n] top-K KL D(μ‖π) of the completion tokens in float64 (μ's support as the rules build it,
    then cast; the logits cast before the softmax)."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    b, t = completion_ids.shape
    logits = model(input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                   attention_mask=torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
                   logits_to_keep=t + 1).logits[:, :-1]
    flat = completion_mask.bool().reshape(-1)
    support = support_in_float64(support_from_topk(
        inputs["pdm_topk_ids"].reshape(b * t, -1)[flat], inputs["pdm_topk_logp"].reshape(b * t, -1)[flat],
        completion_ids.reshape(-1)[flat], inputs["pdm_mu_logp"].reshape(-1)[flat],
        vocab_size=logits.size(-1), k=trainer.pdm_mask.k, convention=trainer.pdm_mask.convention))
    pi = policy_on_support(logits.reshape(b * t, -1)[flat].double(), support.ids, temperature=trainer.temperature)
    return token_stats(support, pi, binary=False).topk_kl


def _distinct_contexts(batch: dict) -> int:
    prompts = [[x for x, m in zip(p, pm) if m]
               for p, pm in zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist())]
    return distinct_contexts(prompts, batch["completion_ids"].tolist(), batch["completion_mask"].tolist())


def audit_generation_batch(trainer, batch: dict) -> dict:
    """Steps 1–4 of the module docstring on one generation batch; returns the merged record."""
    start = time.perf_counter()
    cfg = trainer.pdm_audit
    model = trainer.model
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate's wrapper → torch's
    params = [p for p in model.parameters() if p.requires_grad]
    delta = trainer.pdm_mask.delta if cfg.delta is None else cfg.delta
    rules = tuple(dict.fromkeys(cfg.rules))
    n = batch["completion_ids"].size(0)
    if cfg.sequences is not None:  # the first sequences (whole groups first), this process's share
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        n = min(n, -(-cfg.sequences // world))
    batch = _rows(batch, 0, n)
    size = trainer.args.per_device_train_batch_size
    micros = [_rows(batch, lo, lo + size) for lo in range(0, n, size)]
    resp = [mb["completion_mask"].bool().reshape(-1) for mb in micros]
    per_token = trainer.pdm_mask.aggregation == "token-mean"
    weights = [float(r.sum()) if per_token else float(mb["completion_mask"].any(1).sum()) for r, mb in zip(resp, micros)]
    total = max(sum(weights), 1.0)

    snapshot = HostSnapshot.take(params, optimizer)
    before = torch.cat([measured_divergence(trainer, model, mb) for mb in micros])
    keep, delta_d, first = {}, {}, []
    for rule in rules:
        mask = dataclasses.replace(trainer.pdm_mask, rule=rule, delta=delta, delta_neg=None, estimator=None)
        optimizer.zero_grad(set_to_none=True)
        outs = []
        for mb, w in zip(micros, weights):
            out = trainer.pdm_loss_output(model, mb, mask=mask)
            (out.loss * (w / total)).backward()
            outs.append(out)
        if trainer.args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, trainer.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = torch.cat([measured_divergence(trainer, model, mb) for mb in micros])
        snapshot.restore(params, optimizer)
        keep[rule] = torch.cat([o.keep.reshape(-1)[r] for o, r in zip(outs, resp)]) > 0
        delta_d[rule] = {"topk_kl": after - before, "full_kl": None}
        first = first or outs

    d32 = torch.cat([o.stats.topk_kl[r] for o, r in zip(first, resp)])
    mu_tail = torch.cat([o.stats.mu_tail[r] for o, r in zip(first, resp)])
    adv = torch.cat([mb["advantages"][:, None].expand_as(mb["completion_mask"]).reshape(-1)[r].float()
                     if mb["advantages"].dim() == 1 else mb["advantages"].reshape(-1)[r].float()
                     for mb, r in zip(micros, resp)])
    considered = adv != 0
    mask0 = dataclasses.replace(trainer.pdm_mask, delta=delta, delta_neg=None)
    outside = outside_region(d32, adv, mask0) & considered
    local = step_record(rules, keep, delta_d, outside, cfg.tolerance)
    local.update(tokens=int(adv.numel()), zero_advantage=int((~considered).sum()),
                 contexts=_distinct_contexts(batch))
    gathered = gather_objects((local, d32.double().cpu(), outside.cpu(), considered.cpu(), mu_tail.double().cpu()))
    record = merge_records([g[0] for g in gathered])
    tokens = sum(g[0]["tokens"] for g in gathered)
    contexts = sum(g[0]["contexts"] for g in gathered)
    record.update(tokens=tokens, zero_advantage=sum(g[0]["zero_advantage"] for g in gathered))
    d_all, out_all, cons_all, tail_all = (torch.cat([g[i] for g in gathered]) for i in (1, 2, 3, 4))
    if d_all.numel():
        record["regime"] = regime_table(d_all, out_all, cons_all, topk_mass=1.0 - tail_all,
                                        tokens_per_state=tokens / max(contexts, 1))
    record.update(rules=list(rules), delta=delta, k=trainer.pdm_mask.k, tolerance=cfg.tolerance,
                  ranks=len(gathered), host_snapshot_bytes=snapshot.nbytes,
                  step_doc={"optimizer": type(optimizer).__name__ + " (the trainer's, with its state at this step)",
                            "lr": optimizer.param_groups[0]["lr"], "aggregation": trainer.pdm_mask.aggregation,
                            "grad_clip": trainer.args.max_grad_norm,
                            "batch": "each process's generation batch as one optimiser step",
                            "precision": "model in its dtype, logits + D in float64",
                            "measured": {"topk_kl": True, "full_kl": "not measured: μ's top-K only"}},
                  time_s=time.perf_counter() - start)
    step = trainer.state.global_step + 1
    if record["outside"] == 0 and not getattr(trainer, "_pdm_warned_no_outside", False):
        trainer._pdm_warned_no_outside = True
        warnings.warn(
            f"pdm audit: step {step} found no outside token (D > δ = {delta:g} with Â ≠ 0), so every audit rate "
            "is null. With HF generate the sampler is the trainer's own model (μ = π, D ≈ 1e-7): there is no "
            "mismatch to audit. Create one with a different rollout engine or precision (use_vllm=True, an fp8 "
            "or bf16 engine), a stale or perturbed sampler, or audit at a smaller δ (LiveAuditConfig(delta=…)).",
            stacklevel=2)
    if trainer.accelerator.is_main_process:
        path = Path(trainer.args.output_dir) / "audit.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(json_safe({"step": step, "seed": trainer.args.seed, **record}), allow_nan=False) + "\n")
    for key, value in flat_metrics(record, rules).items():
        if value == value:  # NaN: nothing counted (n/a), not a 0
            trainer._metrics["train"][f"pdm/{key}"].append(float(value))
    trainer._metrics["train"]["pdm/time/audit_s"].append(record["time_s"])
    return record
