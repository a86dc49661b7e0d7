"""The step-matched transfer comparison (envs/transfer/step_matched.py): the toy read at the
multiple of its step whose median |ΔD|/D matches the run's, its unsafe-keep rates scored against
the run's intervals, and SPEC §6c's outcome from Newcombe intervals."""
from __future__ import annotations

import math

import pytest
import torch

from pdm_lab.audit.intervals import rate_diff_ci, wilson_ci
from pdm_lab.audit.probe_record import step_scale_record

from pdm_lab.envs.transfer.step_matched import nearest_scale, pooled_step_scales, step_matched

A, B = "dppo_topk_kl", "pdm_topk"


def test_rate_diff_ci_is_newcombes_hybrid_score_interval():
    # Newcombe (1998), Table II, example (a): 56/70 − 48/80, method 10: 0.0524 to 0.3339
    d = rate_diff_ci(56, 70, 48, 80)
    assert d["diff"] == pytest.approx(0.2)
    assert d["lo"] == pytest.approx(0.0524, abs=1e-4) and d["hi"] == pytest.approx(0.3339, abs=1e-4)
    # example (d): 10/10 − 0/10: 0.6075 to 1
    d = rate_diff_ci(10, 10, 0, 10)
    assert d["lo"] == pytest.approx(0.6075, abs=1e-4) and d["hi"] == pytest.approx(1.0, abs=1e-9)
    assert math.isnan(rate_diff_ci(0, 0, 3, 5)["diff"])


def _record(scale: float, grew_a: int, grew_b: int, n: int, ratio: float) -> dict:
    """A ``step_scale_record`` of 2n outside tokens: A keeps the first n, B the last n (all of
    them disagreement tokens); of A's kept, ``grew_a`` grow, of B's ``grew_b``; |ΔD|/D = ratio."""
    keep_a = torch.arange(2 * n) < n
    keep_b = ~keep_a
    grow = torch.zeros(2 * n, dtype=torch.bool)
    grow[:grew_a] = True
    grow[n:n + grew_b] = True
    d = torch.full((2 * n,), 1e-3, dtype=torch.float64)
    dd = torch.where(grow, ratio * d, -ratio * d)
    return step_scale_record([A, B], {A: keep_a, B: keep_b}, {A: dd, B: dd}, dd.clone(), d,
                             torch.ones(2 * n, dtype=torch.bool), 1e-12, scale)


def _lines(records_per_step: list[dict]) -> list[dict]:
    return [{"step_scales": {f"{r['steps/lr_scale']:g}": r for r in recs}} for recs in records_per_step]


def test_pooling_adds_counts_exactly_and_takes_the_median_of_step_medians():
    lines = _lines([[_record(1.0, 30, 10, 40, 5.0)], [_record(1.0, 20, 5, 40, 7.0)], [_record(1.0, 1, 1, 10, 100.0)]])
    pooled = pooled_step_scales([ln["step_scales"] for ln in lines], [A, B])["1"]
    assert (pooled[A]["grew"], pooled[A]["n"]) == (51, 90) and (pooled[B]["grew"], pooled[B]["n"]) == (16, 90)
    assert (pooled[A]["lo"], pooled[A]["hi"]) == pytest.approx(wilson_ci(51, 90))
    assert pooled["median_abs_dd_over_d"] == pytest.approx(7.0) and pooled["median_of"] == 3
    assert pooled["disagreement"] == 180


def test_nearest_scale_is_nearest_in_log():
    toy = {"1": {"median_abs_dd_over_d": 0.01}, "100": {"median_abs_dd_over_d": 1.0},
           "1000": {"median_abs_dd_over_d": 12.0}}
    assert nearest_scale(toy, 5.0) == "1000"   # log(12/5) < log(5/1)
    assert nearest_scale(toy, 2.0) == "100"
    assert nearest_scale({}, 1.0) is None and nearest_scale(toy, 0.0) is None


def _toy(scales: list[tuple[float, int, int, int, float]]) -> dict:
    return {"step_scales": {f"{s:g}": _record(s, ga, gb, n, r) for s, ga, gb, n, r in scales}}


def test_a_toy_at_the_runs_step_size_predicts_its_rates_and_transfers():
    run = _lines([[_record(1.0, 70, 30, 100, 6.0)] for _ in range(3)])           # A 70%, B 30%, n 300 each
    toy = _toy([(1.0, 50, 50, 100, 0.01), (1000.0, 210, 90, 300, 5.0)])           # at ×1000: 70% vs 30%
    doc = step_matched(toy, run, [A, B])
    assert doc["available"] and doc["toy_scale"] == 1000.0 and doc["step_matched"]
    assert doc["predicted"][A]["hit"] and doc["predicted"][B]["hit"]
    assert doc["outcome"] == "transfers"


def test_the_toy_at_its_own_step_would_miss():
    """Planted: the same toy read at its own (tiny) step instead, by offering only that scale."""
    run = _lines([[_record(1.0, 70, 30, 100, 6.0)] for _ in range(3)])
    toy = _toy([(1.0, 50, 50, 100, 0.01)])
    doc = step_matched(toy, run, [A, B])
    assert not doc["step_matched"] and doc["outcome"] == "unfaithful toy"
    assert not doc["predicted"][A]["hit"] and not doc["predicted"][B]["hit"]


def test_rates_inside_but_intervals_containing_zero_are_undecided():
    run = _lines([[_record(1.0, 41, 40, 50, 6.0)]])
    toy = _toy([(1.0, 40, 41, 50, 6.5)])
    doc = step_matched(toy, run, [A, B])
    assert doc["step_matched"] and doc["outcome"] == "undecided"


def test_opposite_decided_differences_do_not_transfer():
    run = _lines([[_record(1.0, 90, 20, 100, 6.0)]])
    toy = _toy([(1.0, 20, 90, 100, 6.0)])
    doc = step_matched(toy, run, [A, B])
    assert doc["outcome"] == "does not transfer"
    assert not doc["predicted"][A]["hit"]


def test_a_side_without_step_sizes_is_not_available():
    assert step_matched({"step_scales": {}}, _lines([[_record(1.0, 1, 1, 2, 1.0)]]), [A, B])["available"] is False
    assert step_matched(_toy([(1.0, 1, 1, 2, 1.0)]), [{"step_scales": None}], [A, B])["available"] is False


def test_transfer_refuses_runs_of_different_settings_with_exit_2(tmp_path, capsys):
    """``pdm-lab transfer RUN1 RUN2`` pools seeds of one setting; runs audited at different δ are
    refused as bad input (exit 2, one line naming the key), before any toy work."""
    import json

    from pdm_lab.cli import main as cli

    for name, delta in (("a", 5e-4), ("b", 1e-4)):
        run = tmp_path / name
        run.mkdir()
        line = {"step": 1, "rules": [A, B], "delta": delta, "k": 20}
        (run / "audit.jsonl").write_text(json.dumps(line) + "\n")
    code = cli.main(["transfer", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "audited different delta" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "transfer.json").exists()


def test_transfer_compares_a_given_toy_audit_and_refuses_one_of_another_setting(tmp_path):
    """``--toy-audit``: one toy audit against a run, no toy run or calibration; a toy audited at
    another δ is refused naming the key."""
    import json

    from pdm_lab.config import from_dict, to_dict
    from pdm_lab.lab.results import ResultsError

    from pdm_lab.envs.audit.config import AuditConfig
    from pdm_lab.envs.audit.study import run_audit
    from pdm_lab.envs.presets import AUDIT_PRESETS, preset
    from pdm_lab.envs.transfer import compare

    base = to_dict(preset(AUDIT_PRESETS, "quick"))
    base.update(seeds=1, sequences=64, group_size=8, audit_at=[0], rules=[A, B], extra_rules=[], delta=5e-4, k=20,
                contexts=["shared"], k_sweep=[], stress_mismatch="", trajectory_seeds=0, n_boot=100,
                step_scales=[10.0])
    base["problem"]["token_mdp"]["max_len"] = 12  # short responses: seconds, not minutes
    base["mismatch"] = "noise:0.3"  # tokens outside δ
    toy = run_audit(from_dict(AuditConfig, base))
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(toy))
    run = tmp_path / "run"
    run.mkdir()
    kept = lambda n, grew: {"topk_kl": {"count": n, "grew": grew, "shrank": n - grew, "flat_count": 0,  # noqa: E731
                                        "unsafe_keep": grew / n, "shrink": 1 - grew / n, "flat": 0.0}, "full_kl": None}
    lines = [{"step": s, "seed": 0, "rules": [A, B], "delta": 5e-4, "k": 20, "tolerance": 1e-9, "tokens": 200,
              "zero_advantage": 0, "outside": 80, "dropped_outside": {},
              "pairs": {f"{A}|{B}": {"disagreement": 80, A: kept(40, 30), B: kept(40, 10)}},
              "step_scales": {"1": _record(1.0, 30, 10, 40, 6.0)}} for s in (1, 2)]
    (run / "audit.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (run / "mismatch_sample.jsonl").write_text(json.dumps({"step": 1, "d": 1e-3, "mu_tail": 0.0, "pi_tail": 0.0,
                                                           "r": 1.0, "adv": 1.0}) + "\n")
    doc = compare.run_transfer(run, tmp_path / "out", preset(AUDIT_PRESETS, "quick"), toy_audit=path, n_boot=100,
                               log=lambda *_: None)
    assert doc["toy_mismatch"] == toy["config"]["mismatch"] and doc["toy"]["points"] == 1
    assert doc["step_matched"]["available"] and doc["step_matched"]["toy_scale"] in (1.0, 10.0)
    assert "At the run's relative step size" in (tmp_path / "out" / "transfer.md").read_text()
    other = dict(toy, config=dict(toy["config"], delta=0.15))
    path.write_text(json.dumps(other))
    with pytest.raises(ResultsError, match="delta"):
        compare.run_transfer(run, tmp_path / "out2", preset(AUDIT_PRESETS, "quick"), toy_audit=path, log=lambda *_: None)
