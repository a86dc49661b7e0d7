"""Rollout batches: what the behaviour policy μ generated, as the trainer sees it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdm_lab.envs.problems.sampling import UniformPool


@dataclass(frozen=True)
class RolloutBatch:
    """B sequences of up to T tokens sampled from μ, grouped GRPO-style.

    Attributes:
        obs: [B, T, D] int64 observation before each token (what π conditions on).
        tokens: [B, T] int64 sampled tokens (0 at padding; see ``response_mask``).
        response_mask: [B, T] bool, True on real response tokens.
        mu_logp: [B, T, n] float32 μ's full log-probabilities (toys expose the whole vocabulary).
        rewards: [B] float32 sequence rewards.
        groups: [B] int64 group id (sequences of one prompt share a group).
    """

    obs: Tensor
    tokens: Tensor
    response_mask: Tensor
    mu_logp: Tensor
    rewards: Tensor
    groups: Tensor

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def horizon(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: Tensor) -> "RolloutBatch":
        """The sub-batch of sequences ``rows`` ([b] int64), e.g. one mini-batch."""
        return RolloutBatch(obs=self.obs[rows], tokens=self.tokens[rows],
                            response_mask=self.response_mask[rows], mu_logp=self.mu_logp[rows],
                            rewards=self.rewards[rows], groups=self.groups[rows])


class RolloutRNG:
    """The random streams of one run: sampling uniforms, mismatch noise, prompts, shuffles.

    Seeded once; two runs with the same seed draw the same numbers (determinism test).
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.sampling = UniformPool(torch.Generator().manual_seed(seed * 4 + 1))
        self.rewards = UniformPool(torch.Generator().manual_seed(seed * 4 + 2))
        self.noise = torch.Generator().manual_seed(seed * 4 + 3)
        self.order = torch.Generator().manual_seed(seed * 4 + 4)
