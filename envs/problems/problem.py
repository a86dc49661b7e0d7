"""Problems: an environment plus its policy encoder, prior and batched rollout.

A problem is what the trainer, the audit and the sweep run on. Two kinds:

* ``bandit`` — ``SoftmaxBandit`` (T = 1);
* ``token_mdp`` — ``TokenMDP`` through its native vector env (T = L).

Both expose ``collect(policy, mismatch, num_groups, group_size, rng) -> RolloutBatch`` and
``evaluate(policy, seed) -> float`` (π's expected reward, sampled from π itself, no mismatch).
"""
from __future__ import annotations

import functools
import math
from dataclasses import field
from typing import Annotated

import torch
from torch import Tensor

from pdm_lab.config import ConfigError, at_least, config_dataclass, in_range, one_of, positive  # field checks

from pdm_lab.envs.problems.bandit import BanditConfig, SoftmaxBandit
from pdm_lab.envs.problems.encoders import AutomatonEncoder, BanditEncoder, context_hash
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.problems.prior import zipf_logits
from pdm_lab.envs.problems.rollout import RolloutBatch, RolloutRNG
from pdm_lab.envs.problems.sampling import UniformPool, sample_from_cdf, sample_from_logits
from pdm_lab.envs.problems.tasks import EOS, TASKS, make_task
from pdm_lab.envs.problems.token_mdp_vector import TokenMDPVectorEnv

PROBLEM_KINDS = ("bandit", "token_mdp")


@config_dataclass("problem.token_mdp")
class TokenMDPConfig:
    """Arguments of the token-MDP problem (task and the prior of the initial policy)."""

    task: str = "sum"
    """``sum`` or ``grammar`` (see ``tasks``)."""
    vocab_size: Annotated[int, at_least(2)] = 128
    """n."""
    max_len: Annotated[int, at_least(1)] = 6
    """L, the response budget (EOS included)."""
    modulus: Annotated[int, at_least(1)] = 8
    """``sum``: the modulus m (prompts are targets in [0, m)); below n."""
    grammar_states: Annotated[int, at_least(1)] = 4
    """``grammar``: DFA states Q (also the prompt count)."""
    grammar_classes: Annotated[int, at_least(1)] = 4
    """``grammar``: token classes C."""
    min_len: Annotated[int, at_least(0)] = 3
    """``grammar``: shortest accepted answer."""
    task_seed: int = 0
    """``grammar``: seed of the hidden DFA."""
    paraphrases: Annotated[int, at_least(1)] = 1
    """``sum``: prompt tokens per target (m·p prompts): distinct contexts for one instance."""
    temperature: Annotated[float, positive] = 1.0
    """Zipf temperature τ of the prior logits (tail mass; τ ≈ 0.3 puts ≥ 99% on the top 20)."""
    temperature_spread: Annotated[float, at_least(1.0)] = 1.0
    """per-row τ drawn log-uniformly in [τ/spread, τ·spread]: an entropy profile (1 = all equal)."""
    prior_rows: Annotated[int, at_least(0)] = 0
    """0: one prior row per automaton state; R > 0: the row is a hash of the whole context
    (prompt and prefix) mod R, so the pretrained distribution depends on the prefix as an LLM's."""
    eos_top_fraction: Annotated[float, in_range(0.0, 1.0)] = 1.0
    """fraction of prior rows whose favourite token is EOS (the rest rank it at random)."""
    logit_offset: Annotated[float, in_range(-1e4, 1e4)] = 0.0
    """LLM-like logit level: row r is shifted by offset·(0.5 + u_r); softmax-invariant, but a
    low-precision engine rounds at that magnitude (LLM logits are tens; beyond 10⁴ float32's
    log-softmax has no digit left)."""
    prior_seed: int = 0
    """seed of the prior's permutations."""

    def __post_init__(self) -> None:
        one_of("problem.token_mdp.task", self.task, TASKS)
        if self.task == "sum" and self.modulus >= self.vocab_size:
            raise ConfigError(f"problem.token_mdp.modulus: must be < vocab_size ({self.vocab_size}), "
                              f"got {self.modulus}")
        if self.task == "sum" and self.max_len < 2:
            raise ConfigError(f"problem.token_mdp.max_len: must be ≥ 2 for the sum task (an answer "
                              f"token and EOS), got {self.max_len}")

    def task_kwargs(self) -> dict:
        if self.task == "sum":
            return dict(vocab_size=self.vocab_size, modulus=self.modulus, max_len=self.max_len,
                        paraphrases=self.paraphrases)
        return dict(vocab_size=self.vocab_size, num_states=self.grammar_states,
                    num_classes=self.grammar_classes, max_len=self.max_len,
                    min_len=self.min_len, task_seed=self.task_seed)


@config_dataclass("problem")
class ProblemConfig:
    """Which problem, and its arguments."""

    kind: str = "bandit"
    """``bandit`` or ``token_mdp``."""
    bandit: BanditConfig = field(default_factory=BanditConfig)
    token_mdp: TokenMDPConfig = field(default_factory=TokenMDPConfig)

    def __post_init__(self) -> None:
        one_of("problem.kind", self.kind, PROBLEM_KINDS)

    @property
    def vocab_size(self) -> int:
        """n of the chosen problem (K ≤ n)."""
        return self.bandit.vocab_size if self.kind == "bandit" else self.token_mdp.vocab_size


def _groups(num_groups: int, group_size: int) -> Tensor:
    return torch.arange(num_groups).repeat_interleave(group_size)


class BanditProblem:
    """``SoftmaxBandit`` as a problem: observations are [B, 1] prompt ids, T = 1."""

    def __init__(self, config: BanditConfig):
        self.bandit = SoftmaxBandit(config)
        self.encoder = BanditEncoder(config.num_prompts)
        self.prior = self.bandit.prior_logits
        self.vocab_size = config.vocab_size
        self.horizon = 1

    def _prompts(self, num_groups: int, rng: RolloutRNG) -> Tensor:
        p = self.bandit.num_prompts
        if num_groups == p:
            return torch.arange(p)
        if num_groups < p:
            return torch.randperm(p, generator=rng.order)[:num_groups]
        return torch.randint(p, (num_groups,), generator=rng.order)

    @torch.no_grad()
    def collect(self, policy, mismatch: Mismatch, num_groups: int, group_size: int,
                rng: RolloutRNG) -> RolloutBatch:
        """Sample G tokens for each of ``num_groups`` prompts from μ (see module docstring)."""
        prompts = self._prompts(num_groups, rng)
        rows = _groups(num_groups, group_size)
        engine = mismatch.behaviour_copy(policy)
        u = rng.sampling.take(rows.numel())
        if mismatch.stochastic:  # each row gets its own noise: one μ per sampled token
            obs = prompts[rows][:, None]
            logits = mismatch.behaviour_logits(engine(obs), rng.noise, context_hash(obs))
            tokens = sample_from_logits(logits, u)
            mu_logp = torch.log_softmax(logits, dim=-1)
        else:  # one μ per prompt: sample every group member from the prompt's CDF
            obs = prompts[:, None]
            logits = mismatch.behaviour_logits(engine(obs), rng.noise, context_hash(obs))
            cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
            tokens = sample_from_cdf(cdf, rows, u)
            mu_logp = torch.log_softmax(logits, dim=-1)[rows]
        prompt_of_row = prompts[rows]
        rewards = self.bandit.rewards(prompt_of_row, tokens, rng.rewards.take(rows.numel()))
        b = rows.numel()
        return RolloutBatch(obs=prompt_of_row.view(b, 1, 1), tokens=tokens.view(b, 1),
                            response_mask=torch.ones(b, 1, dtype=torch.bool),
                            mu_logp=mu_logp.view(b, 1, -1), rewards=rewards, groups=rows)

    @torch.no_grad()
    def evaluate(self, policy, seed: int = 0, num_sequences: int | None = None) -> float:
        """Exact expected reward of π, averaged over prompts (``num_sequences``: unused, exact)."""
        obs = torch.arange(self.bandit.num_prompts)[:, None]
        return float(self.bandit.expected_reward(policy(obs)).mean())


class TokenMDPProblem:
    """``TokenMDP`` as a problem: one episode per sequence through ``TokenMDPVectorEnv``."""

    def __init__(self, config: TokenMDPConfig):
        self.config = config
        self.task = make_task(config.task, **config.task_kwargs())
        self.encoder = AutomatonEncoder(self.task, prior_rows=config.prior_rows)
        self.prior = _token_mdp_prior(config, config.prior_rows or self.encoder.num_states,
                                      self.task.vocab_size)
        self.vocab_size = self.task.vocab_size
        self.horizon = self.task.max_len
        self._envs: dict[int, TokenMDPVectorEnv] = {}

    def _env(self, num_envs: int) -> TokenMDPVectorEnv:
        if num_envs not in self._envs:
            self._envs[num_envs] = TokenMDPVectorEnv(num_envs, self.task)
        return self._envs[num_envs]

    def _run(self, policy, mismatch: Mismatch | None, prompts: Tensor, uniforms: UniformPool,
             noise: torch.Generator, env_seed: int) -> RolloutBatch:
        b, horizon, n = prompts.numel(), self.task.max_len, self.task.vocab_size
        env = self._env(b)
        obs_np, _ = env.reset(seed=env_seed, options={"prompts": prompts.numpy()})
        obs_buf = torch.empty(b, horizon, self.task.obs_len, dtype=torch.int64)
        tokens = torch.zeros(b, horizon, dtype=torch.int64)
        mask = torch.zeros(b, horizon, dtype=torch.bool)
        mu_logp = torch.full((b, horizon, n), -math.log(n))  # padding rows: a valid (uniform) μ
        rewards = torch.zeros(b)
        alive = torch.ones(b, dtype=torch.bool)
        engine = policy if mismatch is None else mismatch.behaviour_copy(policy)
        for t in range(horizon):
            obs = torch.from_numpy(obs_np)
            obs_buf[:, t] = obs
            logits = engine(obs)
            if mismatch is not None:
                logits = mismatch.behaviour_logits(logits, noise, context_hash(obs))
            token = sample_from_logits(logits, uniforms.take(b))
            obs_np, reward, terminated, truncated, _ = env.step(token.numpy())
            tokens[:, t] = torch.where(alive, token, 0)
            mask[:, t] = alive
            mu_logp[:, t] = torch.log_softmax(logits, dim=-1)
            rewards += torch.from_numpy(reward) * alive
            alive &= ~torch.from_numpy(terminated | truncated)
            if not alive.any():
                obs_buf[:, t + 1:] = obs_buf[:, t:t + 1]
                break
        return RolloutBatch(obs=obs_buf, tokens=tokens, response_mask=mask, mu_logp=mu_logp,
                            rewards=rewards, groups=torch.zeros(b, dtype=torch.int64))

    @torch.no_grad()
    def collect(self, policy, mismatch: Mismatch, num_groups: int, group_size: int,
                rng: RolloutRNG) -> RolloutBatch:
        """Sample G responses for each of ``num_groups`` prompts (drawn uniformly) from μ."""
        prompts = torch.randint(self.task.num_prompts, (num_groups,), generator=rng.order)
        rows = _groups(num_groups, group_size)
        batch = self._run(policy, mismatch, prompts[rows], rng.sampling, rng.noise, rng.seed)
        return RolloutBatch(obs=batch.obs, tokens=batch.tokens, response_mask=batch.response_mask,
                            mu_logp=batch.mu_logp, rewards=batch.rewards, groups=rows)

    @torch.no_grad()
    def evaluate(self, policy, seed: int = 0, num_sequences: int = 2048) -> float:
        """Success rate of π sampled on-policy over ``num_sequences`` prompts (fixed by seed)."""
        gen = torch.Generator().manual_seed(10_000 + seed)
        prompts = torch.randint(self.task.num_prompts, (num_sequences,), generator=gen)
        batch = self._run(policy, None, prompts, UniformPool(gen), gen, seed)
        return float(batch.rewards.mean())


@functools.lru_cache(maxsize=4)
def _token_mdp_prior(config: TokenMDPConfig, rows: int, n: int) -> Tensor:
    """[rows, n] Zipf prior: per-row τ, EOS the favourite in a fraction of rows, a logit level.

    Cached (a sweep builds the same problem for every run; the policies copy it)."""
    gen = torch.Generator().manual_seed(config.prior_seed)
    if config.temperature_spread == 1.0 and config.eos_top_fraction == 1.0 and config.logit_offset == 0.0:
        # the original prior, draw for draw (keeps earlier figures reproducible)
        return zipf_logits(rows, n, temperature=config.temperature, generator=gen, fixed_top=EOS)
    u = torch.rand(rows, generator=gen, dtype=torch.float64) * 2 - 1
    tau = config.temperature * config.temperature_spread ** u
    eos_rows = torch.rand(rows, generator=gen) < config.eos_top_fraction
    with_eos = zipf_logits(rows, n, temperature=tau, generator=gen, fixed_top=EOS)
    free = zipf_logits(rows, n, temperature=tau, generator=gen)
    prior = torch.where(eos_rows[:, None], with_eos, free)
    return prior + config.logit_offset * (0.5 + torch.rand(rows, 1, generator=gen))


def make_problem(config: ProblemConfig):
    """Build the problem named by ``config.kind``."""
    if config.kind == "bandit":
        return BanditProblem(config.bandit)
    return TokenMDPProblem(config.token_mdp)
