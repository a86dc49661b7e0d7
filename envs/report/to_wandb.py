"""The toy commands' outputs in Weights & Biases (``pdm_lab.lab.wandb_log``), after their files
are written, so W&B holds exactly the numbers of the JSON/JSONL files.

- ``sweep``: one W&B run per cell × seed (job type ``cell``, grouped by the output folder): the
  cell's config and seed, its per-step JSONL as history, its results row as summary; plus one
  run per invocation (job type ``sweep``) with the sweep config, the results, regime and audit
  tables and the PNGs. A cell × seed already logged from this folder is not logged again
  (``wandb_logged.json``), so a resumed sweep adds only the runs it finished; the report run is
  the same W&B run on every invocation (id in ``wandb_report_run_id.txt``, resumed).
- ``audit``: one run (job type ``audit``): config, the pair / per-seed / regime tables, PNGs.
- ``transfer``: one run (job type ``transfer``): the toy config, toy vs loop and both regime
  tables, the outcome in the summary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from pdm_lab.config import to_dict
from pdm_lab.lab.records import write_json_atomic
from pdm_lab.lab.wandb_log import WandbConfig, WandbRun, audit_tables, flat


def _jsonable(doc: Any) -> Any:
    return json.loads(json.dumps(doc, default=str))


def log_sweep(wb: WandbConfig, cfg: Any, out: Path, *, regime: Mapping[str, dict], audit_doc: dict | None,
              images: Mapping[str, Path]) -> int:
    """The sweep's runs and its report run; returns how many cell × seed runs were logged now."""
    from pdm_lab.envs.sweep.grid import cell_id, cell_path, load_runs, read_run, run_path

    group = out.resolve().name
    marker = out / "wandb_logged.json"
    done = set(json.loads(marker.read_text())) if marker.exists() else set()
    logged = 0
    for cell in cfg.cells():
        cid = cell_id(cell)
        for seed in cfg.seed_list:
            key = f"{cid}/{seed}"
            run = read_run(run_path(out, cid, seed))
            steps = cell_path(out, cid, f"seed_{seed}.jsonl")
            if key in done or run is None or not steps.exists():
                continue
            row = run["row"]
            name = f"{row['rule']} {row['mismatch']} δ={row['delta']:g} K={row['k']} seed {seed}"
            wr = WandbRun.start(wb, name=name, out_dir=out, group=group, job_type="cell",
                                config={**_jsonable(to_dict(cell)), "seed": seed, "cell_id": cid})
            for line in steps.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                wr.log({k: v for k, v in rec.items() if k != "step"}, step=rec["step"])
            wr.summary(row)
            wr.finish(last=False)
            done.add(key)
            logged += 1
            write_json_atomic(marker, sorted(done))
    # one report run per sweep folder: a re-run resumes it (its id kept in the folder)
    report = WandbRun.start(wb, name=f"{group} sweep", out_dir=out, group=group, job_type="sweep",
                            config=_jsonable(to_dict(cfg)), resume_id_file=out / "wandb_report_run_id.txt")
    report.table("sweep/results", [r["row"] for r in load_runs(cfg, out)])
    report.table("sweep/regime", [{"mismatch": name, **flat(doc.get("table", doc))} for name, doc in regime.items()])
    for key, rows in (audit_tables(audit_doc) if audit_doc else {}).items():
        report.table(key, rows)
    report.images(images)
    report.finish()
    return logged


def log_audit(wb: WandbConfig, cfg: Any, doc: dict, out: Path, images: Mapping[str, Path]) -> None:
    run = WandbRun.start(wb, name=f"{out.resolve().name} audit", out_dir=out, job_type="audit",
                         config=_jsonable(to_dict(cfg)))
    for key, rows in audit_tables(doc).items():
        run.table(key, rows)
    run.images({f"audit/{name}": path for name, path in images.items()})
    run.summary({k: v for k, v in doc.items() if not isinstance(v, (dict, list))})
    run.finish()


def log_transfer(wb: WandbConfig, result: dict, out: Path) -> None:
    run = WandbRun.start(wb, name=f"{out.resolve().name} transfer", out_dir=out, job_type="transfer",
                         config=_jsonable(result.get("toy_config", {})))
    run.table("transfer/sides", [{"side": side, **flat(result[side])} for side in ("toy", "loop")
                                 if isinstance(result.get(side), dict)])
    run.table("transfer/regime", [{"side": side, **flat(result[key])} for side, key in
                                  (("run", "run_regime"), ("toy", "toy_regime")) if isinstance(result.get(key), dict)])
    run.summary({k: v for k, v in result.items() if not isinstance(v, (dict, list))})
    run.finish()
