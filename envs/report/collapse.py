"""A reproduced collapse under rollout/trainer mismatch: the definition, the regime, its table.

## Definition (one for every rule; ``train.is_collapsed``)

A run *collapsed* if training produced non-finite parameters, or if its batch-reward curve,
smoothed over a window of a tenth of the run, ends below half of the best value it reached
(``collapse_drop`` = 0.5) and more than 0.05 below it (``COLLAPSE_MIN_LOSS``: smaller falls are
batch noise near zero). The start counts as a value reached, so a run that only ever falls
collapsed too; a flat run (never learned, never lost) did not. Best and end come from the same
measurement (the reward of the batches μ sampled), so a mismatch that makes μ better or worse
than π shifts both alike; π's own final reward is reported next to it (``final_reward``), since
π falling while μ's batches do not (a sharper engine can hide it) shows only there.

The flag means something only for runs of at least ``COLLAPSE_MIN_STEPS`` steps
(``pdm_lab.lab.evidence``: each smoothed point must average ``COLLAPSE_MIN_WINDOW``
batches, else the best is one lucky batch and the end one unlucky batch). Shorter runs get
"n/a" in the report, and ``pdm-lab promote`` refuses to rest on them.

## Mechanism (the ``collapse`` sweep preset)

The engine samples sharper than the trainer's policy: ``temperature:-0.5`` (μ ∝ π²). The loss
uses the exact ratio r = π/μ, so the gradient is unbiased, but for a token in π's tail
r = Σ_j π_j² / π_k grows as π sharpens. Sampled tail tokens are wrong answers with Â < 0 whose
updates move r towards 1, so no ratio or divergence rule drops them; with plain SGD the step is
proportional to the gradient, so one such token moves the shared network by tens of ordinary
steps and the policy jumps to a deterministic wrong answer. Controls in the preset: no mismatch
and zero-mean logit noise (``noise:1``), same optimiser, step and problem. Measured rates are in
the README.
"""
from __future__ import annotations

from pdm_lab.mask_config import MaskConfig
from pdm_lab.lab.evidence import COLLAPSE_MIN_STEPS, COLLAPSE_MIN_WINDOW

from pdm_lab.envs.problems.bandit import BanditConfig
from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.report.summary import config_label, config_summary, group_rows, mismatch_label, point_label  # noqa: F401
from pdm_lab.envs.sweep.grid import SweepConfig
from pdm_lab.envs.train.grpo import TrainConfig

#: The rules the collapse table compares: no mask, the ratio clip, DPPO, PDM.
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


def collapse_note() -> str:
    """One sentence stating the collapse definition and the run length it needs."""
    return ("*Collapsed*: non-finite parameters, or the smoothed batch-reward curve ends below half of the "
            "best it reached and more than 0.05 below it (one definition for every rule; `pdm_lab.envs.report.collapse`). "
            f"It needs runs of ≥ {COLLAPSE_MIN_STEPS} steps (the smoothing window, a tenth of the run, must "
            f"average ≥ {COLLAPSE_MIN_WINDOW} batches); shorter runs show n/a.")


def collapse_section(rows: list[dict]) -> list[str]:
    """report.md lines: collapse rate (Wilson 95% CI; n/a for runs shorter than
    ``COLLAPSE_MIN_STEPS``) and final reward (bootstrap 95% CI) per mismatch setting × rule, with
    the regime each was measured in."""
    if not rows:
        return []
    lines = ["### Collapse", "", collapse_note(), "",
             "| mismatch | configuration | runs | collapsed | collapse rate [95% Wilson CI] | final reward of π [95% CI] | optimiser, lr | steps | epochs × mini-batches |",
             "| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- |"]
    for (mismatch,), group in group_rows(rows, lambda r: (point_label(r),)).items():
        for (label,), cell in group_rows(group, lambda r: (config_label(r),)).items():
            s = config_summary(cell)
            r0 = cell[0]
            measured = s["collapse_measurable"]
            lines.append(f"| `{mismatch}` | {label} | {s['runs']} | {s['collapses'] if measured else 'n/a'} | "
                         f"{_fmt(s['collapse'], 2) if measured else 'n/a'} | "
                         f"{_fmt(s['final_reward'], 3)} | {r0['optimizer']} {r0['lr']:g} | {r0['steps']} | "
                         f"{r0['epochs']} × {r0['minibatches']} |")
    return lines + [""]
