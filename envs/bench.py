"""``pdm-lab bench`` rows for the toy testbed, each against a reference measured in the same run.

* bandit rollout (env-steps/s, one core) vs the same rollout sampled with ``torch.multinomial``;
  floor 100k steps/s.
* token-MDP rollout with the neural policy (tokens/s, one core) vs ``torch.multinomial``;
  floor 30k tokens/s.
* ``TokenMDPVectorEnv`` vs stepping the scalar Gymnasium env (``gymnasium.make``) in a Python
  loop, same random actions; target ≥ 50×.
* the 61-seed bandit audit (``pdm-lab audit`` defaults, both studies included) against its
  60-second budget.
"""
from __future__ import annotations

import time
from dataclasses import replace

import gymnasium as gym
import numpy as np
import torch

from pdm_lab.tools.benchtools import best_of

from . import ENV_ID
from pdm_lab.envs.audit.config import AuditConfig
from pdm_lab.envs.audit.study import run_audit
from pdm_lab.envs.problems.mismatch import Mismatch
from pdm_lab.envs.policies.models import make_policy
from pdm_lab.envs.problems.problem import ProblemConfig, make_problem
from pdm_lab.envs.problems.rollout import RolloutRNG
from pdm_lab.envs.problems.token_mdp_vector import TokenMDPVectorEnv
from pdm_lab.envs.problems import problem as problems_module


def _multinomial(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The naive sampler the reference rows use."""
    return torch.multinomial(torch.softmax(logits, dim=-1), 1)[:, 0]


def _multinomial_cdf(cdf: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    probs = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1])).float()
    return torch.multinomial(probs[rows], 1)[:, 0]


class _NaiveSampling:
    """Swap the problems' samplers for torch.multinomial while the reference runs."""

    def __enter__(self):
        self.saved = (problems_module.sample_from_logits, problems_module.sample_from_cdf)
        problems_module.sample_from_logits = _multinomial
        problems_module.sample_from_cdf = _multinomial_cdf

    def __exit__(self, *exc):
        problems_module.sample_from_logits, problems_module.sample_from_cdf = self.saved


def bench_bandit(repeat: int) -> dict:
    problem = make_problem(ProblemConfig(kind="bandit"))
    policy = make_policy("tabular", problem.encoder, problem.prior)
    rng = RolloutRNG(0)
    groups, size = problem.bandit.num_prompts, 16
    steps = groups * size

    def rollout():
        problem.collect(policy, Mismatch(), groups, size, rng)

    fast = best_of(rollout, repeat)
    with _NaiveSampling():
        naive = best_of(rollout, repeat)
    return {"name": f"bandit rollout, 1 core ({steps} samples × n={problem.vocab_size}, μ=π)",
            "value": steps / fast, "unit": "steps/s", "reference": steps / naive,
            "ratio": naive / fast, "target": "value ≥ 1e5 steps/s (reference: torch.multinomial)"}


def bench_token_mdp(repeat: int) -> dict:
    problem = make_problem(ProblemConfig(kind="token_mdp"))
    policy = make_policy("neural", problem.encoder, problem.prior)
    rng = RolloutRNG(0)
    groups, size = 64, 16
    tokens = {}

    def rollout():
        batch = problem.collect(policy, Mismatch(), groups, size, rng)
        tokens["n"] = int(batch.response_mask.sum())

    fast = best_of(rollout, repeat)
    n_fast = tokens["n"]
    with _NaiveSampling():
        naive = best_of(rollout, repeat)
    n_naive = tokens["n"]
    return {"name": f"token-MDP rollout, neural policy, 1 core ({groups * size} responses)",
            "value": n_fast / fast, "unit": "tok/s", "reference": n_naive / naive,
            "ratio": (n_fast / fast) / (n_naive / naive),
            "target": "value ≥ 3e4 tok/s (reference: torch.multinomial)"}


def bench_vector_env(num_envs: int = 8192, scalar_steps: int = 20_000, vector_steps: int = 200) -> dict:
    rng = np.random.default_rng(0)
    env = gym.make(ENV_ID)
    actions = rng.integers(0, env.action_space.n, size=scalar_steps)
    env.reset(seed=0)
    start = time.perf_counter()
    for a in actions:
        _, _, terminated, truncated, _ = env.step(int(a))
        if terminated or truncated:
            env.reset()
    scalar = scalar_steps / (time.perf_counter() - start)
    venv = TokenMDPVectorEnv(num_envs)
    batch_actions = rng.integers(0, venv.task.vocab_size, size=(vector_steps, num_envs))
    venv.reset(seed=0)
    start = time.perf_counter()
    for a in batch_actions:
        venv.step(a)
    vector = vector_steps * num_envs / (time.perf_counter() - start)
    return {"name": f"TokenMDPVectorEnv ({num_envs} envs) vs scalar gymnasium.make loop",
            "value": vector, "unit": "steps/s", "reference": scalar, "ratio": vector / scalar,
            "target": "ratio ≥ 50"}


def bench_audit(seeds: int = 61) -> dict:
    cfg = replace(AuditConfig(), seeds=seeds)
    start = time.perf_counter()
    run_audit(cfg)
    seconds = time.perf_counter() - start
    return {"name": f"bandit audit, {seeds} seeds × 1024 sequences, both studies (AuditConfig defaults)",
            "value": seconds, "unit": "s", "reference": 60.0, "ratio": seconds / 60.0,
            "target": "ratio ≤ 1 (60 s budget)"}


def run_bench(args) -> list[dict]:
    """All envs rows (one torch thread; the caller's thread count is restored)."""
    repeat = getattr(args, "repeat", 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [bench_bandit(repeat), bench_token_mdp(repeat), bench_vector_env()]
        rows.append(bench_audit(getattr(args, "audit_seeds", 61)))
    finally:
        torch.set_num_threads(threads)
    return rows
