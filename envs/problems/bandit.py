"""The softmax bandit: one-step prompts with a reward per token, sampled in GRPO groups."""
from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from pdm_lab.config import ConfigError, at_least, config_dataclass, non_negative, one_of, positive  # field checks

from pdm_lab.envs.problems.prior import zipf_logits

REWARD_KINDS = ("one_correct", "few_correct", "bernoulli", "gaussian")


@config_dataclass("problem.bandit")
class BanditConfig:
    """Arguments of ``SoftmaxBandit``."""

    vocab_size: Annotated[int, at_least(2)] = 1000
    """n, tokens per prompt."""
    num_prompts: Annotated[int, at_least(1)] = 64
    """P independent one-state bandits (prompts); 1 gives the classic single-state bandit."""
    reward: str = "one_correct"
    """one of REWARD_KINDS."""
    num_correct: Annotated[int, at_least(1)] = 3
    """correct tokens per prompt for ``few_correct``."""
    correct_rank: Annotated[int, at_least(1)] = 4
    """initial-policy rank of the (first) correct token: sets the starting success rate."""
    temperature: Annotated[float, positive] = 1.0
    """Zipf temperature τ of the initial logits (tail mass: larger τ, heavier tail)."""
    temperature_spread: Annotated[float, at_least(1.0)] = 2.0
    """per-prompt τ drawn log-uniformly in [τ/spread, τ·spread]: peaked and flat prompts side by
    side, as an LLM's positions (n = 1000, K = 20: tail mass from ~3% to ~88%); 1 = all equal."""
    reward_noise: Annotated[float, non_negative] = 1.0
    """σ of the Gaussian reward noise for ``gaussian``."""
    seed: int = 0
    """seed of the prompts' initial logits and reward tables."""

    def __post_init__(self) -> None:
        one_of("bandit.reward", self.reward, REWARD_KINDS)
        if self.temperature <= 0 or self.temperature_spread < 1:
            raise ConfigError("bandit: temperature must be > 0 and temperature_spread ≥ 1")
        if not 1 <= self.correct_rank * max(1, self.num_correct) <= self.vocab_size:
            raise ConfigError("bandit: correct_rank × num_correct must fit in the vocabulary")


class SoftmaxBandit:
    """P one-step prompts, n tokens each; the reward depends on the prompt and the token.

    ## Description

    Each prompt is a single state. The "pretrained" initial policy is Zipf-like
    (``prior_logits`` [P, n], see ``prior.zipf_logits``), each prompt at its own temperature
    (``temperature_spread``), so tail masses range from peaked to flat. A step of GRPO samples G tokens per
    prompt and scores them.

    ## Rewards (``BanditConfig.reward``)

    * ``one_correct``: 1 for the one correct token (the prior's ``correct_rank``-th favourite),
      else 0.
    * ``few_correct``: 1 for any of ``num_correct`` correct tokens (prior ranks r, 2r, 3r, …).
    * ``bernoulli``: token i pays Bernoulli(p_i), p_i ~ Beta(1, 4) per prompt and token.
    * ``gaussian``: token i pays N(m_i, σ²), m_i ~ N(0, 1).

    Attributes:
        prior_logits: [P, n] float32 initial logits.
        mean_reward: [P, n] float32 expected reward of each token.
    """

    def __init__(self, config: BanditConfig = BanditConfig()):
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        n, p = config.vocab_size, config.num_prompts
        u = torch.rand(p, generator=gen, dtype=torch.float64) * 2 - 1
        tau = config.temperature * config.temperature_spread ** u
        self.prior_logits = zipf_logits(p, n, temperature=tau, generator=gen)
        by_rank = torch.argsort(self.prior_logits, dim=1, descending=True, stable=True)
        self.mean_reward = torch.zeros(p, n)
        if config.reward == "one_correct":
            self.mean_reward.scatter_(1, by_rank[:, config.correct_rank - 1:config.correct_rank], 1.0)
        elif config.reward == "few_correct":
            ranks = torch.arange(1, config.num_correct + 1) * config.correct_rank - 1
            self.mean_reward.scatter_(1, by_rank[:, ranks], 1.0)
        elif config.reward == "bernoulli":
            u = torch.rand(p, n, generator=gen)
            self.mean_reward = 1.0 - (1.0 - u) ** 0.25  # inverse CDF of Beta(1, 4)
        else:
            self.mean_reward = torch.randn(p, n, generator=gen)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_prompts(self) -> int:
        return self.config.num_prompts

    def rewards(self, prompts: Tensor, tokens: Tensor, uniforms: Tensor) -> Tensor:
        """Sampled rewards.

        Args:
            prompts: [B] int64 prompt ids.
            tokens: [B] int64 chosen tokens.
            uniforms: [B] U[0, 1) draws (used by the stochastic reward kinds).

        Returns:
            [B] float32 rewards.
        """
        mean = self.mean_reward[prompts, tokens]
        kind = self.config.reward
        if kind == "bernoulli":
            return (uniforms < mean).float()
        if kind == "gaussian":
            # inverse-CDF normal draw from the same uniforms: keeps one noise stream per batch
            u = uniforms.clamp(1e-12, 1 - 1e-12)
            z = torch.special.ndtri(u.to(torch.float64)).float()
            return mean + self.config.reward_noise * z
        return mean

    def expected_reward(self, logits: Tensor) -> Tensor:
        """[P] exact expected reward Σ_i π_i m_i of a policy with logits [P, n]."""
        return (torch.softmax(logits.float(), dim=-1) * self.mean_reward).sum(dim=-1)
