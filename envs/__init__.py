"""Stage 2: the toy testbed — softmax bandits and token MDPs with injected rollout mismatch.

Importing this package registers ``pdm_lab/TokenMDP-v0`` with Gymnasium (scalar entry point
``TokenMDP``, native vector entry point ``TokenMDPVectorEnv``).

Modules, bottom up:

* environments — ``tasks`` (verifiable token tasks as automata), ``token_mdp`` /
  ``token_mdp_vector`` (the Gymnasium env and its batched twin), ``bandit`` (softmax bandit),
  ``prior`` (Zipf-like initial logits), ``sampling`` (inverse-CDF sampling);
* policies — ``encoders`` (observation → state index / features), ``policies`` (tabular, neural);
* behaviour policy — ``mismatch`` (engine rounding, per-context heavy tail, precision, noise,
  temperature, tail noise, staleness);
* rollouts and training — ``problems`` (env + encoder + prior + batched rollout), ``rollout``
  (batches, RNG streams, GRPO advantages), ``update`` (batch → the core's inputs and loss),
  ``train`` (the GRPO loop);
* experiments — ``audit`` (SPEC §6: the update mechanics; statistics in ``pdm_lab.audit``),
  ``calibrate`` (the regime table of SPEC §6b), ``sweep`` (resumable grid),
  ``executors`` (local processes, Ray), ``presets``, ``summary`` / ``plots`` / ``report``,
  ``pipeline`` (sweep → table → figures → report.md), ``records`` (JSONL, atomic JSON);
* entry points — ``cli`` (``pdm-lab audit``, ``pdm-lab sweep``), ``bench`` (``pdm-lab bench`` rows).
"""
import gymnasium as gym

ENV_ID = "pdm_lab/TokenMDP-v0"

if ENV_ID not in gym.registry:
    gym.register(
        id=ENV_ID,
        entry_point="pdm_lab.envs.token_mdp:TokenMDP",
        vector_entry_point="pdm_lab.envs.token_mdp_vector:TokenMDPVectorEnv",
    )
