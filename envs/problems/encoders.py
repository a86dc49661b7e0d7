"""Observation → policy input: a tabular state index and a feature vector.

Both encoders are exact (the index is a sufficient statistic of the observation for the task),
so a tabular policy can represent the optimal policy and a neural one sees the same information.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pdm_lab.envs.problems.tasks import AutomatonTask


_HASH_MOD = 2_147_483_647  # 2^31 − 1: every product below stays inside int64
_HASH_BASE = 1_000_003
_POWERS = torch.ones(1, dtype=torch.int64)
_SCAN_MEMORY = 1 << 22  # int64 elements of the last observation batch an automaton encoder keeps (32 MB)


def context_hash(obs: Tensor, salt: int = 0) -> Tensor:
    """[B, D] int64 observations → [B] int64 in [0, 2^31 − 1): equal rows, equal hashes.

    The context of a token is its whole observation (prompt and prefix), as an LLM's is."""
    width = obs.shape[1]
    digits = obs.long() + 1
    if width * (_HASH_MOD - 1) * (int(digits.max()) if digits.numel() else 0) < 2 ** 62:
        # the same polynomial in one pass: h = salt·B^D + Σ_j (x_j + 1)·B^(D−1−j) mod M
        powers = _hash_powers(width + 1)
        h = (digits * powers[:width].flip(0)).sum(dim=1) + (salt % _HASH_MOD) * int(powers[width])
        h = h % _HASH_MOD
    else:  # large ids: the column loop, which never overflows
        h = torch.full((obs.shape[0],), salt % _HASH_MOD, dtype=torch.int64)
        for j in range(width):
            h = (h * _HASH_BASE + digits[:, j]) % _HASH_MOD
    return (h * 48_271 + 11) % _HASH_MOD


def _hash_powers(count: int) -> Tensor:
    """[count] int64 B^i mod M for i < count."""
    if _POWERS.numel() < count:
        out = [1]
        for _ in range(count - 1):
            out.append(out[-1] * _HASH_BASE % _HASH_MOD)
        _POWERS.resize_(count).copy_(torch.tensor(out, dtype=torch.int64))
    return _POWERS[:count]


def multi_hot(index: Tensor, width: int) -> Tensor:
    """[B, A] int64 active features → [B, width] float32 with 1 at each (a repeat counts once)."""
    out = torch.zeros(index.shape[0], width)
    return out.scatter_(1, index, 1.0)


def ngram_index(obs: Tensor, width: int, pad: int) -> Tensor:
    """[B, 1 + L] int64 token-MDP observations → [B, 3] int64 bins of the hashed context features.

    Three hashed features per context, each one bin of ``width``: the prompt token, the last
    written token, and the last two. Contexts that share a last token (or bigram, or prompt) share
    a feature, so one input row of the network serves many contexts, as an LLM's embeddings and
    attention features do; a one-hot of the full context would share nothing. ``pad``: the
    padding id of empty response slots. Two of a row's bins may coincide (a hash collision).
    """
    written = (obs[:, 1:] != pad).sum(dim=1)
    rows = torch.arange(obs.shape[0])
    last = torch.where(written > 0, obs[rows, written.clamp(min=1)], pad)
    prev = torch.where(written > 1, obs[rows, (written - 1).clamp(min=1)], pad)
    keys = (obs[:, :1], last[:, None], torch.stack([last, prev], dim=1))
    return torch.stack([context_hash(key, salt=101 + salt) % width for salt, key in enumerate(keys)], dim=1)


def ngram_features(obs: Tensor, width: int, pad: int) -> Tensor:
    """[B, 1 + L] int64 → [B, width] float32 multi-hot of ``ngram_index``'s bins."""
    return multi_hot(ngram_index(obs, width, pad), width)


class BanditEncoder:
    """Bandit observations are [B, 1] prompt ids: index = prompt, features = one-hot(prompt)."""

    def __init__(self, num_prompts: int):
        self.num_states = num_prompts
        self.feature_dim = num_prompts

    def state_index(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B] int64."""
        return obs[:, 0]

    prior_index = state_index

    def feature_index(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B, 1] the active feature (the prompt)."""
        return obs[:, :1]

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1] int64 → [B, P] float32 one-hot(prompt)."""
        return multi_hot(self.feature_index(obs), self.feature_dim)


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
        self._last_scan: tuple[Tensor, Tensor, Tensor] | None = None  # (obs, last written slot, q)

    def _summary(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        prompt = obs[:, 0]
        written = obs[:, 1:] != self._pad
        t = written.sum(dim=1).clamp(max=self.task.max_len - 1)
        # the last written slot (0: none): padding after it leaves q unchanged, so the scan stops there
        end = torch.where(written.any(dim=1), written.shape[1] - written.flip(1).long().argmax(dim=1), 0)
        q, start = self._start[prompt], torch.ones_like(end)
        last = self._last_scan
        if last is not None and last[0].shape == obs.shape:
            # a rollout calls once per written slot with the same rows one slot longer: a row whose
            # prompt and written slots are unchanged resumes from its last state instead of slot 1
            # (the scan is O(L) per call, so O(L²) per rollout without this)
            last_obs, last_end, last_q = last
            kept = ((obs == last_obs) | (torch.arange(obs.shape[1]) > last_end[:, None])).all(dim=1)
            kept &= end >= last_end
            q = torch.where(kept, last_q, q)
            start = torch.where(kept, last_end + 1, start)
        flat, width = self._transition.reshape(-1), self._transition.shape[1]
        slot, last_slot = start[:, None], obs.shape[1] - 1
        for _ in range(max(0, int((end - start).max()) + 1) if obs.shape[0] else 0):  # each row its own slot
            token = obs.gather(1, slot.clamp(max=last_slot))[:, 0]
            step = torch.take(flat, q * width + token)  # = transition[q, token], 4× faster
            q = torch.where(slot[:, 0] <= end, step, q)
            slot = slot + 1
        # kept only for observation batches (a rollout's), not the training's [B·L, 1 + L] stacks
        self._last_scan = (obs.clone(), end, q) if obs.numel() <= _SCAN_MEMORY else None
        return prompt, q, t

    def __getstate__(self) -> dict:  # copies and pickles (policy copies, sweep workers) start without the scan
        return {**self.__dict__, "_last_scan": None}

    def state_index(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B] int64 in [0, P·Q·L)."""
        prompt, q, t = self._summary(obs)
        return (self._class[prompt] * self.task.num_states + q) * self.task.max_len + t

    def prior_index(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B] int64 row of the prior."""
        if self.prior_rows:
            return context_hash(obs, salt=1) % self.prior_rows
        return self.state_index(obs)

    def feature_index(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B, 3] the active features: c, C + q, C + Q + t."""
        prompt, q, t = self._summary(obs)
        c, big_q = self.num_classes, self.task.num_states
        return torch.stack([self._class[prompt], c + q, c + big_q + t], dim=1)

    def features(self, obs: Tensor) -> Tensor:
        """[B, 1 + L] int64 → [B, C + Q + L] float32 [one-hot c | one-hot q | one-hot t]."""
        return multi_hot(self.feature_index(obs), self.feature_dim)
