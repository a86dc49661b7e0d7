"""The direction audit's arguments (SPEC §6): ``AuditConfig``, the audited pair and step size.

The step is stated, not hidden: the audited loss is the token *sum* Σ_t M_t·Â_t·r_t (no 1/N), so
with SGD at ``lr`` = η every token's own logits move by η·Â·r·(e_k − π) in a tabular state: η is
the effective per-token step.
"""
from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any

import torch

from pdm_lab.config import ConfigError, at_least, config_dataclass, in_range, non_negative, one_of, positive
from pdm_lab.mask_config import MaskConfig

from pdm_lab.envs.policies.models import POLICY_KINDS
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.train.grpo import OPTIMIZERS

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
CONTEXTS = ("shared", "distinct")
PRECISION = torch.float64
#: The dtypes an audit point can be trained in (``AuditConfig.train_precision``).
TRAIN_PRECISIONS = {"float64": torch.float64, "float32": torch.float32}


@config_dataclass("")
class AuditConfig:
    """Arguments of the direction audit (defaults: the paper's 61 seeds × 1024 sequences)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """environment (default: the softmax bandit, 64 prompts × 1000 tokens)."""
    policy: str = "tabular"
    """``tabular``, ``neural``, ``transformer``/``transformer_tied`` (a hand-written causal transformer)
    or ``qwen3``/``qwen3_untied`` (the loop's model family, from ``transformers``)."""
    hidden: Annotated[int, at_least(1)] = 64
    """neural policy width."""
    rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_topk")
    """the compared pair (A, B): A is the reference every other rule is also paired with."""
    extra_rules: tuple[str, ...] = ("pdm_uniform", "pdm_agg", "pdm_exact")
    """further rules, each audited against rules[0] (their own disagreement sets)."""
    seeds: Annotated[int, in_range(1, 100_000)] = 61
    """seeds, each with a fresh batch (paper: 61; beyond 10⁵ is a typo)."""
    first_seed: Annotated[int, at_least(0)] = 0
    """seeds are first_seed, first_seed + 1, …"""
    sequences: Annotated[int, at_least(1)] = 1024
    """sequences per batch (paper: 1024)."""
    group_size: Annotated[int, at_least(2)] = 16
    """G, sequences per prompt; ≥ 2, since advantages are normalised within the group."""
    delta: Annotated[float, non_negative] = 0.15
    """δ (paper: 0.15)."""
    k: Annotated[int, at_least(1)] = 20
    """K (paper: 20), at most the problem's vocabulary n."""
    convention: str = "union"
    """support convention."""
    kernel_ratio: Annotated[float, non_negative] = 1.0
    """λ = b/a of ``pdm_kernel`` (``MaskConfig.kernel_ratio``): the weight of W Wᵀ beside I in its
    kernel-aware direction test; a probe's ``probe/kernel_fit`` gives a model's b/a."""
    mismatch: str = "noise:1"
    """μ's mismatch (see ``mismatch``); the presets use a realistic setting (SPEC §6b)."""
    sft_steps: Annotated[int, at_least(0)] = 0
    """AdamW steps of supervised fine-tuning on the policy's own accepted responses before any other
    training (``envs.audit.sft``: the loop's SFT warm-up, so the network's kernel is a trained one's)."""
    sft_lr: Annotated[float, positive] = 3e-3
    """AdamW's learning rate in that fine-tuning."""
    warmup_steps: Annotated[int, at_least(0)] = 0
    """plain GRPO steps (rule ``none``, Adam, no mismatch) before the audited training."""
    audit_at: tuple[int, ...] = (0,)
    """training steps at which to audit (plain GRPO under the audited mismatch up to each); the
    main study is at the last, the others form the trajectory."""
    trajectory_seeds: Annotated[int, at_least(0)] = 8
    """seeds audited at the earlier points of ``audit_at``."""
    train_runs: Annotated[int, at_least(1)] = 1
    """independently trained policies; audit seed s reads run s mod train_runs."""
    train_groups: Annotated[int, at_least(1)] = 8
    """prompts per training step (× group_size sequences)."""
    train_lr: Annotated[float, positive] = 0.05
    """Adam's learning rate in the audited training."""
    train_precision: str = "float64"
    """dtype of the policy trained to the audit point and of its rollouts (the behaviour copy's
    engine rounding is applied on top, as before). ``float64``: the trained point, and so every
    count the audit reports, is the same on every CPU path and thread count (float32 kernels differ
    in their last bits between instruction sets, and training amplifies that into another policy;
    docs/findings/reproducibility.md has the measurement); ``float32``: faster, machine-dependent."""
    context_features: Annotated[int, at_least(0)] = 0
    """neural policy: hashed context features that overlap across contexts (0: none)."""
    init_scale: Annotated[float, non_negative] = 0.01
    """neural policy: std of the output layer's initial weights."""
    flip_tokens: Annotated[int, at_least(0)] = 64
    """per seed and rule, at most this many grown kept disagreement tokens are decomposed by cause
    (SGD only; 0 to skip)."""
    optimizer: str = "sgd"
    """``sgd`` (the update direction SPEC §3 analyses), ``adam`` (a fresh Adam: a sign step) or
    ``adamw`` (the loop's AdamW: the policy is trained with it and the audited step carries its
    state — momentum and preconditioner — as a live step does)."""
    lr: Annotated[float, positive] = 1e-3
    """η, the effective per-token step: the audited loss is the token sum (no 1/N), so with SGD a
    tabular token's logits move by η·Â·r·(e_k − π). Small: the audit tests first-order direction."""
    tolerance: Annotated[float, non_negative] = 1e-12
    """|ΔD| ≤ tolerance is flat (float64 rounding of D is ~1e-15)."""
    contexts: tuple[str, ...] = CONTEXTS
    """``shared`` and/or ``distinct`` (one token per state); the first is the main study."""
    k_sweep: Annotated[tuple[int, ...], at_least(1)] = ()
    """K values of the K-sweep study; empty to skip."""
    k_sweep_seeds: Annotated[int, at_least(1)] = 6
    """seeds per K in the K sweep."""
    stress_mismatch: str = ""
    """a stress setting (e.g. ``noise:1``) to re-run the main pair under; empty to skip."""
    stress_seeds: Annotated[int, at_least(1)] = 8
    """seeds of the stress study."""
    n_boot: Annotated[int, at_least(1)] = 10_000
    """bootstrap resamples."""
    step_scales: tuple[float, ...] = ()
    """further step sizes as multiples of ``lr`` (e.g. 0.1, 0.01): each rule's unsafe-keep, the
    controls and the median |ΔD|/D at each (SPEC §6d; the run's own step, 1, always)."""
    probe_tokens: Annotated[int, at_least(0)] = 0
    """per seed, the outside tokens the own-update probe and the step decomposition read (SPEC §6d:
    every disagreement token first, then a sample); 0: no probe."""
    mini_batches: Annotated[int, at_least(1)] = 1
    """M (SPEC §6b, §6c): the audited rollout batch of ``sequences`` is trained over M mini-batches
    of whole groups (contiguous equal chunks, the scaling loop's ``pdm_lab.lab.minibatches.split``), so
    mini-batch j meets π after j optimiser steps on the same rollouts. 1: the whole batch, no
    staleness (today's audit). Must divide the batch's groups (``sequences / group_size``)."""
    mini_batch: Any = "last"  # int | str: checked in __post_init__ (the config's union check is numeric-only)
    """the audited mini-batch j < M: ``first`` (j = 0: the numerics alone), ``last`` (j = M − 1, the
    loop's default) or an integer. The policy first takes j plain GRPO steps on mini-batches
    0 … j − 1 of the drawn batch (``batch.audit_batch``), then the audit runs on mini-batch j's
    tokens."""

    def __post_init__(self) -> None:
        if len(self.rules) != 2:
            raise ValueError(f"rules: the audit compares exactly two rules, got {list(self.rules)}")
        for rule in self.all_rules:
            self.mask(rule)  # unknown rule names raise here
        Mismatch.parse(self.mismatch)
        if self.stress_mismatch:
            Mismatch.parse(self.stress_mismatch)
        if self.sequences % self.group_size:
            raise ConfigError(f"sequences ({self.sequences}) must be a multiple of group_size ({self.group_size})")
        if not self.contexts or any(c not in CONTEXTS for c in self.contexts):
            raise ConfigError(f"contexts: each of {', '.join(CONTEXTS)}, got {list(self.contexts)}")
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        one_of("train_precision", self.train_precision, TRAIN_PRECISIONS)
        for i, scale in enumerate(self.step_scales):
            if not scale > 0 or scale != scale or scale == float("inf"):
                raise ConfigError(f"step_scales[{i}]: a positive multiple of lr, got {scale!r}")
        if not self.audit_at or any(s < 0 for s in self.audit_at) or list(self.audit_at) != sorted(set(self.audit_at)):
            raise ConfigError(f"audit_at: training steps ≥ 0 in increasing order, got {list(self.audit_at)}")
        one_of("policy", self.policy, POLICY_KINDS)
        self.audited_mini_batch  # noqa: B018 — validates mini_batch against mini_batches
        groups = self.sequences // self.group_size
        if groups % self.mini_batches:
            raise ConfigError(f"mini_batches: {self.mini_batches} does not split the batch's {groups} groups "
                              f"(sequences / group_size = {self.sequences} / {self.group_size}) into whole groups")
        if self.mini_batches > 1:
            for name in ("mismatch", "stress_mismatch"):
                value = getattr(self, name)
                if value and Mismatch.parse(value).stale_steps > 1:
                    raise ConfigError(f"mini_batches: {self.mini_batches} mini-batches already make the audited "
                                      f"batch stale; {name} {value!r} adds stale:s batches on top (use one of them)")
        kernel_rules = [r for r in self.all_rules if "kernel" in self.mask(r).rule_record.needs]
        if kernel_rules and self.policy == "tabular":  # pdm_kernel's h_t needs the unembedding W
            raise ConfigError(f"rules: {kernel_rules[0]!r} needs the policy's unembedding W, which policy: tabular "
                              "has none of; use policy neural or transformer")
        if self.context_features and self.policy == "neural" and self.problem.kind != "token_mdp":
            raise ConfigError(f"context_features: {self.context_features} hashed n-grams of a token MDP's text are "
                              f"part of the neural policy's input; problem.kind {self.problem.kind!r} has no text "
                              "(set context_features=0)")
        vocab = self.problem.vocab_size
        for name, ks in (("k", (self.k,)), ("k_sweep", self.k_sweep)):
            if ks and max(ks) > vocab:
                raise ConfigError(f"{name}: K = {max(ks)} exceeds the vocabulary (problem.{self.problem.kind}"
                                  f".vocab_size = {vocab})")

    @property
    def scales(self) -> tuple[float, ...]:
        """The audited step sizes as multiples of ``lr``: 1 first, then ``step_scales``."""
        return (1.0, *dict.fromkeys(float(s) for s in self.step_scales if float(s) != 1.0))

    @property
    def audited_mini_batch(self) -> int:
        """j, the audited mini-batch index (``mini_batch`` resolved against ``mini_batches``), or a
        ``ConfigError`` naming ``mini_batch``."""
        choice, m = self.mini_batch, self.mini_batches
        if isinstance(choice, str) and choice in ("first", "last"):
            return 0 if choice == "first" else m - 1
        if isinstance(choice, bool) or not isinstance(choice, int):
            extra = " (the toy audits one j per audit: run one audit per j)" if choice == "all" else ""
            raise ConfigError(f"mini_batch: first, last or a mini-batch index 0 … {m - 1}, got {choice!r}{extra}")
        if not 0 <= choice < m:
            raise ConfigError(f"mini_batch: {choice} is not one of the batch's {m} mini-batches (0 … {m - 1}; "
                              "set mini_batches)")
        return choice

    @property
    def main_step(self) -> int:
        """The training step of the main study (the last audit point)."""
        return self.audit_at[-1]

    def mask(self, rule: str, k: int | None = None) -> MaskConfig:
        return MaskConfig(rule=rule, delta=self.delta, k=self.k if k is None else k,
                          convention=self.convention, kernel_ratio=self.kernel_ratio)

    @property
    def all_rules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.rules, *self.extra_rules)))

    @property
    def pairs(self) -> list[tuple[str, str]]:
        ref = self.rules[0]
        return [(ref, r) for r in self.all_rules if r != ref]

    def step_doc(self) -> dict:
        """The audited step as audit.json states it."""
        loss = {"sgd": "token sum of M·Â·r (no 1/N): with SGD a tabular token's logits move by η·Â·r·(e_k − π)",
                "adam": "token sum of M·Â·r, one fresh Adam step (each parameter moves by about η)",
                "adamw": "token mean of M·Â·r (the training loss), one AdamW step carrying the trained run's "
                         "state (momentum and preconditioner)"}[self.optimizer]
        return {"optimizer": self.optimizer, "effective_per_token_step": self.lr, "loss": loss}

