"""``pdm-lab promote``: carry the best toy-sweep configuration into a full-run config.

Reads a sweep's table through the core schema (``pdm_lab.runtime.results``: typed ``SweepRow``s from
``results.json`` or ``results.csv``, with a schema version), never the toy stage's code. Every
path it opens resolves strictly inside the sweep directory; a non-finite configuration value, a
truncated file or an unknown schema is a one-line error naming the file.

Criterion (default ``reward``): among the cells that never collapsed (no seed collapsed), the
highest mean final reward over seeds; ties (within ``tie_tol``) go to the lower mean unsafe-keep
rate, then to the cell id. The mask section comes from ``cells/<cell_id>/config.json`` when the
sweep wrote one (every MaskConfig field), else from the row. The result is the base config with
its ``mask:`` section replaced and a ``provenance:`` section (sweep path, cell, criterion, metric
values, code version, time).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from pdm_lab.config import MaskConfig, from_dict
from pdm_lab.runtime.results import COLUMNS, ResultsError, SweepRow, cell_path, read_results

from .config import Provenance, load_config, save_config

MASK_FIELDS = tuple(f.name for f in dataclasses.fields(MaskConfig))
#: the row's columns that are the cell's mask (the rest is outcome and provenance)
ROW_MASK_FIELDS = ("rule", "delta", "k", "convention", "estimator")


class SweepError(ResultsError):
    """A sweep directory that cannot be promoted from."""


@dataclasses.dataclass
class Cell:
    cell_id: str
    rows: list[SweepRow]

    @property
    def seeds(self) -> int:
        return len(self.rows)

    @property
    def mask(self) -> dict:
        """The mask fields of the cell's rows (``estimator``: the direction metric's, the same)."""
        return {name: getattr(self.rows[0], name) for name in ROW_MASK_FIELDS}

    def mean(self, key: str) -> float:
        """Mean of a numeric column over the seeds that measured it (NaN: none did)."""
        vals = [float(getattr(r, key)) for r in self.rows if math.isfinite(float(getattr(r, key)))]
        return sum(vals) / len(vals) if vals else math.nan

    @property
    def collapsed(self) -> bool:
        return any(r.collapsed for r in self.rows)


def group_cells(rows: list[SweepRow]) -> list[Cell]:
    """Rows grouped by ``cell_id``; rows of one cell must agree on the mask fields."""
    cells: dict[str, Cell] = {}
    for row in rows:
        cell = cells.setdefault(row.cell_id, Cell(cell_id=row.cell_id, rows=[]))
        cell.rows.append(row)
        mask = {name: getattr(row, name) for name in ROW_MASK_FIELDS}
        if mask != cell.mask:
            raise SweepError(f"cell {row.cell_id}: rows disagree on the mask ({mask} vs {cell.mask})")
    return list(cells.values())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SweepError(f"{path}: not valid JSON (truncated or corrupt?): {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SweepError(f"{path}: cannot read: {err}") from None


def _finite_mask(where: str, mask: dict) -> dict:
    for key, value in mask.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SweepError(f"{where}: mask.{key} = {value!r} is not finite")
    return mask


def full_mask(sweep_dir: Path, cell: Cell, log=print) -> dict:
    """The cell's complete mask section: ``cells/<cell_id>/config.json``'s ``mask`` when the sweep
    wrote one (it has every MaskConfig field: ε, cap, aggregation, ...), else the row's fields."""
    path = cell_path(sweep_dir, cell.cell_id, "config.json")
    if not path.is_file():
        log(f"[promote] {path}: missing; the mask comes from the results rows")
        mask = dict(cell.mask)
        if mask["estimator"] == MaskConfig(rule=mask["rule"]).direction_estimator:
            del mask["estimator"]  # the rule's own: leave MaskConfig.estimator at None
        return _finite_mask(f"{sweep_dir} cell {cell.cell_id}", mask)
    doc = _read_json(path)
    mask = doc.get("mask") if isinstance(doc, dict) else None
    if not isinstance(mask, dict):
        raise SweepError(f"{path}: no 'mask' mapping")
    mask = _finite_mask(str(path), {k: v for k, v in mask.items() if k in MASK_FIELDS})
    for key, value in cell.mask.items():
        if key == "estimator":
            continue  # the row holds the direction metric's estimator, config.json the override
        if mask.get(key) != value:
            raise SweepError(f"{path}: mask.{key}={mask.get(key)!r} but the results rows say {value!r}")
    return mask


CRITERIA = ("reward",)


def choose(cells: list[Cell], *, criterion: str = "reward", tie_tol: float = 0.0) -> Cell:
    """The best cell by ``criterion`` (see module docstring)."""
    if criterion not in CRITERIA:
        raise SweepError(f"criterion: unknown {criterion!r}; valid: {', '.join(CRITERIA)}")
    alive = [c for c in cells if not c.collapsed and math.isfinite(c.mean("final_reward"))]
    if not alive:
        raise SweepError(f"every one of the {len(cells)} cells collapsed (or has no finite reward)")
    best = max(c.mean("final_reward") for c in alive)
    tied = [c for c in alive if c.mean("final_reward") >= best - tie_tol]

    def unsafe(c: Cell) -> float:
        u = c.mean("unsafe_keep")
        return u if math.isfinite(u) else math.inf

    return min(tied, key=lambda c: (unsafe(c), c.cell_id))


def code_version() -> str:
    """``git describe --always --dirty`` of the code, or 'unknown'."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
        out = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return "no-commit" + ("-dirty" if out.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def promote(sweep_dir: Path, base: Path, out: Path, *, criterion: str = "reward",
            tie_tol: float = 0.0, keep_base_aggregation: bool = False, log=print) -> dict:
    """Write ``out``: ``base`` with the best cell's mask and provenance. Returns the provenance.

    ``keep_base_aggregation``: keep the base config's loss aggregation and horizon (a toy's
    horizon rarely means anything for 8k-token responses) instead of the cell's.
    """
    rows = read_results(sweep_dir)
    cells = group_cells(rows)
    if not cells:
        raise SweepError(f"{sweep_dir}: no rows")
    best = choose(cells, criterion=criterion, tie_tol=tie_tol)
    base_cfg = load_config(base)
    fields = full_mask(sweep_dir, best, log)
    if keep_base_aggregation:
        fields.update(aggregation=base_cfg.mask.aggregation, horizon=base_cfg.mask.horizon)
    mask = from_dict(MaskConfig, fields, where="mask")
    metrics: dict[str, Any] = {"seeds": best.seeds, "collapsed_any": best.collapsed,
                               "cells_total": len(cells),
                               "cells_collapsed": sum(c.collapsed for c in cells)}
    outcomes = COLUMNS[COLUMNS.index("initial_reward"):]  # the rest describes the cell
    for f in dataclasses.fields(SweepRow):
        if f.name in ("seed", "cell_id", "schema_version") or f.name in ROW_MASK_FIELDS:
            continue
        values = [getattr(r, f.name) for r in best.rows]
        if f.name in outcomes and f.type in ("float", "int"):
            mean = best.mean(f.name)
            metrics[f"{f.name}_mean"] = mean if math.isfinite(mean) else None  # None: n/a
        elif len(set(values)) == 1:
            metrics[f.name] = values[0]
    prov = Provenance(
        sweep_dir=str(sweep_dir), cell_id=best.cell_id,
        criterion=f"{criterion}: highest mean final_reward among never-collapsed cells; ties "
                  f"(±{tie_tol}) → lower mean unsafe_keep",
        metrics=metrics, code_version=code_version(), base_config=str(base),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    cfg = dataclasses.replace(base_cfg, mask=mask, provenance=prov)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out, header=f"# promoted from toy sweep {sweep_dir} (cell {best.cell_id}); "
                                 f"base {base}\n# pdm-lab train --config {out}")
    load_config(out)  # the written file must load back
    log(f"[promote] cell {best.cell_id}: final_reward {best.mean('final_reward'):.4g} over "
        f"{best.seeds} seeds, unsafe_keep {best.mean('unsafe_keep'):.4g} → {out}")
    return dataclasses.asdict(prov)
