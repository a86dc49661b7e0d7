"""Stage 2: the toy testbed — softmax bandits and token MDPs with injected rollout mismatch.

Importing this package registers ``pdm_lab/TokenMDP-v0`` with Gymnasium (scalar entry point
``TokenMDP``, native vector entry point ``TokenMDPVectorEnv``).

Packages, bottom up (each imports only those above it in this list, and the core):

* ``problems`` — tasks as automata, the Gymnasium ``token_mdp`` and its vector twin, the
  ``bandit``, the Zipf ``prior``, observation ``encoders``, the behaviour policy ``mismatch``,
  fast ``sampling`` and batched ``rollout`` (``problem`` builds one from a config);
* ``policies`` — tabular and neural softmax policies (``models``);
* ``train`` — a batch into the core's loss (``update``) and the GRPO loop (``grpo``);
* ``audit`` — SPEC §6 on a toy: ``study``, ``points``, ``flips``, ``report``, ``coupled``;
* ``sweep`` — the resumable grid (``grid``) and its ``executors``;
* ``report`` — ``summary`` tables, ``collapse``, ``plots``, ``sweep_report`` (report.md);
* ``transfer`` — ``calibrate`` (SPEC §6b) and ``compare`` (SPEC §6c);
* top level — ``presets`` (named configurations), ``pipeline`` (sweep → report, audit → files),
  ``commands`` (``pdm-lab audit|sweep|calibrate|transfer``), ``bench`` (``pdm-lab bench`` rows).
"""
import gymnasium as gym

ENV_ID = "pdm_lab/TokenMDP-v0"

if ENV_ID not in gym.registry:
    gym.register(
        id=ENV_ID,
        entry_point="pdm_lab.envs.problems.token_mdp:TokenMDP",
        vector_entry_point="pdm_lab.envs.problems.token_mdp_vector:TokenMDPVectorEnv",
    )
