"""Promotion from a toy sweep: the criterion, a tolerant reader (JSON and CSV, strings for numbers,
missing cell ids, extra columns, unusable rows), and a written config that loads and validates."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from pdm_lab.config import MaskConfig
from pdm_lab.scaling.config import load_config
from pdm_lab.scaling.promote import SweepError, choose, group_cells, promote, read_results

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "scaling" / "configs" / "qwen3-4b-base-dapo.yaml"


def cell_rows(cell_id, rule, rewards, *, collapsed=(), unsafe=0.3, delta=0.15, estimator="uniform",
              extra=None):
    rows = []
    for seed, r in enumerate(rewards):
        rows.append({"cell_id": cell_id, "rule": rule, "delta": delta, "k": 20, "convention": "union",
                     "estimator": estimator, "mismatch_kind": "fp8", "mismatch_strength": 0.5,
                     "seed": seed, "final_reward": r, "collapsed": seed in collapsed, "unsafe_keep": unsafe,
                     **(extra or {})})
    return rows


SWEEP = (cell_rows("c_ratio", "ppo_clip", [0.70, 0.72])
         + cell_rows("c_collapse", "none", [0.95, 0.10], collapsed=(1,))  # best mean? no: collapsed
         + cell_rows("c_pdm_a", "pdm_topk", [0.80, 0.82], unsafe=0.34, estimator="topk")
         + cell_rows("c_pdm_b", "pdm_uniform", [0.82, 0.80], unsafe=0.31, delta=0.05)
         + cell_rows("c_dppo", "dppo_topk_kl", [0.75, 0.77]))


def test_criterion_excludes_collapse_and_breaks_ties_by_unsafe_keep():
    cells, warnings = group_cells(SWEEP)
    assert not warnings and len(cells) == 5
    best = choose(cells)
    assert best.cell_id == "c_pdm_b"  # ties with c_pdm_a on mean reward, lower unsafe-keep
    assert choose([c for c in cells if c.cell_id != "c_pdm_b"]).cell_id == "c_pdm_a"
    with pytest.raises(SweepError, match="every one of the 1 cells collapsed"):
        choose([c for c in cells if c.cell_id == "c_collapse"])


def test_promote_from_json_writes_a_runnable_config(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.json").write_text(json.dumps(SWEEP))
    out = tmp_path / "promoted.yaml"
    prov = promote(sweep, BASE, out, log=lambda *_: None)
    cfg = load_config(out)  # the written file loads with the same schema
    base = load_config(BASE)
    assert cfg.mask == MaskConfig(rule="pdm_uniform", delta=0.05, k=20, convention="union", estimator="uniform")
    assert cfg.rollout == base.rollout and cfg.trainer == base.trainer and cfg.model == base.model
    assert cfg.provenance.cell_id == "c_pdm_b" and cfg.provenance.sweep_dir == str(sweep)
    m = cfg.provenance.metrics
    assert m["final_reward_mean"] == pytest.approx(0.81) and m["unsafe_keep_mean"] == pytest.approx(0.31)
    assert m["mismatch_kind"] == "fp8" and m["seeds"] == 2 and m["cells_collapsed"] == 1
    assert cfg.provenance.code_version and cfg.provenance.created.endswith("Z")
    assert "criterion" in prov and "never-collapsed" in prov["criterion"]
    text = out.read_text()
    assert text.startswith("# promoted from toy sweep") and "pdm-lab train --config" in text


def test_full_mask_from_the_cells_config(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "cells" / "c_pdm_b").mkdir(parents=True)
    (sweep / "results.json").write_text(json.dumps(SWEEP))
    full = {"rule": "pdm_uniform", "delta": 0.05, "k": 20, "convention": "union", "estimator": "uniform",
            "eps_high": 0.3, "clip_ratio_c": 2.0, "aggregation": "seq-mean-token-mean"}
    (sweep / "cells" / "c_pdm_b" / "config.json").write_text(json.dumps({"mask": full, "lr": 0.05}))
    out = tmp_path / "p.yaml"
    promote(sweep, BASE, out, log=lambda *_: None)
    assert load_config(out).mask == MaskConfig(**full)
    promote(sweep, BASE, out, keep_base_aggregation=True, log=lambda *_: None)
    kept = load_config(out).mask
    assert (kept.aggregation, kept.horizon) == ("seq-mean-token-sum-norm", 8192) and kept.eps_high == 0.3


def test_promote_from_csv_with_strings_and_missing_cell_ids(tmp_path):
    sweep = tmp_path / "sweep_csv"
    sweep.mkdir()
    rows = [dict(r) for r in SWEEP]
    for r in rows:
        r.pop("cell_id")
        r["clip_ratio_c"] = ""  # empty → None (default)
        r["notes"] = "extra column"
    rows.append({"rule": "pdm_agg", "final_reward": "", "collapsed": "False"})  # no outcome: left out
    with open(sweep / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    parsed = read_results(sweep)
    assert parsed[0]["delta"] == 0.15 and parsed[0]["collapsed"] is False and parsed[0]["k"] == 20
    assert {r["rule"] for r in parsed} >= {"none", "pdm_topk"}  # the rule called "none" stays a rule
    logs = []
    out = tmp_path / "p.yaml"
    promote(sweep, BASE, out, log=logs.append)
    assert any("no numeric final_reward" in x for x in logs)
    cfg = load_config(out)
    assert cfg.mask.rule == "pdm_uniform" and cfg.mask.delta == 0.05 and cfg.mask.clip_ratio_c is None
    assert cfg.provenance.cell_id.startswith("{")  # made from the mask fields


def test_bad_sweeps(tmp_path):
    with pytest.raises(SweepError, match="no results.json or results.csv"):
        promote(tmp_path, BASE, tmp_path / "x.yaml")
    (tmp_path / "results.json").write_text(json.dumps({"rows": [{"rule": "pdm_topk"}]}))
    with pytest.raises(SweepError, match="no usable rows"):
        promote(tmp_path, BASE, tmp_path / "x.yaml", log=lambda *_: None)
    (tmp_path / "results.json").write_text(json.dumps(cell_rows("c", "not_a_rule", [0.5])))
    with pytest.raises(Exception, match="mask.rule"):
        promote(tmp_path, BASE, tmp_path / "x.yaml", log=lambda *_: None)


def test_promote_cli(tmp_path, capsys):
    from pdm_lab.cli import main

    sweep = tmp_path / "s"
    sweep.mkdir()
    (sweep / "results.json").write_text(json.dumps(SWEEP))
    out = tmp_path / "o.yaml"
    assert main(["promote", str(sweep), "--base", str(BASE), "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["mask"]["rule"] == "pdm_uniform"
    assert main(["promote", str(tmp_path / "missing"), "--base", str(BASE), "--out", str(out)]) == 2
    assert "no results.json" in capsys.readouterr().err


def test_promote_from_a_real_toy_sweep(tmp_path):
    """The toy stage's own sweep output (columns, cells/<id>/config.json) promotes unchanged."""
    pytest.importorskip("pdm_lab.envs.sweep")
    from pdm_lab.cli import main

    out_dir = tmp_path / "sweep"
    assert main(["sweep", "--rules", "dppo_topk_kl", "pdm_uniform", "--mismatch", "noise:1", "--seeds", "2",
                 "--steps", "3", "--workers", "1", "--no-audit", "--quiet", "--out", str(out_dir)]) == 0
    out = tmp_path / "promoted.yaml"
    prov = promote(out_dir, BASE, out, log=lambda *_: None)
    cfg = load_config(out)
    cells, warnings = group_cells(read_results(out_dir))
    assert not warnings and len(cells) == 2
    alive = [c for c in cells if not c.collapsed]
    chosen = next(c for c in cells if c.cell_id == prov["cell_id"])
    assert chosen.mean("final_reward") == max(c.mean("final_reward") for c in alive)
    assert cfg.mask.rule == chosen.mask["rule"] and cfg.provenance.metrics["seeds"] == 2
