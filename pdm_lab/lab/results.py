"""The toy-sweep results table: one typed row per cell × seed, written by the sweep
(``pdm_lab.envs.sweep.grid``) and read by ``promote`` (``pdm_lab.scaling.promote``) — neither stage
imports the other; both go through this schema.

Files in a sweep directory::

    results.json   {"schema_version": 1, "columns": [...], "rows": [{...}, ...]}
    results.csv    the same rows, one line each (empty cell: n/a)
    cells/<cell_id>/config.json   the cell's full config (``cell_path``)

Measured columns may be NaN ("n/a": e.g. no outside token, so no direction disagreement);
configuration columns and the initial reward must be finite, and the final reward too unless the
run went non-finite. A bad file is one ``ResultsError`` line naming the file, row and column.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import re
import typing
from pathlib import Path
from typing import Any, Iterable
from pdm_lab.errors import UserInputError

SCHEMA_VERSION = 1
RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"


class ResultsError(UserInputError, ValueError):
    """A sweep results file or path that cannot be used (one line: file, row, column)."""


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One finished toy run (a sweep cell × seed): the cell's configuration and its outcome."""

    cell_id: str
    """12 hex digits naming the cell (``cells/<cell_id>/``)."""
    seed: int
    problem: str
    policy: str
    rule: str
    """mask rule (``pdm_lab.masks.MASK_RULES``)."""
    delta: float
    k: int
    convention: str
    estimator: str
    """the Ḋ estimator of the direction metrics (``MaskConfig.direction_estimator``)."""
    mismatch: str
    mismatch_kind: str
    mismatch_strength: float
    optimizer: str
    lr: float
    steps: int
    epochs: int
    minibatches: int
    initial_reward: float
    final_reward: float
    """π's reward after training; NaN only when ``nonfinite``."""
    collapsed: bool
    nonfinite: bool
    realised_topk_kl_mean: float
    """rollout-time top-K KL D(μ‖π), pooled over the run's response tokens."""
    realised_topk_kl_max: float
    realised_full_kl_mean: float
    realised_full_kl_max: float
    update_topk_kl_mean: float
    """top-K KL over the tokens of every update (staleness included)."""
    mask_fraction: float
    outside_fraction: float
    dir_disagree: float
    """sign(r − 1) ≠ sign(Ḋ) among outside tokens, pooled; NaN: no outside token."""
    unsafe_keep: float
    shrink: float
    unsafe_keep_count: int
    """kept outside tokens whose ΔD was measured (the denominator of ``unsafe_keep``, ``shrink``)."""
    unsafe_count: int
    """of those, how many grew D (``unsafe_keep`` = unsafe_count / unsafe_keep_count)."""
    shrink_count: int
    wall_s: float
    clip_ratio_c: float = math.nan
    """the TIS cap c of the importance weight min(r, c) (``MaskConfig.clip_ratio_c``); NaN: none."""
    optimizer_steps: int = -1
    """optimiser steps the run took (steps × epochs × minibatches unless it went non-finite); −1: not recorded."""
    update_tail_ratio: float = math.nan
    """p99.9/p50 of the update-time top-K KL over every update's response tokens (pooled over
    mini-batches, staleness included: SPEC §6b's tail ratio); NaN: not recorded."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ResultsError(f"schema_version {self.schema_version!r}: this pdm_lab reads version "
                               f"{SCHEMA_VERSION} (re-run the same `pdm-lab sweep` to rewrite the table)")
        for name in _FINITE:
            if not math.isfinite(getattr(self, name)):
                raise ResultsError(f"{name}: must be finite, got {getattr(self, name)!r}")
        if not self.nonfinite and not math.isfinite(self.final_reward):
            raise ResultsError(f"final_reward: {self.final_reward!r} but the run is not marked nonfinite")
        _safe_name("cell_id", self.cell_id)


COLUMNS = tuple(f.name for f in dataclasses.fields(SweepRow))
_TYPES = typing.get_type_hints(SweepRow)
#: columns an older row may lack (their defaults: not recorded)
_OPTIONAL = tuple(f.name for f in dataclasses.fields(SweepRow) if f.default is not dataclasses.MISSING)
_FINITE = ("delta", "mismatch_strength", "lr", "initial_reward")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _safe_name(where: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ResultsError(f"{where}: {name!r} is not a plain name (letters, digits, '_', '.', '-')")
    return name


def _convert(where: str, tp: Any, value: Any) -> Any:
    """A JSON or CSV value as the column's type (None / "" → NaN for floats)."""
    if tp is float:
        if value is None or value == "":
            return math.nan
        if isinstance(value, bool):
            raise ResultsError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ResultsError(f"{where}: expected a number, got {value!r}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
        raise ResultsError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ResultsError(f"{where}: expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ResultsError(f"{where}: expected an integer, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ResultsError(f"{where}: expected text, got {value!r}")
    return value


def row_from_dict(mapping: dict, where: str = "row") -> SweepRow:
    """A ``SweepRow`` from a mapping (JSON or CSV strings); a missing or unknown column raises."""
    if not isinstance(mapping, dict):
        raise ResultsError(f"{where}: expected an object, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - set(COLUMNS))
    if unknown:
        raise ResultsError(f"{where}: unknown column(s) {', '.join(unknown)}")
    missing = [c for c in COLUMNS if c not in mapping and c not in _OPTIONAL]
    if missing:
        raise ResultsError(f"{where}: missing column(s) {', '.join(missing)}")
    values = {c: _convert(f"{where}.{c}", _TYPES[c], mapping[c]) for c in COLUMNS if c in mapping}
    try:
        return SweepRow(**values)
    except ResultsError as err:
        raise ResultsError(f"{where}.{err}") from None


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _csv_cell(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "" if not math.isfinite(value) else repr(value)
    return str(value)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_results(out: str | Path, rows: Iterable[SweepRow]) -> list[SweepRow]:
    """``results.json`` and ``results.csv`` in ``out``, each replaced atomically."""
    out = Path(out)
    rows = list(rows)
    doc = {"schema_version": SCHEMA_VERSION, "columns": list(COLUMNS),
           "rows": [{c: _plain(getattr(r, c)) for c in COLUMNS} for r in rows]}
    _write_atomic(out / RESULTS_JSON, json.dumps(doc, indent=1) + "\n")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows([_csv_cell(getattr(r, c)) for c in COLUMNS] for r in rows)
    _write_atomic(out / RESULTS_CSV, buf.getvalue())
    return rows


def read_results(sweep_dir: str | Path) -> list[SweepRow]:
    """The rows of ``results.json`` (else ``results.csv``) in ``sweep_dir``, typed and checked."""
    sweep_dir = Path(sweep_dir)
    js, cs = sweep_dir / RESULTS_JSON, sweep_dir / RESULTS_CSV
    if js.is_file():
        try:
            doc = json.loads(js.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ResultsError(f"{js}: not valid JSON (truncated or corrupt?): {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ResultsError(f"{js}: cannot read: {err}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ResultsError(f"{js}: expected {{\"schema_version\": {SCHEMA_VERSION}, \"rows\": [...]}}")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ResultsError(f"{js}: schema_version {doc.get('schema_version')!r}, this pdm_lab reads "
                               f"{SCHEMA_VERSION} (re-run the same `pdm-lab sweep` to rewrite the table)")
        return [row_from_dict(r, f"{js} row {i}") for i, r in enumerate(doc["rows"])]
    if cs.is_file():
        try:
            with open(cs, newline="", encoding="utf-8") as fh:
                records = list(csv.DictReader(fh))
        except (OSError, UnicodeDecodeError, csv.Error) as err:
            raise ResultsError(f"{cs}: cannot read: {err}") from None
        return [row_from_dict({k: v for k, v in r.items() if k is not None}, f"{cs} row {i}")
                for i, r in enumerate(records)]
    raise ResultsError(f"{sweep_dir}: no {RESULTS_JSON} or {RESULTS_CSV}")


def cell_path(sweep_dir: str | Path, cell_id: str, *names: str) -> Path:
    """``sweep_dir/cells/<cell_id>/<names…>``, refused unless it resolves strictly inside
    ``sweep_dir`` (a crafted id such as ``../../x`` or a symlink out is an error)."""
    root = Path(sweep_dir).resolve()
    parts = [_safe_name("cell_id", cell_id)] + [_safe_name("file", n) for n in names]
    path = root.joinpath("cells", *parts).resolve()
    if root not in path.parents:
        raise ResultsError(f"{path}: outside the sweep directory {root}")
    return path
