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

