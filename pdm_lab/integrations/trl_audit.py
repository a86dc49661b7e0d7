"""The direction audit (SPEC §6, §6c, §6d) inside ``PDMGRPOTrainer``: TRL's live generation batch.

``PDMGRPOTrainer(..., audit=LiveAuditConfig(every=N, rules=(A, B, …), delta=δ, probe_tokens=M,
step_scales=(1, 0.1, …)))`` audits every N-th training generation batch at θ₀ — the parameters
that generated μ and the optimiser state the next real step will use — just before the trainer's
first optimiser step on it (``PendingAudit``), through the one live audit,
``pdm_lab.audit.live.run_live_audit``, with TRL's stage (``trl_audit_stage.TRLAuditStage``):

0. the idle check: the trainer's own loss has by then computed D at θ₀ for every row of the batch
   (its first forward of each row; ``PendingAudit.observe``), so a batch with no token within 1% of
   δ is recorded without a forward, a snapshot or a step (``idle_check: "loss"``). Where that step
   saw only part of the batch (``steps_per_generation`` > ``gradient_accumulation_steps``) the
   check runs its own float64 forward instead (``idle_check: "forward"``);
1. snapshot the parameters, the optimiser's state and settings, the gradients the trainer has
   accumulated and the RNG to host memory; D per completion token at θ₀ in float64;
2. per step size and rule: one optimiser step over the whole generation batch (micro-batches of
   ``per_device_train_batch_size``, each loss weighted by its share of the batch, TRL's
   ``max_grad_norm`` clip, the wrapped torch optimiser at that multiple of its current learning
   rate) with that rule's mask from ``pdm_policy_loss``; D recomputed; ΔD; the snapshot restored
   bit for bit; the same step with every Â = 0 (the optimiser's memory alone);
3. the own-update probe and the step decomposition (SPEC §6d) on up to ``probe_tokens`` outside
   tokens, K v by central differences of the model (the output layer in float64);
4. the record, with the scaling loop's ``audit.jsonl`` keys (``pairs``, ``regime``,
   ``step_scales``, ``probe``, ``decomposition``, ``time/probe_s``, …), appended to
   ``output_dir/audit.jsonl`` by the main process, and its per-rule rates added to TRL's logs as
   ``pdm/audit/...``.

Only the top-K KL is measured (``full_kl`` null), as in the scaling loop. Tested in one process
(HF generate); under several processes the records are merged over processes, but the audited
backward runs outside Accelerate's gradient synchronisation, so each process steps on its own batch.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from pdm_lab.audit.live import (LossDivergence, distinct_contexts, flat_metrics, gather_objects, json_safe,
                                 run_live_audit)
from pdm_lab.integrations.trl_audit_stage import BATCH_KEYS, TRLAuditStage, batch_rows, measured_divergence  # noqa: F401

__all__ = ["audit_generation_batch", "measured_divergence", "BATCH_KEYS", "ROW_KEY", "PendingAudit"]

#: Each completion's row in its generation batch, carried through TRL's shuffle and split so that
#: the loss can say which rows of an audited batch it has measured.
ROW_KEY = "pdm_row"


class PendingAudit:
    """An audit due on one generation batch, held until the trainer's first optimiser step on it.

    Until that step θ is θ₀, so every loss forward of the batch's rows measures D at θ₀:
    ``observe`` keeps the loss's D and μ_T per row, and ``at_start`` hands them to the idle check
    when every audited row was seen (on every process), else None (the check then runs its own
    forward).
    """

    def __init__(self, batch: dict):
        self.batch = {key: batch[key] for key in BATCH_KEYS}
        rows, cols = batch["completion_ids"].shape
        self.topk_kl = torch.full((rows, cols), float("nan"))
        self.mu_tail = torch.full((rows, cols), float("nan"))
        self.seen = torch.zeros(rows, dtype=torch.bool)

    def observe(self, inputs: dict, out) -> None:
        """The loss ``out`` (``LossOutput``, stats per [b·t] token) of the micro-batch ``inputs``."""
        rows = inputs[ROW_KEY].cpu()
        b, t = inputs["completion_ids"].shape
        self.topk_kl[rows, :t] = out.stats.topk_kl.detach().reshape(b, t).float().cpu()
        self.mu_tail[rows, :t] = out.stats.mu_tail.detach().reshape(b, t).float().cpu()
        self.seen[rows] = True

    def at_start(self, n: int) -> LossDivergence | None:
        """D at θ₀ of the first ``n`` rows' completion tokens, in ``TRLAuditStage``'s token order
        (row-major), if every process saw all of its rows (collective)."""
        if not all(gather_objects(bool(self.seen[:n].all()))):
            return None
        resp = self.batch["completion_mask"][:n].bool().cpu()
        return LossDivergence(topk_kl=self.topk_kl[:n][resp], mu_tail=self.mu_tail[:n][resp])


def _distinct_contexts(batch: dict) -> int:
    prompts = [[x for x, m in zip(p, pm) if m]
               for p, pm in zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist())]
    return distinct_contexts(prompts, batch["completion_ids"].tolist(), batch["completion_mask"].tolist())


def _rng_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def audit_generation_batch(trainer, batch: dict, pending: PendingAudit | None = None) -> dict:
    """Steps 0–4 of the module docstring on one generation batch (``pending``: the loss's D at θ₀
    for the idle check, where the trainer kept it); returns the merged record."""
    start = time.perf_counter()
    cfg = trainer.pdm_audit
    delta = trainer.pdm_mask.delta if cfg.delta is None else cfg.delta
    rules = tuple(dict.fromkeys(cfg.rules))
    n = batch["completion_ids"].size(0)
    if cfg.sequences is not None:  # the first sequences (whole groups first), this process's share
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        n = min(n, -(-cfg.sequences // world))
    batch = batch_rows(batch, 0, n)
    stage = TRLAuditStage(trainer, batch, delta=delta)
    # the probe runs after the last restore: its passes leave the RNG as the snapshot left it
    with torch.enable_grad(), torch.random.fork_rng(devices=_rng_devices()):
        record = run_live_audit(stage, rules=rules, cfg=cfg, mask_cfg=trainer.pdm_mask, delta=delta,
                                contexts=_distinct_contexts(batch), seed=trainer.args.seed,
                                at_start=None if pending is None else pending.at_start(n))
    optimizer = stage.optimizer
    record.update(k=trainer.pdm_mask.k,
                  step_doc={"optimizer": type(optimizer).__name__ + " (the trainer's, with its state at this step)",
                            "lr": optimizer.param_groups[0]["lr"], "aggregation": trainer.pdm_mask.aggregation,
                            "grad_clip": trainer.args.max_grad_norm,
                            "batch": "each process's generation batch as one optimiser step",
                            "precision": "model in its dtype, logits + D in float64",
                            "measured": {"topk_kl": True, "full_kl": "not measured: μ's top-K only"},
                            "probe": "K v by central differences of the model (output layer in float64) at θ ± εu"},
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
    trainer._metrics["train"]["pdm/time/probe_s"].append(record["time/probe_s"])
    return record
