"""report.md's summary table: a short job says "n/a", a verdict from too little data is never a
separated finding, a separated stress finding is named as stress, "insufficient data" once."""
import math

from pdm_lab.envs.report.summary_table import summary_lines


def _doc(mismatch: str, diff: tuple[float, float, float], seeds_with_both: int, outside: float, tail: float) -> dict:
    d = {"mean_diff": diff[0], "ci_low": diff[1], "ci_high": diff[2]}
    insufficient = seeds_with_both < 10
    words = ("insufficient data: %d seed(s) gave kept disagreement tokens to both rules (a verdict needs 10)."
             % seeds_with_both if insufficient else "dppo_topk_kl keeps fewer divergence-growing updates than pdm_topk.")
    return {"config": {"seeds": 16, "sequences": 1024, "mismatch": mismatch},
            "regime": {"outside_fraction": outside, "tail_ratio": tail},
            "self_test": {"passed": True, "min_tokens": 20,
                          "checks": {"pdm_topk": {"unsafe_keep": 0.0, "kept": 400, "tested": True, "passed": True}}},
            "pairs": [{"a": "dppo_topk_kl", "b": "pdm_topk", "audit_step": 0, "verdict": words, "pooled_verdict": words,
                       "unsafe_keep_diff": d, "pooled_unsafe_keep_diff": d,
                       "data": {"seeds_with_both": seeds_with_both, "min_seeds": 10, "min_tokens": 30,
                                "tokens_a": 300, "tokens_b": 300}}]}


ROWS = [{"rule": r, "mismatch": "none", "seed": s, "steps": 10, "final_reward": 0.5, "collapsed": False}
        for r in ("dppo_topk_kl", "pdm_topk") for s in (0, 1)]


def test_short_job_says_na_and_a_stress_separation_is_named():
    realistic = _doc("bf16_engine:0+outlier:0.3:1", (0.1, -0.2, 0.4), 2, 0.008, 600)
    stress = _doc("noise:1", (-0.16, -0.24, -0.08), 16, 0.81, 5.5)
    text = "\n".join(summary_lines(ROWS, {"none": {"outside_fraction": 0.0, "tail_ratio": 1.0}}, realistic, stress))
    assert text.startswith("## Summary") and "n/a: a short job" in text and "tied" not in text
    assert text.count("insufficient data") == 1
    assert "Separated (the interval excludes 0): `noise:1` (**stress**)" in text
    assert "| direction audit: " in text and "realistic: 0.80%" in text


def test_planted_bug_interval_excluding_zero_from_too_few_seeds_is_not_a_finding():
    few = _doc("noise:1", (-0.3, -0.5, -0.1), 3, 0.81, 5.5)
    text = "\n".join(summary_lines(None, {}, few, None))
    assert "No finding here has an interval that excludes 0." in text
    nan = _doc("noise:1", (math.nan, math.nan, math.nan), 16, 0.81, 5.5)
    assert "No finding" in "\n".join(summary_lines(None, {}, nan, None))
