"""GRPO-style training on a toy problem with any mask rule, readable top to bottom.

Per step: roll out G responses for each of ``groups_per_step`` prompts from μ (π with injected
mismatch), normalise rewards within groups, then E epochs × M mini-batches of masked
policy-gradient steps (loss, mask and metrics from ``pdm_lab.loss.pdm_policy_loss``). After each
optimiser step the divergence D of the mini-batch is recomputed, so every run also reports how
often a kept token outside the region grew D (the unsafe-keep rate of SPEC §6, online).
"""
from __future__ import annotations

import time
from dataclasses import field
from typing import Annotated
from pathlib import Path

import torch

from pdm_lab.lab.advantages import group_advantages
from pdm_lab.audit.measure import regime_table, unsafe_keep_rates
from pdm_lab.config import ConfigError, at_least, config_dataclass, in_range, one_of  # field checks
from pdm_lab.errors import PDMInputError
from pdm_lab.loss_checks import gradient_flags
from pdm_lab.mask_config import MaskConfig
from pdm_lab.metrics import MetricSums, as_mismatch, finalize_floats, merge_metrics, metric, step_metric_sums
from pdm_lab.lab.evidence import collapse_window
from pdm_lab.lab.memory import check_memory

from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import POLICY_KINDS, make_policy
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.lab.records import JsonlWriter
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.mask_registry import get_mask_rule
from pdm_lab.masks import compute_mask, outside_region
from pdm_lab.envs.train.update import current_stats, masked_loss, token_batch

OPTIMIZERS = ("adam", "sgd", "adamw")
#: AdamW as the scaling loop runs it (its trainer defaults: betas, eps, no weight decay).
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.999), 1e-8
#: The largest learning rate accepted (the collapse study's SGD runs use 10).
MAX_LR = 1e4
#: Bytes per (token, vocabulary entry) a step holds at least: μ's and π's log-probabilities and
#: probabilities in float32 (the memory estimate that refuses a batch this machine cannot hold).
BYTES_PER_LOGIT = 16
#: a smaller fall of the smoothed reward is not a collapse, whatever its fraction (batch noise)
COLLAPSE_MIN_LOSS = 0.05

#: The run's summary columns (results rows) and the pooled metric each one reads.
SUMMARY_KEYS = {
    "realised_topk_kl_mean": "mismatch/topk_kl_mean", "realised_topk_kl_max": "mismatch/topk_kl_max",
    "realised_full_kl_mean": "mismatch/full_kl_mean", "realised_full_kl_max": "mismatch/full_kl_max",
    "update_topk_kl_mean": "div/topk_kl_mean", "mask_fraction": "mask/frac_dropped",
    "outside_fraction": "mask/frac_outside", "dir_disagree": "mask/dir_disagree",
    "unsafe_keep": "audit/unsafe_keep", "shrink": "audit/shrink",
}


@config_dataclass("")
class TrainConfig:
    """One training run (a sweep cell × seed)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """the environment (bandit or token MDP) and its arguments."""
    policy: str = "tabular"
    """``tabular``, ``neural``, ``transformer``/``transformer_tied`` or ``qwen3``/``qwen3_untied``
    (``envs.policies.models.make_policy``)."""
    hidden: Annotated[int, at_least(1)] = 64
    """hidden width of a network policy."""
    mask: MaskConfig = field(default_factory=MaskConfig)
    """mask rule, δ, K, convention, estimator, aggregation (pdm_lab.mask_config.MaskConfig)."""
    mismatch: str = "none"
    """μ's mismatch, e.g. ``noise:0.5`` or ``fp8_e4m3_weights:0+stale:4`` (see ``mismatch``)."""
    optimizer: str = "adam"
    """``adam`` or ``sgd``."""
    lr: Annotated[float, in_range(0.0, MAX_LR, low_open=True)] = 0.05
    """learning rate (beyond ``MAX_LR`` the first step leaves every float range)."""
    steps: Annotated[int, at_least(1)] = 40
    """rollout batches (GRPO steps)."""
    groups_per_step: Annotated[int, at_least(1)] = 32
    """prompts per rollout batch."""
    group_size: Annotated[int, at_least(2)] = 16
    """G, responses per prompt; ≥ 2, since advantages are normalised within the group."""
    epochs: Annotated[int, at_least(1)] = 1
    """E, passes over each rollout batch."""
    minibatches: Annotated[int, at_least(1)] = 1
    """M, optimiser steps per pass (``stale:s`` raises it to s)."""
    scale_adv_by_std: bool = True
    """GRPO's division by the group's reward std (False: Dr. GRPO)."""
    track_unsafe_keep: bool = True
    """recompute D after each optimiser step (one extra forward pass)."""
    eval_sequences: Annotated[int, at_least(1)] = 2048
    """responses for the final on-policy evaluation of π (token MDP; the bandit is exact)."""
    collapse_drop: Annotated[float, in_range(0.0, 1.0)] = 0.5
    """collapsed if the smoothed batch reward ended below (1 − this) × the best it reached."""
    seed: int = 0
    """seeds the rollout streams and the neural policy's initial weights."""

    def __post_init__(self) -> None:
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        one_of("policy", self.policy, POLICY_KINDS)
        if "kernel" in self.mask.rule_record.needs and self.policy == "tabular":  # no unembedding W
            raise ConfigError(f"mask.rule: {self.mask.rule!r} needs the policy's unembedding W, which policy: tabular "
                              "has none of; use policy neural or transformer")
        if self.eval_sequences < 1:
            raise ConfigError(f"eval_sequences: must be ≥ 1, got {self.eval_sequences}")
        mismatch = Mismatch.parse(self.mismatch)  # validate early
        sequences = self.groups_per_step * self.group_size
        for name, value in (("minibatches", self.minibatches), (f"mismatch {self.mismatch} (stale steps)",
                                                                mismatch.stale_steps)):
            if value > sequences:  # an empty mini-batch is no optimiser step
                raise ConfigError(f"{name}: {value} exceeds the sequences per step (groups_per_step × "
                                  f"group_size = {sequences})")
        horizon = 1 if self.problem.kind == "bandit" else self.problem.token_mdp.max_len
        per_row = BYTES_PER_LOGIT * horizon * self.problem.vocab_size  # one sequence's [L, n] passes
        check_memory(per_row * sequences, f"groups_per_step × group_size = {self.groups_per_step:g} × "
                     f"{self.group_size} sequences of {horizon} tokens over n = {self.problem.vocab_size}")
        check_memory(per_row * self.eval_sequences, f"eval_sequences = {self.eval_sequences:g}")


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)
    return torch.optim.SGD(params, lr=lr)


def is_collapsed(curve: list[float], final: float | None = None, *, drop: float, nonfinite: bool) -> bool:
    """Collapse: non-finite training, or the reward ended below (1 − `drop`) × the best reached.

    The curve is smoothed over a window of a tenth of the run; best = its maximum (the start
    included, so a run that only ever falls counts), end = its last value (``final`` overrides
    it). The loss best − end must also exceed 0.05, so batch noise at a reward near zero is not a
    collapse; a flat run (never learned, never lost) is not one either. Best and end come from
    one measurement, the batch reward, and the definition is the same for every rule (see
    ``collapse``).
    """
    if nonfinite:
        return True
    if not curve:
        return False
    w = collapse_window(len(curve))
    smooth = [sum(curve[max(0, i - w + 1):i + 1]) / len(curve[max(0, i - w + 1):i + 1])
              for i in range(len(curve))]
    best = max(smooth)
    end = smooth[-1] if final is None else final
    return end < (1.0 - drop) * best and best - end > COLLAPSE_MIN_LOSS


def tail_ratio(values: list[torch.Tensor]) -> float:
    """p99.9/p50 of D over the pooled tokens (SPEC §6b's tail ratio; NaN: none; inf: p50 = 0)."""
    if not values:
        return float("nan")
    d = torch.cat(values).double()
    d = d[torch.isfinite(d)]
    if d.numel() == 0:
        return float("nan")
    none = torch.zeros_like(d, dtype=torch.bool)  # the regime table's own definition, not a second one
    return regime_table(d, none, ~none)["tail_ratio"]


def _total(sums: MetricSums, key: str) -> int:
    """The Σ behind a count-valued metric (0 when nothing was measured)."""
    return int(sums[key].value) if key in sums else 0


def train(cfg: TrainConfig, *, log_path: str | Path | None = None, on_step=None) -> dict:
    """Run GRPO; append one JSON line of metrics per step to ``log_path``.

    Returns:
        A summary dict: initial/final reward, collapse flag, realised mismatch (rollout time and
        update time), mask fraction, unsafe-keep counts, the reward curve and wall time.
    """
    start = time.perf_counter()
    problem = make_problem(cfg.problem)
    policy = make_policy(cfg.policy, problem.encoder, problem.prior, seed=cfg.seed, hidden=cfg.hidden)
    optimizer = make_optimizer(cfg.optimizer, policy.parameters(), cfg.lr)
    mismatch = Mismatch.parse(cfg.mismatch)
    minibatches = max(cfg.minibatches, mismatch.stale_steps)
    rule = get_mask_rule(cfg.mask.rule)
    rng = RolloutRNG(cfg.seed)
    initial_reward = problem.evaluate(policy, cfg.seed, num_sequences=cfg.eval_sequences)
    curve: list[float] = []
    run_sums: MetricSums = {}  # every step's sums: the run's pooled metrics
    optimizer_steps = 0  # counted, so the sweep can check the staleness axis (M steps per batch)
    update_d: list[torch.Tensor] = []  # D of every update's response tokens: the regime's tail ratio
    nonfinite, why = False, ""

    with JsonlWriter(log_path) as log:
        for step in range(cfg.steps):
            # 1. rollout from μ and GRPO advantages
            batch = problem.collect(policy, mismatch, cfg.groups_per_step, cfg.group_size, rng)
            adv = group_advantages(batch.rewards, batch.groups, scale_by_std=cfg.scale_adv_by_std)
            tokens = token_batch(batch, adv, cfg.mask)
            resp = tokens.response_mask.reshape(-1)

            # 2. realised mismatch μ vs π at rollout time (before any update on this batch)
            stats0 = current_stats(policy, tokens, binary=rule.binary_stats)
            adv0 = torch.where(resp, tokens.advantages.reshape(-1).to(stats0.ratio.dtype), 0.0)
            # the mask at θ₀ (verl's rollout_rs_* keys) and (B, T) for the per-sequence keys, so the toys
            # log verl's rollout_corr/* set as the loop's first mini-batch does; a rule that needs c_t or
            # h_t from the model has no mask before its loss call (those two keys are then absent)
            keep0 = None if set(rule.needs) - {"full"} else compute_mask(cfg.mask, stats0, adv0, tokens.response_mask)
            parts = [as_mismatch(step_metric_sums(stats0, keep0, tokens.advantages.reshape(-1), resp, cfg.mask,
                                                  layout=tuple(tokens.response_mask.shape)))]

            # 3. E epochs × M mini-batches of masked policy-gradient steps
            for _epoch in range(cfg.epochs):
                order = torch.randperm(batch.num_sequences, generator=rng.order)
                for rows in order.chunk(minibatches):
                    mb = tokens.select(rows)
                    try:
                        out = masked_loss(policy, mb, cfg.mask, optimizer=optimizer)
                    except PDMInputError as err:
                        if not str(err).startswith("loss:"):
                            raise
                        nonfinite, why = True, str(err)  # a non-finite loss: the run is marked, not stepped
                        break
                    optimizer.zero_grad(set_to_none=True)
                    out.loss.backward()
                    grad_flags, bad_grad = gradient_flags(policy.named_parameters())
                    parts.append(grad_flags)
                    if bad_grad is not None:  # never step on it: the weights would take the NaN/inf
                        nonfinite, why = True, f"non-finite gradient: {bad_grad}"
                        break
                    optimizer.step()
                    optimizer_steps += 1
                    update_d.append(out.stats.topk_kl.reshape(-1)[mb.response_mask.reshape(-1)].detach().float())
                    if not all(bool(torch.isfinite(p).all()) for p in policy.parameters()):
                        nonfinite, why = True, "non-finite parameters after the step"  # diverged
                        break
                    parts.append(out.metric_sums)
                    if cfg.track_unsafe_keep:  # SPEC §6 online: did the kept outside tokens' D grow?
                        outside = outside_region(out.stats.topk_kl, mb.advantages.reshape(-1), cfg.mask) & mb.response_mask.reshape(-1)
                        kept = outside & (out.keep.reshape(-1) > 0) & (mb.advantages.reshape(-1) != 0)
                        after = current_stats(policy, mb, full=False)
                        rates = unsafe_keep_rates(after.topk_kl - out.stats.topk_kl, kept)
                        parts.append({
                            "audit/unsafe_keep": metric("mean", rates["grew"], rates["count"]),
                            "audit/shrink": metric("mean", rates["shrank"], rates["count"]),
                            "audit/considered": metric("sum", rates["count"]),
                        })
                if nonfinite:
                    break
            step_sums = merge_metrics(*parts)
            run_sums = merge_metrics(run_sums, step_sums)
            record = {"step": step, "reward/mean": float(batch.rewards.mean()), **finalize_floats(step_sums),
                      **({"nonfinite": why} if nonfinite else {}),
                      "time/elapsed_s": time.perf_counter() - start}
            curve.append(record["reward/mean"])
            log.write(record)
            if on_step is not None:
                on_step(record)
            if nonfinite:
                break

    final_reward = (float("nan") if nonfinite
                    else problem.evaluate(policy, cfg.seed, num_sequences=cfg.eval_sequences))
    final = finalize_floats(run_sums)
    nan = float("nan")
    return {
        "initial_reward": initial_reward,
        "final_reward": final_reward,
        "collapsed": is_collapsed(curve, drop=cfg.collapse_drop, nonfinite=nonfinite),
        "nonfinite": nonfinite,
        **{column: final.get(key, nan) for column, key in SUMMARY_KEYS.items()},
        "unsafe_keep_count": _total(run_sums, "audit/considered"),
        "unsafe_count": _total(run_sums, "audit/unsafe_keep"),
        "shrink_count": _total(run_sums, "audit/shrink"),
        "curve": curve,
        "steps_done": len(curve),
        "optimizer_steps": optimizer_steps,
        "update_tail_ratio": tail_ratio(update_d),
        "wall_s": time.perf_counter() - start,
    }
