"""Native batched twin of ``TokenMDP``: B responses stepped with numpy, no Python loop per env."""
from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from gymnasium import spaces

from pdm_lab.envs.problems.tasks import EOS, AutomatonTask, make_task
from pdm_lab.envs.problems.token_mdp import observation_space_for, render_episode


class TokenMDPVectorEnv(VectorEnv):
    """``num_envs`` copies of ``TokenMDP`` stepped as arrays.

    Same MDP as ``TokenMDP`` (see its docstring), same spaces per sub-env. Observations are
    [B, 1 + L] int64, rewards [B] float32, terminations/truncations [B] bool. Autoreset follows
    Gymnasium's ``NEXT_STEP`` mode: the step after an episode ends resets that sub-env (its
    action is ignored, its reward is 0, and the observation is the new prompt).

    Prompts are drawn from one generator for the whole batch (as in Gymnasium's
    ``CartPoleVectorEnv``), or given: ``reset(options={"prompts": array [B]})``. Given the same
    prompts and actions, every sub-env matches a scalar ``TokenMDP`` exactly (tested).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 1, task: str | AutomatonTask = "sum",
                 render_mode: str | None = None, **task_kwargs: Any):
        self.task = task if isinstance(task, AutomatonTask) else make_task(task, **task_kwargs)
        self.num_envs = num_envs
        self.render_mode = render_mode
        self.single_action_space = spaces.Discrete(self.task.vocab_size)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.single_observation_space = observation_space_for(self.task)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self._obs = np.full((num_envs, self.task.obs_len), self.task.pad, dtype=np.int64)
        self._state = np.zeros(num_envs, dtype=np.int64)
        self._length = np.zeros(num_envs, dtype=np.int64)
        self._prev_done = np.zeros(num_envs, dtype=bool)
        self._rows = np.arange(num_envs)

    def _start(self, which: np.ndarray, prompts: np.ndarray) -> None:
        self._obs[which] = self.task.pad
        self._obs[which, 0] = prompts
        self._state[which] = self.task.start[prompts]
        self._length[which] = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        prompts = options.get("prompts")
        if prompts is None:
            prompts = self.np_random.integers(self.task.num_prompts, size=self.num_envs)
        prompts = np.asarray(prompts, dtype=np.int64)
        if prompts.shape != (self.num_envs,):
            raise ValueError(f"prompts: expected shape ({self.num_envs},), got {prompts.shape}")
        if ((prompts < 0) | (prompts >= self.task.num_prompts)).any():
            raise ValueError(f"prompts: must lie in [0, {self.task.num_prompts})")
        self._start(self._rows, prompts)
        self._prev_done[:] = False
        return self._obs.copy(), {}

    def step(self, actions):
        task = self.task
        tokens = np.asarray(actions, dtype=np.int64)
        if tokens.shape != (self.num_envs,):
            raise ValueError(f"actions: expected shape ({self.num_envs},), got {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= task.vocab_size:
            raise ValueError(f"actions: must lie in [0, {task.vocab_size})")
        prev_done, length = self._prev_done, self._length
        # write every token in its slot; envs that finished last step are overwritten by the reset
        self._obs[self._rows, 1 + np.minimum(length, task.max_len - 1)] = tokens
        is_eos = tokens == EOS
        accepted = task.accept[self._obs[:, 0], self._state] & (length >= task.min_len)
        terminated = is_eos & ~prev_done
        reward = (terminated & accepted).astype(np.float32)
        advancing = ~is_eos & ~prev_done
        self._state = np.where(advancing, task.transition[self._state, tokens], self._state)
        self._length = length + advancing
        truncated = advancing & (self._length == task.max_len)
        # NEXT_STEP autoreset of the envs that finished on the previous call
        if prev_done.any():
            done_rows = self._rows[prev_done]
            prompts = self.np_random.integers(task.num_prompts, size=done_rows.size)
            self._start(done_rows, prompts)
        self._prev_done = terminated | truncated
        return self._obs.copy(), reward, terminated, truncated, {}

    def render(self):
        if self.render_mode != "ansi":
            return None
        return [render_episode(self.task, row, None) for row in self._obs]
