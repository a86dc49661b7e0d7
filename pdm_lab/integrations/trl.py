"""``PDMGRPOTrainer``: TRL's ``GRPOTrainer`` with pdm_lab's mask and loss on μ's top-K support.

    from pdm_lab import MaskConfig
    from pdm_lab.integrations.trl import PDMGRPOTrainer

    trainer = PDMGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                             mask=MaskConfig(rule="pdm_topk", delta=0.15, k=20))

Three overrides, the fewest TRL 1.16 allows (it has no hook for a custom mask):

* ``_generate_single_turn`` — keeps μ's top-K at every generated position: from HF ``generate``
  the processed log-probs log_softmax(scores) (after temperature and the logits processors, the
  distribution actually sampled); from vLLM ``logprobs=K`` in ``processed_logprobs`` mode, read
  by the core's parser (``pdm_lab.engine_topk.topk_from_ranked``: the sampled token's log-prob
  re-picked by id, vLLM's extra (K+1)-th entry when it is outside the top-K).
* ``_generate_and_score_completions`` — adds [B, T, K] ``pdm_topk_ids``/``pdm_topk_logp`` and [B, T]
  ``pdm_mu_logp`` to TRL's batch dict; TRL shuffles and splits them with the rest.
* ``_compute_loss`` — π on the support through ``policy_on_support`` (chunked gather: no [B·T, V]
  float32 log-softmax), then ``pdm_policy_loss`` with the whole ``MaskConfig`` (rule, δ, K, the
  support convention, the sequence rules' fields, the cap, the aggregation) and the batch's
  data-parallel counts (``DPInfo``: TRL's ``num_items_in_batch`` and the sequences with a response
  token, scaled to one accumulation window, ``world`` = the processes whose gradients Accelerate
  averages — the normalisation TRL's ``dapo`` loss applies); its metrics go to TRL's logs as
  ``pdm/...``.

The engine's sampling mask (``keep_sampling_mask``, default on when the generation cuts: TRL's
``top_p < 1``, ``top_k > 0`` or ``min_p > 0``, ``generation_kwargs`` included): π is taken over
the tokens the generator could sample, renormalised (``pdm_lab.sampling_mask``). The resolved
mask config, convention included, and the sampling mask are written to
``output_dir/pdm_config.json`` when training starts.

``audit=LiveAuditConfig(every=N, …)`` runs the direction audit (SPEC §6c) on every N-th training
generation batch (``trl_audit.py``), just before the first optimiser step on it (θ still θ₀; a batch
the loss found idle costs no forward): ``output_dir/audit.jsonl`` and ``pdm/audit/...`` in the logs.

μ stays the rollout's for every reuse of a batch (``num_iterations > 1``), as the trust region
requires. Tested with the TRL versions in ``pdm_lab.integrations.versions.TESTED``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import weakref
from pathlib import Path

import torch
from torch import Tensor

from pdm_lab.aggregation import DPInfo
from pdm_lab.audit.live import LiveAuditConfig
from pdm_lab.config import ConfigError, to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.engine_topk import EngineTopK, pad_responses, topk_from_ranked
from pdm_lab.loss import pdm_policy_loss
from pdm_lab.masks import MASK_RULES
from pdm_lab.policy_side import policy_on_support
from pdm_lab.sampling_mask import SamplingMask, engine_kept, on_sampling_set
from pdm_lab.support import support_from_topk, topk_lower_id_ties
from pdm_lab.integrations.versions import require_version

TRL_VERSION = require_version("trl")

from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

TOPK_KEYS = ("pdm_topk_ids", "pdm_topk_logp", "pdm_mu_logp")
#: The batch's count of sequences with a response token, over every process (a scalar, as
#: TRL's own ``num_items_in_batch``): the ``seq-mean-*`` aggregations' normaliser.
NUM_SEQS_KEY = "pdm_num_seqs"


def rows_from_scores(scores: list[Tensor], sampled: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """HF ``generate`` scores (T tensors [B, V], processed logits) → [B, T, K] ids, log μ, [B, T] log μ_k.

    log_softmax of the processed logits is the sampled distribution (temperature, top-k/top-p
    applied; cut tokens are −inf, a legal zero probability).
    """
    logp = torch.log_softmax(torch.stack(scores, dim=1).float(), dim=-1)  # [B, T, V]
    b, t, v = logp.shape
    ids, top = topk_lower_id_ties(logp.reshape(b * t, v), min(k, v))
    mu_k = logp.gather(-1, sampled[..., None])[..., 0]
    return ids.reshape(b, t, -1), top.reshape(b, t, -1), mu_k


def rollout_from_vllm(completion_ids: list[list[int]], logprobs: list, token_ids: list,
                      k: int) -> list[EngineTopK]:
    """TRL's view of vLLM's answer (``vllm_generation.generate``: per completion, per position,
    log-probs and ids sorted by rank) → μ's top-K of each completion, by the core's parser."""
    return [topk_from_ranked(lps, ids, seq, k, response=i)
            for i, (seq, lps, ids) in enumerate(zip(completion_ids, logprobs, token_ids, strict=True))]


def _refuse_kernel_rules(mask: MaskConfig, audit: LiveAuditConfig) -> None:
    """``pdm_kernel`` needs h_t = ⟨Wᵀg, Wᵀv⟩ from the policy's unembedding, which this trainer's loss
    path does not compute (the scaling loop's does: ``scaling/train_step.py``)."""
    named = [("mask.rule", mask.rule)] + [(f"audit.rules[{i}]", r) for i, r in enumerate(audit.rules) if audit.every]
    for where, rule in named:
        if "kernel" in MASK_RULES[rule].needs:
            raise ConfigError(f"{where}: {rule!r} needs h_t = ⟨Wᵀg, Wᵀv⟩ from the trainer's unembedding, which "
                              "PDMGRPOTrainer does not supply; run it in the scaling loop (pdm-lab train) or the toys")


def _refuse_audit_under_deepspeed(audit: LiveAuditConfig, deepspeed: bool) -> None:
    """The audit runs at ``on_pre_optimizer_step``, at θ₀; DeepSpeed's engine steps inside the
    backward of the accumulation window's last micro-batch, before that hook, and partitions the
    parameters and the optimiser state the audit snapshots."""
    if audit.every and deepspeed:
        raise ConfigError("audit.every: the live audit is not supported under DeepSpeed (its engine takes the "
                          "optimiser step inside backward, before the audit's pre-step hook, and partitions the "
                          "state the audit snapshots); audit with FSDP, DDP or one process, or set audit.every=0")


class _AuditBeforeStep(TrainerCallback):
    """Runs the trainer's pending audit just before the optimiser step (the gradients clipped, θ
    and the optimiser's state still those that generated the batch)."""

    def __init__(self, trainer: "PDMGRPOTrainer"):
        self._trainer = weakref.ref(trainer)  # the trainer holds its callbacks: no cycle

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer.pdm_run_pending_audit()


class PDMGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is pdm_lab's masked policy loss (``mask``: the ``MaskConfig``).

    TRL's own ``loss_type``, ε and importance-sampling settings are not used by the loss; the KL
    penalty (``beta``) must be 0 and multimodal/tool rollouts are not supported (clear errors).
    """

    def __init__(self, *args, mask: MaskConfig | None = None, audit: LiveAuditConfig | None = None,
                 keep_sampling_mask: bool | None = None, **kwargs):
        self.pdm_mask = mask or MaskConfig()
        self.pdm_audit = audit or LiveAuditConfig()
        _refuse_kernel_rules(self.pdm_mask, self.pdm_audit)
        self._pdm_audit_batches = 0
        if keep_sampling_mask not in (None, True, False):
            raise ValueError("PDMGRPOTrainer: keep_sampling_mask must be True, False or None, "
                             f"got {keep_sampling_mask!r}")
        super().__init__(*args, **kwargs)
        if self.beta != 0.0:
            raise ValueError("PDMGRPOTrainer: set GRPOConfig(beta=0.0); the KL penalty is not part of pdm_lab's loss")
        _refuse_audit_under_deepspeed(self.pdm_audit, self.is_deepspeed_enabled)
        if self.use_vllm:
            self.vllm_generation.logprobs = self.pdm_mask.k  # top-K processed log-probs per position
        if self.pdm_mask.aggregation == "seq-mean-token-sum-norm" and self.pdm_mask.horizon is None:
            # TRL's Dr. GRPO horizon: the completion budget, not each micro-batch's padded length
            self.pdm_mask = dataclasses.replace(self.pdm_mask, horizon=self.max_completion_length)
        cut = self._generation_cut()
        self.pdm_sampling = cut if cut.active and keep_sampling_mask is not False else None
        self._pdm_rollout: list[tuple[Tensor, Tensor, Tensor]] = []
        self._pdm_scores_config = None
        self._pdm_pending_audit = None
        if self.pdm_audit.every:
            self.add_callback(_AuditBeforeStep(self))

    def _generation_cut(self) -> SamplingMask:
        """The cut the generator samples with: TRL's ``top_k``/``top_p``/``min_p``, overridden by
        ``generation_kwargs`` as TRL overrides them (HF: the ``generation_config`` it built)."""
        if not self.use_vllm and getattr(self, "generation_config", None) is not None:
            return SamplingMask.from_mapping(self.generation_config)
        params = {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}
        extra = self.args.generation_kwargs if isinstance(self.args.generation_kwargs, dict) else {}
        params.update({key: extra[key] for key in params if key in extra})
        return SamplingMask.from_mapping(params)

    def pdm_record(self) -> dict:
        """What this run's mask is, resolved: the ``MaskConfig`` (every field, convention included),
        the sampling mask (None: π is the full softmax) and how the loss is normalised."""
        return {"mask": to_dict(self.pdm_mask),
                "sampling_mask": None if self.pdm_sampling is None else self.pdm_sampling.as_dict(),
                "dp": {"processes": self.accelerator.num_processes,
                       "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                       "steps_per_generation": self.args.steps_per_generation},
                "generation": "vllm" if self.use_vllm else "transformers"}

    def train(self, *args, **kwargs):
        if self.accelerator.is_main_process:
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "pdm_config.json").write_text(json.dumps(self.pdm_record(), indent=2) + "\n")
        return super().train(*args, **kwargs)

    # --- generation: keep μ's top-K --------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields or has_tool_images:
            raise NotImplementedError("PDMGRPOTrainer: multimodal rollouts are not supported")
        k = self.pdm_mask.k
        if self.use_vllm:
            from trl.extras.profiling import profiling_context

            if self.state.global_step != self._last_loaded_step:
                with profiling_context(self, "sync_weights"):
                    self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
                prompts=prompt_ids, images=None, num_generations=num_generations,
                profiler=profiling_context(self, "vLLM.generate"))
            self._pdm_rollout = rollout_from_vllm(completion_ids, logprobs, token_ids, k)
            return completion_ids, [r.sampled_logp.tolist() for r in self._pdm_rollout]
        if self.use_transformers_continuous_batching:
            raise NotImplementedError("PDMGRPOTrainer: continuous batching exposes no scores; use generate or vLLM")
        return self._generate_with_scores(prompt_ids, k)

    def _generate_with_scores(self, prompt_ids, k: int):
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {"input_ids": pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left"),
                  "attention_mask": pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left")}
        inputs = super(GRPOTrainer, self)._prepare_inputs(inputs)
        # the same contexts as TRL's own generate path (DeepSpeed/FSDP gathering, generation kwargs)
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                         gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                         generation_kwargs=self.generation_kwargs,
                                         gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
                                         ) as unwrapped, torch.no_grad(), \
                self._dist.summon_full_params(self.model_wrapped, recurse=False):
            out = unwrapped.generate(**inputs, generation_config=self._scores_config())
        completion = out.sequences[:, inputs["input_ids"].size(1):]
        top_ids, top_lp, mu_k = rows_from_scores(list(out.scores), completion, k)
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=device))
        length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], completion.size(1),
                                                                                        dtype=torch.long))
        completion_ids, rollout = [], []
        for i, n in enumerate(length.tolist()):
            completion_ids.append(completion[i, :n].tolist())
            rollout.append(EngineTopK(ids=top_ids[i, :n].cpu(), logp=top_lp[i, :n].cpu(),
                                      sampled=completion[i, :n].cpu(), sampled_logp=mu_k[i, :n].cpu()))
        self._pdm_rollout = rollout
        return completion_ids, None

    def _scores_config(self):
        """TRL's ``generation_config`` asking for the processed scores too (one config object:
        transformers deprecates a config passed with generation keyword arguments beside it)."""
        if self._pdm_scores_config is None:
            cfg = copy.deepcopy(self.generation_config)
            cfg.output_scores, cfg.return_dict_in_generate = True, True
            self._pdm_scores_config = cfg
        return self._pdm_scores_config

    # --- the batch: carry the top-K with TRL's keys ---------------------------------------------
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rollout = self._pdm_rollout
        length = output["completion_ids"].size(1)
        if len(rollout) != output["completion_ids"].size(0):
            raise RuntimeError(f"PDMGRPOTrainer: {len(rollout)} rollouts kept for a batch of "
                               f"{output['completion_ids'].size(0)} completions")
        device = output["completion_ids"].device
        batch = pad_responses(rollout, length)
        output["pdm_topk_ids"] = batch.ids.to(device)
        output["pdm_topk_logp"] = batch.logp.to(device)
        output["pdm_mu_logp"] = batch.sampled_logp.to(device)
        with_tokens = (output["completion_mask"].sum(dim=1) > 0).sum()
        output[NUM_SEQS_KEY] = self.accelerator.gather(with_tokens).sum()
        self._pdm_rollout = []
        if self.pdm_audit.every and self.model.training:  # SPEC §6c on the fresh batch, before any step
            from pdm_lab.integrations.trl_audit import ROW_KEY, PendingAudit

            self.pdm_run_pending_audit()  # a batch generated before any step since: θ is still its θ₀
            output[ROW_KEY] = torch.arange(output["completion_ids"].size(0), device=device)
            self._pdm_audit_batches += 1
            if self._pdm_audit_batches % self.pdm_audit.every == 0:
                self._pdm_pending_audit = PendingAudit(output)
        return output

    def pdm_run_pending_audit(self) -> None:
        """The audit due on the last generation batch, at θ₀: called just before the optimiser step
        (``_AuditBeforeStep``), after the loss has measured D at θ₀ for the step's rows."""
        pending, self._pdm_pending_audit = self._pdm_pending_audit, None
        if pending is not None:
            from pdm_lab.integrations.trl_audit import audit_generation_batch

            audit_generation_batch(self, pending.batch, pending)

    # --- the loss: pdm_lab's ---------------------------------------------------------------------
    def pdm_dp(self, inputs) -> DPInfo | None:
        """The counts this micro-batch's loss is normalised by: the generation batch's tokens
        (TRL's ``num_items_in_batch``) and sequences over every process, scaled to one
        accumulation window (training: ``gradient_accumulation_steps / steps_per_generation`` of
        the batch), and the processes whose gradients are averaged. None for rows without TRL's
        counts (the audit's own micro-batches, which it weights itself): this batch alone."""
        if "num_items_in_batch" not in inputs:
            return None
        mode = "train" if self.model.training else "eval"
        window = self.current_gradient_accumulation_steps / self.args.steps_per_generation if mode == "train" else 1.0
        tokens = inputs["num_items_in_batch"].double().clamp(min=1.0) * window
        seqs = inputs[NUM_SEQS_KEY].double().clamp(min=1.0) * window if NUM_SEQS_KEY in inputs else None
        return DPInfo(tokens=float(tokens), sequences=None if seqs is None else float(seqs),
                      world=self.accelerator.num_processes)

    def pdm_loss_output(self, model, inputs, mask: MaskConfig | None = None):
        """``LossOutput`` of ``pdm_policy_loss`` on this batch (also used by the tests; ``mask``:
        another rule's section, for the audit; default the trainer's)."""
        mask = mask or self.pdm_mask
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            raise NotImplementedError("PDMGRPOTrainer: tool rollouts are not supported")
        b, t = completion_ids.shape
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=t + 1).logits[:, :-1]
        resp = completion_mask.bool()
        flat = resp.reshape(-1)
        support = support_from_topk(
            inputs["pdm_topk_ids"].reshape(b * t, -1), inputs["pdm_topk_logp"].reshape(b * t, -1),
            completion_ids.reshape(-1), inputs["pdm_mu_logp"].reshape(-1), vocab_size=logits.size(-1),
            k=mask.k, convention=mask.convention, row_mask=flat)
        pi = policy_on_support(logits.reshape(b * t, -1), support.ids, temperature=self.temperature,
                               sampling=self.pdm_sampling, keep_on_support=engine_kept(support))
        support = on_sampling_set(support, pi.tail_count)
        advantages = inputs["advantages"]
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand(b, t).float()
        return pdm_policy_loss(pi, support, advantages, resp, mask, dp=self.pdm_dp(inputs))

    def _compute_loss(self, model, inputs):
        out = self.pdm_loss_output(model, inputs)
        self.pdm_last_output = out  # the last micro-batch's keep mask and stats, for inspection
        mode = "train" if self.model.training else "eval"
        if self._pdm_pending_audit is not None and mode == "train":  # D at θ₀: the audit's idle check
            self._pdm_pending_audit.observe(inputs, out)
        for key, value in out.metrics.items():
            if not torch.isnan(value):  # NaN: nothing counted in this micro-batch (n/a), not a 0
                self._metrics[mode][f"pdm/{key}"].append(float(value))
        return out.loss  # normalised for the accumulation window by its DPInfo (pdm_dp)
