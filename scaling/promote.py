"""``pdm-lab promote``: carry the best toy-sweep configuration into a full-run config.

Reads a sweep's table through the core schema (``pdm_lab.lab.results``: typed ``SweepRow``s from
``results.json`` or ``results.csv``, with a schema version), never the toy stage's code. Every
path it opens resolves strictly inside the sweep directory; a non-finite configuration value, a
truncated file or an unknown schema is a one-line error naming the file.

Criterion (default ``reward``): among the cells that never collapsed (no seed collapsed), the
highest mean final reward over seeds; ties (within ``tie_tol``) go to the lower mean unsafe-keep
rate, then to the cell id. The mask section comes from ``cells/<cell_id>/config.json`` when the
sweep wrote one (every MaskConfig field), else from the row. The result is the base config with
its ``mask:`` section replaced and a ``provenance:`` section (sweep path, cell, criterion, metric
values, the evidence, code version, time).

Evidence (``pdm_lab.lab.evidence``, the rule the sweep's report names winners by): the chosen
cell must be separated from the runner-up (the best other never-collapsed cell) at 95% — the
Welch interval of the difference in final reward over seeds excludes 0 — with runs long enough
for "never collapsed" to mean anything and enough seeds. Otherwise promote refuses in one line,
unless ``allow_tie``; the written file's header states the evidence either way. Outputs follow
``pdm_lab.lab.outputs``: never over the sweep's tables, a cell's config or the base config,
nor over a file promote did not write, unless ``force``.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from pdm_lab.config import from_dict
from pdm_lab.mask_config import MaskConfig
from pdm_lab.lab.evidence import CRITERION, Separation, separation, shortfalls
from pdm_lab.lab.outputs import check_not_input, check_overwritable
from pdm_lab.lab.results import (COLUMNS, RESULTS_CSV, RESULTS_JSON, ResultsError, SweepRow, cell_path,
                                     read_results)

from .config import Provenance, load_config, save_config

MASK_FIELDS = tuple(f.name for f in dataclasses.fields(MaskConfig))
#: the row's columns that are the cell's mask (the rest is outcome and provenance)
ROW_MASK_FIELDS = ("rule", "delta", "k", "convention", "estimator")


class SweepError(ResultsError):
    """A sweep directory that cannot be promoted from."""


class NotSeparatedError(SweepError):
    """The chosen cell is not separated from the runner-up, or rests on too little (the message
    says which), and ``allow_tie`` was not given."""


#: Text at the top of every file promote writes (the output policy's signature of its own files).
SIGNATURES = ("# promoted from toy sweep", "promoted by `pdm-lab promote`")


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

    def values(self, key: str) -> list[float]:
        return [float(getattr(r, key)) for r in self.rows]

    @property
    def label(self) -> str:
        return f"{self.cell_id} ({self.rows[0].rule}, mismatch {self.rows[0].mismatch})"


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


def _alive(cells: list[Cell]) -> list[Cell]:
    return [c for c in cells if not c.collapsed and math.isfinite(c.mean("final_reward"))]


def choose(cells: list[Cell], *, criterion: str = "reward", tie_tol: float = 0.0) -> Cell:
    """The best cell by ``criterion`` (see module docstring)."""
    if criterion not in CRITERIA:
        raise SweepError(f"criterion: unknown {criterion!r}; valid: {', '.join(CRITERIA)}")
    if not (math.isfinite(tie_tol) and tie_tol >= 0):
        raise SweepError(f"--tie-tol: must be a finite number ≥ 0, got {tie_tol!r}")
    alive = _alive(cells)
    if not alive:
        raise SweepError(f"every one of the {len(cells)} cells collapsed (or has no finite reward)")
    best = max(c.mean("final_reward") for c in alive)
    tied = [c for c in alive if c.mean("final_reward") >= best - tie_tol]

    def unsafe(c: Cell) -> float:
        u = c.mean("unsafe_keep")
        return u if math.isfinite(u) else math.inf

    return min(tied, key=lambda c: (unsafe(c), c.cell_id))


def runner_up(cells: list[Cell], chosen: Cell) -> Cell | None:
    """The never-collapsed cell with the highest mean final reward other than ``chosen``."""
    others = [c for c in _alive(cells) if c.cell_id != chosen.cell_id]
    return max(others, key=lambda c: (c.mean("final_reward"), c.cell_id)) if others else None


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the choice rests on: the chosen cell against the runner-up on final reward."""

    chosen: Cell
    runner_up: Cell | None
    separation: Separation | None
    shortfalls: tuple[str, ...]

    @property
    def problems(self) -> list[str]:
        """Why the choice is not evidence (empty: it is)."""
        out = list(self.shortfalls)
        if self.separation is not None and not self.separation.separated:
            out.insert(0, f"not separated from the runner-up {self.runner_up.cell_id} ({self.runner_up.rows[0].rule}) "
                          f"at 95%: {self.separation.text()}")
        return out

    def regime(self) -> str:
        r = self.chosen.rows[0]
        return (f"problem {r.problem}, policy {r.policy}, mismatch {r.mismatch}, {r.optimizer} lr {r.lr:g}, "
                f"{r.steps} steps, {r.epochs} epoch(s) × {r.minibatches} mini-batch(es)")

    def lines(self, allow_tie: bool) -> list[str]:
        """The header lines stating the evidence."""
        rows = self.chosen.rows
        steps = sorted({r.steps for r in rows})
        out = [f"evidence: {CRITERION}",
               f"chosen {self.chosen.label}: final reward "
               + (self.separation.best.text() if self.separation else f"{self.chosen.mean('final_reward'):.3f}")
               + f"; {len(rows)} seeds × {'/'.join(map(str, steps))} steps"]
        if self.runner_up is None:
            out.append("runner-up: none (no other never-collapsed cell): nothing to separate it from")
        else:
            out.append(f"runner-up {self.runner_up.label}: final reward {self.separation.runner_up.text()}; "
                       f"{self.separation.text()}")
        out.append(f"regime: {self.regime()}")
        problems = self.problems
        if not problems:
            out.append("verdict: separated at 95%" if self.runner_up is not None else
                       "verdict: the only never-collapsed cell (every other cell collapsed)")
        else:
            out.append(("verdict: NOT evidence, promoted with --allow-tie: " if allow_tie else "verdict: ")
                       + "; ".join(problems))
        return out

    def as_dict(self, allow_tie: bool) -> dict[str, Any]:
        sep = self.separation

        def est(e):
            return None if e is None else {"mean": _none(e.mean), "ci95": [_none(e.lo), _none(e.hi)], "runs": e.n}

        return {"criterion": CRITERION, "separated": bool(sep is not None and sep.separated),
                "sufficient": not self.problems, "allow_tie": allow_tie,
                "chosen": est(sep.best if sep else None), "chosen_cell": self.chosen.cell_id,
                "runner_up_cell": self.runner_up.cell_id if self.runner_up else None,
                "runner_up": est(sep.runner_up if sep else None),
                "difference": None if sep is None else {"mean": _none(sep.diff), "ci95": [_none(sep.lo), _none(sep.hi)]},
                "seeds": self.chosen.seeds, "steps": sorted({r.steps for r in self.chosen.rows}),
                "regime": self.regime(), "problems": self.problems}


def _none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def evidence(cells: list[Cell], chosen: Cell) -> Evidence:
    """The chosen cell's ``Evidence`` among ``cells``."""
    other = runner_up(cells, chosen)
    sep = None if other is None else separation(chosen.values("final_reward"), other.values("final_reward"))
    steps = min(r.steps for r in chosen.rows)
    return Evidence(chosen, other, sep, tuple(shortfalls(steps=steps, seeds=chosen.seeds)))


def check_out_paths(sweep_dir: Path, base: Path, outs: list[Path], *, force: bool = False) -> None:
    """Refuse outputs that are an input (the sweep's tables, the base config) or an existing
    file promote did not write (a cell's config.json, the sweep's report.md, …; see
    ``pdm_lab.lab.outputs``), unless ``force``."""
    inputs = {"the sweep's results.json": sweep_dir / RESULTS_JSON, "the sweep's results.csv": sweep_dir / RESULTS_CSV,
              "the --base config": base}
    for out in outs:
        check_not_input(out, inputs, force=force)
        check_overwritable(out, SIGNATURES, force=force)


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
            tie_tol: float = 0.0, keep_base_aggregation: bool = False, allow_tie: bool = False,
            force: bool = False, log=print) -> dict:
    """Write ``out``: ``base`` with the best cell's mask and provenance. Returns the provenance.

    ``keep_base_aggregation``: keep the base config's loss aggregation and horizon (a toy's
    horizon rarely means anything for 8k-token responses) instead of the cell's. ``allow_tie``:
    promote a choice the evidence does not separate (the header says so); ``force``: write over
    a path the output policy protects.
    """
    sweep_dir, base, out = Path(sweep_dir), Path(base), Path(out)
    check_out_paths(sweep_dir, base, [out], force=force)
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
    proof = evidence(cells, best)
    if proof.problems and not allow_tie:
        raise NotSeparatedError(f"{sweep_dir}: refusing to promote cell {best.cell_id} ({best.rows[0].rule}): "
                                + "; ".join(proof.problems) + " (--allow-tie promotes it anyway)")
    metrics: dict[str, Any] = {"seeds": best.seeds, "collapsed_any": best.collapsed,
                               "cells_total": len(cells),
                               "cells_collapsed": sum(c.collapsed for c in cells),
                               "evidence": proof.as_dict(allow_tie)}
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
                  f"(±{tie_tol}) → lower mean unsafe_keep; {CRITERION}",
        metrics=metrics, code_version=code_version(), base_config=str(base),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    cfg = dataclasses.replace(base_cfg, mask=mask, provenance=prov)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# promoted from toy sweep {sweep_dir} (cell {best.cell_id}); base {base}"]
    header += [f"# {line}" for line in proof.lines(allow_tie)]
    save_config(cfg, out, header="\n".join(header + [f"# pdm-lab train --config {out}"]))
    load_config(out)  # the written file must load back
    log(f"[promote] cell {best.cell_id}: final_reward {best.mean('final_reward'):.4g} over "
        f"{best.seeds} seeds, unsafe_keep {best.mean('unsafe_keep'):.4g} → {out}"
        + ("" if not proof.problems else f" (NOT separated; --allow-tie: {'; '.join(proof.problems)})"))
    return dataclasses.asdict(prov)
