"""The end-to-end runs behind the CLI: sweep → table → figures → report, and audit → files."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from pdm_lab.lab.locking import DirLock

from pdm_lab.envs.audit.study import AuditConfig, run_audit
from pdm_lab.envs.report.plots import audit_figures, sweep_figures
from pdm_lab.lab.records import write_json_atomic
from pdm_lab.envs.report.sweep_report import write_report
from pdm_lab.envs.sweep.grid import SweepConfig, claim_out, load_runs, run_sweep
from pdm_lab.lab.outputs import OutputPathError, move_aside as outputs_move_aside


def audit_to_dir(cfg: AuditConfig, out: str | Path, *, progress: bool = True, wandb=None) -> dict:
    """Run the audit; write audit.json, audit figures and audit.md into ``out`` (and to W&B when
    ``wandb``, a ``WandbConfig``, is on: ``envs.report.to_wandb``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = run_audit(cfg, progress_bar=progress, seed_dir=out / "seeds")
    write_json_atomic(out / "audit.json", doc)
    figs = audit_figures(doc, out)
    write_report(out / "audit.md", title="pdm_lab direction audit",
                 intro=["Produced by `pdm-lab audit`; the numbers are in audit.json."],
                 audit=doc, audit_figs=figs)
    if wandb is not None and wandb.enabled:
        from pdm_lab.envs.report.to_wandb import log_audit

        log_audit(wandb, cfg, doc, out, figs)
    return doc


def sweep_to_dir(cfg: SweepConfig, out: str | Path, *, executor=None, audit: AuditConfig | None = None,
                 progress: bool = True, title: str = "pdm_lab toy sweep", force: bool = False,
                 move_aside: bool = False, wandb=None, stress_audit: AuditConfig | None = None) -> dict:
    """Run (or resume) the sweep, optionally the audit, then the table, figures and report.md
    (``force``: over another grid's results; ``move_aside``: another grid's folder is renamed
    ``<out>.<UTC time>`` first; see ``sweep.claim_out``). Returns the status, with ``moved_to``
    when a folder was moved aside. ``wandb``: a ``WandbConfig`` (``envs.report.to_wandb``: one
    W&B run per cell × seed and one report run). ``stress_audit``: a second audit, in a stress
    setting where the rules separate, reported beside the first (``stress-audit/``)."""
    out = Path(out)
    moved = None
    if move_aside and not force:
        with DirLock(out, what="sweep output") if out.is_dir() else contextlib.nullcontext():
            try:
                claim_out(cfg, out)
            except OutputPathError:  # another grid's results: kept under a dated name
                moved = outputs_move_aside(out)
    claim_out(cfg, out, force=force)  # before the lock: a refused sweep leaves nothing in out
    with DirLock(out, what="sweep output"):  # held through the report too (re-entrant)
        status = _sweep_to_dir_locked(cfg, out, executor, audit, progress, title, force, wandb, stress_audit)
    return {**status, "moved_to": str(moved) if moved else None}


def _sweep_to_dir_locked(cfg: SweepConfig, out: Path, executor, audit: AuditConfig | None,
                         progress: bool, title: str, force: bool, wandb=None, stress_audit=None) -> dict:
    start = time.perf_counter()
    status = run_sweep(cfg, out, executor=executor, progress=progress, force=force)
    audit_doc, audit_figs = _audit_into(audit, out / "audit", progress)
    stress_doc, stress_figs = _audit_into(stress_audit, out / "stress-audit", progress)
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
    bad = [r["row"] for r in runs if r["row"].get("nonfinite")]
    if bad:
        intro.insert(0, f"**{len(bad)} of {len(runs)} runs went non-finite** (NaN or inf parameters; column "
                        "`nonfinite` in results.csv, counted as collapsed, final reward NaN): "
                        + ", ".join(f"{r['rule']} {r['mismatch']} δ {r['delta']:g} seed {r['seed']}" for r in bad[:10])
                        + (" …" if len(bad) > 10 else "") + ".")
    regime = sweep_regime(cfg, out)
    report = write_report(out / "report.md", title=title, intro=intro, rows=[r["row"] for r in runs],
                          sweep_figs=figs, audit=audit_doc, audit_figs=audit_figs, regime=regime,
                          stress_audit=stress_doc, stress_figs=stress_figs)
    if wandb is not None and wandb.enabled:
        from pdm_lab.envs.report.to_wandb import log_sweep

        images = {**{f"sweep/{k}": v for k, v in figs.items()}, **{f"audit/{k}": v for k, v in (audit_figs or {}).items()}}
        status = {**status, "wandb_runs": log_sweep(wandb, cfg, out, regime=regime, audit_doc=audit_doc, images=images)}
    return {**status, "report": str(report), "runs": len(runs), "nonfinite": len(bad),
            "wall_s": time.perf_counter() - start}


def _audit_into(audit: AuditConfig | None, folder: Path, progress: bool) -> tuple[dict | None, dict | None]:
    """(audit.json's document, its figures) of ``audit`` in ``folder``: read back when that folder
    holds the same configuration's audit, run otherwise; (None, None) without an audit."""
    if audit is None:
        return None, None
    audit_json = folder / "audit.json"
    if audit_json.exists() and json.loads(audit_json.read_text())["config"] == _audit_dict(audit):
        doc = json.loads(audit_json.read_text())  # resumed: the audit is already done
    else:
        doc = audit_to_dir(audit, folder, progress=progress)
    return doc, audit_figures(doc, folder)


def sweep_regime(cfg: SweepConfig, out: Path, *, seeds: int = 1, sequences: int = 256) -> dict[str, dict]:
    """The calibration table of each mismatch setting of the grid, on the sweep's problem and
    policy at initialisation (cached in ``out/regime.json``)."""

    from pdm_lab.envs.transfer.calibrate import toy_table
    from pdm_lab.envs.sweep.grid import compose

    path = out / "regime.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    b = cfg.base
    tables = {}
    for spec in cfg.mismatches:
        name = compose(spec, cfg.base_mismatch)
        audit = AuditConfig(problem=b.problem, policy=b.policy, hidden=b.hidden, mismatch=name,
                            sequences=sequences, group_size=b.group_size, delta=b.mask.delta, k=b.mask.k,
                            convention=b.mask.convention)
        key = regime_key(audit, seeds)
        entry = cached.get(key)
        if not isinstance(entry, dict) or "table" not in entry:
            entry = {"mismatch": name, "seeds": seeds, "config": _audit_dict(audit), "table": toy_table(audit, seeds)}
            cached[key] = entry
            write_json_atomic(path, cached)
        tables[name] = entry["table"]
    return tables


def regime_key(audit: AuditConfig, seeds: int) -> str:
    """The regime cache's key: the full specification the table was computed from (the parsed
    mismatch with every parameter, the problem, the policy, the batch, δ, K and the seeds), so a
    changed parameter behind the same mismatch name never reuses a stale table."""
    import hashlib

    doc = {"config": _audit_dict(audit), "seeds": seeds}
    return hashlib.sha1(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _audit_dict(cfg: AuditConfig) -> dict:
    from pdm_lab.config import to_dict

    return json.loads(json.dumps(to_dict(cfg)))
