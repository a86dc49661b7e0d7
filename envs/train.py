"""GRPO-style training on a toy problem with any mask rule, readable top to bottom.

Per step: roll out G responses for each of ``groups_per_step`` prompts from μ (π with injected
mismatch), normalise rewards within groups, then E epochs × M mini-batches of masked
policy-gradient steps (loss, mask and metrics from ``pdm_lab.loss.pdm_policy_loss``). After each
optimiser step the divergence D of the mini-batch is recomputed, so every run also reports how
often a kept token outside the region grew D (the unsafe-keep rate of SPEC §6, online).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdm_lab.advantages import group_advantages
from pdm_lab.audit import unsafe_keep_rates
from pdm_lab.config import MaskConfig

from .mismatch import Mismatch
from .policies import make_policy
from .problems import ProblemConfig, make_problem
from .records import JsonlWriter
from .rollout import RolloutRNG
from .update import current_stats, masked_loss, outside_region, token_batch

OPTIMIZERS = ("adam", "sgd")
#: a smaller fall of the smoothed reward is not a collapse, whatever its fraction (batch noise)
COLLAPSE_MIN_LOSS = 0.05


@dataclass(frozen=True)
class TrainConfig:
    """One training run (a sweep cell × seed)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """the environment (bandit or token MDP) and its arguments."""
    policy: str = "tabular"
    """``tabular`` or ``neural``."""
    hidden: int = 64
    """hidden width of the neural policy."""
    mask: MaskConfig = field(default_factory=MaskConfig)
    """mask rule, δ, K, convention, estimator, aggregation (pdm_lab.config.MaskConfig)."""
    mismatch: str = "none"
    """μ's mismatch, e.g. ``noise:0.5`` or ``fp8_e4m3_weights:0+stale:4`` (see ``mismatch``)."""
    optimizer: str = "adam"
    """``adam`` or ``sgd``."""
    lr: float = 0.05
    """learning rate."""
    steps: int = 40
    """rollout batches (GRPO steps)."""
    groups_per_step: int = 32
    """prompts per rollout batch."""
    group_size: int = 16
    """G, responses per prompt."""
    epochs: int = 1
    """E, passes over each rollout batch."""
    minibatches: int = 1
    """M, optimiser steps per pass (``stale:s`` raises it to s)."""
    scale_adv_by_std: bool = True
    """GRPO's division by the group's reward std (False: Dr. GRPO)."""
    track_unsafe_keep: bool = True
    """recompute D after each optimiser step (one extra forward pass)."""
    eval_sequences: int = 2048
    """responses for the final on-policy evaluation of π (token MDP; the bandit is exact)."""
    collapse_drop: float = 0.5
    """collapsed if the smoothed batch reward ended below (1 − this) × the best it reached."""
    seed: int = 0
    """seeds the rollout streams and the neural policy's initial weights."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: unknown {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        Mismatch.parse(self.mismatch)  # validate early


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
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
    w = max(1, len(curve) // 10)
    smooth = [sum(curve[max(0, i - w + 1):i + 1]) / len(curve[max(0, i - w + 1):i + 1])
              for i in range(len(curve))]
    best = max(smooth)
    end = smooth[-1] if final is None else final
    return end < (1.0 - drop) * best and best - end > COLLAPSE_MIN_LOSS


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
    rng = RolloutRNG(cfg.seed)
    initial_reward = problem.evaluate(policy, cfg.seed)
    curve, totals = [], {"unsafe": 0, "shrink": 0, "considered": 0, "outside": 0, "tokens": 0}
    sums: dict[str, float] = {}
    peaks: dict[str, float] = {}
    nonfinite = False

    with JsonlWriter(log_path) as log:
        for step in range(cfg.steps):
            # 1. rollout from μ and GRPO advantages
            batch = problem.collect(policy, mismatch, cfg.groups_per_step, cfg.group_size, rng)
            adv = group_advantages(batch.rewards, batch.groups, scale_by_std=cfg.scale_adv_by_std)
            tokens = token_batch(batch, adv, cfg.mask)
            resp = tokens.response_mask.reshape(-1)

            # 2. realised mismatch μ vs π at rollout time (before any update on this batch)
            stats0 = current_stats(policy, tokens)
            record = {
                "step": step,
                "reward/mean": float(batch.rewards.mean()),
                "mismatch/topk_kl_mean": float(stats0.topk_kl[resp].mean()),
                "mismatch/topk_kl_max": float(stats0.topk_kl[resp].max()),
                "mismatch/full_kl_mean": float(stats0.full_kl[resp].mean()),
                "mismatch/full_kl_max": float(stats0.full_kl[resp].max()),
            }

            # 3. E epochs × M mini-batches of masked policy-gradient steps
            step_metrics: dict[str, list[float]] = {}
            unsafe = shrink = considered = 0
            for _epoch in range(cfg.epochs):
                order = torch.randperm(batch.num_sequences, generator=rng.order)
                for rows in order.chunk(minibatches):
                    mb = tokens.select(rows)
                    out = masked_loss(policy, mb, cfg.mask, optimizer=optimizer)
                    optimizer.zero_grad(set_to_none=True)
                    out.loss.backward()
                    optimizer.step()
                    if not all(bool(torch.isfinite(p).all()) for p in policy.parameters()):
                        nonfinite = True  # diverged: stop here, the run counts as collapsed
                        break
                    for key, value in out.metrics.items():
                        step_metrics.setdefault(key, []).append(float(value))
                    mb_resp = mb.response_mask.reshape(-1)
                    outside = outside_region(out.stats, mb.advantages, cfg.mask) & mb_resp
                    totals["outside"] += int(outside.sum())
                    totals["tokens"] += int(mb_resp.sum())
                    if cfg.track_unsafe_keep:  # SPEC §6 online: did the kept outside tokens' D grow?
                        kept = outside & (out.keep.reshape(-1) > 0) & (mb.advantages.reshape(-1) != 0)
                        after = current_stats(policy, mb, full=False)
                        rates = unsafe_keep_rates(after.topk_kl - out.stats.topk_kl, kept)
                        if rates["count"]:
                            unsafe += round(rates["unsafe_keep"] * rates["count"])
                            shrink += round(rates["shrink"] * rates["count"])
                            considered += rates["count"]
                if nonfinite:
                    break
            record.update({k: sum(v) / len(v) for k, v in step_metrics.items()})
            if considered:
                record["audit/unsafe_keep"] = unsafe / considered
                record["audit/shrink"] = shrink / considered
            record["audit/considered"] = considered
            totals["unsafe"] += unsafe
            totals["shrink"] += shrink
            totals["considered"] += considered
            record["time/elapsed_s"] = time.perf_counter() - start
            for key in ("mismatch/topk_kl_mean", "mismatch/topk_kl_max", "mismatch/full_kl_mean",
                        "mismatch/full_kl_max", "div/topk_kl_mean", "mask/frac_dropped",
                        "mask/frac_outside", "mask/dir_disagree"):
                if key in record and record[key] is not None and math.isfinite(record[key]):
                    sums[key] = sums.get(key, 0.0) + record[key]
                    peaks[key] = max(peaks.get(key, -math.inf), record[key])
            curve.append(record["reward/mean"])
            log.write(record)
            if on_step is not None:
                on_step(record)
            if nonfinite:
                break

    final_reward = float("nan") if nonfinite else problem.evaluate(policy, cfg.seed)
    steps_done = max(1, len(curve))
    return {
        "initial_reward": initial_reward,
        "final_reward": final_reward,
        "collapsed": is_collapsed(curve, drop=cfg.collapse_drop, nonfinite=nonfinite),
        "nonfinite": nonfinite,
        "realised_topk_kl_mean": sums.get("mismatch/topk_kl_mean", 0.0) / steps_done,
        "realised_topk_kl_max": peaks.get("mismatch/topk_kl_max", 0.0),
        "realised_full_kl_mean": sums.get("mismatch/full_kl_mean", 0.0) / steps_done,
        "realised_full_kl_max": peaks.get("mismatch/full_kl_max", 0.0),
        "update_topk_kl_mean": sums.get("div/topk_kl_mean", 0.0) / steps_done,
        "mask_fraction": sums.get("mask/frac_dropped", 0.0) / steps_done,
        "outside_fraction": totals["outside"] / max(1, totals["tokens"]),
        "dir_disagree": sums.get("mask/dir_disagree", 0.0) / steps_done,
        "unsafe_keep": totals["unsafe"] / totals["considered"] if totals["considered"] else float("nan"),
        "shrink": totals["shrink"] / totals["considered"] if totals["considered"] else float("nan"),
        "unsafe_keep_count": totals["considered"],
        "curve": curve,
        "steps_done": len(curve),
        "wall_s": time.perf_counter() - start,
    }
