"""Adapters that run pdm_lab's mask and loss inside the frameworks people train with.

* ``pdm_lab.integrations.trl`` — ``PDMGRPOTrainer``, a TRL ``GRPOTrainer`` with top-K μ.
* ``pdm_lab.integrations.verl`` — a verl plugin: every sampled-token rule as a policy loss.
* ``pdm_lab.integrations.verl_topk`` — verl's top-K data path (vLLM top-K → actor → loss).
* ``pdm_lab.integrations.verl_patches`` — the versioned runtime patch set wiring it into verl
  (``PDM_LAB_VERL_TOPK=K``).
* ``pdm_lab.integrations.launch_files`` — what ``pdm-lab promote --target`` writes.

Each adapter checks the framework version it was tested with (``require_version``). Nothing here
re-derives a formula: supports, π on the support, stats, masks and metrics come from the core.
"""
