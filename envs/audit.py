"""The direction audit of SPEC §6 on a toy problem: the update mechanics.

Per seed: a fresh batch from μ; the policy, μ and the batch cast to float64; D per token; for
every rule one optimiser step from the same parameters on the same batch (``rule_step``); D
recomputed, both the top-K KL and the full KL. For each compared pair (A, B), over the tokens
outside the region (D > δ, Â ≠ 0) where A and B disagree, each rule's kept tokens are classified
by their ΔD with a tolerance (grow / shrink / flat), against each divergence. Every statistic
(rates with counts, pooling, paired bootstrap CI, sign test, the regime table) comes from
``pdm_lab.audit``.

The step is stated, not hidden: the audited loss is the token *sum* Σ_t M_t·Â_t·r_t (no 1/N), so
with SGD at ``lr`` = η every token's own logits move by η·Â·r·(e_k − π) in a tabular state: η is
the effective per-token step.

Contexts (``AuditConfig.contexts``):
  ``shared``   the policy as it is: tokens of one state share its parameters (tabular), or every
               token shares the network's weights (neural) — the coupling of a real batch;
  ``distinct`` one token per state: the batch's float64 logits become a per-token table, so each
               token's ΔD comes from its own update alone — SPEC §3's first-order setting, where
               the matched rules must show unsafe-keep near 0 (the audit's own test).

Studies: a K sweep (the main pair at several K, with μ's tail mass), and the main pair under a
stress mismatch setting (does the verdict change outside the realistic regime?).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import torch
from torch import Tensor, nn

from pdm_lab.advantages import group_advantages
from pdm_lab.audit import (MEASURED_DIVERGENCES, compare_paired, delta_rates, pooled_diff_ci,
                           predicted_divergence, rate_summary, regime_table, verdict)
from pdm_lab.config import MaskConfig, to_dict
from pdm_lab.config import ConfigError, at_least, config_dataclass, in_range, non_negative, one_of, positive  # field checks
from pdm_lab.masks import get_mask_rule

from .mismatch import Mismatch
from .policies import POLICY_KINDS, make_policy
from .problems import ProblemConfig, make_problem
from .rollout import RolloutRNG
from .train import OPTIMIZERS, TrainConfig, make_optimizer
from pdm_lab.masks import outside_region
from .update import TokenBatch, current_stats, masked_loss, token_batch

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
CONTEXTS = ("shared", "distinct")
PRECISION = torch.float64


@config_dataclass("")
class AuditConfig:
    """Arguments of the direction audit (defaults: the paper's 61 seeds × 1024 sequences)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """environment (default: the softmax bandit, 64 prompts × 1000 tokens)."""
    policy: str = "tabular"
    """``tabular`` or ``neural``."""
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
    group_size: Annotated[int, at_least(1)] = 16
    """G, sequences per prompt."""
    delta: Annotated[float, non_negative] = 0.15
    """δ (paper: 0.15)."""
    k: Annotated[int, at_least(1)] = 20
    """K (paper: 20), at most the problem's vocabulary n."""
    convention: str = "union"
    """support convention."""
    mismatch: str = "noise:1"
    """μ's mismatch (see ``mismatch``); the presets use a realistic setting (SPEC §6b)."""
    warmup_steps: Annotated[int, at_least(0)] = 0
    """plain GRPO steps (rule ``none``, Adam, no mismatch) before the audit, to leave the prior."""
    optimizer: str = "sgd"
    """``sgd`` (the update direction SPEC §3 analyses) or ``adam`` (a fresh Adam: a sign step)."""
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

    def __post_init__(self) -> None:
        if len(self.rules) != 2:
            raise ValueError(f"rules: the audit compares exactly two rules, got {list(self.rules)}")
        for rule in self.all_rules:
            self.mask(rule)  # unknown rule names raise here
        Mismatch.parse(self.mismatch)
        if self.stress_mismatch:
            Mismatch.parse(self.stress_mismatch)
        if self.sequences % self.group_size:
            raise ValueError(f"sequences ({self.sequences}) must be a multiple of group_size ({self.group_size})")
        if not self.contexts or any(c not in CONTEXTS for c in self.contexts):
            raise ValueError(f"contexts: each of {', '.join(CONTEXTS)}, got {list(self.contexts)}")
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        one_of("policy", self.policy, POLICY_KINDS)
        vocab = self.problem.vocab_size
        for name, ks in (("k", (self.k,)), ("k_sweep", self.k_sweep)):
            if ks and max(ks) > vocab:
                raise ConfigError(f"{name}: K = {max(ks)} exceeds the vocabulary (problem.{self.problem.kind}"
                                  f".vocab_size = {vocab})")

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

    def step_doc(self) -> dict:
        """The audited step as audit.json states it."""
        return {"optimizer": self.optimizer, "effective_per_token_step": self.lr,
                "loss": "token sum of M·Â·r (no 1/N): with SGD a tabular token's logits move by "
                        "η·Â·r·(e_k − π)" if self.optimizer == "sgd" else
                        "token sum of M·Â·r, one fresh Adam step (each parameter moves by about η)"}


class TokenTable(nn.Module):
    """One state per token: logits = base[i] + table[i] for observation [i] (the distinct study)."""

    def __init__(self, base: Tensor):
        super().__init__()
        self.register_buffer("base", base.detach().clone())
        self.table = nn.Parameter(torch.zeros_like(self.base))

    def forward(self, obs: Tensor) -> Tensor:
        rows = obs[:, 0]
        return self.base[rows] + self.table[rows]


def audit_batch(cfg: AuditConfig, seed: int, mismatch: str | None = None):
    """Problem, policy and one fresh batch from μ for `seed` (float32, as a rollout produces).

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
    mismatch = Mismatch.parse(cfg.mismatch if mismatch is None else mismatch)
    rng = RolloutRNG(seed)
    groups = cfg.sequences // cfg.group_size
    earlier = [problem.collect(policy, mismatch, groups, cfg.group_size, rng)
               for _ in range(mismatch.stale_steps - 1)]
    batch = problem.collect(policy, mismatch, groups, cfg.group_size, rng)
    if earlier:
        opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
        for old in earlier:
            _plain_step(plain, policy, opt, old)
    return problem, policy, batch, group_advantages(batch.rewards, batch.groups)


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


def float64_tokens(batch, advantages: Tensor, mask: MaskConfig) -> TokenBatch:
    """The batch for the measurement: μ cast to float64 (and renormalised there: a float32 μ's
    mass is 1 only to float32 rounding) before its support is built."""
    batch64 = dataclasses.replace(batch, mu_logp=torch.log_softmax(batch.mu_logp.to(PRECISION), dim=-1))
    tokens = token_batch(batch64, advantages, mask)
    return dataclasses.replace(tokens, advantages=tokens.advantages.to(PRECISION))


def audit_model(policy: nn.Module, tokens: TokenBatch, contexts: str,
                focus: Tensor) -> tuple[nn.Module, TokenBatch, Tensor]:
    """The float64 model the rules step, the tokens it reads, and the focus rows among them.

    ``shared``: the policy itself on the whole batch. ``distinct``: one state per token — each
    token's ΔD then depends on its own update alone, so only the focus tokens (those outside the
    region) need a state: their logits become a per-token table."""
    model = copy.deepcopy(policy).to(PRECISION)
    if contexts == "shared":
        return model, tokens, focus
    sub = tokens.rows(focus)
    with torch.no_grad():
        base = model(sub.obs)
    rows = torch.arange(focus.numel())
    return TokenTable(base), dataclasses.replace(sub, obs=rows[:, None]), rows


@dataclass(frozen=True)
class RuleStep:
    """What one rule's step did: its keep mask and the per-token change of each divergence."""

    keep: Tensor
    """[N] bool."""
    delta: dict[str, Tensor]
    """divergence name (``MEASURED_DIVERGENCES``) → [N] float64 ΔD (NaN off the focus rows)."""


def measure(model: nn.Module, tokens: TokenBatch) -> dict[str, Tensor]:
    """[N] top-K KL and full KL of μ‖π_model (float64 when model and tokens are)."""
    stats = current_stats(model, tokens, full=True)
    return {"topk_kl": stats.topk_kl, "full_kl": stats.full_kl}


def rule_step(model: nn.Module, tokens: TokenBatch, mask: MaskConfig, cfg: AuditConfig,
              focus: Tensor, before: dict[str, Tensor], cache: dict | None = None) -> RuleStep:
    """One optimiser step with `mask`'s rule from a copy of `model`; ΔD on the `focus` rows, for
    both divergences (``before``: their values there).

    The loss is the token sum of the core's masked surrogate (``masked_loss`` with token-mean,
    times the response-token count), so ``cfg.lr`` is the effective per-token step. Two rules
    with the same keep mask take the same step: ``cache`` (keep bytes → ΔD) reuses it.
    """
    return rule_steps(model, tokens, mask, cfg, focus, before, (1.0,), cache)[1.0]


def rule_steps(model: nn.Module, tokens: TokenBatch, mask: MaskConfig, cfg: AuditConfig,
               focus: Tensor, before: dict[str, Tensor], scales: tuple[float, ...],
               cache: dict | None = None) -> dict[float, RuleStep]:
    """``rule_step`` at the step sizes η·s for each s in `scales`, from one forward and backward.

    The mask is decided before the step, so it does not depend on η; and the first step of
    either optimiser is linear in η (SGD: −η g; a fresh Adam: −η m̂/(√v̂ + ε), with m̂ = g and
    v̂ = g²), so the step at η·s is s times the step at η: θ_s = θ + s (θ_η − θ). In float64 this
    equals a separate step at η·s to rounding (tested). ``cache`` is keyed by the keep mask and
    the scales.
    """
    if mask.aggregation != "token-mean":
        raise ValueError("rule_step: the audited step sums the token-mean loss back to a token sum")
    trial = copy.deepcopy(model)
    out = masked_loss(trial, tokens, mask)
    keep = out.keep.reshape(-1) > 0
    key = (keep.numpy().tobytes(), tuple(scales))
    if cache is not None and key in cache:
        return {s: RuleStep(keep=keep, delta=d) for s, d in cache[key].items()}
    start = [p.detach().clone() for p in trial.parameters()]
    opt = make_optimizer(cfg.optimizer, trial.parameters(), cfg.lr)
    opt.zero_grad(set_to_none=True)
    (out.loss * tokens.response_mask.sum()).backward()
    opt.step()
    stepped = [p.detach().clone() for p in trial.parameters()]
    sub = tokens.rows(focus)
    deltas: dict[float, dict[str, Tensor]] = {}
    for scale in scales:
        with torch.no_grad():  # scale 1 is the optimiser's own step, bit for bit
            for p, p0, p1 in zip(trial.parameters(), start, stepped):
                p.copy_(p1 if scale == 1.0 else p0 + scale * (p1 - p0))
        after = measure(trial, sub)
        delta = {}
        for name in MEASURED_DIVERGENCES:
            full = torch.full((tokens.num_tokens,), float("nan"), dtype=PRECISION)
            full[focus] = after[name] - before[name]
            delta[name] = full
        deltas[scale] = delta
    if cache is not None:
        cache[key] = deltas
    return {s: RuleStep(keep=keep, delta=d) for s, d in deltas.items()}


def _tokens_per_state(tokens: TokenBatch, resp: Tensor) -> float:
    obs = tokens.obs[resp]
    return float(obs.shape[0]) / max(1, torch.unique(obs, dim=0).shape[0])


def _regime_inputs(tokens: TokenBatch, d: Tensor, outside: Tensor, considered: Tensor, k: int,
                   resp: Tensor) -> tuple:
    """(D, outside, Â ≠ 0, μ's top-K mass, μ's entropy) over response tokens, tokens per state."""
    mu = tokens.mu_full[resp]
    topk_mass = torch.topk(mu, min(k, mu.shape[1]), dim=1).values.exp().sum(dim=1)
    entropy = -(mu.exp() * mu).nan_to_num(0.0).sum(dim=1)  # 0·log 0 = 0
    return (d[resp], outside[resp], considered[resp], topk_mass, entropy,
            _tokens_per_state(tokens, resp))


def _table(inputs: tuple) -> dict:
    d, outside, considered, mass, entropy, tps = inputs
    return regime_table(d, outside, considered, topk_mass=mass, entropy=entropy, tokens_per_state=tps)


def study(cfg: AuditConfig, model: nn.Module, tokens: TokenBatch, focus: Tensor,
          k: int | None = None) -> dict:
    """Every rule's step on one float64 model; per pair, the disagreement and each rule's rates.

    ``focus``: the rows outside the region with Â ≠ 0 (the only tokens the pairs score)."""
    before = measure(model, tokens.rows(focus))
    cache: dict = {}
    steps = {rule: rule_step(model, tokens, cfg.mask(rule, k), cfg, focus, before, cache)
             for rule in cfg.all_rules}
    outside = torch.zeros(tokens.num_tokens, dtype=torch.bool)
    outside[focus] = True
    record = {"outside": int(focus.numel()), "distinct_steps": len(cache), "pairs": {}}
    for a, b in cfg.pairs:
        disagree = outside & (steps[a].keep != steps[b].keep)
        entry = {"disagreement": int(disagree.sum())}
        for rule in (a, b):
            kept = disagree & steps[rule].keep
            entry[rule] = {name: delta_rates(steps[rule].delta[name], kept, cfg.tolerance)
                           for name in MEASURED_DIVERGENCES}
        record["pairs"][f"{a}|{b}"] = entry
    return record


def audit_seed(cfg: AuditConfig, seed: int, *, k: int | None = None, mismatch: str | None = None,
               contexts: tuple[str, ...] | None = None, keep_d: list | None = None) -> dict:
    """The audit on one seed's batch, for each contexts setting; appends the regime inputs to
    `keep_d` if given."""
    _, policy, batch, adv = audit_batch(cfg, seed, mismatch)
    ref_mask = cfg.mask(cfg.rules[0], k)
    tokens = float64_tokens(batch, adv, ref_mask)
    resp = tokens.response_mask.reshape(-1)
    considered = resp & (tokens.advantages.reshape(-1) != 0)
    with torch.no_grad():
        stats = current_stats(copy.deepcopy(policy).to(PRECISION), tokens, full=False)
    outside = outside_region(stats.topk_kl, tokens.advantages.reshape(-1), ref_mask) & considered
    focus = torch.nonzero(outside)[:, 0]
    inputs = _regime_inputs(tokens, stats.topk_kl, outside, considered, ref_mask.k, resp)
    if keep_d is not None:
        keep_d.append(inputs)
    record = {"seed": seed, "tokens": int(resp.sum()), "zero_advantage": int((resp & ~considered).sum()),
              "outside": int(focus.numel()), "mu_tail": _quantiles(stats.mu_tail[resp]),
              "regime": _table(inputs), "contexts": {}}
    for ctx in contexts or cfg.contexts:
        model, tok, foc = audit_model(policy, tokens, ctx, focus)
        rec = study(cfg, model, tok, foc, k)
        rec["tokens_per_state"] = inputs[5] if ctx == "shared" else 1.0
        record["contexts"][ctx] = rec
    return record


def _quantiles(x: Tensor) -> dict:
    if x.numel() == 0:
        return {"count": 0}
    q = torch.quantile(x.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {"count": int(x.numel()), "mean": float(x.mean()),
            **{f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}}


def summarize_pairs(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> list[dict]:
    """Per pair: each rule's rates against both divergences (and the one it predicts), and the
    paired comparison (A − B) of unsafe-keep and shrink, each rule on its predicted divergence."""
    out = []
    for a, b in cfg.pairs:
        key = f"{a}|{b}"
        entries = [s["contexts"][contexts]["pairs"][key] for s in per_seed]
        dis = [e["disagreement"] for e in entries]
        pair = {"a": a, "b": b, "disagreement_per_seed": dis,
                "disagreement_mean": sum(dis) / max(1, len(dis))}
        for rule in (a, b):
            scored = predicted_divergence(get_mask_rule(rule))
            tables = {name: rate_summary([e[rule][name] for e in entries]) for name in MEASURED_DIVERGENCES}
            pair[rule] = {**tables[scored], "scored_against": scored, **tables}
        pair["unsafe_keep_diff"] = compare_paired(pair[a]["unsafe_keep_per_seed"], pair[b]["unsafe_keep_per_seed"],
                                                  n_boot=cfg.n_boot)
        pair["shrink_diff"] = compare_paired(pair[a]["shrink_per_seed"], pair[b]["shrink_per_seed"], n_boot=cfg.n_boot)
        scored = {rule: predicted_divergence(get_mask_rule(rule)) for rule in (a, b)}
        pair["pooled_unsafe_keep_diff"] = pooled_diff_ci([e[a][scored[a]] for e in entries],
                                                         [e[b][scored[b]] for e in entries], n_boot=cfg.n_boot)
        pair["unsafe_keep_diff_by_divergence"] = {
            name: compare_paired(pair[a][name]["unsafe_keep_per_seed"], pair[b][name]["unsafe_keep_per_seed"],
                                 n_boot=cfg.n_boot) for name in MEASURED_DIVERGENCES}
        out.append(pair)
    return out


def per_rule(pairs: list[dict]) -> dict:
    """Rule → its scored divergence and pooled unsafe-keep / shrink / flat under ``topk_kl`` and
    ``full_kl`` (the reference rule's figures from its pair with the main B rule)."""
    out = {}
    for pair in pairs:
        for rule in (pair["a"], pair["b"]):
            if rule in out:
                continue
            s = pair[rule]
            out[rule] = {"scored_against": s["scored_against"], "paired_with": pair["b"] if rule == pair["a"] else pair["a"],
                         **{name: {key: s[name][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "flat_pooled",
                                                                 "unsafe_keep_mean", "shrink_mean",
                                                                 "kept_disagreement_tokens")}
                            for name in MEASURED_DIVERGENCES}}
    return out


def _main_pair_summary(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> dict:
    main_cfg = replace(cfg, extra_rules=())
    (pair,) = summarize_pairs(main_cfg, per_seed, contexts)
    return pair


def _k_sweep(cfg: AuditConfig, progress=None) -> list[dict]:
    rows = []
    sweep_cfg = replace(cfg, extra_rules=())
    a, b = cfg.rules
    for k in cfg.k_sweep:
        per_seed = []
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.k_sweep_seeds):
            per_seed.append(audit_seed(sweep_cfg, seed, k=k, contexts=cfg.contexts[:1]))
            if progress:
                progress()
        summary = _main_pair_summary(cfg, per_seed, cfg.contexts[0])
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
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.stress_seeds):
        per_seed.append(_audit_seed_resumable(stress_cfg, seed, seed_dir and Path(seed_dir) / "stress", pooled))
        if progress:
            progress()
    pair = _main_pair_summary(cfg, per_seed, cfg.contexts[0])
    a, b = cfg.rules
    now, then = verdict(pair["unsafe_keep_diff"], a, b), verdict(main["unsafe_keep_diff"], a, b)
    return {"mismatch": cfg.stress_mismatch, "seeds": cfg.stress_seeds, "pair": pair,
            "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
            "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
            "regime": [s["regime"] for s in per_seed], "verdict": now, "verdict_changes": now != then}


def _seed_path(seed_dir, seed: int):
    return None if seed_dir is None else Path(seed_dir) / f"seed_{seed}.pt"


#: Fields that do not change a seed's record (so runs over different seed ranges share a store).
_RUN_ONLY_FIELDS = ("seeds", "first_seed", "n_boot", "stress_mismatch", "stress_seeds", "k_sweep", "k_sweep_seeds")


def seed_key(cfg: AuditConfig) -> str:
    """What a stored seed record must match: the configuration minus the run-only fields."""
    doc = {k: v for k, v in to_dict(cfg).items() if k not in _RUN_ONLY_FIELDS}
    return json.dumps(doc, sort_keys=True, default=str)


def _audit_seed_resumable(cfg: AuditConfig, seed: int, seed_dir, pooled: list) -> dict:
    """``audit_seed``, stored in ``seed_dir/seed_<s>.pt`` as soon as it is done and read back on a
    rerun with the same configuration (so a killed 61-seed audit loses only the seed in flight)."""
    path = _seed_path(seed_dir, seed)
    key = seed_key(cfg)
    if path is not None and path.exists():
        saved = torch.load(path, weights_only=False)
        if saved.get("config") == key:
            pooled.append(saved["inputs"])
            return saved["record"]
    inputs: list = []
    record = audit_seed(cfg, seed, keep_d=inputs)
    pooled.extend(inputs)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"config": key, "record": record, "inputs": inputs[0]}, tmp)
        tmp.replace(path)
    return record


def run_audit(cfg: AuditConfig, *, progress_bar: bool = False, seed_dir=None) -> dict:
    """The audit and its studies; returns the audit.json document (``seed_dir``: resume store)."""
    start = time.perf_counter()
    total = cfg.seeds + len(cfg.k_sweep) * cfg.k_sweep_seeds + (cfg.stress_seeds if cfg.stress_mismatch else 0)
    bar = None
    if progress_bar:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="audit", unit="seed")
    tick = bar.update if bar else None
    per_seed, pooled = [], []
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
        per_seed.append(_audit_seed_resumable(cfg, seed, seed_dir, pooled))
        if tick:
            tick()
    main_s = time.perf_counter() - start
    contexts = {}
    for ctx in cfg.contexts:
        pairs = summarize_pairs(cfg, per_seed, ctx)
        contexts[ctx] = {"pairs": pairs, "per_rule": per_rule(pairs),
                         "tokens_per_state_mean": sum(s["contexts"][ctx]["tokens_per_state"] for s in per_seed) / max(1, len(per_seed))}
    main = contexts[cfg.contexts[0]]
    regime = _pooled_regime(pooled)
    studies = {"k_sweep": _k_sweep(cfg, progress=tick) if cfg.k_sweep else [],
               "stress": _stress(cfg, main["pairs"][0], progress=tick, seed_dir=seed_dir) if cfg.stress_mismatch else None}
    if bar:
        bar.close()
    return {
        "config": to_dict(cfg),
        "rules": list(cfg.all_rules),
        "precision": "float64",
        "step": cfg.step_doc(),
        "tolerance": cfg.tolerance,
        "main_contexts": cfg.contexts[0],
        "pairs": main["pairs"],
        "per_rule": main["per_rule"],
        "contexts": contexts,
        "regime": regime,
        "per_seed": per_seed,
        "studies": studies,
        "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
        "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
        "zero_advantage_mean": sum(s["zero_advantage"] for s in per_seed) / max(1, len(per_seed)),
        "wall_s": time.perf_counter() - start,
        "main_audit_wall_s": main_s,
    }


def _pooled_regime(pooled: list[tuple]) -> dict | None:
    """The calibration table over every seed's tokens (tokens per state: the mean over seeds)."""
    if not pooled:
        return None
    cat = [torch.cat([p[i] for p in pooled]) for i in range(5)]
    return _table((*cat, sum(p[5] for p in pooled) / len(pooled)))
