"""``pdm-lab transfer`` (SPEC §6c): the toy calibrated to a run, audited, next to the run's own audit.

The run directory here is written by the test in the loop's formats (audit.jsonl lines as
``scaling/audit_step.py`` writes them, a mismatch sample as ``scaling/mismatch_sample.py`` does),
so the command is exercised as a user runs it without a scaling run; the loop's own end-to-end
test (tests/test_scaling_audit.py) writes the real files.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from pdm_lab.envs.presets import AUDIT_PRESETS, preset
from pdm_lab.envs.transfer import compare as transfer
from pdm_lab.envs.transfer import faithful as faithful_mod
from pdm_lab.envs.transfer.faithful import outcome

A, B = "dppo_topk_kl", "pdm_topk"


def rates(count, grew, shrank):
    return {"unsafe_keep": grew / count if count else None, "shrink": shrank / count if count else None,
            "flat": (count - grew - shrank) / count if count else None, "count": count, "grew": grew,
            "shrank": shrank, "flat_count": count - grew - shrank}


def line(step, a=(4, 3, 1), b=(3, 0, 3), outside=10, disagreement=7, tokens=1000):
    return {"step": step, "seed": 0, "rules": [A, B], "delta": 0.15, "k": 20, "tolerance": 1e-9,
            "tokens": tokens, "zero_advantage": 100, "outside": outside,
            "pairs": {f"{A}|{B}": {"disagreement": disagreement, A: {"topk_kl": rates(*a), "full_kl": None},
                                   B: {"topk_kl": rates(*b), "full_kl": None}}},
            "dropped_outside": {}}


def points(n, a=(4, 3, 1), b=(3, 0, 3)):
    return transfer.loop_points([line(s, a, b) for s in range(1, n + 1)], A, B)


def test_side_summary_counts_and_ci():
    side = transfer.side_summary(points(12), A, B, n_boot=500)
    assert side["outside_fraction"]["mean"] == pytest.approx(10 / 900)
    assert side["disagreement_fraction"]["mean"] == pytest.approx(0.7)
    assert side[A]["unsafe_keep"]["rate"] == pytest.approx(0.75) and side[A]["unsafe_keep"]["tokens"] == 48
    assert side[B]["unsafe_keep"]["rate"] == 0.0 and side[B]["shrink"]["rate"] == 1.0
    assert side["diff_pooled"]["mean_diff"] == pytest.approx(0.75)
    assert side["sufficiency"]["sufficient"] and side["fewer_unsafe"] == B
    assert "pdm_topk keeps fewer" in side["verdict"]


def test_pooled_rate_ci_is_the_pooled_count_with_a_cluster_bootstrap():
    entries = [rates(10, 1, 0), rates(10, 9, 0), rates(0, 0, 0)]
    out = transfer.pooled_rate_ci(entries, "grew", n_boot=2000)
    assert out["rate"] == pytest.approx(0.5) and out["tokens"] == 20
    assert out["ci_low"] < 0.5 < out["ci_high"] and out["ci_low"] >= 0.1 - 1e-12
    assert math.isnan(transfer.pooled_rate_ci([rates(0, 0, 0)], "grew")["rate"])


@pytest.mark.parametrize("n,tokens_ok,expected", [(10, True, True), (9, True, False), (12, False, False)])
def test_sufficiency_is_spec_6s_minimum(n, tokens_ok, expected):
    # 10 points with kept tokens for both rules and ≥ 30 tokens each; (1, 1, 0) per point gives only 12
    pts = points(n) if tokens_ok else points(n, a=(1, 1, 0), b=(1, 0, 1))
    assert transfer.sufficiency(pts, A, B)["sufficient"] is expected


def test_transfer_verdict_never_calls_insufficient_data_agreement():
    good = transfer.side_summary(points(12), A, B, n_boot=300)
    thin = transfer.side_summary(points(3), A, B, n_boot=300)  # the same direction, too few points
    assert thin["verdict"] == "insufficient data"
    assert transfer.transfer_verdict(good, good, True)["outcome"] == "transfers"
    for toy, loop, which in ((good, thin, "loop"), (thin, good, "toy"), (thin, thin, "toy and loop")):
        out = transfer.transfer_verdict(toy, loop, True)
        assert out == {"outcome": "undecided", "reason": f"insufficient data ({which})"}
    flipped = transfer.side_summary(points(12, a=(3, 0, 3), b=(4, 3, 1)), A, B, n_boot=300)
    assert transfer.transfer_verdict(good, flipped, True)["outcome"] == "does not transfer"


def diff(mean, lo, hi):
    return {"mean_diff": mean, "ci_low": lo, "ci_high": hi}


@pytest.mark.parametrize("toy,loop,faithful,expected", [
    (diff(0.1, 0.05, 0.15), diff(0.2, 0.1, 0.3), False, "unfaithful toy"),   # intervals alone: transfers
    (diff(0.02, -0.01, 0.05), diff(-0.01, -0.04, 0.02), True, "undecided"),  # both contain 0
    (diff(0.1, 0.05, 0.15), diff(0.2, 0.1, 0.3), True, "transfers"),
    (diff(-0.1, -0.15, -0.05), diff(-0.02, -0.12, 0.03), True, "consistent"),  # loop contains the toy's −0.1
    (diff(0.1, 0.05, 0.15), diff(0.03, -0.01, 0.08), True, "does not transfer"),  # loop misses the toy's 0.1
    (diff(0.1, 0.05, 0.15), diff(-0.02, -0.05, 0.2), True, "does not transfer"),  # contains it, opposite sign
    (diff(0.1, 0.05, 0.15), diff(-0.2, -0.3, -0.1), True, "does not transfer"),   # both exclude 0, opposite
    (diff(0.1, 0.05, 0.15), diff(0.2, 0.1, 0.3), None, "undecided"),  # no probe keys in the run: not faithful
])
def test_each_spec_6c_outcome(toy, loop, faithful, expected):
    assert outcome(toy, loop, faithful)["outcome"] == expected


@given(st.lists(st.floats(-1, 1), min_size=4, max_size=4), st.sampled_from([True, None]))
def test_two_intervals_that_contain_0_never_transfer(xs, faithful):
    a_lo, a_hi, b_lo, b_hi = -abs(xs[0]), abs(xs[1]), -abs(xs[2]), abs(xs[3])
    toy, loop = diff((a_lo + a_hi) / 2, a_lo, a_hi), diff((b_lo + b_hi) / 2, b_lo, b_hi)
    assert outcome(toy, loop, faithful)["outcome"] == "undecided"


def probe_keys(agree=0.8, cos=0.3, memory=0.7, dd=2.0, n=300):
    """A pooled probe and decomposition with the keys the toy and the loop write."""
    probe = {"probe/tokens": n, f"probe/agree/{A}/outside/topk_kl": {"rate": agree, "lo": agree - 0.05, "hi": agree + 0.05, "n": n},
             f"probe/agree/{B}/outside/topk_kl": {"rate": 1 - agree, "lo": 0.95 - agree, "hi": 1.05 - agree, "n": n},
             "probe/cos_kv_v": {"median": cos, "lo": cos - 0.05, "hi": cos + 0.05, "n": n}}
    decomp = {A: {"decomp/tokens": n, "decomp/share/memory": {"mean": memory, "lo": memory - 0.05, "hi": memory + 0.05},
                  "decomp/median_abs_dd_over_d": {"value": dd, "lo": dd * 0.8, "hi": dd * 1.2}}}
    return probe, decomp


def test_a_toy_outside_the_runs_probe_intervals_is_unfaithful_and_never_transfers():
    run = faithful_mod.probe_statistics(*probe_keys(), [A, B])
    same = faithful_mod.probe_statistics(*probe_keys(agree=0.81, dd=2.1), [A, B])
    tabular = faithful_mod.probe_statistics(*probe_keys(cos=1.0, memory=0.0, dd=0.01), [A, B])
    assert faithful_mod.faithfulness(same, run)["faithful"] is True
    faith = faithful_mod.faithfulness(tabular, run)
    assert faith["faithful"] is False
    assert {k for k, s in faith["statistics"].items() if not s["match"]} == {"cos_kv_v", "memory_share",
                                                                              "median_abs_dd_over_d"}
    good = transfer.side_summary(points(12), A, B, n_boot=300)
    assert transfer.transfer_verdict(good, good, faith["faithful"])["outcome"] == "unfaithful toy"


def test_a_run_without_probe_keys_is_said_to_have_none():
    lines = [line(s) for s in range(1, 4)]  # an older audit.jsonl: no "probe" key
    assert faithful_mod.run_statistics(lines, [A, B]) is None
    faith = faithful_mod.faithfulness(faithful_mod.probe_statistics(*probe_keys(), [A, B]), None)
    assert faith["faithful"] is None and "no probe keys" in faith["reason"]
    md = "\n".join(transfer.faithfulness_lines(faith))
    assert "no probe keys" in md


def test_read_audit_lines_keeps_the_last_line_of_a_redone_step_and_refuses_mixed_settings(tmp_path):
    rows = [line(1), line(2, a=(1, 1, 0)), line(2, a=(5, 0, 5))]
    (tmp_path / "audit.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines = transfer.read_audit_lines(tmp_path)
    assert [r["step"] for r in lines] == [1, 2] and lines[1]["pairs"][f"{A}|{B}"][A]["topk_kl"]["count"] == 5
    bad = dict(line(3), delta=0.05)
    (tmp_path / "audit.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [bad]) + "\n")
    with pytest.raises(ValueError, match="delta"):
        transfer.read_audit_lines(tmp_path)


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "audit.jsonl").write_text("\n".join(json.dumps(line(s)) for s in range(1, 4)) + "\n")
    sample = []
    for i in range(2000):  # 0.5% of tokens above δ = 0.15
        sample.append({"step": 1, "d": 0.3 if i % 200 == 0 else 1e-3 * (1 + i % 7), "mu_tail": 0.001,
                       "pi_tail": 0.001, "r": 1.0, "adv": 1.0 if i % 3 else -1.0})
    (run / "mismatch_sample.jsonl").write_text("\n".join(json.dumps(r) for r in sample) + "\n")
    return run


def test_transfer_command_as_a_user_runs_it(tmp_path):
    run, out = _run_dir(tmp_path), tmp_path / "out"
    cmd = [sys.executable, "-m", "pdm_lab", "transfer", str(run), "--out", str(out), "--preset", "quick",
           "--seeds", "2", "--n-boot", "200", "--search-iters", "3", "sequences=64", "group_size=8", "audit_at=[0]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    doc = json.loads((out / "transfer.json").read_text())
    assert doc["target_outside_fraction"] == pytest.approx(0.005, rel=0.2)
    assert doc["target_source"] == "mismatch_sample.jsonl"
    assert doc["toy_mismatch"] != "none" and doc["toy"]["points"] == 2 and doc["loop"]["points"] == 3
    assert doc["loop"][A]["unsafe_keep"]["rate"] == pytest.approx(0.75)
    assert doc["transfer"] == "undecided"  # 3 loop points, 2 toy seeds: below SPEC §6's minimum
    assert doc["transfer_reason"].startswith("insufficient data")
    assert doc["faithfulness"]["faithful"] is None and "no probe keys" in doc["faithfulness"]["reason"]
    md = (out / "transfer.md").read_text()
    assert "| outside fraction" in md and "insufficient data" in md and "no probe keys" in md


def test_transfer_pools_several_runs_and_refuses_mixed_settings(tmp_path):
    runs = []
    for name, delta in (("a", 0.15), ("b", 0.15), ("c", 0.05)):
        run = tmp_path / name
        run.mkdir()
        (run / "audit.jsonl").write_text("\n".join(json.dumps(dict(line(s), delta=delta)) for s in (1, 2)) + "\n")
        runs.append(run)
    with pytest.raises(ValueError, match="delta"):
        transfer.run_transfer(runs, tmp_path / "out", preset(AUDIT_PRESETS, "quick"), preset_name="quick", seeds=1)
    lines = [x for run in runs[:2] for x in transfer.read_audit_lines(run)]
    assert len(transfer.loop_points(lines, A, B)) == 4  # two runs' steps 1, 2: four audit points


def test_transfer_command_names_a_missing_audit_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdm_lab", "transfer", str(tmp_path), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "audit.jsonl" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [b'{"step": 1, "rules": ["dppo', b"[1, 2]", b'{"step": "abc", "rules": [], "delta": 0.15, "k": 20}'])
def test_a_refused_transfer_names_the_line_and_leaves_no_out_folder(tmp_path, bad):
    import json as _json
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    good = _json.dumps({"step": 0, "rules": ["dppo_topk_kl", "pdm_topk"], "delta": 0.15, "k": 20}).encode()
    (run / "audit.jsonl").write_bytes(good + b"\n" + bad + b"\n")
    res = subprocess.run([sys.executable, "-m", "pdm_lab", "transfer", str(run), "--out", str(tmp_path / "t")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "audit.jsonl:2" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "t").exists()
