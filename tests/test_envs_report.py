"""Confidence intervals and the report's verdicts."""
import math

from hypothesis import given
from hypothesis import strategies as st

from pdm_lab.envs.report import _winner
from pdm_lab.envs.summary import config_label, mean_ci, wilson_ci


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=30))
def test_mean_ci_brackets_the_mean(xs):
    mean, lo, hi = mean_ci(xs, n_boot=200)
    assert lo - 1e-9 <= mean <= hi + 1e-9
    assert min(xs) - 1e-9 <= lo and hi <= max(xs) + 1e-9


@given(st.integers(0, 50), st.integers(1, 50))
def test_wilson_interval_is_a_proper_interval(k, n):
    k = min(k, n)
    p, lo, hi = wilson_ci(k, n)
    assert 0 <= lo <= p <= hi <= 1


def test_nan_and_empty_inputs():
    assert all(math.isnan(v) for v in mean_ci([None, float("nan")]))
    assert all(math.isnan(v) for v in wilson_ci(0, 0))


def test_winner_says_tie_when_intervals_overlap_and_separated_when_not():
    close = {"a": {"r": (0.50, 0.40, 0.60)}, "b": {"r": (0.45, 0.35, 0.55)}}
    far = {"a": {"r": (0.90, 0.85, 0.95)}, "b": {"r": (0.20, 0.10, 0.30)}}
    assert "tie within noise" in _winner(close, lambda s: s["r"][0], higher=True, interval=lambda s: s["r"])
    assert "separated at 95%" in _winner(far, lambda s: s["r"][0], higher=True, interval=lambda s: s["r"])
    equal = {"a": {"r": (0.0, 0.0, 0.0)}, "b": {"r": (0.0, 0.0, 0.0)}}
    assert _winner(equal, lambda s: s["r"][0], higher=False).startswith("tie at 0.000")


def test_config_label_hides_region_parameters_of_region_free_rules():
    assert config_label({"rule": "ppo_clip", "delta": 0.15, "k": 20}) == "ppo_clip"
    assert config_label({"rule": "pdm_uniform", "delta": 0.05, "k": 5, "convention": "kslot"}) == \
        "pdm_uniform δ=0.05 K=5 kslot"
