"""Small file helpers: JSON Lines appended as they come and read back (the one reader), atomic
JSON writes, plain numbers, and reading back a result file that may have been damaged (named,
moved aside, recomputed)."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from pdm_lab.errors import UserInputError


def plain(value: Any) -> Any:
    """Tensors, numpy scalars and tuples → JSON-ready Python; NaN/inf → None."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):
        return plain(value.tolist())
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the last line."""

    def __init__(self, path: str | Path | None, *, truncate: bool = True):
        self.path = Path(path) if path is not None else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "w" if truncate else "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(plain(record)) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RecordError(UserInputError, ValueError):
    """A run record (``audit.jsonl``, ``metrics.jsonl``, ``mismatch_sample.jsonl``) that cannot be
    read: names the file, the line and the field; the command line exits with status 2."""


#: a field's expected kind: "int" (not bool), "number" (finite int/float, not bool), "str",
#: "list", "dict", or a tuple of them
_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "str": lambda v: isinstance(v, str), "list": lambda v: isinstance(v, list),
          "dict": lambda v: isinstance(v, dict)}


def read_jsonl(path: str | Path, *, error: type[Exception] = RecordError,
               fields: dict[str, str | tuple[str, ...]] | None = None,
               optional: dict[str, str | tuple[str, ...]] | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for each non-blank line of the JSON Lines file at ``path`` — the
    one reader of run records. A line that is not UTF-8, not JSON, or (with ``fields``) not an
    object holding each required field with its kind (``optional``: checked when present) raises
    ``error`` naming the file, the line and the field; nothing is skipped silently."""
    path = Path(path)
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise error(f"{path}:{line_no}: not UTF-8 text (byte {err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{line_no}: not a JSON row ({err.msg} at column {err.colno})") from None
            if fields is not None or optional is not None:
                _check_fields(path, line_no, record, fields or {}, optional or {}, error)
            yield line_no, record


def _check_fields(path: Path, line_no: int, record: Any, fields: dict, optional: dict,
                  error: type[Exception]) -> None:
    if not isinstance(record, dict):
        raise error(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    for name, kinds in (*fields.items(), *optional.items()):
        if name not in record:
            if name in fields:
                raise error(f"{path}:{line_no}: no {name!r} field")
            continue
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        if not any(_KINDS[k](record[name]) for k in kinds):
            raise error(f"{path}:{line_no}: {name} = {record[name]!r} is not {' or '.join(kinds)}")


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write through a uniquely named temporary file in the same folder, fsync, rename over
    ``path``: two writers never share a temporary name, a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON atomically (unique temporary file, fsync, rename over ``path``)."""
    _write_atomic(Path(path), lambda fh: json.dump(plain(data), fh, indent=1))


def read_json_or_quarantine(path: str | Path, *, valid: Callable[[Any], bool] = lambda doc: True,
                            warn: Callable[[str], None] | None = None) -> Any | None:
    """The JSON document at ``path``; None if it is missing. A file that does not parse (or fails
    ``valid``) is named in a warning and moved aside to ``<name>.corrupt``, ``.corrupt1``, …, and
    None is returned, so the caller recomputes it instead of dying on a ``JSONDecodeError``."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if valid(doc):
            return doc
        why = "unexpected content"
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as err:
        why = f"not valid JSON ({str(err).splitlines()[0]})"
    aside, n = path.with_name(path.name + ".corrupt"), 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt{n}")
    os.replace(path, aside)
    (warn or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
        f"warning: {path}: {why}; moved aside to {aside.name}, recomputing")
    return None

