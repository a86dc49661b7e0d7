"""Promotion from a toy sweep through the core results schema: the criterion, the evidence it
needs (separated from the runner-up at 95%, long enough runs, enough seeds), the written config,
the output-path policy, and every bad sweep refused in one line (paths outside the sweep,
non-finite values, truncated or foreign files)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from pdm_lab.mask_config import MaskConfig
from pdm_lab.lab.results import SCHEMA_VERSION, ResultsError, SweepRow, read_results, write_results
from pdm_lab.scaling.config import load_config
from pdm_lab.scaling.promote import SweepError, choose, group_cells, promote

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"


def row(cell_id, rule, reward, seed, *, collapsed=False, unsafe=0.3, delta=0.15, estimator="uniform", steps=40):
    return SweepRow(
        cell_id=cell_id, seed=seed, problem="bandit", policy="tabular", rule=rule, delta=delta, k=20,
        convention="union", estimator=estimator, mismatch="fp8_e4m3_weights:0.5", mismatch_kind="fp8",
        mismatch_strength=0.5, optimizer="adam", lr=0.05, steps=steps, epochs=1, minibatches=1,
        initial_reward=0.1, final_reward=reward, collapsed=collapsed, nonfinite=False,
        realised_topk_kl_mean=0.01, realised_topk_kl_max=0.2, realised_full_kl_mean=0.02,
        realised_full_kl_max=0.3, update_topk_kl_mean=0.01, mask_fraction=0.05, outside_fraction=0.1,
        dir_disagree=math.nan, unsafe_keep=unsafe, shrink=1 - unsafe, unsafe_keep_count=100,
        unsafe_count=round(100 * unsafe), shrink_count=100 - round(100 * unsafe), wall_s=1.0)


def cell_rows(cell_id, rule, rewards, *, collapsed=(), **kw):
    return [row(cell_id, rule, r, seed, collapsed=seed in collapsed, **kw) for seed, r in enumerate(rewards)]


#: Two seeds per cell and near-equal leaders: ``choose`` ranks it, ``promote`` refuses it.
SWEEP = (cell_rows("c_ratio", "ppo_clip", [0.70, 0.72])
         + cell_rows("c_collapse", "none", [0.95, 0.10], collapsed=(1,))  # best mean? no: collapsed
         + cell_rows("c_pdm_a", "pdm_topk", [0.80, 0.82], unsafe=0.34, estimator="topk")
         + cell_rows("c_pdm_b", "pdm_uniform", [0.82, 0.80], unsafe=0.31, delta=0.05)
         + cell_rows("c_dppo", "dppo_topk_kl", [0.75, 0.77]))


#: Three seeds, 40 steps, the winner clear of the runner-up: promotes.
SEPARATED = (cell_rows("c_ratio", "ppo_clip", [0.70, 0.72, 0.71])
             + cell_rows("c_collapse", "none", [0.95, 0.10, 0.9], collapsed=(1,))
             + cell_rows("c_pdm_b", "pdm_uniform", [0.82, 0.80, 0.81], unsafe=0.31, delta=0.05)
             + cell_rows("c_dppo", "dppo_topk_kl", [0.75, 0.77, 0.76]))

#: A near-tie example: ppo_clip chosen by a 0.136 mean over two 10-step seeds, tied with the runner-up.
ISSUE_EXAMPLE = (cell_rows("c_ppo", "ppo_clip", [0.130, 0.142], steps=10)
                 + cell_rows("c_dppo", "dppo_topk_kl", [0.129, 0.139], steps=10, estimator="topk")
                 + cell_rows("c_none", "none", [0.20, 0.05], collapsed=(1,), steps=10))


def sweep_dir(tmp_path, rows=SEPARATED, name="sweep") -> Path:
    out = tmp_path / name
    out.mkdir()
    write_results(out, rows)
    return out


def test_criterion_excludes_collapse_and_breaks_ties_by_unsafe_keep():
    cells = group_cells(SWEEP)
    assert len(cells) == 5
    assert choose(cells).cell_id == "c_pdm_b"  # ties with c_pdm_a on mean reward, lower unsafe-keep
    assert choose([c for c in cells if c.cell_id != "c_pdm_b"]).cell_id == "c_pdm_a"
    with pytest.raises(SweepError, match="every one of the 1 cells collapsed"):
        choose([c for c in cells if c.cell_id == "c_collapse"])
    with pytest.raises(SweepError, match="disagree on the mask"):
        group_cells(cell_rows("c", "pdm_topk", [0.5]) + cell_rows("c", "pdm_agg", [0.5]))


def test_promote_from_json_writes_a_runnable_config(tmp_path):
    sweep = sweep_dir(tmp_path)
    out = tmp_path / "promoted.yaml"
    prov = promote(sweep, BASE, out, log=lambda *_: None)
    cfg = load_config(out)  # the written file loads with the same schema
    base = load_config(BASE)
    assert cfg.mask == MaskConfig(rule="pdm_uniform", delta=0.05, k=20, convention="union")  # own estimator
    assert cfg.mask.direction_estimator == "uniform"
    assert cfg.rollout == base.rollout and cfg.trainer == base.trainer and cfg.model == base.model
    assert cfg.provenance.cell_id == "c_pdm_b" and cfg.provenance.sweep_dir == str(sweep)
    m = cfg.provenance.metrics
    assert m["final_reward_mean"] == pytest.approx(0.81) and m["unsafe_keep_mean"] == pytest.approx(0.31)
    assert m["dir_disagree_mean"] is None  # n/a, never 0.0
    assert m["mismatch_kind"] == "fp8" and m["lr"] == 0.05 and m["seeds"] == 3 and m["cells_collapsed"] == 1
    ev = m["evidence"]
    assert ev["separated"] and ev["runner_up_cell"] == "c_dppo" and ev["seeds"] == 3 and ev["steps"] == [40]
    assert ev["difference"]["ci95"][0] > 0 and ev["chosen"]["mean"] == pytest.approx(0.81)
    assert cfg.provenance.code_version and cfg.provenance.created.endswith("Z")
    assert "criterion" in prov and "never-collapsed" in prov["criterion"]
    text = out.read_text()
    assert text.startswith("# promoted from toy sweep") and "pdm-lab train --config" in text
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("runner-up c_dppo" in h and "95% Welch CI [+" in h for h in header)
    assert any(h.startswith("# regime: problem bandit") and "40 steps" in h for h in header)
    assert "# verdict: separated at 95%" in header


def test_the_issue_example_is_refused_and_allow_tie_says_so(tmp_path, capsys):
    """ppo_clip by a 0.136 mean over two 10-step seeds, tied with the runner-up: exit 2, one line."""
    from pdm_lab.cli.main import main

    sweep = sweep_dir(tmp_path, ISSUE_EXAMPLE)
    out = tmp_path / "launch.sh"
    args = ["promote", str(sweep), "--base", str(BASE), "--out", str(out), "--target", "verl"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to promote cell c_ppo" in err
    assert "not separated from the runner-up c_dppo" in err and "includes 0" in err
    assert "runs of 10 steps < 30, the collapse definition's minimum" in err and "2 seeds < 3 per configuration" in err
    assert not out.exists() and not Path(str(out) + ".pdm.yaml").exists()
    assert main(args + ["--allow-tie"]) == 0
    text = out.read_text()
    assert "# verdict: NOT evidence, promoted with --allow-tie: not separated" in text
    assert "final reward of the chosen cell c_ppo: 0.136" in text and "runner-up c_dppo: 0.134" in text
    cfg = load_config(Path(str(out) + ".pdm.yaml"))
    assert cfg.provenance.metrics["evidence"]["allow_tie"] and not cfg.provenance.metrics["evidence"]["separated"]


def test_the_only_never_collapsed_cell_says_so(tmp_path):
    rows = cell_rows("a", "pdm_topk", [0.9, 0.91, 0.92], estimator="topk") + cell_rows(
        "b", "ppo_clip", [0.95, 0.2, 0.9], collapsed=(1,))
    out = tmp_path / "only.yaml"
    promote(sweep_dir(tmp_path, rows), BASE, out, log=lambda *_: None)
    ev = load_config(out).provenance.metrics["evidence"]
    assert ev["sufficient"] and not ev["separated"] and ev["runner_up_cell"] is None
    assert "# verdict: the only never-collapsed cell (every other cell collapsed)" in out.read_text()


def test_each_shortfall_alone_refuses(tmp_path):
    """Separated but too short; separated but too few seeds; long and many but tied."""
    cases = {"too_short": cell_rows("a", "pdm_topk", [0.9, 0.91, 0.92], steps=20, estimator="topk")
             + cell_rows("b", "ppo_clip", [0.5, 0.51, 0.52], steps=20),
             "too_few": cell_rows("a", "pdm_topk", [0.9, 0.91], estimator="topk") + cell_rows("b", "ppo_clip", [0.5, 0.51]),
             "tied": cell_rows("a", "pdm_topk", [0.9, 0.5, 0.7, 0.8], estimator="topk")
             + cell_rows("b", "ppo_clip", [0.6, 0.8, 0.7, 0.75])}
    why = {"too_short": "runs of 20 steps < 30", "too_few": "2 seeds < 3",
           "tied": "not separated from the runner-up b"}
    for name, rows in cases.items():
        with pytest.raises(SweepError, match=why[name]) as err:
            promote(sweep_dir(tmp_path, rows, name), BASE, tmp_path / f"{name}.yaml", log=lambda *_: None)
        assert [w for w in why if why[w] in str(err.value)] == [name]  # that reason alone
        assert not (tmp_path / f"{name}.yaml").exists()


def test_output_policy_refuses_inputs_and_foreign_files(tmp_path, capsys):
    from pdm_lab.cli.main import main

    sweep = sweep_dir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(BASE.read_text())
    results = (sweep / "results.json").read_bytes()
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    cases = [(sweep / "results.json", "the sweep's results.json"), (sweep / "results.csv", "the sweep's results.csv"),
             (base, "the --base config"), (sweep / ".." / sweep.name / "results.json", "results.json"),
             (notes, "was not written by this command")]
    for out, why in cases:
        assert main(["promote", str(sweep), "--base", str(base), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1
    assert (sweep / "results.json").read_bytes() == results and base.read_text() == BASE.read_text()
    assert notes.read_text() == "my notes\n"
    mine = tmp_path / "promoted.yaml"  # promote's own earlier output is overwritten
    assert main(["promote", str(sweep), "--base", str(base), "--out", str(mine)]) == 0
    assert main(["promote", str(sweep), "--base", str(base), "--out", str(mine)]) == 0
    assert main(["promote", str(sweep), "--base", str(base), "--out", str(notes), "--force"]) == 0
    assert notes.read_text().startswith("# promoted from toy sweep")


def test_csv_reads_back_the_same_rows(tmp_path):
    sweep = sweep_dir(tmp_path, SWEEP)
    from_json = read_results(sweep)
    (sweep / "results.json").unlink()
    from_csv = read_results(sweep)

    def same(a, b):
        return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                   for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))

    assert len(from_csv) == len(SWEEP) and all(same(a, b) for a, b in zip(from_json, from_csv))
    assert all(same(a, b) for a, b in zip(from_csv, SWEEP))
    assert all(math.isnan(r.dir_disagree) for r in from_csv)  # empty CSV cell: n/a
    assert {r.rule for r in from_csv} >= {"none", "pdm_topk"}  # the rule called "none" stays a rule


def test_full_mask_from_the_cells_config(tmp_path):
    sweep = sweep_dir(tmp_path)
    (sweep / "cells" / "c_pdm_b").mkdir(parents=True)
    full = {"rule": "pdm_uniform", "delta": 0.05, "k": 20, "convention": "union", "estimator": "uniform",
            "eps_high": 0.3, "clip_ratio_c": 2.0, "aggregation": "seq-mean-token-mean"}
    (sweep / "cells" / "c_pdm_b" / "config.json").write_text(json.dumps({"mask": full, "lr": 0.05}))
    out = tmp_path / "p.yaml"
    promote(sweep, BASE, out, log=lambda *_: None)
    assert load_config(out).mask == MaskConfig(**full)
    promote(sweep, BASE, out, keep_base_aggregation=True, log=lambda *_: None)
    kept = load_config(out).mask
    assert (kept.aggregation, kept.horizon) == ("seq-mean-token-sum-norm", 8192) and kept.eps_high == 0.3
    (sweep / "cells" / "c_pdm_b" / "config.json").write_text(json.dumps({"mask": {**full, "delta": 0.15}}))
    with pytest.raises(SweepError, match="mask.delta=0.15 but the results rows say 0.05"):
        promote(sweep, BASE, out, log=lambda *_: None)


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_bad_sweeps_are_one_line_errors_naming_the_file(tmp_path):
    with pytest.raises(ResultsError, match="no results.json or results.csv"):
        promote(tmp_path, BASE, tmp_path / "x.yaml")
    sweep = sweep_dir(tmp_path)
    js = sweep / "results.json"
    full = js.read_text()
    js.write_text(full[: len(full) // 2])  # truncated mid-write
    with pytest.raises(ResultsError) as err:
        promote(sweep, BASE, tmp_path / "x.yaml")
    assert str(js) in _one_line(err.value) and "truncated" in str(err.value)

    doc = json.loads(full)
    doc["rows"][0]["delta"] = float("nan")  # Python's json writes NaN; the reader refuses it
    js.write_text(json.dumps(doc))
    with pytest.raises(ResultsError, match=r"row 0\.delta: must be finite"):
        promote(sweep, BASE, tmp_path / "x.yaml")
    doc["rows"][0]["delta"] = None
    js.write_text(json.dumps(doc))
    with pytest.raises(ResultsError, match=r"row 0\.delta: must be finite"):
        promote(sweep, BASE, tmp_path / "x.yaml")

    js.write_text(json.dumps({**json.loads(full), "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ResultsError, match="schema_version"):
        promote(sweep, BASE, tmp_path / "x.yaml")
    js.write_text(json.dumps(json.loads(full)["rows"]))  # an older, unversioned table
    with pytest.raises(ResultsError, match="schema_version"):
        promote(sweep, BASE, tmp_path / "x.yaml")

    bad_rule = sweep_dir(tmp_path, cell_rows("c", "not_a_rule", [0.5]), "bad_rule")
    with pytest.raises(Exception, match="mask.rule"):
        promote(bad_rule, BASE, tmp_path / "x.yaml", log=lambda *_: None)


def test_paths_stay_inside_the_sweep_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"mask": {"rule": "none"}}))
    doc = {"schema_version": SCHEMA_VERSION, "rows": [dataclasses.asdict(r) for r in cell_rows("x", "none", [0.9])]}
    for crafted in ("../../../outside", "../outside", "/abs", "a/b", ".."):
        sweep = tmp_path / f"s{abs(hash(crafted))}"
        (sweep / "cells").mkdir(parents=True)
        doc["rows"][0]["cell_id"] = crafted
        (sweep / "results.json").write_text(json.dumps(doc))
        with pytest.raises(ResultsError, match="cell_id") as err:
            promote(sweep, BASE, tmp_path / "x.yaml", log=lambda *_: None)
        _one_line(err.value)
    sweep = sweep_dir(tmp_path, cell_rows("linked", "none", [0.9]), "linked_sweep")
    (sweep / "cells").mkdir()
    (sweep / "cells" / "linked").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ResultsError, match="outside the sweep directory"):
        promote(sweep, BASE, tmp_path / "x.yaml", log=lambda *_: None)


def test_non_finite_or_truncated_cell_config(tmp_path):
    sweep = sweep_dir(tmp_path)
    cfg_path = sweep / "cells" / "c_pdm_b" / "config.json"
    cfg_path.parent.mkdir(parents=True)
    cfg_path.write_text('{"mask": {"rule": "pdm_uniform", "delta": NaN, "k": 20, "convention": "union"}}')
    with pytest.raises(SweepError, match="mask.delta = nan is not finite"):
        promote(sweep, BASE, tmp_path / "x.yaml", log=lambda *_: None)
    cfg_path.write_text('{"mask": {"rule": "pdm_uni')
    with pytest.raises(SweepError) as err:
        promote(sweep, BASE, tmp_path / "x.yaml", log=lambda *_: None)
    assert str(cfg_path) in _one_line(err.value)


def test_promote_cli(tmp_path, capsys):
    from pdm_lab.cli.main import main

    sweep = sweep_dir(tmp_path, name="s")
    out = tmp_path / "o.yaml"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["mask"]["rule"] == "pdm_uniform"
    capsys.readouterr()
    with pytest.raises(SweepError, match="--tie-tol: must be a finite number ≥ 0"):  # the library's own guard
        choose(group_cells(SWEEP), tie_tol=-1.0)
    assert main(["promote", str(tmp_path / "missing"), "--base", str(BASE), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no results.json" in err and err.count("\n") == 1


def test_promote_from_a_real_toy_sweep(tmp_path):
    """The toy stage's own sweep output (results schema, cells/<id>/config.json) promotes unchanged."""
    from pdm_lab.cli.main import main

    out_dir = tmp_path / "sweep"
    assert main(["sweep", "--preset", "quick", "rules=[dppo_topk_kl,pdm_uniform]", "mismatches=[noise:1]",
                 "tis_rules=[]", "minibatches=[1]",
                 "base.problem.kind=bandit", "base.policy=tabular", "base.steps=3", "--seeds", "2",
                 "--workers", "1", "--no-audit", "--quiet", "--out", str(out_dir)]) == 0
    out = tmp_path / "promoted.yaml"
    with pytest.raises(SweepError, match="runs of 3 steps < 30"):  # a 3-step toy is no evidence
        promote(out_dir, BASE, out, log=lambda *_: None)
    prov = promote(out_dir, BASE, out, allow_tie=True, log=lambda *_: None)
    cfg = load_config(out)
    cells = group_cells(read_results(out_dir))
    assert len(cells) == 2
    alive = [c for c in cells if not c.collapsed]
    chosen = next(c for c in cells if c.cell_id == prov["cell_id"])
    assert chosen.mean("final_reward") == max(c.mean("final_reward") for c in alive)
    assert cfg.mask.rule == chosen.mask["rule"] and cfg.provenance.metrics["seeds"] == 2
