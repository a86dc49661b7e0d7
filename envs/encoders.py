"""Observation → policy input: a tabular state index and a feature vector.

Both encoders are exact (the index is a sufficient statistic of the observation for the task),
so a tabular policy can represent the optimal policy and a neural one sees the same information.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .tasks import AutomatonTask


_HASH_MOD = 2_147_483_647  # 2^31 − 1: every product below stays inside int64


def context_hash(obs: Tensor, salt: int = 0) -> Tensor:
    """[B, D] int64 observations → [B] int64 in [0, 2^31 − 1): equal rows, equal hashes.

    The context of a token is its whole observation (prompt and prefix), as an LLM's is."""
    h = torch.full((obs.shape[0],), salt % _HASH_MOD, dtype=torch.int64)
    for j in range(obs.shape[1]):
        h = (h * 1_000_003 + obs[:, j].long() + 1) % _HASH_MOD
    return (h * 48_271 + 11) % _HASH_MOD


class BanditEncoder:
    """Bandit observations are [B, 1] prompt ids: index = prompt, features = one-hot(prompt)."""

    def __init__(self, num_prompts: int):
        self.num_states = num_prompts
        self.feature_dim = num_prompts

    def state_index(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B] int64."""
        return obs[:, 0]

    prior_index = state_index

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B, P] float32."""
        return F.one_hot(obs[:, 0], self.num_states).float()


class AutomatonEncoder:
    """Token-MDP observations [B, 1 + L] → (prompt c, automaton state q, position t).

    index = (c·Q + q)·L + t over C·Q·L states, c the prompt's class (paraphrases share it);
    features = [one-hot c | one-hot q | one-hot t] (C + Q + L floats). q is recomputed by running
    the task's transition table over the written slots (padding leaves q unchanged), so the
    encoder needs only the observation. ``prior_index``: the automaton state, or with
    ``prior_rows`` R > 0 a hash of the whole context mod R (an LLM's prior sees the prefix).
    """

    def __init__(self, task: AutomatonTask, prior_rows: int = 0):
        self.task = task
        q, n = task.num_states, task.vocab_size
        transition = torch.as_tensor(task.transition, dtype=torch.int64)
        self._transition = torch.cat([transition, torch.arange(q)[:, None]], dim=1)  # [Q, n+1]
        self._start = torch.as_tensor(task.start, dtype=torch.int64)
        self._class = torch.as_tensor(task.classes, dtype=torch.int64)
        self.num_classes = task.num_classes
        self.num_states = self.num_classes * q * task.max_len
        self.feature_dim = self.num_classes + q + task.max_len
        self.prior_rows = prior_rows
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
        return (self._class[prompt] * self.task.num_states + q) * self.task.max_len + t

    def prior_index(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B] int64 row of the prior."""
        if self.prior_rows:
            return context_hash(obs, salt=1) % self.prior_rows
        return self.state_index(obs)

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B, C + Q + L] float32."""
        prompt, q, t = self._summary(obs)
        return torch.cat([F.one_hot(self._class[prompt], self.num_classes), F.one_hot(q, self.task.num_states),
                          F.one_hot(t, self.task.max_len)], dim=1).float()
