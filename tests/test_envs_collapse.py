"""The collapse regime collapses unmasked training, its controls do not, and the definition can fail."""
import math
from dataclasses import replace

import pytest

from pdm_lab.mask_config import MaskConfig
from pdm_lab.envs.report.collapse import COLLAPSE_RULES, COLLAPSE_SWEEP, COLLAPSE_TRAIN, collapse_section
from pdm_lab.envs.presets import SWEEP_PRESETS
from pdm_lab.envs.train.grpo import is_collapsed, train

#: the preset's regime at half the steps (the collapse happens within the first ten)
SMALL = replace(COLLAPSE_TRAIN, steps=20, track_unsafe_keep=False, mask=MaskConfig(rule="none"))


def _run(mismatch: str, seed: int) -> tuple[dict, float]:
    ratios = []
    out = train(replace(SMALL, mismatch=mismatch, seed=seed),
                on_step=lambda rec: ratios.append(rec["ratio/max"]))
    return out, max(ratios)


@pytest.mark.parametrize("seed", [0, 1])
def test_sharp_engine_collapses_unmasked_sgd_through_large_tail_ratios(seed):
    out, ratio_max = _run("temperature:-0.5", seed)
    assert out["collapsed"] and not out["nonfinite"]
    assert max(out["curve"]) > out["curve"][0] + 0.2  # it learned first, then lost it
    assert out["final_reward"] < 0.2
    assert ratio_max > 10  # the mechanism: sampled tail tokens with r = π/μ ≫ 1


@pytest.mark.parametrize("mismatch", ["none", "noise:1"])
def test_same_regime_without_the_mechanism_learns_and_is_not_marked_collapsed(mismatch):
    out, _ = _run(mismatch, 0)
    assert not out["collapsed"]
    assert out["final_reward"] > 0.8


def test_definition_compares_the_curve_with_itself():
    rise_fall = [0.0, 0.2, 0.5, 0.8, 0.9, 0.9, 0.6, 0.3, 0.1, 0.1]
    rising = [0.0, 0.2, 0.5, 0.8, 0.9, 0.9, 0.9, 0.95, 1.0, 1.0]
    assert is_collapsed(rise_fall, drop=0.5, nonfinite=False)
    assert not is_collapsed(rising, drop=0.5, nonfinite=False)
    assert not is_collapsed([0.05] * 10, drop=0.5, nonfinite=False)  # never learned: not a collapse
    assert not is_collapsed([0.0, 0.5, 0.5, 0.48, 0.46, 0.45], drop=0.5, nonfinite=False)  # small dip
    assert is_collapsed([0.2, 0.15, 0.1, 0.05, 0.02, 0.0, 0.0, 0.0, 0.0, 0.0], drop=0.5,
                        nonfinite=False)  # fell from the start: the start is the best it reached
    assert not is_collapsed([0.04, 0.0, 0.03, 0.0, 0.02, 0.0], drop=0.5, nonfinite=False)  # noise at ~0
    assert is_collapsed(rising, drop=0.5, nonfinite=True)


def test_preset_and_report_table():
    assert SWEEP_PRESETS["collapse"] is COLLAPSE_SWEEP
    assert COLLAPSE_SWEEP.rules == COLLAPSE_RULES and COLLAPSE_SWEEP.seeds >= 16
    assert "none" in COLLAPSE_SWEEP.mismatches  # the control
    base = dict(delta=0.15, k=20, convention="union", optimizer="sgd", lr=10.0, steps=40, epochs=1,
                minibatches=1, mask_fraction=0.0, update_topk_kl_mean=0.1, unsafe_keep=math.nan,
                unsafe_keep_count=0, unsafe_count=0)
    rows = [dict(base, rule="none", mismatch="temperature:-0.5", final_reward=0.06 if i < 3 else 0.9,
                 collapsed=i < 3) for i in range(4)]
    text = "\n".join(collapse_section(rows))
    assert "| `temperature:-0.5` | none | 4 | 3 | 0.75 [" in text
    assert "sgd 10 | 40 | 1 × 1 |" in text


def _noise_collapse_rate(steps: int, trials: int = 600) -> float:
    """How often a run whose policy never changes is flagged collapsed: batch rewards of 64
    responses at a success rate of 0.14 (the quick preset's reward level and batch size)."""
    import random

    rng = random.Random(0)
    hits = 0
    for _ in range(trials):
        curve = [sum(rng.random() < 0.14 for _ in range(64)) / 64 for _ in range(steps)]
        hits += is_collapsed(curve, drop=0.5, nonfinite=False)
    return hits / trials


def test_the_minimum_run_length_is_where_batch_noise_stops_passing_for_collapse():
    """At 10 steps (``make run``'s sweep) batch noise alone is flagged in about a fifth of runs:
    the flag means nothing there, so the report shows n/a. At COLLAPSE_MIN_STEPS it is rare; a
    minimum set at 10 (the planted bug) would fail the second check."""
    from pdm_lab.envs.report.collapse import COLLAPSE_MIN_STEPS

    assert _noise_collapse_rate(10) > 0.12
    assert _noise_collapse_rate(COLLAPSE_MIN_STEPS) < 0.05
