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

Audit points (``audit_at``): the policy is trained with plain GRPO under the audited mismatch
(``audit_points``) and audited at each listed training step, every point a fresh batch; the main
study is at the last point, over all seeds, and the earlier points (the trajectory) over the
first ``trajectory_seeds`` seeds. The audit's tensors hold response tokens only (no padding rows).

Per seed and rule the record also holds the interference-only rate (dropped outside tokens whose
D grew anyway) and, for SGD, where each grown kept disagreement token's first-order ΔD came from
(``audit_flips``). Verdicts need data (``pdm_lab.audit.data_sufficiency``); a power line gives
the seeds needed for the paper's 2.7-point difference at the measured per-seed spread; the
one-token-per-state study is the audit's self-test (``pdm_lab.audit.self_test``).

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
from pdm_lab.audit import (MEASURED_DIVERGENCES, PAPER_FIGURES, compare_paired, data_sufficiency, delta_rates,
                           flip_summary, gated_verdict, pooled_diff_ci, predicted_divergence, rate_summary,
                           regime_table, seeds_for_power, self_test, verdict)
from pdm_lab.config import to_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.config import ConfigError, at_least, config_dataclass, in_range, non_negative, one_of, positive  # field checks
from pdm_lab.masks import get_mask_rule

from pdm_lab.masks import outside_region
from pdm_lab.support import support_from_full

from pdm_lab.envs.audit.flips import decompose, distinct_rows, group_ids
from pdm_lab.envs.audit.points import TrainedPolicies, plain_config, plain_step
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import POLICY_KINDS
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.train.grpo import OPTIMIZERS, make_optimizer
from pdm_lab.envs.train.update import TokenBatch, current_stats, masked_loss

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
    group_size: Annotated[int, at_least(2)] = 16
    """G, sequences per prompt; ≥ 2, since advantages are normalised within the group."""
    delta: Annotated[float, non_negative] = 0.15
    """δ (paper: 0.15)."""
    k: Annotated[int, at_least(1)] = 20
    """K (paper: 20), at most the problem's vocabulary n."""
    convention: str = "union"
    """support convention."""
    mismatch: str = "noise:1"
    """μ's mismatch (see ``mismatch``); the presets use a realistic setting (SPEC §6b)."""
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
    context_features: Annotated[int, at_least(0)] = 0
    """neural policy: hashed context features that overlap across contexts (0: none)."""
    init_scale: Annotated[float, non_negative] = 0.01
    """neural policy: std of the output layer's initial weights."""
    flip_tokens: Annotated[int, at_least(0)] = 64
    """per seed and rule, at most this many grown kept disagreement tokens are decomposed by cause
    (SGD only; 0 to skip)."""
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
            raise ConfigError(f"sequences ({self.sequences}) must be a multiple of group_size ({self.group_size})")
        if not self.contexts or any(c not in CONTEXTS for c in self.contexts):
            raise ConfigError(f"contexts: each of {', '.join(CONTEXTS)}, got {list(self.contexts)}")
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        if not self.audit_at or any(s < 0 for s in self.audit_at) or list(self.audit_at) != sorted(set(self.audit_at)):
            raise ConfigError(f"audit_at: training steps ≥ 0 in increasing order, got {list(self.audit_at)}")
        one_of("policy", self.policy, POLICY_KINDS)
        vocab = self.problem.vocab_size
        for name, ks in (("k", (self.k,)), ("k_sweep", self.k_sweep)):
            if ks and max(ks) > vocab:
                raise ConfigError(f"{name}: K = {max(ks)} exceeds the vocabulary (problem.{self.problem.kind}"
                                  f".vocab_size = {vocab})")

    @property
    def main_step(self) -> int:
        """The training step of the main study (the last audit point)."""
        return self.audit_at[-1]

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


def audit_batch(cfg: AuditConfig, seed: int, mismatch: str | None = None, *, step: int | None = None,
                policies: TrainedPolicies | None = None):
    """Problem, policy and one fresh batch from μ for `seed` (float32, as a rollout produces).

    The policy is run ``seed mod train_runs`` after `step` plain GRPO steps under the audited
    mismatch (default: the main study's step; ``policies`` shares the trained runs across seeds).
    With ``stale:s`` in the mismatch, the rollout round has s batches: the policy first takes
    s − 1 plain GRPO steps (rule ``none``, Adam) on the other s − 1, then the audit runs on the
    last one — the off-policy mini-batch of DPPO-style training.
    """
    problem = policies.problem if policies is not None else make_problem(cfg.problem)
    policies = policies or TrainedPolicies(cfg, problem)
    policy = policies.at(seed % cfg.train_runs, cfg.main_step if step is None else step)
    mismatch = Mismatch.parse(cfg.mismatch if mismatch is None else mismatch)
    rng = RolloutRNG(seed)
    groups = cfg.sequences // cfg.group_size
    earlier = [problem.collect(policy, mismatch, groups, cfg.group_size, rng)
               for _ in range(mismatch.stale_steps - 1)]
    batch = problem.collect(policy, mismatch, groups, cfg.group_size, rng)
    if earlier:
        plain = plain_config(cfg)
        opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
        for old in earlier:
            plain_step(plain, policy, opt, old)
    return problem, policy, batch, group_advantages(batch.rewards, batch.groups)


def float64_tokens(batch, advantages: Tensor, mask: MaskConfig) -> TokenBatch:
    """The batch for the measurement, compact: one row per response token (no padding rows), as
    an [M, 1] layout, with μ cast to float64 (and renormalised there: a float32 μ's mass is 1
    only to float32 rounding) before its support is built. Every audited rule is per token and
    the audited loss is the token sum, so the layout changes no figure."""
    b, t, n = batch.mu_logp.shape
    rows = torch.nonzero(batch.response_mask.reshape(-1))[:, 0]
    mu = torch.log_softmax(batch.mu_logp.reshape(b * t, n)[rows].to(PRECISION), dim=-1)
    support = support_from_full(mu, batch.tokens.reshape(-1)[rows], k=mask.k, convention=mask.convention)
    adv = advantages.to(PRECISION)[rows // t]
    m = rows.numel()
    return TokenBatch(obs=batch.obs.reshape(b * t, -1)[rows], support=support, mu_full=mu,
                      advantages=adv.view(m, 1), response_mask=torch.ones(m, 1, dtype=torch.bool))


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
    step: tuple[Tensor, ...] = ()
    """Δθ per parameter at step size η (θ_η − θ), for the flip decomposition."""


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
        step, deltas = cache[key]
        return {s: RuleStep(keep=keep, delta=d, step=step) for s, d in deltas.items()}
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
    step = tuple(p1 - p0 for p0, p1 in zip(start, stepped))
    if cache is not None:
        cache[key] = (step, deltas)
    return {s: RuleStep(keep=keep, delta=d, step=step) for s, d in deltas.items()}


def tokens_per_state(tokens: TokenBatch, resp: Tensor) -> float:
    """Response tokens per distinct observation (context) among the `resp` rows."""
    obs = tokens.obs[resp]
    return float(obs.shape[0]) / max(1, distinct_rows(obs))


def _regime_inputs(tokens: TokenBatch, d: Tensor, outside: Tensor, considered: Tensor, k: int,
                   resp: Tensor) -> tuple:
    """(D, outside, Â ≠ 0, μ's top-K mass, μ's entropy) over response tokens, tokens per state."""
    mu = tokens.mu_full[resp]
    topk_mass = torch.topk(mu, min(k, mu.shape[1]), dim=1).values.exp().sum(dim=1)
    entropy = -(mu.exp() * mu).nan_to_num(0.0).sum(dim=1)  # 0·log 0 = 0
    return (d[resp], outside[resp], considered[resp], topk_mass, entropy,
            tokens_per_state(tokens, resp))


def _table(inputs: tuple) -> dict:
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
          k: int | None = None, *, flips: bool = False) -> dict:
    """Every rule's step on one float64 model; per pair, the disagreement and each rule's rates.

    ``focus``: the rows outside the region with Â ≠ 0 (the only tokens the pairs score). Per rule
    also the interference-only rate (its dropped outside tokens whose D grew anyway) and, with
    `flips` (SGD), the cause split of its grown kept disagreement tokens in the main pair."""
    before = measure(model, tokens.rows(focus))
    cache: dict = {}
    steps = {rule: rule_step(model, tokens, cfg.mask(rule, k), cfg, focus, before, cache)
             for rule in cfg.all_rules}
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
                                                  grew, scored, measure, everything=list(steps[rule].step))
        record["pairs"][f"{a}|{b}"] = entry
    return record


def audit_seed(cfg: AuditConfig, seed: int, *, k: int | None = None, mismatch: str | None = None,
               contexts: tuple[str, ...] | None = None, keep_d: list | None = None, step: int | None = None,
               policies: TrainedPolicies | None = None) -> dict:
    """The audit on one seed's batch at training step `step` (default: the main study's), for
    each contexts setting; appends the regime inputs to `keep_d` if given."""
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
    inputs = _regime_inputs(tokens, stats.topk_kl, outside, considered, ref_mask.k, resp)
    if keep_d is not None:
        keep_d.append(inputs)
    record = {"seed": seed, "step": step, "train_run": seed % cfg.train_runs, "tokens": int(resp.sum()),
              "zero_advantage": int((resp & ~considered).sum()),
              "outside": int(focus.numel()), "mu_tail": _quantiles(stats.mu_tail[resp]),
              "regime": _table(inputs), "contexts": {}}
    for i, ctx in enumerate(contexts or cfg.contexts):
        model, tok, foc = audit_model(policy, tokens, ctx, focus)
        rec = study(cfg, model, tok, foc, k, flips=ctx == "shared" and i == 0)
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
        pair["audit_step"] = per_seed[0].get("step", cfg.main_step) if per_seed else cfg.main_step
        pair["data"] = data_sufficiency(pair[a]["count_per_seed"], pair[b]["count_per_seed"])
        pair["verdict"] = gated_verdict(pair["unsafe_keep_diff"], a, b, pair["data"])
        pair["pooled_verdict"] = gated_verdict(pair["pooled_unsafe_keep_diff"], a, b, pair["data"])
        pair["power"] = seeds_for_power([x - y for x, y in zip(pair[a]["unsafe_keep_per_seed"],
                                                                pair[b]["unsafe_keep_per_seed"])])
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
    policies = TrainedPolicies(sweep_cfg, make_problem(cfg.problem))
    a, b = cfg.rules
    for k in cfg.k_sweep:
        per_seed = []
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.k_sweep_seeds):
            per_seed.append(audit_seed(sweep_cfg, seed, k=k, contexts=cfg.contexts[:1], policies=policies))
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
    store = seed_dir and Path(seed_dir) / "stress"
    policies = TrainedPolicies(stress_cfg, make_problem(cfg.problem), store and store / "policies")
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.stress_seeds):
        per_seed.append(_audit_seed_resumable(stress_cfg, seed, store, pooled, policies=policies))
        if progress:
            progress()
    pair = _main_pair_summary(cfg, per_seed, cfg.contexts[0])
    a, b = cfg.rules
    now, then = pair["verdict"], main["verdict"]
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


class SeedRecordError(ValueError):
    """A stored seed record that is not one pdm_lab wrote (refused, never executed)."""


def _load_seed_record(path: Path) -> dict:
    """A seed record written by ``_audit_seed_resumable``: tensors, numbers, strings and
    containers only (``weights_only=True``), so a crafted pickle runs no code; it is refused."""
    import pickle

    try:
        saved = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError) as err:
        raise SeedRecordError(f"{path}: not a pdm_lab seed record, refused ({type(err).__name__}); "
                              "delete it to recompute that seed") from None
    if not isinstance(saved, dict) or not {"config", "record", "inputs"} <= set(saved):
        raise SeedRecordError(f"{path}: not a pdm_lab seed record (keys config, record, inputs), refused")
    return saved


def _audit_seed_resumable(cfg: AuditConfig, seed: int, seed_dir, pooled: list | None, *,
                          step: int | None = None, policies: TrainedPolicies | None = None,
                          contexts: tuple[str, ...] | None = None) -> dict:
    """``audit_seed``, stored in ``seed_dir/seed_<s>[_at_<step>].pt`` as soon as it is done and
    read back on a rerun with the same configuration (so a killed 61-seed audit loses only the
    seed in flight). ``pooled``: appended the regime inputs, if given."""
    step = cfg.main_step if step is None else step
    path = _seed_path(seed_dir, seed)
    if path is not None and step != cfg.main_step:
        path = path.with_name(f"seed_{seed}_at_{step}.pt")
    key = seed_key(cfg) + json.dumps({"step": step, "contexts": list(contexts or cfg.contexts)})
    if path is not None and path.exists():
        saved = _load_seed_record(path)
        if saved["config"] == key:
            if pooled is not None:
                pooled.append(tuple(saved["inputs"]))
            return saved["record"]
    inputs: list = []
    record = audit_seed(cfg, seed, keep_d=inputs, step=step, policies=policies, contexts=contexts)
    if pooled is not None:
        pooled.extend(inputs)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"config": key, "record": record, "inputs": inputs[0]}, tmp)
        tmp.replace(path)
    return record


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far (GB; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _trajectory(cfg: AuditConfig, earlier: dict[int, list[dict]], main: dict) -> list[dict]:
    """The main pair at every audit point: the earlier points over the seeds audited there
    (`earlier`: step → per-seed records), the main point from the main study."""
    points = [_point(cfg, per_seed, _main_pair_summary(cfg, per_seed, cfg.contexts[0]))
              for step, per_seed in earlier.items() if per_seed]
    return points + [_point(cfg, main["per_seed"], main["pair"])]


def _point(cfg: AuditConfig, per_seed: list[dict], pair: dict) -> dict:
    a, b = pair["a"], pair["b"]
    return {"step": pair["audit_step"], "seeds": len(per_seed),
            "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
            "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
            "disagreement_mean": pair["disagreement_mean"], "verdict": pair["verdict"], "data": pair["data"],
            "unsafe_keep_diff": pair["unsafe_keep_diff"], "pooled_unsafe_keep_diff": pair["pooled_unsafe_keep_diff"],
            **{rule: {key: pair[rule][key] for key in ("unsafe_keep_pooled", "shrink_pooled", "unsafe_keep_mean",
                                                       "shrink_mean", "kept_disagreement_tokens")}
               for rule in (a, b)}}


def flip_decomposition(cfg: AuditConfig, per_seed: list[dict], contexts: str) -> dict:
    """Per rule of the main pair: the cause split of its grown kept disagreement tokens (pooled
    over seeds) and its interference-only rate (dropped outside tokens that grew anyway)."""
    from pdm_lab.audit import pool

    out = {}
    for rule in cfg.all_rules:
        blocks = [s["contexts"][contexts] for s in per_seed]
        terms = [t for blk in blocks for t in blk.get("flips", {}).get(rule, [])]
        entry = {"interference_only": pool(blk["interference"][rule] for blk in blocks if rule in blk.get("interference", {}))}
        if rule in cfg.rules:
            entry["causes"] = flip_summary(terms)
            entry["first_order_check"] = _first_order_check(terms)
        out[rule] = entry
    return out


def _first_order_check(terms: list[dict]) -> dict:
    """How well the cause terms add up to the first-order total (max relative gap)."""
    gaps = [abs(sum(t[c] for c in ("own", "context", "state", "rest")) - t["total"]) / max(abs(t["total"]), 1e-300)
            for t in terms]
    return {"tokens": len(terms), "max_relative_gap": max(gaps) if gaps else float("nan")}


def paper_side_by_side(pair: dict) -> dict:
    """The main pair next to the paper's figures (SPEC §6): per-seed mean unsafe-keep and shrink
    of each rule, seeds where B is lower, the paired CI and the sign test."""
    a, b = pair["a"], pair["b"]
    d, sh = pair["unsafe_keep_diff"], pair["shrink_diff"]
    return {"paper": PAPER_FIGURES, "a": a, "b": b,
            "unsafe_keep_mean": {a: pair[a]["unsafe_keep_mean"], b: pair[b]["unsafe_keep_mean"]},
            "shrink_mean": {a: pair[a]["shrink_mean"], b: pair[b]["shrink_mean"]},
            "unsafe_keep_pooled": {a: pair[a]["unsafe_keep_pooled"], b: pair[b]["unsafe_keep_pooled"]},
            "shrink_pooled": {a: pair[a]["shrink_pooled"], b: pair[b]["shrink_pooled"]},
            "b_lower_seeds": d["b_lower_seeds"], "a_lower_seeds": d["a_lower_seeds"], "ties": d["ties"],
            "seeds_used": d["seeds_used"], "unsafe_keep_diff": d, "shrink_diff": sh,
            "verdict": pair["verdict"], "power": pair["power"]}


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
        per_seed.append(_audit_seed_resumable(cfg, seed, seed_dir, pooled, policies=policies))
        if tick:
            tick()
        if i < cfg.trajectory_seeds:  # the seed's earlier points at once: a killed run keeps them
            for step in earlier:
                earlier[step].append(_audit_seed_resumable(traj_cfg, seed, seed_dir, None, step=step,
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
        main["coupling"] = _mean_coupling([s["contexts"]["shared"]["coupling"] for s in per_seed])
    main["flips"] = flip_decomposition(cfg, per_seed, main_ctx)
    regime = _pooled_regime(pooled)
    trajectory = _trajectory(cfg, earlier, {"per_seed": per_seed, "pair": main["pairs"][0]})
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
        "paper_side_by_side": paper_side_by_side(main["pairs"][0]),
        "trajectory": trajectory,
        "regime": regime,
        "per_seed": per_seed,
        "studies": studies,
        "outside_mean": sum(s["outside"] for s in per_seed) / max(1, len(per_seed)),
        "tokens_mean": sum(s["tokens"] for s in per_seed) / max(1, len(per_seed)),
        "zero_advantage_mean": sum(s["zero_advantage"] for s in per_seed) / max(1, len(per_seed)),
        "wall_s": wall,
        "main_audit_wall_s": main_s,
        "peak_rss_gb": _peak_rss_gb(),
    }


def _mean_coupling(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))] if rows else []
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}


def _pooled_regime(pooled: list[tuple]) -> dict | None:
    """The calibration table over every seed's tokens (tokens per state: the mean over seeds)."""
    if not pooled:
        return None
    cat = [torch.cat([p[i] for p in pooled]) for i in range(5)]
    return _table((*cat, sum(p[5] for p in pooled) / len(pooled)))
