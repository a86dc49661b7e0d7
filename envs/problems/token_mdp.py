"""The token MDP: a Gymnasium environment where the agent writes a response one token at a time."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pdm_lab.envs.problems.tasks import EOS, AutomatonTask, make_task


def observation_space_for(task: AutomatonTask) -> spaces.MultiDiscrete:
    """MultiDiscrete([num_prompts, n+1, …, n+1]): the prompt token then L response slots."""
    nvec = np.array([task.num_prompts] + [task.vocab_size + 1] * task.max_len, dtype=np.int64)
    return spaces.MultiDiscrete(nvec)


def render_episode(task: AutomatonTask, obs: np.ndarray, reward: float | None) -> str:
    """One line: the prompt, the response so far (EOS as <eos>), and the reward once known."""
    tokens = [("<eos>" if int(t) == EOS else str(int(t))) for t in obs[1:] if int(t) != task.pad]
    tail = "" if reward is None else f"  -> reward {reward:g}"
    return f"[{task.name}] prompt {int(obs[0])} | {' '.join(tokens)}{tail}"


class TokenMDP(gym.Env):
    """Write a short response token by token; a verifier scores it at the end.

    ## Description

    A toy analogue of LLM RL with verifiable rewards. An episode is one response to one prompt:
    the agent emits tokens from a vocabulary of n ids (id 0 is EOS) and receives a sparse reward
    when it stops. The task (``sum`` or ``grammar``, see ``pdm_lab.envs.problems.tasks``) is a finite
    automaton read over the response; the prompt token names the instance (a target sum, a start
    state).

    ## Action Space

    ``Discrete(n)``: the next token. Token 0 is EOS.

    ## Observation Space

    ``MultiDiscrete([num_prompts, n+1, …, n+1])`` of length 1 + L, int64: the prompt token, then
    the L response slots, each holding the token written there or the padding id n if not yet
    written.

    ## Rewards

    1.0 when the agent emits EOS and the verifier accepts the answer (the tokens before EOS);
    0.0 on every other step, on a rejected answer, and on truncation.

    ## Starting State

    A prompt drawn uniformly from [0, num_prompts) with the environment's generator (or given by
    ``reset(options={"prompt": c})``); all response slots empty.

    ## Episode End

    * Termination: the agent emitted EOS (the response is complete; the reward is final).
    * Truncation: L tokens were written without EOS (the response budget ran out; reward 0,
      like an over-long LLM answer).

    ## Arguments

    ``gymnasium.make("pdm_lab/TokenMDP-v0", task="sum", render_mode=None, **task_kwargs)``;
    ``task_kwargs`` go to the task factory (``vocab_size``, ``max_len``, ``modulus``, …).
    ``render_mode`` is ``"ansi"`` (``render()`` returns the line) or ``"human"`` (prints it).

    ## Vector environment

    ``TokenMDPVectorEnv`` (``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")``)
    steps a batch natively and matches this class step for step.
    """

    metadata = {"render_modes": ["ansi", "human"], "render_fps": 4}

    def __init__(self, task: str | AutomatonTask = "sum", render_mode: str | None = None,
                 **task_kwargs: Any):
        self.task = task if isinstance(task, AutomatonTask) else make_task(task, **task_kwargs)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode: unknown {render_mode!r}; valid: ansi, human")
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(self.task.vocab_size)
        self.observation_space = observation_space_for(self.task)
        self._obs = np.full(self.task.obs_len, self.task.pad, dtype=np.int64)
        self._state = 0
        self._length = 0
        self._done = True
        self._last_reward: float | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        prompt = options.get("prompt")
        if prompt is None:
            prompt = int(self.np_random.integers(self.task.num_prompts))
        if not 0 <= int(prompt) < self.task.num_prompts:
            raise ValueError(f"prompt: must be in [0, {self.task.num_prompts}), got {prompt}")
        self._obs[:] = self.task.pad
        self._obs[0] = int(prompt)
        self._state = int(self.task.start[int(prompt)])
        self._length = 0
        self._done = False
        self._last_reward = None
        if self.render_mode == "human":
            self.render()
        return self._obs.copy(), {}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        token = int(action)
        if not 0 <= token < self.task.vocab_size:
            raise ValueError(f"action: must be in [0, {self.task.vocab_size}), got {action}")
        task = self.task
        self._obs[1 + self._length] = token
        reward, terminated, truncated = 0.0, False, False
        if token == EOS:
            terminated = True
            ok = self._length >= task.min_len and bool(task.accept[self._obs[0], self._state])
            reward = 1.0 if ok else 0.0
        else:
            self._state = int(task.transition[self._state, token])
            self._length += 1
            truncated = self._length == task.max_len
        self._done = terminated or truncated
        self._last_reward = reward if self._done else None
        if self.render_mode == "human":
            self.render()
        return self._obs.copy(), reward, terminated, truncated, {}

    def render(self):
        line = render_episode(self.task, self._obs, self._last_reward)
        if self.render_mode == "human":
            print(line)
            return None
        return line
