"""Named sweep and audit configurations: ``quick`` (about two minutes on a 2-core laptop, the
README's main command and an end-to-end test) and ``paper`` (the paper's statistics: 61 seeds,
δ ∈ {0.05, 0.15}, K = 20: 9 mismatch settings × (1 + 5 × 2) rule/δ cells × 61 seeds = 6039
runs of ~5 s each, about 9 core-hours — hours on one machine, or spread with ``--executor ray``)."""
from __future__ import annotations

from .audit import AuditConfig
from .collapse import COLLAPSE_SWEEP
from .problems import ProblemConfig
from .sweep import SweepConfig
from .train import TrainConfig

_TOKEN_MDP = ProblemConfig(kind="token_mdp")

SWEEP_PRESETS: dict[str, SweepConfig] = {
    "quick": SweepConfig(
        base=TrainConfig(problem=_TOKEN_MDP, policy="neural", steps=20),
        rules=("none", "ppo_clip", "dppo_topk_kl", "pdm_uniform", "pdm_coupled"),
        mismatches=("none", "noise:1", "noise:2"),
        deltas=(0.15,), ks=(20,), seeds=4),
    # SPEC §4b: the rules verl and slime ship, beside the paper's baseline and PDM (quick's size)
    "frameworks": SweepConfig(
        base=TrainConfig(problem=_TOKEN_MDP, policy="neural", steps=20),
        rules=("ppo_clip", "ppo_clip_dual", "seq_geo_mean", "seq_k3", "opsm", "token_k1", "dppo_topk_kl",
               "pdm_topk"),
        mismatches=("none", "noise:1", "noise:2"),
        deltas=(0.15,), ks=(20,), seeds=4),
    "paper": SweepConfig(
        base=TrainConfig(problem=_TOKEN_MDP, policy="neural", steps=60),
        rules=("ppo_clip", "dppo_topk_kl", "pdm_uniform", "pdm_agg", "pdm_topk", "pdm_coupled"),
        mismatches=("none", "noise:0.5", "noise:1", "noise:2", "tail_noise:2", "temperature:0.3",
                    "fp8_e4m3:16", "fp8_e4m3_weights:0", "stale:4"),
        deltas=(0.05, 0.15), ks=(20,), seeds=61),
    # a reproduced collapse under mismatch (see ``collapse``): 5 rules × 3 settings × 16 seeds
    "collapse": COLLAPSE_SWEEP,
}

AUDIT_PRESETS: dict[str, AuditConfig] = {
    # the softmax bandit: fast, and the hardest case for a per-token direction test (the 16
    # responses of a prompt share one state, so every update is coupled within its group)
    "quick": AuditConfig(seeds=16, k_sweep=(5, 20, 100), k_sweep_seeds=4),
    # the paper's statistics on the most LLM-like toy: token MDP, neural policy (shared weights)
    "paper": AuditConfig(problem=_TOKEN_MDP, policy="neural"),
}


def preset(table: dict, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"preset: unknown {name!r}; valid: {', '.join(table)}") from None
