"""W&B as a logging backend, offline only (no login, nothing leaves the machine): the runs' files
are read back with W&B's own record reader (its datastore and protobuf records) and their values
matched with the JSONL the same run wrote: the training loop, a tiny sweep, and the config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from pdm_lab.config import ConfigError  # noqa: E402
from pdm_lab.lab.wandb_log import WandbConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "scaling" / "configs" / "tiny-cpu.yaml"


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """Every W&B file under tmp_path; offline, silent, no credentials. ``WANDB_DIR`` and the
    variables that fill in a run's fields are unset: a run's files go under its output folder."""
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_TAGS",
                "WANDB_RUN_GROUP", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "WANDB_JOB_TYPE"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "wandb_home"
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def read_offline_runs(folder: Path) -> list[dict]:
    """Each offline run under ``folder/wandb``: its run record, config, history rows, summary."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        run = {"config": {}, "history": [], "summary": {}}
        while (data := store.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            items = {"run": lambda: rec.run.config.update, "config": lambda: rec.config.update,
                     "history": lambda: rec.history.item, "summary": lambda: rec.summary.update}
            if kind not in items:
                continue
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items[kind]()}
            if kind == "run":
                run.update(id=rec.run.run_id, name=rec.run.display_name, group=rec.run.run_group,
                           job_type=rec.run.job_type, tags=list(rec.run.tags), project=rec.run.project,
                           entity=rec.run.entity)
            target = {"run": run["config"], "config": run["config"], "summary": run["summary"]}.get(kind)
            if target is None:
                run["history"].append(values)
            else:
                target.update(values)
        runs.append(run)
    return runs


def assert_history_matches(history: list[dict], records: list[dict]) -> None:
    """Every JSONL step is a W&B step with the same non-null values (a null is not logged)."""
    by_step = {row["_step"]: row for row in history if "_step" in row}
    assert sorted(by_step) == [rec["step"] for rec in records]
    checked = 0
    for rec in records:
        row = by_step[rec["step"]]
        for key, value in rec.items():
            if key == "step":
                continue
            if value is None:
                assert key not in row, key
            else:
                assert row[key] == value, (rec["step"], key, row[key], value)
                checked += 1
    assert checked >= 10 * len(records)


def test_config_is_off_by_default_and_offline_when_on():
    assert not WandbConfig().enabled
    assert WandbConfig(project="p").resolved_mode == "offline"
    assert WandbConfig(mode="online").resolved_mode == "online" and not WandbConfig(mode="disabled").enabled
    with pytest.raises(ConfigError, match="log.wandb.mode"):
        WandbConfig(mode="sometimes")
    from pdm_lab.scaling.config import load_config

    cfg = load_config(TINY, ["log.wandb.mode=offline", "log.wandb.tags=[a,b]"])
    assert cfg.log.wandb.resolved_mode == "offline" and cfg.log.wandb.tags == ("a", "b")
    assert not load_config(TINY).log.wandb.enabled
    with pytest.raises(ConfigError, match="log.wandb"):
        load_config(TINY, ["log.wandb.projekt=x"])


def test_command_flags_give_the_same_section():
    import argparse

    from pdm_lab.lab.wandb_log import add_wandb_arguments, wandb_config_from_args

    p = argparse.ArgumentParser()
    add_wandb_arguments(p)
    assert wandb_config_from_args(p.parse_args([])) == WandbConfig()
    assert wandb_config_from_args(p.parse_args(["--wandb"])).resolved_mode == "offline"
    got = wandb_config_from_args(p.parse_args(["--wandb-project", "x", "--wandb-tags", "a, b"]))
    assert got == WandbConfig(project="x", tags=("a", "b")) and got.resolved_mode == "offline"


def test_metrics_log_resumes_the_same_run_and_logs_the_audit_tables(tmp_path):
    from pdm_lab.scaling.audit_step import write_record
    from pdm_lab.scaling.config import load_config
    from pdm_lab.scaling.metrics_log import MetricsLog

    cfg = load_config(TINY, ["log.wandb.project=unit", "name=unit"])
    run_dir = tmp_path / "run"
    log = MetricsLog(run_dir, tensorboard=False, config=cfg)
    log.log(1, {"a": 0.5, "b": float("nan")})
    log.log(2, {"a": 0.25, "b": 1.0})
    log.close()
    time.sleep(1.0)  # an offline run's folder is named by the second it starts: the resume gets its own
    log = MetricsLog(run_dir, tensorboard=False, resume_step=1, config=cfg)  # step 2 redone
    log.log(2, {"a": 0.125, "b": 2.0})
    write_record(run_dir, 2, 0, {"outside": 3, "rules": ["a", "b"], "regime": {"outside_fraction": 0.01}})
    log.close()
    first, second = read_offline_runs(run_dir)
    assert first["id"] == second["id"] == (run_dir / "wandb_run_id.txt").read_text().strip()
    assert first["project"] == "unit" and first["name"] == "unit" and first["config"]["mask"]["rule"] == "pdm_topk"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "a": 0.5, "b": None}, {"step": 2, "a": 0.125, "b": 2.0}]
    assert second["history"][0]["a"] == 0.125
    tables = {k.split("/_type")[0] for row in second["history"] for k, v in row.items() if v == "table-file"}
    assert tables == {"audit/steps", "audit/regime"}
    # the tables sit at the step they describe: no history step beyond the run's last one
    assert [row["_step"] for row in first["history"]] == [1, 2]
    assert [row["_step"] for row in second["history"]] == [2]


def test_environment_fills_what_the_config_leaves_out(tmp_path, monkeypatch):
    """``WANDB_PROJECT/ENTITY/MODE/TAGS/RUN_GROUP/DIR`` where the config is silent; the config
    wins where it is set; the environment never turns W&B on. Read back from the offline files."""
    from pdm_lab.lab.wandb_log import WandbRun

    env = {"WANDB_PROJECT": "envproj", "WANDB_ENTITY": "envteam", "WANDB_TAGS": "x, y",
           "WANDB_RUN_GROUP": "envgroup", "WANDB_DIR": str(tmp_path / "envdir"), "WANDB_MODE": "disabled"}
    on = WandbConfig(mode="offline")
    assert on.resolve(out_dir="out", group="cmd", env=env) == {
        "project": "envproj", "entity": "envteam", "group": "envgroup", "dir": str(tmp_path / "envdir"),
        "tags": ["x", "y"], "mode": "offline"}
    mine = WandbConfig(project="p", entity="e", group="g", dir="d", tags=("t",), mode="offline")
    assert mine.resolve(out_dir="out", group="cmd", env=env) == {
        "project": "p", "entity": "e", "group": "g", "dir": "d", "tags": ["t"], "mode": "offline"}
    assert WandbConfig(mode="offline").resolve(out_dir="out", group="cmd", env={}) == {
        "project": "pdm_lab", "entity": None, "group": "cmd", "dir": "out", "tags": [], "mode": "offline"}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert not WandbConfig().enabled and not WandbConfig(project="p").enabled  # WANDB_MODE=disabled
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert WandbConfig(project="p").resolved_mode == "offline" and not WandbConfig().enabled
    run = WandbRun.start(WandbConfig(project="p", tags=()), name="n", out_dir=tmp_path / "out", config={"k": 1})
    run.log({"a": 1.0}, step=1)
    run.finish()
    assert not (tmp_path / "out" / "wandb").exists()
    (got,) = read_offline_runs(tmp_path / "envdir")
    assert (got["project"], got["entity"], got["group"], got["tags"]) == ("p", "envteam", "envgroup", ["x", "y"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_training_loop_offline_run_matches_its_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PDM_LAB_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pdm_lab", "train", "--config", str(TINY), "total_steps=2",
           "model.tiny.sft_steps=20", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=6",
           "trainer.mini_batches=1", "trainer.micro_batch_size=16", "eval.every=0", "checkpoint.every=0",
           "log.sync_check_every=0", "data.synthetic.n_train=100", "launch.nproc_per_node=1",
           "log.tensorboard=false", "log.wandb.mode=offline", "log.wandb.tags=[test]", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (run,) = read_offline_runs(run_dir)
    assert run["name"] == "tiny-cpu" and run["tags"] == ["test"] and run["job_type"] == "train"
    assert run["config"]["total_steps"] == 2 and run["config"]["log"]["wandb"]["mode"] == "offline"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_history_matches(run["history"], records)
    # the rollout-correction metrics under verl's names reach W&B like every key
    assert "rollout_corr/k3_kl" in run["history"][-1] and "corr/ppl_ratio" in run["history"][-1]


def test_sweep_logs_one_run_per_cell_and_seed_and_a_report_run(tmp_path):
    from pdm_lab.envs.pipeline import sweep_to_dir
    from pdm_lab.envs.problems.problem import ProblemConfig
    from pdm_lab.envs.sweep.executors import LocalExecutor
    from pdm_lab.envs.sweep.grid import SweepConfig, cell_id, cell_path
    from pdm_lab.envs.train.grpo import TrainConfig

    cfg = SweepConfig(base=TrainConfig(problem=ProblemConfig(kind="bandit"), steps=2, groups_per_step=8, group_size=8),
                      rules=("dppo_topk_kl", "pdm_uniform"), mismatches=("noise:1",), seeds=1)
    out = tmp_path / "sweep"
    wb = WandbConfig(project="sweep-test", tags=("t",))
    status = sweep_to_dir(cfg, out, executor=LocalExecutor(1), progress=False, wandb=wb)
    assert status["wandb_runs"] == 2
    runs = read_offline_runs(out)
    cells = [r for r in runs if r["job_type"] == "cell"]
    (report,) = [r for r in runs if r["job_type"] == "sweep"]
    assert len(cells) == 2 and {r["group"] for r in runs} == {"sweep"} and all(r["tags"] == ["t"] for r in runs)
    for cell in cfg.cells():
        cid = cell_id(cell)
        (run,) = [r for r in cells if r["config"]["cell_id"] == cid]
        assert run["config"]["mask"]["rule"] == cell.mask.rule and run["config"]["seed"] == 0
        records = [json.loads(line) for line in cell_path(out, cid, "seed_0.jsonl").read_text().splitlines()]
        assert_history_matches(run["history"], records)
        row = json.loads(cell_path(out, cid, "seed_0.json").read_text())["row"]
        assert run["summary"]["final_reward"] == row["final_reward"]
    logged = {k.split("/_type")[0]: v for row in report["history"] for k, v in row.items() if k.endswith("/_type")}
    assert logged.get("sweep/results") == logged.get("sweep/regime") == "table-file"
    assert any(v == "images/separated" or v == "image-file" for k, v in logged.items() if k.startswith("sweep/"))
    assert [row["_step"] for row in report["history"]] == [0]  # every table and image at one step
    # a second invocation reuses every run: no cell run is logged again, and the report run is
    # resumed (the same W&B run id; offline, its second part is a folder of its own)
    again = sweep_to_dir(cfg, out, executor=LocalExecutor(1), progress=False, wandb=wb)
    assert again["wandb_runs"] == 0
    reports = [r for r in read_offline_runs(out) if r["job_type"] == "sweep"]
    assert len(reports) == 2 and reports[0]["id"] == reports[1]["id"]
    assert reports[0]["id"] == (out / "wandb_report_run_id.txt").read_text().strip()


def test_audit_and_transfer_documents_become_tables(tmp_path):
    """The audit's and transfer's JSON documents (shapes as ``audit.json`` / ``transfer.json``
    hold them) as W&B tables and summary, read back from the offline files."""
    from pdm_lab.envs.presets import AUDIT_PRESETS, preset
    from pdm_lab.envs.report.to_wandb import log_audit, log_transfer

    pair = {"a": "dppo_topk_kl", "b": "pdm_topk", "dppo_topk_kl": {"unsafe_keep_mean": 0.5},
            "pdm_topk": {"unsafe_keep_mean": 0.25}, "unsafe_keep_diff": {"mean_diff": 0.25, "ci_low": -0.1},
            "disagreement_per_seed": [3, 4], "verdict": "insufficient data"}
    doc = {"pairs": [pair], "per_seed": [{"seed": 0, "outside": 12}, {"seed": 1, "outside": 9}],
           "regime": {"outside_fraction": 0.01, "d_quantiles": {"p50": 1e-3}}, "outside_mean": 10.5}
    log_audit(WandbConfig(mode="offline"), preset(AUDIT_PRESETS, "quick"), doc, tmp_path / "audit", {})
    (run,) = read_offline_runs(tmp_path / "audit")
    assert run["job_type"] == "audit" and run["summary"]["outside_mean"] == 10.5
    tables = {k.split("/_type")[0] for row in run["history"] for k, v in row.items() if v == "table-file"}
    assert tables == {"audit/pairs", "audit/per_seed", "audit/regime"}
    result = {"toy": {"unsafe_keep": {"mean": 0.5}}, "loop": {"unsafe_keep": {"mean": 0.4}},
              "run_regime": {"outside_fraction": 0.02}, "toy_regime": {"outside_fraction": 0.021},
              "toy_config": {"seeds": 2}, "transfer": "undecided", "delta": 0.15}
    log_transfer(WandbConfig(project="t"), result, tmp_path / "transfer")
    (run,) = read_offline_runs(tmp_path / "transfer")
    assert run["summary"]["transfer"] == "undecided" and run["config"]["seeds"] == 2
    tables = {k.split("/_type")[0] for row in run["history"] for k, v in row.items() if v == "table-file"}
    assert tables == {"transfer/sides", "transfer/regime"}
