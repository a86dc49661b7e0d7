"""Observation → policy input: a tabular state index and a feature vector.

Both encoders are exact (the index is a sufficient statistic of the observation for the task),
so a tabular policy can represent the optimal policy and a neural one sees the same information.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .tasks import AutomatonTask


class BanditEncoder:
    """Bandit observations are [B, 1] prompt ids: index = prompt, features = one-hot(prompt)."""

    def __init__(self, num_prompts: int):
        self.num_states = num_prompts
        self.feature_dim = num_prompts

    def state_index(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B] int64."""
        return obs[:, 0]

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B, P] float32."""
        return F.one_hot(obs[:, 0], self.num_states).float()


class AutomatonEncoder:
    """Token-MDP observations [B, 1 + L] → (prompt c, automaton state q, position t).

    index = (c·Q + q)·L + t over P·Q·L states; features = [one-hot c | one-hot q | one-hot t]
    (P + Q + L floats). q is recomputed by running the task's transition table over the written
    slots (padding leaves q unchanged), so the encoder needs only the observation.
    """

    def __init__(self, task: AutomatonTask):
        self.task = task
        q, n = task.num_states, task.vocab_size
        transition = torch.as_tensor(task.transition, dtype=torch.int64)
        self._transition = torch.cat([transition, torch.arange(q)[:, None]], dim=1)  # [Q, n+1]
        self._start = torch.as_tensor(task.start, dtype=torch.int64)
        self.num_states = task.num_prompts * q * task.max_len
        self.feature_dim = task.num_prompts + q + task.max_len
        self._pad = n

    def _summary(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        prompt = obs[:, 0]
        q = self._start[prompt]
        for j in range(1, obs.shape[1]):
            q = self._transition[q, obs[:, j]]
        t = (obs[:, 1:] != self._pad).sum(dim=1).clamp(max=self.task.max_len - 1)
        return prompt, q, t

    def state_index(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B] int64 in [0, P·Q·L)."""
        prompt, q, t = self._summary(obs)
        return (prompt * self.task.num_states + q) * self.task.max_len + t

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B, P + Q + L] float32."""
        prompt, q, t = self._summary(obs)
        return torch.cat([F.one_hot(prompt, self.task.num_prompts), F.one_hot(q, self.task.num_states),
                          F.one_hot(t, self.task.max_len)], dim=1).float()
