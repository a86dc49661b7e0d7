"""The direction audit of SPEC §6 on a toy problem: the update mechanics.

Per seed: a fresh batch from μ; the policy, μ and the batch cast to float64; D per token; for
every rule one optimiser step from the same parameters on the same batch (``rule_step``); D
recomputed, both the top-K KL and the full KL. For each compared pair (A, B), over the tokens
outside the region (D > δ, Â ≠ 0) where A and B disagree, each rule's kept tokens are classified
by their ΔD with a tolerance (grow / shrink / flat), against each divergence. Every statistic
(rates with counts, pooling, paired bootstrap CI, sign test, the regime table) comes from
``pdm_lab.audit.measure``.

The step is stated, not hidden: the audited loss is the token *sum* Σ_t M_t·Â_t·r_t (no 1/N), so
with SGD at ``lr`` = η every token's own logits move by η·Â·r·(e_k − π) in a tabular state: η is
the effective per-token step.

Contexts (``AuditConfig.contexts``):
  ``shared``   the policy as it is: tokens of one state share its parameters (tabular), or every
               token shares the network's weights (neural) — the coupling of a real batch;
  ``distinct`` one token per state: the batch's float64 logits become a per-token table, so each
               token's ΔD comes from its own update alone — SPEC §3's first-order setting, where
               the matched rules must show unsafe-keep near 0 (the audit's own test).

Audit points (``audit_at``): the policy is trained with plain GRPO under the audited mismatch
(``audit_points``) and audited at each listed training step, every point a fresh batch; the main
study is at the last point, over all seeds, and the earlier points (the trajectory) over the
first ``trajectory_seeds`` seeds. The audit's tensors hold response tokens only (no padding rows).

Per seed and rule the record also holds the interference-only rate (dropped outside tokens whose
D grew anyway) and, for SGD, where each grown kept disagreement token's first-order ΔD came from
(``audit_flips``). Verdicts need data (``pdm_lab.audit.measure.data_sufficiency``); a power line gives
the seeds needed for the paper's 2.7-point difference at the measured per-seed spread; the
one-token-per-state study is the audit's self-test (``pdm_lab.audit.measure.self_test``).

With ``probe_tokens`` > 0 (SPEC §6d, ``own_update``): the main pair at every step size of
``scales`` beside the Â = 0 step (``step_scales``), the own-update probe (``probe``) and each main
rule's step decomposition (``decomposition``), pooled token by token over seeds, under the keys
the loop's audit writes. With ``optimizer = adamw`` the audited step carries the trained run's
AdamW state (``step.audit_optimizer``).

Studies: a K sweep (the main pair at several K, with μ's tail mass), and the main pair under a
stress mismatch setting (does the verdict change outside the realistic regime?).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdm_lab.lab.machine import machine_info
from pdm_lab.audit.measure import self_test
from pdm_lab.config import to_dict

from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.own_update import pooled_probe, step_scales
from pdm_lab.envs.audit.points import TrainedPolicies
from pdm_lab.envs.audit.seed import audit_seed
from pdm_lab.envs.audit.statistics import (flip_decomposition, main_pair_summary, mean_coupling, paper_side_by_side,
                                           per_rule, pooled_regime, summarize_pairs, trajectory_points)
from pdm_lab.envs.audit.store import audit_seed_resumable
from pdm_lab.envs.problems.problem import make_problem


def _k_sweep(cfg: AuditConfig, progress=None) -> list[dict]:
    rows = []
    sweep_cfg = replace(cfg, extra_rules=())
    policies = TrainedPolicies(sweep_cfg, make_problem(cfg.problem))
    a, b = cfg.rules
    for k in cfg.k_sweep:
        per_seed = []
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.k_sweep_seeds):
            per_seed.append(audit_seed(sweep_cfg, seed, k=k, contexts=cfg.contexts[:1], policies=policies))
            if progress:
                progress()
        summary = main_pair_summary(cfg, per_seed, cfg.contexts[0])
        tails = torch.tensor([s["mu_tail"].get("mean", math.nan) for s in per_seed])
        rows.append({"k": k, "seeds": len(per_seed),
                     "outside_mean": sum(s["outside"] for s in per_seed) / len(per_seed),
                     "disagreement_mean": summary["disagreement_mean"],
                     a: {key: summary[a][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "kept_disagreement_tokens")},
                     b: {key: summary[b][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "kept_disagreement_tokens")},
                     "unsafe_keep_diff": summary["unsafe_keep_diff"],
                     "mu_tail_mean": float(tails.nanmean()),
                     "mu_tail_quantiles": [s["mu_tail"] for s in per_seed]})
    return rows


def _stress(cfg: AuditConfig, main: dict, progress=None, seed_dir=None) -> dict:
    """The main pair under the stress mismatch: its figures, and whether the verdict changes."""
    per_seed, pooled = [], []
    stress_cfg = replace(cfg, mismatch=cfg.stress_mismatch, extra_rules=(), contexts=cfg.contexts[:1])
    store = seed_dir and Path(seed_dir) / "stress"
    policies = TrainedPolicies(stress_cfg, make_problem(cfg.problem), store and store / "policies")
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.stress_seeds):
        per_seed.append(audit_seed_resumable(stress_cfg, seed, store, pooled, policies=policies))
        if progress:
            progress()
    pair = main_pair_summary(cfg, per_seed, cfg.contexts[0])
    a, b = cfg.rules
    now, then = pair["verdict"], main["verdict"]
    return {"mismatch": cfg.stress_mismatch, "seeds": cfg.stress_seeds, "pair": pair,
            "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
            "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
            "regime": [s["regime"] for s in per_seed], "verdict": now, "verdict_changes": now != then}


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far (GB; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run_audit(cfg: AuditConfig, *, progress_bar: bool = False, seed_dir=None) -> dict:
    """The audit and its studies; returns the audit.json document (``seed_dir``: resume store,
    also of the trained policies)."""
    start = time.perf_counter()
    trajectory_seeds = min(cfg.trajectory_seeds, cfg.seeds) * (len(cfg.audit_at) - 1)
    total = (cfg.seeds + trajectory_seeds + len(cfg.k_sweep) * cfg.k_sweep_seeds
             + (cfg.stress_seeds if cfg.stress_mismatch else 0))
    bar = None
    if progress_bar:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="audit", unit="seed")
    tick = bar.update if bar else None
    problem = make_problem(cfg.problem)
    policies = TrainedPolicies(cfg, problem, None if seed_dir is None else Path(seed_dir) / "policies")
    per_seed, pooled = [], []
    earlier: dict[int, list[dict]] = {step: [] for step in cfg.audit_at[:-1]}
    traj_cfg = replace(cfg, extra_rules=())
    for i, seed in enumerate(range(cfg.first_seed, cfg.first_seed + cfg.seeds)):
        per_seed.append(audit_seed_resumable(cfg, seed, seed_dir, pooled, policies=policies))
        if tick:
            tick()
        if i < cfg.trajectory_seeds:  # the seed's earlier points at once: a killed run keeps them
            for step in earlier:
                earlier[step].append(audit_seed_resumable(traj_cfg, seed, seed_dir, None, step=step,
                                                           policies=policies, contexts=cfg.contexts[:1]))
                if tick:
                    tick()
    main_s = time.perf_counter() - start
    contexts = {}
    for ctx in cfg.contexts:
        pairs = summarize_pairs(cfg, per_seed, ctx)
        contexts[ctx] = {"pairs": pairs, "per_rule": per_rule(pairs),
                         "tokens_per_state_mean": sum(s["contexts"][ctx]["tokens_per_state"] for s in per_seed) / max(1, len(per_seed))}
    if "distinct" in contexts:
        contexts["distinct"]["self_test"] = self_test(contexts["distinct"]["per_rule"])
    main_ctx = cfg.contexts[0]
    main = contexts[main_ctx]
    if main_ctx == "shared":
        main["coupling"] = mean_coupling([s["contexts"]["shared"]["coupling"] for s in per_seed])
    main["flips"] = flip_decomposition(cfg, per_seed, main_ctx)
    blocks = [s["contexts"][main_ctx] for s in per_seed]
    scales = step_scales(cfg, [blk.pop("step_inputs", None) for blk in blocks])  # tensors: pooled, not written
    probe, decomposition = pooled_probe(cfg, blocks)
    regime = pooled_regime(pooled)
    trajectory = trajectory_points(cfg, earlier, {"per_seed": per_seed, "pair": main["pairs"][0]})
    studies = {"k_sweep": _k_sweep(cfg, progress=tick) if cfg.k_sweep else [],
               "stress": _stress(cfg, main["pairs"][0], progress=tick, seed_dir=seed_dir) if cfg.stress_mismatch else None}
    if bar:
        bar.close()
    wall = time.perf_counter() - start
    return {
        "config": to_dict(cfg),
        "rules": list(cfg.all_rules),
        "precision": "float64",
        "step": cfg.step_doc(),
        "tolerance": cfg.tolerance,
        "audit_step": cfg.main_step,
        "main_contexts": main_ctx,
        "pairs": main["pairs"],
        "per_rule": main["per_rule"],
        "contexts": contexts,
        "self_test": contexts.get("distinct", {}).get("self_test"),
        "coupling": main.get("coupling"),
        "flips": main["flips"],
        "step_scales": scales,
        "probe": probe,
        "decomposition": decomposition,
        "paper_side_by_side": paper_side_by_side(main["pairs"][0]),
        "trajectory": trajectory,
        "regime": regime,
        # SPEC §6b/§6c: the audited mini-batch j of the M the rollout batch is trained over, and its
        # regime (``regime`` above is that mini-batch's: the audit reads only its tokens)
        "mini_batches": cfg.mini_batches,
        "mini_batch": cfg.audited_mini_batch,
        "mini_batch_regime": {"mini_batch": cfg.audited_mini_batch, "mini_batches": cfg.mini_batches,
                              "optimizer_steps_before": [s.get("optimizer_steps_before", 0) for s in per_seed],
                              "regime": regime},
        "per_seed": per_seed,
        "studies": studies,
        "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
        "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
        "zero_advantage_mean": sum(s["zero_advantage"] for s in per_seed) / max(1, len(per_seed)),
        "wall_s": wall,
        "main_audit_wall_s": main_s,
        "peak_rss_gb": _peak_rss_gb(),
        "machine": machine_info(),
    }

