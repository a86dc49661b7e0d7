"""A reproduced collapse under rollout/trainer mismatch: the definition, the regime, its table.

## Definition (one for every rule; ``train.is_collapsed``)

A run *collapsed* if training produced non-finite parameters, or if its batch-reward curve,
smoothed over a window of a tenth of the run, ends below half of the best value it reached
(``collapse_drop`` = 0.5) and more than 0.05 below it (``COLLAPSE_MIN_LOSS``: smaller falls are
batch noise near zero). The start counts as a value reached, so a run that only ever falls
collapsed too; a flat run (never learned, never lost) did not. Best and end come from the same
measurement (the reward of the batches μ sampled), so a mismatch that makes μ better or worse
than π shifts both alike; π's own final reward is reported next to it (``final_reward``). What
it cannot see: π falling while μ's batches do not (a sharper engine can hide it), which the
final reward of π shows.

## Mechanism (the ``collapse`` sweep preset)

The engine samples sharper than the trainer's policy: ``temperature:-0.5`` (the engine's
temperature is 0.5, μ ∝ π²). The loss uses the exact ratio r = π/μ, so the gradient is
unbiased, but for a token in π's tail r = Σ_j π_j² / π_k: the rarer the token under π, the larger
its ratio, and the sharper π gets, the larger the ratios of the tail tokens μ still samples
(batch maxima of 25–350). Sampled tail tokens are wrong answers with Â < 0, and their updates
move r towards 1 (inward), so no ratio or divergence rule drops them (PPO's clip does not act on
Â < 0 with r > 1; DPPO's and PDM's direction tests call pushing π_k down towards μ_k
shrinking). With SGD the step is proportional to the gradient, so one such token moves the
shared network by tens of ordinary steps: the policy jumps to a deterministic wrong answer on
most prompts, groups then get equal rewards (Â = 0), and nothing pulls it back. Controls in the
preset: no mismatch and zero-mean logit noise (``noise:1``), same optimiser, step and problem.

Measured (16 seeds each, neural softmax bandit n = 200, 16 prompts, 16 × 16 responses per step,
SGD lr 10, 40 steps, 1 epoch × 1 mini-batch, δ = 0.15, K = 20; Wilson 95% CIs):

| mismatch | none | ppo_clip | dppo_topk_kl | pdm_uniform | pdm_topk |
| --- | --- | --- | --- | --- | --- |
| ``none`` | 0/16 | 0/16 | 0/16 | 0/16 | 0/16 |
| ``noise:1`` | 1/16 | 2/16 | 2/16 | 1/16 | 2/16 |
| ``temperature:-0.5`` | 16/16 [0.81, 1] | 14/16 [0.64, 0.97] | 15/16 [0.72, 0.99] | 7/16 [0.23, 0.67] | 8/16 [0.28, 0.72] |

Final reward of π under ``temperature:-0.5``: 0.055, 0.071, 0.059, 0.100, 0.100 (control: 0.999
for every rule). The PDM rules collapse less often because they rise less before falling
(batch-reward peaks ≈ 0.2 against 0.4–0.9 unmasked); no rule keeps what it learned. Two probes
of the mechanism with rule ``none``: capping the ratio factor (``mask.clip_ratio_c = 2``, TIS)
gives 0/16 collapses, final 0.902 [0.891, 0.913]; Adam (lr 0.05), whose step does not grow
with the gradient, gives 0/16, final 0.934 [0.906, 0.958] (0.980 without mismatch).

## Mechanisms tried (neural softmax bandit as above unless stated; one or two seeds each)

* several off-policy mini-batch updates per rollout (Adam lr 0.05, 2–4 epochs × 4 mini-batches):
  no rise-then-fall; the policy turns deterministic after the first batch (premature entropy
  collapse, final 0.44–0.69 with or without mismatch, flat from step 1). On a small token MDP,
  Adam 4 × 4 with ``temperature:-0.5``: π's reward rose to 0.75 and fell to 0.49 (one seed).
* error that grows with the logits' magnitude (``fp8_e4m3:0``, per-row FP8 scale; the
  ``temperature`` kind is the other one, its logit error z·(1/T − 1) grows with |z| as π
  sharpens): ``fp8_e4m3:0`` learns like no mismatch (Adam, 1 × 1 and 2 × 4).
* low-μ tail tokens with Adam (``tail_noise:3``, ``temperature:-0.7``, ``temperature:-0.5``):
  slower learning, π lags μ, no collapse at 1 × 1; premature determinism at 2 × 4.
* low-μ tail tokens with SGD (this preset): collapse, above. The same mismatch on the token MDP
  (sum task, n = 32, L = 4, modulus 4, 16 × 8 responses, hidden 32, SGD lr 2, 40 steps, 16
  seeds; the preset with those fields overridden): collapsed none 11/16 [0.44, 0.86],
  ppo_clip 10/16 [0.39, 0.82], dppo_topk_kl, pdm_uniform and pdm_topk 16/16 [0.81, 1]; final
  reward 0.225, 0.193, 0.058, 0.062, 0.062 (0.978 and 0/16 for every rule without mismatch).
  There the masks fall from the first step: the realised top-K KL (0.43–0.52) exceeds δ almost
  everywhere, the masks keep the updates that move π towards μ ∝ π², i.e. they sharpen π onto
  the prior's top token, EOS (an empty answer: 76% of DPPO's final responses, 0% unmasked).
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
