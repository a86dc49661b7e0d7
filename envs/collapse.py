"""A reproduced collapse under rollout/trainer mismatch: the definition, the regime, its table.

## Definition (one for every rule; ``train.is_collapsed``)

A run *collapsed* if training produced non-finite parameters, or if its batch-reward curve,
smoothed over a window of a tenth of the run, ends having lost more than ``collapse_drop``
(0.5) of its best gain: ``end < best − 0.5·(best − initial)``, where ``initial`` is the first
smoothed value. A run that never gained more than 0.05 cannot collapse (it failed to learn,
which the final reward shows). Best and end come from the same measurement (the reward of the
batches μ sampled), so a mismatch that makes μ better or worse than π shifts both alike; π's own
final reward is reported next to it (``final_reward``).

## Mechanism (the ``collapse`` sweep preset)

The engine samples sharper than the trainer's policy: ``temperature:-0.5`` (the engine's
temperature is 0.5, μ ∝ π²). Every rule's loss uses the exact ratio r = π/μ, so the gradient is
unbiased, but for a token in π's tail r = Σ_j π_j² / π_k: the rarer the token under π, the larger
its ratio, and the sharper π gets, the larger the ratios of the tail tokens μ still samples
(ratios of 25–350 within the first steps). Sampled tail tokens are wrong answers with Â < 0,
and their updates move r towards 1 (inward), so no ratio or divergence rule drops them (PPO's
clip does not act on Â < 0 with r > 1; DPPO's and PDM's direction tests both call pushing
π_k down towards μ_k "shrinking"). With SGD the step is proportional to the gradient, so one such
token moves the shared network's weights by tens of ordinary steps: the policy jumps to a
deterministic wrong answer on most prompts, groups then get equal rewards (Â = 0), and nothing
pulls it back. Without mismatch, or with zero-mean logit noise (``noise:1``), the same optimiser,
step size and problem learn to ≥ 0.9 without collapsing: the two control settings of the preset.

## Mechanisms tried (neural softmax bandit, n = 200, 16 prompts, 16 × 16 responses per step)

* several off-policy mini-batch updates per rollout (Adam lr 0.05, 2–4 epochs × 4 mini-batches):
  no rise-then-fall; the policy turns deterministic after the first batch (premature entropy
  collapse: final reward 0.44–0.69 with or without mismatch, stuck from step 1). On a small token
  MDP, Adam 4 × 4 with ``temperature:-0.5``: π's reward rose to 0.75 and fell to 0.49 (one seed).
* error that grows with the logits' magnitude (``fp8_e4m3:0``, per-row FP8 scale): learns like
  no mismatch (Adam, 1 × 1 and 2 × 4).
* low-μ tail tokens (``tail_noise:3``, ``temperature:-0.7``) with Adam: slower learning, π lags μ,
  no collapse at 1 × 1; with 2 × 4 premature determinism (reward 0.12–0.38).
* low-μ tail tokens with SGD (this preset): collapse (see the table in the sweep's report.md).
"""
from __future__ import annotations

from pdm_lab.config import MaskConfig

from .bandit import BanditConfig
from .problems import ProblemConfig
from .summary import config_label, config_summary, group_rows, mismatch_label
from .sweep import SweepConfig
from .train import TrainConfig

#: The rules the collapse table compares (issue 8 item 3).
COLLAPSE_RULES = ("none", "ppo_clip", "dppo_topk_kl", "pdm_uniform", "pdm_topk")

#: The collapse regime: a neural softmax bandit trained with plain SGD, one update per rollout.
COLLAPSE_TRAIN = TrainConfig(
    problem=ProblemConfig(kind="bandit", bandit=BanditConfig(vocab_size=200, num_prompts=16)),
    policy="neural", optimizer="sgd", lr=10.0, steps=40, groups_per_step=16, group_size=16,
    mask=MaskConfig())

#: ``pdm-lab sweep --preset collapse``: two controls (no mismatch, zero-mean noise) and the
#: collapse setting, 5 rules, 16 seeds (240 runs of a few seconds each).
COLLAPSE_SWEEP = SweepConfig(base=COLLAPSE_TRAIN, rules=COLLAPSE_RULES,
                             mismatches=("none", "noise:1", "temperature:-0.5"),
                             deltas=(0.15,), ks=(20,), seeds=16)


def _fmt(triple: tuple[float, float, float], digits: int) -> str:
    mean, lo, hi = triple
    return "–" if mean != mean else f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def collapse_section(rows: list[dict]) -> list[str]:
    """report.md lines: collapse rate (Wilson 95% CI) and final reward (bootstrap 95% CI) per
    mismatch setting × rule, with the regime each was measured in."""
    if not rows:
        return []
    lines = ["### Collapse", "",
             "*Collapsed*: non-finite parameters, or the smoothed batch-reward curve ends below half of the "
             "best it reached and more than 0.05 below it (one definition for every rule; `pdm_lab.envs.collapse`).", "",
             "| mismatch | configuration | runs | collapsed | collapse rate [95% Wilson CI] | final reward of π [95% CI] | optimiser, lr | steps | epochs × mini-batches |",
             "| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- |"]
    for (mismatch,), group in group_rows(rows, lambda r: (mismatch_label(r),)).items():
        for (label,), cell in group_rows(group, lambda r: (config_label(r),)).items():
            s = config_summary(cell)
            r0 = cell[0]
            lines.append(f"| `{mismatch}` | {label} | {s['runs']} | {s['collapses']} | {_fmt(s['collapse'], 2)} | "
                         f"{_fmt(s['final_reward'], 3)} | {r0['optimizer']} {r0['lr']:g} | {r0['steps']} | "
                         f"{r0['epochs']} × {r0['minibatches']} |")
    return lines + [""]
