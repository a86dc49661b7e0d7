"""The audited batch (SPEC §6): one fresh batch from μ at an audit point, cast to float64, and the
float64 model the rules step (``shared``: the policy; ``distinct``: one state per token)."""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor, nn

from pdm_lab.lab.advantages import group_advantages
from pdm_lab.fast.compiled import one_thread
from pdm_lab.mask_config import MaskConfig
from pdm_lab.support import support_from_full

from pdm_lab.envs.audit.config import PRECISION, AuditConfig
from pdm_lab.envs.audit.points import TrainedPolicies, plain_config, plain_step
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.problems.problem import make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.train.grpo import make_optimizer
from pdm_lab.envs.train.update import TokenBatch


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

    With ``mini_batches`` M > 1 (SPEC §6b/§6c, ``stale_mini_batch``): the one batch drawn is split
    into M mini-batches of whole groups, the policy takes j real plain GRPO steps on mini-batches
    0 … j − 1 of it, and the returned batch and advantages are mini-batch j's (j =
    ``cfg.audited_mini_batch``). M = 1 returns the whole batch, as before.
    """
    problem = policies.problem if policies is not None else make_problem(cfg.problem)
    policies = policies or TrainedPolicies(cfg, problem)
    # toy-sized ops, one per generated slot: on one thread (a fork/join per op waits for a busy core;
    # measured on the quick preset at load ~4: rollout 1.7 s on one thread, 122 s on two)
    with one_thread(torch.device("cpu")):
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
        advantages = group_advantages(batch.rewards, batch.groups)
        if cfg.mini_batches > 1:
            batch, advantages = stale_mini_batch(cfg, policy, batch, advantages)
    return problem, policy, batch, advantages


def mini_batch_rows(sequences: int, mini_batches: int) -> list[Tensor]:
    """The rows of each of M mini-batches: the scaling loop's own split (``pdm_lab.lab.minibatches.split``: M
    contiguous equal chunks; a batch's groups are contiguous, so with M dividing the groups each
    chunk holds whole groups, as ``envs.train.grpo`` needs for its advantages)."""
    from pdm_lab.lab.minibatches import split  # the loop's own split

    return [torch.tensor(rows, dtype=torch.int64) for rows in split(sequences, mini_batches)]


def _optimizer_steps(opt) -> int:
    """Steps the optimiser has taken, from its own state (Adam/AdamW count per parameter)."""
    steps = [int(state["step"]) for state in opt.state.values() if "step" in state]
    return max(steps, default=0)


def stale_mini_batch(cfg: AuditConfig, policy: nn.Module, batch, advantages: Tensor):
    """Mini-batch j of `batch` and its advantages, after `policy` took j optimiser steps on
    mini-batches 0 … j − 1 of the same batch (in place; SPEC §6b's staleness, as the loop meets it).

    The steps are plain GRPO (rule ``none``, ``points.plain_step``: the training loss, lr
    ``train_lr``) with the training optimiser: with ``optimizer = adamw`` the AdamW the trained
    point carries (``policy.trained_optimizer_state``, the run's momentum and preconditioner at the
    audit point), whose state after the j steps then replaces ``trained_optimizer_state`` so the
    audited step carries it, as the loop's audit at j does; otherwise (sgd/adam audits, trained
    with Adam whose state a point does not keep) a fresh Adam, exactly as the ``stale:s`` path.
    Records ``policy.audit_mini_batch``: j, M and the optimiser steps actually taken (read from the
    optimiser's own step count)."""
    j, m = cfg.audited_mini_batch, cfg.mini_batches
    rows = mini_batch_rows(batch.num_sequences, m)
    groups = [set(batch.groups[r].tolist()) for r in rows]
    if any(a & b for i, a in enumerate(groups) for b in groups[i + 1:]):  # never: groups are contiguous
        raise ValueError("mini-batches split a group: advantages would differ from the loop's")
    plain = plain_config(cfg)
    opt = make_optimizer(plain.optimizer, policy.parameters(), plain.lr)
    memory = getattr(policy, "trained_optimizer_state", None)
    carried = isinstance(opt, torch.optim.AdamW) and memory is not None
    if carried:
        for p, state in zip(policy.parameters(), memory):
            if state:
                opt.state[p] = {k: v.detach().clone() for k, v in state.items()}
    start = _optimizer_steps(opt)
    for i in range(j):
        plain_step(plain, policy, opt, batch.select(rows[i]))
    if carried:  # the state the loop's audit at j carries (points._save_point's layout)
        policy.trained_optimizer_state = [{k: v.detach().clone() for k, v in opt.state[p].items()}
                                          if p in opt.state else {} for p in policy.parameters()]
    origin = "the trained point's state" if carried else "fresh"
    policy.audit_mini_batch = {"mini_batch": j, "mini_batches": m, "optimizer_steps": _optimizer_steps(opt) - start,
                               "optimizer": f"{plain.optimizer} ({origin})"}
    return batch.select(rows[j]), advantages[rows[j]]


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

