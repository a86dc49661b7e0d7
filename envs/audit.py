"""The direction audit of SPEC §6 on a toy problem, and the two studies the paper leaves open.

Per seed: a fresh batch from μ; D per token; for every rule one optimiser step from the same
parameters on the same batch; D recomputed; for each compared pair (A, B), over the tokens
outside the region (D > δ) where A and B disagree, the unsafe-keep rate of each rule (the
fraction of the tokens it kept whose D grew) and its shrink rate. The statistics come from
``pdm_lab.audit`` (rates, paired bootstrap CI, sign test).

Studies:
  (a) single-token: each disagreement token's own update alone (its share of the token-mean
      loss, nothing else), against the full-batch step — how much of the error is batch
      coupling rather than the per-token direction test;
  (b) K sweep: the audit at several K, with the distribution of μ's tail mass μ_T.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import field, replace
from typing import Annotated

import torch
from torch import Tensor

from pdm_lab.advantages import group_advantages
from pdm_lab.audit import paired_bootstrap_ci, sign_test, unsafe_keep_rates
from pdm_lab.config import MaskConfig, to_dict
from pdm_lab.config import at_least, config_dataclass, non_negative, positive  # field checks

from .mismatch import Mismatch
from .policies import make_policy
from .problems import ProblemConfig, make_problem
from .rollout import RolloutRNG
from .train import TrainConfig, make_optimizer
from .update import TokenBatch, current_stats, masked_loss, outside_region, token_batch

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@config_dataclass("")
class AuditConfig:
    """Arguments of the direction audit (defaults: the paper's 61 seeds × 1024 sequences)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """environment (default: the softmax bandit, 64 prompts × 1000 tokens)."""
    policy: str = "tabular"
    """``tabular`` or ``neural``."""
    hidden: Annotated[int, at_least(1)] = 64
    """neural policy width."""
    rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_uniform")
    """the compared pair (A, B): A is the reference every other rule is also paired with."""
    extra_rules: tuple[str, ...] = ("pdm_agg", "pdm_topk", "pdm_exact")
    """further rules, each audited against rules[0] (their own disagreement sets)."""
    seeds: Annotated[int, at_least(1)] = 61
    """seeds, each with a fresh batch (paper: 61)."""
    first_seed: Annotated[int, at_least(0)] = 0
    """seeds are first_seed, first_seed + 1, …"""
    sequences: Annotated[int, at_least(1)] = 1024
    """sequences per batch (paper: 1024)."""
    group_size: Annotated[int, at_least(1)] = 16
    """G, sequences per prompt."""
    delta: Annotated[float, non_negative] = 0.15
    """δ (paper: 0.15)."""
    k: Annotated[int, at_least(1)] = 20
    """K (paper: 20)."""
    convention: str = "union"
    """support convention."""
    mismatch: str = "noise:1"
    """μ's mismatch (see ``mismatch``); σ = 1 gives a bandit seed ~60 disagreement tokens (paper: 82)."""
    warmup_steps: Annotated[int, at_least(0)] = 0
    """plain GRPO steps (rule ``none``, Adam, no mismatch) before the audit, to leave the prior."""
    optimizer: str = "sgd"
    """``sgd`` (the update direction SPEC §3 analyses) or ``adam`` (a fresh Adam: a sign step)."""
    lr: Annotated[float, positive] = 1.0
    """learning rate of the audited step."""
    single_token: bool = True
    """run study (a)."""
    single_token_max: Annotated[int, at_least(0)] = 16
    """at most this many disagreement tokens per rule and seed in study (a)."""
    single_token_rules: tuple[str, ...] = ("dppo_topk_kl", "pdm_uniform", "pdm_exact")
    """rules whose kept disagreement tokens study (a) updates one at a time."""
    k_sweep: Annotated[tuple[int, ...], at_least(1)] = (1, 2, 5, 10, 20, 50, 100)
    """K values of study (b); empty to skip."""
    k_sweep_seeds: Annotated[int, at_least(1)] = 6
    """seeds per K in study (b)."""
    n_boot: Annotated[int, at_least(1)] = 10_000
    """bootstrap resamples."""

    def __post_init__(self) -> None:
        if len(self.rules) != 2:
            raise ValueError(f"rules: the audit compares exactly two rules, got {list(self.rules)}")
        for rule in self.all_rules:
            self.mask(rule)  # unknown rule names raise here
        Mismatch.parse(self.mismatch)
        if self.sequences % self.group_size:
            raise ValueError(f"sequences ({self.sequences}) must be a multiple of group_size ({self.group_size})")

    def mask(self, rule: str, k: int | None = None) -> MaskConfig:
        return MaskConfig(rule=rule, delta=self.delta, k=self.k if k is None else k,
                          convention=self.convention)

    @property
    def all_rules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.rules, *self.extra_rules)))

    @property
    def pairs(self) -> list[tuple[str, str]]:
        ref = self.rules[0]
        return [(ref, r) for r in self.all_rules if r != ref]


def _audit_batch(cfg: AuditConfig, seed: int):
    """Problem, policy and one fresh batch from μ for `seed`.

    With ``stale:s`` in the mismatch, the rollout round has s batches: the policy first takes
    s − 1 plain GRPO steps (rule ``none``, Adam) on the other s − 1, then the audit runs on the
    last one — the off-policy mini-batch of DPPO-style training.
    """
    problem = make_problem(cfg.problem)
    policy = make_policy(cfg.policy, problem.encoder, problem.prior, seed=seed, hidden=cfg.hidden)
    plain = TrainConfig(problem=cfg.problem, policy=cfg.policy, hidden=cfg.hidden,
                        mask=MaskConfig(rule="none", k=cfg.k, convention=cfg.convention), seed=seed)
    if cfg.warmup_steps:
        _plain_steps(plain, problem, policy, Mismatch(), cfg.warmup_steps, RolloutRNG(10_000 + seed))
    mismatch = Mismatch.parse(cfg.mismatch)
    rng = RolloutRNG(seed)
    groups = cfg.sequences // cfg.group_size
    earlier = [problem.collect(policy, mismatch, groups, cfg.group_size, rng)
               for _ in range(mismatch.stale_steps - 1)]
    batch = problem.collect(policy, mismatch, groups, cfg.group_size, rng)
    if earlier:
        opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
        for old in earlier:
            _plain_step(plain, policy, opt, old)
    return policy, batch, group_advantages(batch.rewards, batch.groups)


def _plain_step(plain: TrainConfig, policy, opt, batch) -> None:
    tokens = token_batch(batch, group_advantages(batch.rewards, batch.groups), plain.mask)
    out = masked_loss(policy, tokens, plain.mask)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()


def _plain_steps(plain: TrainConfig, problem, policy, mismatch: Mismatch, steps: int,
                 rng: RolloutRNG) -> None:
    """A few plain on-policy GRPO steps (the audit then starts mid-training, as the paper's)."""
    opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
    for _ in range(steps):
        batch = problem.collect(policy, mismatch, plain.groups_per_step, plain.group_size, rng)
        _plain_step(plain, policy, opt, batch)


def _step_and_delta(cfg: AuditConfig, policy, tokens: TokenBatch, mask: MaskConfig,
                    before: Tensor, scale: float = 1.0):
    """One optimiser step with `mask` from a copy of `policy`; returns (keep [N], ΔD [N]).

    ``scale`` multiplies the loss (the single-token study passes 1/N: the token's share)."""
    trial = copy.deepcopy(policy)
    opt = make_optimizer(cfg.optimizer, trial.parameters(), cfg.lr)
    out = masked_loss(trial, tokens, mask)
    opt.zero_grad(set_to_none=True)
    (out.loss * scale).backward()
    opt.step()
    after = current_stats(trial, tokens, full=False)
    return out.keep.reshape(-1), after.topk_kl - before


def audit_seed(cfg: AuditConfig, seed: int, *, k: int | None = None,
               single_token: bool = False) -> dict:
    """The audit on one seed's batch: per pair, disagreement counts and per-rule rates."""
    policy, batch, adv = _audit_batch(cfg, seed)
    ref_mask = cfg.mask(cfg.rules[0], k)
    tokens = token_batch(batch, adv, ref_mask)
    resp = tokens.response_mask.reshape(-1)
    stats = current_stats(policy, tokens)
    outside = outside_region(stats, tokens.advantages, ref_mask) & resp
    keep, delta = {}, {}
    for rule in cfg.all_rules:
        keep[rule], delta[rule] = _step_and_delta(cfg, policy, tokens, cfg.mask(rule, k), stats.topk_kl)
    record = {"seed": seed, "tokens": int(resp.sum()), "outside": int(outside.sum()),
              "mu_tail": _quantiles(stats.mu_tail[resp]),
              "mu_tail_outside": _quantiles(stats.mu_tail[outside]), "pairs": {}}
    for a, b in cfg.pairs:
        disagree = outside & (keep[a] != keep[b])
        entry = {"disagreement": int(disagree.sum())}
        for rule in (a, b):
            kept = disagree & (keep[rule] > 0)
            entry[rule] = unsafe_keep_rates(delta[rule], kept)
            if single_token and rule in cfg.single_token_rules:
                entry[rule]["single_token"] = _single_token(cfg, policy, tokens, cfg.mask(rule, k),
                                                           kept, delta[rule], stats.topk_kl)
        record["pairs"][f"{a}|{b}"] = entry
    return record


def _single_token(cfg: AuditConfig, policy, tokens: TokenBatch, mask: MaskConfig, kept: Tensor,
                  batch_delta: Tensor, before: Tensor) -> dict:
    """Study (a): each kept disagreement token's update alone, vs the full-batch ΔD."""
    idx = torch.nonzero(kept)[:, 0][: cfg.single_token_max]
    n_resp = float(tokens.response_mask.sum())
    single = torch.empty(idx.numel())
    for i, j in enumerate(idx.tolist()):
        one = tokens.single(j)
        _, d = _step_and_delta(cfg, policy, one, mask, before[j:j + 1], scale=1.0 / n_resp)
        single[i] = d[0]
    considered = torch.ones(idx.numel(), dtype=torch.bool)
    return {"single": unsafe_keep_rates(single, considered),
            "batch_same_tokens": unsafe_keep_rates(batch_delta[idx], considered)}


def _quantiles(x: Tensor) -> dict:
    if x.numel() == 0:
        return {"count": 0}
    q = torch.quantile(x.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {"count": int(x.numel()), "mean": float(x.mean()),
            **{f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}}


def _rule_summary(per_seed: list[dict], pair: str, rule: str) -> dict:
    entries = [s["pairs"][pair][rule] for s in per_seed]
    unsafe = [e["unsafe_keep"] for e in entries]
    shrink = [e["shrink"] for e in entries]
    counts = [e["count"] for e in entries]
    total = sum(counts)
    pooled_unsafe = sum(u * c for u, c in zip(unsafe, counts) if c) / total if total else math.nan
    pooled_shrink = sum(s * c for s, c in zip(shrink, counts) if c) / total if total else math.nan
    finite = [u for u in unsafe if not math.isnan(u)]
    finite_s = [s for s in shrink if not math.isnan(s)]
    return {"unsafe_keep_per_seed": unsafe, "shrink_per_seed": shrink, "count_per_seed": counts,
            "unsafe_keep_mean": sum(finite) / len(finite) if finite else math.nan,
            "shrink_mean": sum(finite_s) / len(finite_s) if finite_s else math.nan,
            "unsafe_keep_pooled": pooled_unsafe, "shrink_pooled": pooled_shrink,
            "kept_disagreement_tokens": total}


def _compare(x: list[float], y: list[float], n_boot: int) -> dict:
    """Paired over seeds: mean of x − y, bootstrap 95% CI, sign test, wins per side."""
    mean, lo, hi = paired_bootstrap_ci(x, y, n_boot=n_boot)
    pairs = [(a, b) for a, b in zip(x, y) if not (math.isnan(a) or math.isnan(b))]
    return {"mean_diff": mean, "ci_low": lo, "ci_high": hi, "level": 0.95,
            "sign_test_p": sign_test(x, y), "seeds_used": len(pairs),
            "a_lower_seeds": sum(a < b for a, b in pairs), "b_lower_seeds": sum(b < a for a, b in pairs),
            "ties": sum(a == b for a, b in pairs)}


def summarize_pairs(cfg: AuditConfig, per_seed: list[dict]) -> list[dict]:
    """Per pair: both rules' rates and the paired comparison (A − B) of unsafe-keep and shrink."""
    out = []
    for a, b in cfg.pairs:
        key = f"{a}|{b}"
        sa, sb = _rule_summary(per_seed, key, a), _rule_summary(per_seed, key, b)
        dis = [s["pairs"][key]["disagreement"] for s in per_seed]
        out.append({"a": a, "b": b, "disagreement_per_seed": dis,
                    "disagreement_mean": sum(dis) / max(1, len(dis)), a: sa, b: sb,
                    "unsafe_keep_diff": _compare(sa["unsafe_keep_per_seed"], sb["unsafe_keep_per_seed"], cfg.n_boot),
                    "shrink_diff": _compare(sa["shrink_per_seed"], sb["shrink_per_seed"], cfg.n_boot)})
    return out


def _single_token_summary(cfg: AuditConfig, per_seed: list[dict]) -> dict:
    out = {}
    for a, b in cfg.pairs:
        key = f"{a}|{b}"
        for rule in (a, b):
            single = [s["pairs"][key][rule].get("single_token") for s in per_seed]
            single = [x for x in single if x is not None]
            if not single or rule in out:
                continue
            s_rates = [x["single"]["unsafe_keep"] for x in single]
            b_rates = [x["batch_same_tokens"]["unsafe_keep"] for x in single]
            n = sum(x["single"]["count"] for x in single)
            pooled = lambda field: (sum(x[field]["unsafe_keep"] * x[field]["count"]
                                        for x in single if x[field]["count"]) / n) if n else math.nan
            out[rule] = {"tokens": n, "single_unsafe_keep_pooled": pooled("single"),
                         "batch_unsafe_keep_pooled": pooled("batch_same_tokens"),
                         "batch_minus_single": _compare(b_rates, s_rates, cfg.n_boot)}
    return out


def _k_sweep(cfg: AuditConfig, progress=None) -> list[dict]:
    rows = []
    sweep_cfg = replace(cfg, extra_rules=())
    for k in cfg.k_sweep:
        per_seed = []
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.k_sweep_seeds):
            per_seed.append(audit_seed(sweep_cfg, seed, k=k))
            if progress:
                progress()
        (summary,) = summarize_pairs(sweep_cfg, per_seed)
        tails = torch.tensor([s["mu_tail"].get("mean", math.nan) for s in per_seed])
        rows.append({"k": k, "seeds": len(per_seed),
                     "outside_mean": sum(s["outside"] for s in per_seed) / len(per_seed),
                     "disagreement_mean": summary["disagreement_mean"],
                     cfg.rules[0]: {key: summary[cfg.rules[0]][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "kept_disagreement_tokens")},
                     cfg.rules[1]: {key: summary[cfg.rules[1]][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "kept_disagreement_tokens")},
                     "unsafe_keep_diff": summary["unsafe_keep_diff"],
                     "mu_tail_mean": float(tails.nanmean()),
                     "mu_tail_quantiles": [s["mu_tail"] for s in per_seed],
                     "mu_tail_outside_quantiles": [s["mu_tail_outside"] for s in per_seed]})
    return rows


def run_audit(cfg: AuditConfig, *, progress_bar: bool = False) -> dict:
    """The audit and both studies; returns the audit.json document."""
    start = time.perf_counter()
    total = cfg.seeds + len(cfg.k_sweep) * cfg.k_sweep_seeds
    bar = None
    if progress_bar:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="audit", unit="seed")
    per_seed = []
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
        per_seed.append(audit_seed(cfg, seed, single_token=cfg.single_token))
        if bar:
            bar.update()
    main_s = time.perf_counter() - start
    k_rows = _k_sweep(cfg, progress=(bar.update if bar else None)) if cfg.k_sweep else []
    if bar:
        bar.close()
    return {
        "config": to_dict(cfg),
        "rules": list(cfg.all_rules),
        "pairs": summarize_pairs(cfg, per_seed),
        "per_seed": per_seed,
        "studies": {
            "single_token": _single_token_summary(cfg, per_seed) if cfg.single_token else None,
            "k_sweep": k_rows,
        },
        "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
        "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
        "wall_s": time.perf_counter() - start,
        "main_audit_wall_s": main_s,
    }
