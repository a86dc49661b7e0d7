"""Metrics output of a run (rank 0): one JSON line per step, TensorBoard scalars and W&B beside it.

``metrics.jsonl`` is appended and flushed every step, so a run's results exist as it goes. On
resume from step s, lines after s (steps that will be redone) are dropped first and TensorBoard
purges its events after s, so every step appears exactly once in both. W&B (``log.wandb``, off
by default) gets each step's non-null values, the resolved config, and at the end the live
audit's tables (``audit.jsonl``: one row per audited step, and its regime table); a resumed run
continues the same W&B run (its id is kept in ``run_dir/wandb_run_id.txt``).

``summary.json`` (``write_summary``) is the run's result: how it ended (``completed`` or
``stopped_nonfinite``), the last step, and every step whose loss or gradient went non-finite
(its optimiser steps skipped), with the quantity and where. Written when such a step happens
and at the end, replaced atomically; a resumed run keeps the entries up to the resumed step.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only per-step metrics (JSONL + optional TensorBoard)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, resume_step: int = 0, enabled: bool = True,
                 config: Any = None):
        """``config``: the run's ``TrainConfig`` (its ``log.wandb`` section, name and values for
        W&B); None: no W&B."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = self.wb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1)
        if config is not None and config.log.wandb.enabled:
            from pdm_lab.lab.wandb_log import WandbRun

            from .config import config_to_dict

            self.wb = WandbRun.start(config.log.wandb, name=config.name, out_dir=run_dir,
                                     config=config_to_dict(config), job_type="train",
                                     resume_id_file=Path(run_dir) / "wandb_run_id.txt")

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                continue
            if rec.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in sorted(metrics.items())}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
            fh.flush()
        if self.tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(clean, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self._audit_tables()
            self.wb.finish()
            self.wb = None

    def _audit_tables(self) -> None:
        """The live audit's records (the last line of each step) as W&B tables."""
        from pdm_lab.lab.wandb_log import flat

        path = self.path.parent / "audit.jsonl"
        if not path.exists():
            return
        by_step: dict[int, dict] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                continue
            by_step[rec.get("step", 0)] = rec
        records = [by_step[s] for s in sorted(by_step)]
        self.wb.table("audit/steps", [flat({k: v for k, v in r.items() if k != "regime"}) for r in records])
        self.wb.table("audit/regime", [{"step": r.get("step"), **flat(r["regime"])} for r in records
                                       if isinstance(r.get("regime"), dict)])



SUMMARY = "summary.json"


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``run_dir/summary.json`` atomically (a reader never sees half a file)."""
    path = Path(run_dir) / SUMMARY
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/summary.json``, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads((Path(run_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
