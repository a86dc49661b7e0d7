"""Confidence intervals and the report's verdicts: a winner only where separated from the
runner-up at 95% with enough seeds, a collapse rate only for runs long enough to define one."""
import math

from hypothesis import given
from hypothesis import strategies as st

from pdm_lab.envs.report.criteria import COLLAPSE, REWARD, _by_config, _winner
from pdm_lab.envs.report.sweep_report import sweep_section
from pdm_lab.envs.report.summary import collapse_rate, config_label, mean_ci, newcombe_diff_ci, wilson_ci


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


def _rows(rule, rewards, *, steps=40, collapsed=()):
    base = dict(delta=0.15, k=20, convention="union", mismatch="none", optimizer="adam", lr=0.05, epochs=1,
                minibatches=1, mask_fraction=0.1, update_topk_kl_mean=0.01, unsafe_keep=0.3,
                unsafe_keep_count=10, unsafe_count=3)
    return [dict(base, rule=rule, seed=i, steps=steps, final_reward=r, collapsed=i in collapsed)
            for i, r in enumerate(rewards)]


def test_the_issue_example_names_no_winner():
    """ppo_clip 0.136 over two 10-step seeds against a runner-up within noise: tied, no collapse rate."""
    rows = _rows("ppo_clip", [0.130, 0.142], steps=10) + _rows("dppo_topk_kl", [0.129, 0.139], steps=10,
                                                                collapsed=(1,))
    groups = _by_config(rows)
    text = _winner(groups, REWARD)
    assert text.startswith("no winner: tied (best ppo_clip 0.136") and "**" not in text
    assert "includes 0" in text and "2 seeds < 3 per configuration" in text
    assert _winner(groups, COLLAPSE) == "n/a (runs of 10 steps; the collapse definition needs ≥ 30)"
    report = "\n".join(sweep_section(rows, {}, None))
    assert "| ppo_clip | 2 | 0.136 [" in report and "| n/a |" in report  # the collapse column
    assert "It needs runs of ≥ 30 steps" in report and "**ppo_clip**" not in report
    assert "| `none` | dppo_topk_kl δ=0.15 | 2 | n/a | n/a |" in report  # the collapse table


def test_a_separated_winner_is_named_with_its_interval():
    rows = _rows("pdm_topk", [0.80, 0.82, 0.81], collapsed=()) + _rows("ppo_clip", [0.70, 0.72, 0.71],
                                                                       collapsed=(0, 1, 2))
    groups = _by_config(rows)
    text = _winner(groups, REWARD)
    assert text.startswith("**pdm_topk δ=0.15** (best") and "95% Welch CI [+0.077, +0.123]" in text
    assert _winner(groups, COLLAPSE).startswith("**pdm_topk δ=0.15** (best pdm_topk δ=0.15 0/3; runner-up ppo_clip 3/3")
    tied = _by_config(_rows("pdm_topk", [0.9, 0.5, 0.7]) + _rows("ppo_clip", [0.6, 0.8, 0.7]))
    assert _winner(tied, REWARD).startswith("no winner: tied (")
    one = _by_config(_rows("pdm_topk", [0.9, 0.5, 0.7]))
    assert "nothing to compare" in _winner(one, REWARD)


def test_collapse_rate_only_for_runs_long_enough():
    """The rate behind the collapse column and figure: NaN if any run is shorter than 30 steps."""
    assert all(math.isnan(v) for v in collapse_rate(_rows("none", [0.1, 0.2, 0.3], steps=29, collapsed=(0,))))
    assert collapse_rate(_rows("none", [0.1, 0.2, 0.3], steps=30, collapsed=(0,))) == wilson_ci(1, 3)
    mixed = _rows("none", [0.1], steps=10) + _rows("none", [0.1, 0.2], steps=40)
    assert math.isnan(collapse_rate(mixed)[0])


@given(st.integers(0, 20), st.integers(1, 20), st.integers(0, 20), st.integers(1, 20))
def test_newcombe_interval_brackets_the_difference(k1, n1, k2, n2):
    k1, k2 = min(k1, n1), min(k2, n2)
    d, lo, hi = newcombe_diff_ci(k1, n1, k2, n2)
    assert -1 - 1e-12 <= lo <= d <= hi <= 1 + 1e-12
    assert d == k1 / n1 - k2 / n2


def test_config_label_hides_region_parameters_of_region_free_rules():
    assert config_label({"rule": "ppo_clip", "delta": 0.15, "k": 20}) == "ppo_clip"
    assert config_label({"rule": "pdm_uniform", "delta": 0.05, "k": 5, "convention": "kslot"}) == \
        "pdm_uniform δ=0.05 K=5 kslot"
