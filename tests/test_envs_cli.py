"""`pdm-lab audit` and `pdm-lab sweep` as a user runs them (subprocesses of the installed entry point)."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).with_name("pdm-lab")


def run(*args, cwd=None, timeout=900):
    cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "pdm_lab"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("cmd", ["audit", "sweep"])
def test_help(cmd):
    res = run(cmd, "--help")
    assert res.returncode == 0 and f"usage: pdm-lab {cmd}" in res.stdout


@pytest.mark.slow
def test_quick_preset_end_to_end(tmp_path):
    """The README's main command: the quick sweep and the audit, then a report (its grid at 3 of
    the preset's 6 seeds, to keep the suite's time; ``make run``'s own figures are in docs)."""
    res = run("sweep", "--preset", "quick", "--seeds", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "runs" / "sweep-quick"
    assert f"report: {Path('runs') / 'sweep-quick' / 'report.md'}" in res.stdout
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 * 4 * 3  # (4 rules + TIS) × (3 precision points + 1 staleness point) × seeds
    assert {int(r["minibatches"]) for r in rows} == {1, 8}
    assert all(int(r["optimizer_steps"]) == 30 * int(r["minibatches"]) for r in rows if r["nonfinite"] == "false")
    for column in ("rule", "delta", "k", "convention", "estimator", "mismatch_kind", "mismatch_strength",
                   "seed", "cell_id", "final_reward", "collapsed", "unsafe_keep",
                   "realised_topk_kl_mean", "realised_full_kl_mean", "mask_fraction"):
        assert column in rows[0]
    report = (out / "report.md").read_text()
    for needle in ("Regime (SPEC §6b calibration table)", "Which configuration won", "highest final reward",
                   "Direction audit", "effective per-token step", "one token per state",
                   "figures/final_reward_vs_mismatch.png"):
        assert needle in report
    # 30-step runs over 3 seeds: a collapse rate, and the two-axis strength study's verdicts
    assert "- lowest collapse rate: " in report and "- highest final reward: " in report
    for needle in ("### Strength study (two axes)", "#### precision axis", "#### staleness axis",
                   "precision axis (none → lognormal:0.5): where each rule first degrades",
                   "staleness axis: where rules separate", "none+TIS(c=2)", "MDD (reward, 80% power)"):
        assert needle in report, needle
    for png in ("learning_curves", "final_reward_vs_mismatch", "collapse_vs_mismatch",
                "unsafe_keep_vs_mismatch", "mask_fraction_vs_mismatch", "strength_reward", "strength_collapse"):
        assert (out / "figures" / f"{png}.png").stat().st_size > 1000
    # the report opens with its summary; the stress audit separates the rules, said to be a stress setting
    assert report.startswith("# pdm_lab toy sweep\n\n## Summary\n")
    assert "Separated (the interval excludes 0): `noise:1` (**stress**)" in report
    audit = json.loads((out / "audit" / "audit.json").read_text())
    assert len(audit["per_seed"]) == 2 and audit["pairs"][0]["audit_step"] > 0  # the quick audit: a trained point
    # the quick audit preset's power per seed at its trained point: ≥ 20 disagreement tokens each
    from pdm_lab.audit.measure import INSUFFICIENT
    from pdm_lab.envs.presets import AUDIT_PRESETS
    quick = AUDIT_PRESETS["quick"]
    assert audit["pairs"][0]["audit_step"] == quick.main_step
    assert min(audit["pairs"][0]["disagreement_per_seed"]) >= 20, audit["pairs"][0]["disagreement_per_seed"]
    assert audit["pairs"][0]["verdict"].startswith(INSUFFICIENT)  # two seeds: never a verdict
    assert [p["step"] for p in audit["trajectory"]] == list(quick.audit_at)
    again = run("sweep", "--preset", "quick", "--seeds", "3", cwd=tmp_path)  # resumes: nothing to recompute
    assert again.returncode == 0 and "0 runs now, 60 reused" in again.stdout


def test_audit_command_writes_json_and_summary(tmp_path):
    res = run("audit", "--preset", "stress", "--seeds", "3", "sequences=256", "k_sweep=[5,20]",
              "--contexts", "distinct", "--out", str(tmp_path / "a"), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert doc["config"]["seeds"] == 3 and len(doc["per_seed"]) == 3
    assert list(doc["contexts"]) == ["distinct"] and doc["main_contexts"] == "distinct"
    assert "sign test p" in res.stdout and (tmp_path / "a" / "audit.md").exists()
    assert (tmp_path / "a" / "audit_k_sweep.png").exists()


def test_sweep_from_a_yaml_config_with_key_path_overrides(tmp_path):
    """Preset, then the YAML file, then key.path=value overrides (the same syntax as `train`)."""
    cfg = tmp_path / "grid.yaml"
    cfg.write_text("base:\n  problem:\n    kind: bandit\n  steps: 5\n  groups_per_step: 8\n"
                   "rules: [ppo_clip, pdm_agg]\nmismatches: [none]\ntis_rules: []\nminibatches: [1]\nseeds: 1\n")
    res = run("sweep", "--config", str(cfg), "mismatches=[noise:0.5,tail_noise:0.5]", "--out", str(tmp_path / "s"),
              "deltas=[0.05]", "base.steps=2", "--no-audit", "--quiet", "--workers", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "s" / "results.json").read_text())["rows"]
    assert {r["steps"] for r in rows} == {2}  # the override wins over the file
    assert {(r["rule"], r["mismatch"], r["delta"]) for r in rows} == {
        (rule, mm, 0.05) for rule in ("ppo_clip", "pdm_agg") for mm in ("noise:0.5", "tail_noise:0.5")}
    assert {r["estimator"] for r in rows if r["rule"] == "pdm_agg"} == {"agg"}


def test_unknown_yaml_key_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("rulez: [none]\n")
    res = run("sweep", "--config", str(cfg), "--out", str(tmp_path / "s"))
    assert res.returncode != 0 and "rulez" in res.stderr and "rules" in res.stderr
    res = run("sweep", "base.stepz=3", "--out", str(tmp_path / "s"))
    assert res.returncode == 2 and "did you mean 'steps'" in res.stderr and res.stderr.count("\n") == 1
    res = run("audit", "rules=[dppo_topk_kl,pdm_topkk]", "--out", str(tmp_path / "a"))
    assert res.returncode == 2 and "did you mean 'pdm_topk'" in res.stderr
