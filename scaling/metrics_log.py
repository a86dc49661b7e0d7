"""Metrics output of a run (rank 0): one JSON line per step, TensorBoard scalars beside it.

``metrics.jsonl`` is appended and flushed every step, so a run's results exist as it goes. On
resume from step s, lines after s (steps that will be redone) are dropped first and TensorBoard
purges its events after s, so every step appears exactly once in both.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Append-only per-step metrics (JSONL + optional TensorBoard)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1)

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

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

