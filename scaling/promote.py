"""``pdm-lab promote``: carry the best toy-sweep configuration into a full-run config.

Reads a sweep's ``results.json`` (a list of rows, or ``{"rows": [...]}``) or ``results.csv``: one
row per cell × seed, with the ``MaskConfig`` fields of the cell (rule, delta, k, convention,
estimator, ...) and its outcome (``final_reward``, ``collapsed``, ``unsafe_keep``, ``cell_id``;
other columns such as the mismatch kind are kept as provenance). The reader is tolerant: extra
columns are ignored, numbers may arrive as strings, a missing ``cell_id`` is replaced by the
cell's mask fields, and rows whose outcome is missing are reported and left out.

Criterion (default ``reward``): among the cells that never collapsed (no seed collapsed), the
highest mean final reward over seeds; ties (within ``tie_tol``) go to the lower mean unsafe-keep
rate, then to the cell id. The mask section comes from ``cells/<cell_id>/config.json`` when the
sweep wrote one (every MaskConfig field), else from the row. The result is the base config with its ``mask:`` section replaced and
a ``provenance:`` section (sweep path, cell, criterion, metric values, code version, time).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from pdm_lab.config import MaskConfig, from_dict

from .config import Provenance, load_config, save_config

MASK_FIELDS = tuple(f.name for f in dataclasses.fields(MaskConfig))


class SweepError(ValueError):
    """A sweep directory that cannot be promoted from."""


def _scalar(value: Any) -> Any:
    """CSV text → bool / None (empty cell) / int / float / str."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    low = text.lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    if low == "":  # how csv/pandas write None (note: "none" is a mask rule name, kept as text)
        return None
    if low == "nan":
        return math.nan
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def read_results(sweep_dir: Path) -> list[dict]:
    """Rows of ``results.json`` (preferred) or ``results.csv``, values parsed."""
    sweep_dir = Path(sweep_dir)
    js, cs = sweep_dir / "results.json", sweep_dir / "results.csv"
    if js.exists():
        data = json.loads(js.read_text(encoding="utf-8"))
        rows = data.get("rows", data.get("results")) if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise SweepError(f"{js}: expected a list of rows (or {{'rows': [...]}})")
        return [dict(r) for r in rows if isinstance(r, dict)]  # JSON is typed already
    if cs.exists():
        with open(cs, newline="", encoding="utf-8") as fh:
            return [{k.strip(): _scalar(v) for k, v in r.items() if k} for r in csv.DictReader(fh)]
    raise SweepError(f"{sweep_dir}: no results.json or results.csv")


def mask_of(row: dict) -> dict:
    """The MaskConfig fields present in a row (None values dropped: the defaults apply)."""
    out = {}
    for name in MASK_FIELDS:
        if name in row and row[name] is not None and not (isinstance(row[name], float) and math.isnan(row[name])):
            out[name] = row[name]
    for name in ("k", "horizon"):
        if isinstance(out.get(name), float) and out[name].is_integer():
            out[name] = int(out[name])
    return out


def _is_true(value: Any) -> bool:
    return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0
                             and not math.isnan(value))


@dataclasses.dataclass
class Cell:
    cell_id: str
    mask: dict
    rows: list[dict]

    @property
    def seeds(self) -> int:
        return len(self.rows)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else math.nan

    @property
    def collapsed(self) -> bool:
        return any(_is_true(r.get("collapsed")) for r in self.rows)


def group_cells(rows: list[dict]) -> tuple[list[Cell], list[str]]:
    """Group rows by cell; returns (cells, warnings about unusable rows)."""
    cells: dict[str, Cell] = {}
    warnings = []
    for i, row in enumerate(rows):
        reward = row.get("final_reward")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            warnings.append(f"row {i}: no numeric final_reward ({reward!r}); left out")
            continue
        mask = mask_of(row)
        if "rule" not in mask:
            warnings.append(f"row {i}: no mask rule; left out")
            continue
        cid = row.get("cell_id")
        cid = str(cid) if cid not in (None, "") else json.dumps(mask, sort_keys=True)
        cell = cells.setdefault(cid, Cell(cell_id=cid, mask=mask, rows=[]))
        if cell.mask != mask:
            warnings.append(f"row {i}: cell {cid} has differing mask fields {mask} vs {cell.mask}")
        cell.rows.append(row)
    return list(cells.values()), warnings


def full_mask(sweep_dir: Path, cell: Cell, log=print) -> dict:
    """The cell's complete mask section: ``cells/<cell_id>/config.json``'s ``mask`` when the sweep
    wrote one (it has every MaskConfig field: ε, cap, aggregation, ...), else the row's fields."""
    path = Path(sweep_dir) / "cells" / cell.cell_id / "config.json"
    if not path.exists():
        return dict(cell.mask)
    mask = json.loads(path.read_text(encoding="utf-8")).get("mask")
    if not isinstance(mask, dict):
        return dict(cell.mask)
    for key, value in cell.mask.items():
        if key in mask and mask[key] != value:
            log(f"[promote] {path}: mask.{key}={mask[key]!r} but results rows say {value!r}; using config.json")
    return {k: v for k, v in mask.items() if k in MASK_FIELDS}


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
    cells, warnings = group_cells(rows)
    for w in warnings[:10]:
        log(f"[promote] {w}")
    if not cells:
        raise SweepError(f"{sweep_dir}: no usable rows ({len(rows)} read)")
    best = choose(cells, criterion=criterion, tie_tol=tie_tol)
    base_cfg = load_config(base)
    fields = full_mask(sweep_dir, best, log)
    if keep_base_aggregation:
        fields.update(aggregation=base_cfg.mask.aggregation, horizon=base_cfg.mask.horizon)
    mask = from_dict(MaskConfig, fields, where="mask")
    extra_keys = sorted({k for r in best.rows for k in r} - set(MASK_FIELDS) - {"seed"})
    metrics: dict[str, Any] = {"seeds": best.seeds, "collapsed_any": best.collapsed,
                               "cells_total": len(cells),
                               "cells_collapsed": sum(c.collapsed for c in cells)}
    for key in extra_keys:
        vals = [r.get(key) for r in best.rows]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if nums and len(nums) == len(vals):
            metrics[f"{key}_mean"] = sum(nums) / len(nums)
        elif len({json.dumps(v, default=str) for v in vals}) == 1 and not isinstance(vals[0], (list, dict)):
            metrics[key] = vals[0]
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
