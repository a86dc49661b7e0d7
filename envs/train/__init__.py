"""GRPO training on a toy problem: a rollout batch into the core's loss (``update``) and the loop
(``grpo``), and the toys' g for ``pdm_coupled`` (``coupled_jvp``, SPEC §3b). Imports ``problems``, ``policies`` and the core."""
