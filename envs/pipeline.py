"""The end-to-end runs behind the CLI: sweep → table → figures → report, and audit → files."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pdm_lab.runtime.locking import DirLock

from pdm_lab.envs.audit.study import AuditConfig, run_audit
from pdm_lab.envs.report.plots import audit_figures, sweep_figures
from pdm_lab.runtime.records import write_json_atomic
from pdm_lab.envs.report.sweep_report import write_report
from pdm_lab.envs.sweep.grid import SweepConfig, load_runs, run_sweep


def audit_to_dir(cfg: AuditConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Run the audit; write audit.json, audit figures and audit.md into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = run_audit(cfg, progress_bar=progress, seed_dir=out / "seeds")
    write_json_atomic(out / "audit.json", doc)
    figs = audit_figures(doc, out)
    write_report(out / "audit.md", title="pdm_lab direction audit",
                 intro=["Produced by `pdm-lab audit`; the numbers are in audit.json."],
                 audit=doc, audit_figs=figs)
    return doc


def sweep_to_dir(cfg: SweepConfig, out: str | Path, *, executor=None, audit: AuditConfig | None = None,
                 progress: bool = True, title: str = "pdm_lab toy sweep", force: bool = False) -> dict:
    """Run (or resume) the sweep, optionally the audit, then the table, figures and report.md
    (``force``: over another grid's results; see ``sweep.claim_out``)."""
    out = Path(out)
    with DirLock(out, what="sweep output"):  # held through the report too (re-entrant)
        return _sweep_to_dir_locked(cfg, out, executor, audit, progress, title, force)


def _sweep_to_dir_locked(cfg: SweepConfig, out: Path, executor, audit: AuditConfig | None,
                         progress: bool, title: str, force: bool) -> dict:
    start = time.perf_counter()
    status = run_sweep(cfg, out, executor=executor, progress=progress, force=force)
    audit_doc, audit_figs = None, None
    if audit is not None:
        audit_json = out / "audit" / "audit.json"
        if audit_json.exists() and json.loads(audit_json.read_text())["config"] == _audit_dict(audit):
            audit_doc = json.loads(audit_json.read_text())  # resumed: the audit is already done
            audit_figs = audit_figures(audit_doc, out / "audit")
        else:
            audit_doc = audit_to_dir(audit, out / "audit", progress=progress)
            audit_figs = audit_figures(audit_doc, out / "audit")
    runs = load_runs(cfg, out)
    figs = sweep_figures(runs, out / "figures") if runs else {}
    b = cfg.base
    intro = [f"Problem `{b.problem.kind}`, policy `{b.policy}`, {b.steps} GRPO steps of "
             f"{b.groups_per_step} prompts × {b.group_size} responses, `{b.optimizer}` lr {b.lr}, "
             f"{b.epochs} epoch(s) × {b.minibatches} mini-batch(es); float32 training, token-mean loss "
             "(each token's share of a step is lr/N); the audit below states its own step and precision.",
             f"Grid: rules {', '.join(cfg.rules)}; mismatch {', '.join(cfg.mismatches)}"
             + (f" (+ `{cfg.base_mismatch}` everywhere)" if cfg.base_mismatch else "")
             + f"; δ {', '.join(f'{d:g}' for d in cfg.deltas)}; K {', '.join(map(str, cfg.ks))}; "
             f"{cfg.seeds} seeds. {len(runs)} of {status['total']} runs finished "
             f"({status['skipped']} reused from an earlier invocation).",
             "Tables: results.csv / results.json (one row per cell × seed); per-step logs: cells/*/seed_*.jsonl."]
    report = write_report(out / "report.md", title=title, intro=intro, rows=[r["row"] for r in runs],
                          sweep_figs=figs, audit=audit_doc, audit_figs=audit_figs,
                          regime=sweep_regime(cfg, out))
    return {**status, "report": str(report), "runs": len(runs), "wall_s": time.perf_counter() - start}


def sweep_regime(cfg: SweepConfig, out: Path, *, seeds: int = 1, sequences: int = 256) -> dict[str, dict]:
    """The calibration table of each mismatch setting of the grid, on the sweep's problem and
    policy at initialisation (cached in ``out/regime.json``)."""
    from dataclasses import replace

    from pdm_lab.envs.transfer.calibrate import toy_table
    from pdm_lab.envs.sweep.grid import compose

    path = out / "regime.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    b = cfg.base
    tables = {}
    for spec in cfg.mismatches:
        name = compose(spec, cfg.base_mismatch)
        if name not in cached:
            audit = AuditConfig(problem=b.problem, policy=b.policy, hidden=b.hidden, mismatch=name,
                                sequences=sequences, group_size=b.group_size, delta=b.mask.delta, k=b.mask.k,
                                convention=b.mask.convention)
            cached[name] = toy_table(replace(audit, mismatch=name), seeds)
            write_json_atomic(path, cached)
        tables[name] = cached[name]
    return tables


def _audit_dict(cfg: AuditConfig) -> dict:
    from pdm_lab.config import to_dict

    return json.loads(json.dumps(to_dict(cfg)))
