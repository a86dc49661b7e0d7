"""The sweep: grid expansion, stable cell ids, the tidy table, resuming, a kill mid-sweep, Ray,
and its output folder: another grid's results are never overwritten without --force."""
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdm_lab.mask_config import MaskConfig
from pdm_lab.envs.sweep.executors import LocalExecutor, make_executor
from pdm_lab.envs.problems.problem import ProblemConfig
from pdm_lab.envs.sweep.grid import COLUMNS, SweepConfig, cell_id, load_runs, mismatch_axis, run_sweep
from pdm_lab.envs.train.grpo import TrainConfig
from pdm_lab.lab.outputs import OutputPathError
from pdm_lab.lab.results import read_results

TINY = SweepConfig(
    base=TrainConfig(problem=ProblemConfig(kind="bandit"), steps=2, groups_per_step=8, group_size=8),
    rules=("dppo_topk_kl", "pdm_uniform"), mismatches=("none", "noise:1"), seeds=2)


def test_grid_expands_to_the_product_with_distinct_stable_ids():
    cfg = SweepConfig(rules=("ppo_clip", "pdm_uniform", "pdm_agg"), mismatches=("none", "noise:1"),
                      deltas=(0.05, 0.15), ks=(5, 20), seeds=1)
    cells = cfg.cells()
    # ppo_clip ignores δ and K: one cell per mismatch setting; the PDM rules get the full product
    assert len(cells) == 2 + 2 * (2 * 2 * 2)
    assert {(c.mask.delta, c.mask.k) for c in cells if c.mask.rule == "ppo_clip"} == {(0.05, 5)}
    ids = [cell_id(c) for c in cells]
    assert len(set(ids)) == len(ids)
    assert ids == [cell_id(c) for c in cfg.cells()]  # stable across calls
    assert cell_id(cells[0]) == cell_id(TrainConfig(**{**cells[0].__dict__, "seed": 9}))  # seed excluded


def test_base_mismatch_is_composed_and_the_axis_is_the_swept_source():
    cfg = SweepConfig(mismatches=("noise:0.5",), base_mismatch="stale:2", rules=("none",), seeds=1)
    (cell,) = cfg.cells()
    assert cell.mismatch == "noise:0.5+stale:2"
    assert mismatch_axis(cell.mismatch) == ("noise", 0.5)
    assert mismatch_axis("none") == ("none", 0.0)


def test_table_has_one_row_per_cell_and_seed(tmp_path):
    status = run_sweep(TINY, tmp_path, executor=LocalExecutor(1), progress=False)
    assert status == {**status, "total": 8, "ran": 8, "skipped": 0}
    with open(tmp_path / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8 and tuple(rows[0]) == COLUMNS
    assert {(r["rule"], r["mismatch"], r["seed"]) for r in rows} == {
        (rule, mm, str(s)) for rule in TINY.rules for mm in TINY.mismatches for s in (0, 1)}
    as_json = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(as_json) == 8 and as_json[0]["estimator"] == MaskConfig(rule=as_json[0]["rule"]).direction_estimator
    typed = read_results(tmp_path)  # the core schema reads what the sweep wrote
    assert [r.cell_id for r in typed] == [r["cell_id"] for r in rows]
    for r in typed:  # exact pooled counts behind the rates
        assert r.unsafe_keep_count == 0 or r.unsafe_keep == r.unsafe_count / r.unsafe_keep_count
    for cell in TINY.cells():
        for seed in (0, 1):
            log = tmp_path / "cells" / cell_id(cell) / f"seed_{seed}.jsonl"
            assert len(log.read_text().splitlines()) == TINY.base.steps


def test_rerun_skips_finished_runs_and_never_rewrites_them(tmp_path):
    run_sweep(TINY, tmp_path, executor=LocalExecutor(1), progress=False)
    done = sorted((tmp_path / "cells").glob("*/seed_*.json"))
    stamps = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in done}
    again = run_sweep(TINY, tmp_path, executor=LocalExecutor(1), progress=False)
    assert (again["ran"], again["skipped"]) == (0, 8)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in done} == stamps
    bigger = SweepConfig(**{**TINY.__dict__, "seeds": 3})
    grown = run_sweep(bigger, tmp_path, executor=LocalExecutor(1), progress=False)
    assert (grown["ran"], grown["skipped"]) == (4, 8)


def _cli(*args):
    exe = Path(sys.executable).with_name("pdm-lab")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pdm_lab"]


@pytest.mark.extended
def test_kill_mid_sweep_then_resume_loses_only_runs_in_flight(tmp_path):
    out = tmp_path / "sweep"
    args = _cli() + ["sweep", "--out", str(out), "--no-audit", "--quiet", "--workers", "2",
                     "base.problem.kind=bandit", "base.policy=tabular", "base.steps=6",
                     "rules=[dppo_topk_kl,pdm_uniform]", "mismatches=[none,noise:1]", "minibatches=[1]", "tis_rules=[]",
                     "--seeds", "4"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.glob("cells/*/seed_*.json"))) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and its workers, mid-sweep
    proc.wait()
    finished = {p: p.read_bytes() for p in out.glob("cells/*/seed_*.json")}
    assert 2 <= len(finished) < 16, "the sweep should have been killed part-way"
    for data in finished.values():
        json.loads(data)  # atomic writes: no torn result file
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert f"{len(finished)} reused" in res.stdout
    assert all(p.read_bytes() == data for p, data in finished.items())
    assert len(list(out.glob("cells/*/seed_*.json"))) == 16
    report = (out / "report.md").read_text()
    assert "lowest collapse rate: n/a (runs of 6 steps; the collapse definition needs ≥ 30)" in report
    assert "- highest final reward: no winner: tied (" in report or "- highest final reward: **" in report


def test_out_holding_another_grids_results_is_refused(tmp_path):
    run_sweep(TINY, tmp_path, executor=LocalExecutor(1), progress=False)
    before = {name: (tmp_path / name).read_bytes() for name in ("results.json", "results.csv", "sweep.json")}
    other = SweepConfig(**{**TINY.__dict__, "rules": ("ppo_clip",)})
    with pytest.raises(OutputPathError, match="holds the results.json, results.csv of a different sweep") as err:
        run_sweep(other, tmp_path, executor=LocalExecutor(1), progress=False)
    assert "\n" not in str(err.value) and "--force" in str(err.value)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert run_sweep(TINY, tmp_path, executor=LocalExecutor(1), progress=False)["skipped"] == 8  # same grid resumes
    forced = run_sweep(other, tmp_path, executor=LocalExecutor(1), progress=False, force=True)
    assert forced["ran"] == 4 and json.loads((tmp_path / "sweep.json").read_text())["rules"] == ["ppo_clip"]
    foreign = tmp_path / "foreign"  # a table nobody recorded as a sweep
    foreign.mkdir()
    (foreign / "report.md").write_text("someone's report\n")
    with pytest.raises(OutputPathError, match="holds report.md but no sweep.json"):
        run_sweep(TINY, foreign, executor=LocalExecutor(1), progress=False)
    assert (foreign / "report.md").read_text() == "someone's report\n"


def test_sweep_cli_refuses_another_grids_out_in_one_line(tmp_path, capsys):
    from pdm_lab.cli.main import main

    out = tmp_path / "s"
    grid = ["base.problem.kind=bandit", "base.policy=tabular", "base.steps=2", "mismatches=[none]", "--seeds", "1",
            "--workers", "1", "--no-audit", "--quiet", "--out", str(out)]
    assert main(["sweep", "rules=[pdm_uniform]"] + grid) == 0
    report = (out / "report.md").read_bytes()
    capsys.readouterr()
    assert main(["sweep", "rules=[ppo_clip]"] + grid) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of a different sweep" in err and str(out) in err
    assert (out / "report.md").read_bytes() == report
    assert main(["sweep", "rules=[ppo_clip]", "--force"] + grid) == 0


def test_ray_executor_matches_local(tmp_path):
    pytest.importorskip("ray")
    local = run_sweep(TINY, tmp_path / "local", executor=LocalExecutor(1), progress=False)
    remote = run_sweep(TINY, tmp_path / "ray", executor=make_executor("ray", workers=2), progress=False)
    assert local["ran"] == remote["ran"] == 8
    key = lambda r: (r["cell_id"], r["seed"])
    a = sorted((run["row"] for run in load_runs(TINY, tmp_path / "local")), key=key)
    b = sorted((run["row"] for run in load_runs(TINY, tmp_path / "ray")), key=key)
    assert [(key(r), r["final_reward"]) for r in a] == [(key(r), r["final_reward"]) for r in b]
