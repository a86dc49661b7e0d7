"""Stage 2: the toy testbed — softmax bandits and token MDPs with injected rollout mismatch.

Importing this package registers ``pdm_lab/TokenMDP-v0`` with Gymnasium (scalar entry point
``TokenMDP``, native vector entry point ``TokenMDPVectorEnv``).

Packages, bottom up (each imports only its own package, those above it in this list, and the
core; ``tests/test_core_imports.py`` enforces the order):

* ``problems`` — tasks as automata, the Gymnasium ``token_mdp`` and its vector twin, the
  ``bandit``, the Zipf ``prior``, observation ``encoders``, the behaviour policy ``mismatch``,
  fast ``sampling`` and batched ``rollout`` (``problem`` builds one from a config);
* ``policies`` — tabular and neural softmax policies (``models``), the causal ``transformer``
  (SPEC §6d's faithful toy), what they share (``base``);
* ``train`` — a batch into the core's loss (``update``) and the GRPO loop (``grpo``);
* ``audit`` — SPEC §6 on a toy: ``config``, ``batch``, ``step``, ``seed``, ``statistics``,
  ``store``, ``study`` (the run), ``own_update`` (SPEC §6d's probe, decomposition, step sizes),
  ``points``, ``flips``, ``report``, ``coupled``;
* ``transfer`` — ``calibrate`` (SPEC §6b), ``compare`` and ``faithful`` (SPEC §6c);
* ``sweep`` — the resumable grid (``grid``) and its ``executors``;
* ``report`` — ``summary`` tables, ``collapse``, ``plots``, ``step_sizes``, ``sweep_report`` (report.md);
* top level — ``presets`` (named configurations), ``pipeline`` (sweep → report, audit → files),
  ``commands`` (``pdm-lab audit|sweep|calibrate|transfer``), ``study_commands`` (calibrate,
  transfer and the coupled study's command lines), ``bench`` (``pdm-lab bench`` rows).
"""
import gymnasium as gym

ENV_ID = "pdm_lab/TokenMDP-v0"

if ENV_ID not in gym.registry:
    gym.register(
        id=ENV_ID,
        entry_point="pdm_lab.envs.problems.token_mdp:TokenMDP",
        vector_entry_point="pdm_lab.envs.problems.token_mdp_vector:TokenMDPVectorEnv",
    )
