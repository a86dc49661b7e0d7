"""Where a command may write: one policy for every command's outputs.

* Never over one of the command's own inputs (``promote --out`` equal to the sweep's
  ``results.json`` or to the ``--base`` config), nor over a file another command wrote (a file a
  command writes carries its signature in its first lines; anything else is someone's data).
* An output folder belongs to one result: a folder holding another result's products (a sweep's
  ``results.json``/``report.md`` from a different grid) is refused; the same result resumes.
* Names that become path components (a run's ``name``) are plain names: no separator, no ``..``,
  so ``runs/<name>`` stays inside ``runs/``.

``--force`` lifts the first two. Every refusal is one ``OutputPathError`` line (exit 2) naming
the path and what it holds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from pdm_lab.config import ConfigError

#: How much of a file's start is read for its signature.
SIGNATURE_BYTES = 4096


class OutputPathError(ConfigError):
    """An output path this command may not write (one line: the path and why)."""


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (after symlinks and ``..``; also through hard links)."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def check_not_input(out: str | Path, inputs: Mapping[str, str | Path | None], *, flag: str = "--out",
                    force: bool = False) -> None:
    """Refuse ``out`` when it is one of ``inputs`` (what → path; None entries ignored)."""
    if force:
        return
    for what, path in inputs.items():
        if path is not None and same_file(out, path):
            raise OutputPathError(f"{flag} {out} is {what} (an input of this command): writing there would "
                                  "overwrite it; choose another path (or --force)")


def check_overwritable(out: str | Path, signatures: Iterable[str], *, flag: str = "--out",
                       force: bool = False) -> None:
    """Refuse an existing file ``out`` unless one of ``signatures`` (text this command writes
    near the top of its files) is in its first ``SIGNATURE_BYTES``: then it is this command's
    own earlier output."""
    out = Path(out)
    if force or not out.exists():
        return
    if out.is_dir():
        raise OutputPathError(f"{flag} {out} is a directory; give a file path")
    try:
        with open(out, "rb") as fh:
            head = fh.read(SIGNATURE_BYTES).decode("utf-8", errors="replace")
    except OSError as err:
        raise OutputPathError(f"{flag} {out}: cannot read the existing file ({err})") from None
    if not any(sig in head for sig in signatures):
        raise OutputPathError(f"{flag} {out} exists and was not written by this command: it would be "
                              "overwritten; choose another path (or --force)")


def claim_output_dir(out: str | Path, *, marker: str, identity: Mapping[str, Any], products: Iterable[str],
                     what: str, ignore: Iterable[str] = (), force: bool = False) -> None:
    """Refuse folder ``out`` when it holds any of ``products`` of a different result: the result
    is named by ``identity`` (a JSON mapping), recorded in ``out/marker`` by whoever wrote it,
    compared without the top-level keys in ``ignore``. The same identity (a resumed run) passes;
    so does a folder without those products."""
    out = Path(out)
    if force or not out.is_dir():
        return
    present = [name for name in products if (out / name).exists()]
    if not present:
        return
    path = out / marker
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutputPathError(f"--out {out} holds {', '.join(present)} but no {marker}: another command's results, "
                              "which this would overwrite; choose another folder (or --force)") from None
    except (OSError, ValueError) as err:
        raise OutputPathError(f"--out {out}: {marker} is unreadable ({err}); choose another folder (or --force)") from None
    drop = set(ignore)

    def key(doc: Any) -> Any:
        return {k: v for k, v in doc.items() if k not in drop} if isinstance(doc, dict) else doc

    if key(recorded) != key(json.loads(json.dumps(identity))):
        raise OutputPathError(f"--out {out} holds the {', '.join(present)} of a different {what} (its {marker} "
                              f"differs from this one); choose another folder (or --force)")


def check_name(value: str, field: str) -> str:
    """``value`` if it is a plain name for a path component (not empty, no '/' or '\\', not '.'
    or '..', no NUL), else an ``OutputPathError`` naming ``field``."""
    if (not isinstance(value, str) or not value.strip() or any(c in value for c in "/\\\0")
            or value in (".", "..")):
        raise OutputPathError(f"{field}: {value!r} is not a plain name (it becomes a folder name: no '/', "
                              "'\\', '..' or empty); use run_dir to choose the folder")
    return value


def inside(root: str | Path, path: str | Path, what: str) -> Path:
    """``path`` resolved, refused unless it lies strictly inside ``root`` (resolved)."""
    base = Path(root).resolve()
    full = (base / path).resolve()
    if base not in full.parents:
        raise OutputPathError(f"{what}: {path} resolves to {full}, outside {base}")
    return full


def write_output(path: str | Path, text: str, *, flag: str = "--out") -> Path:
    """Write `text` to `path` (its folder created); an OS error is an ``OutputPathError`` naming the
    path (``--out /dev/full: cannot write (No space left on device)``), never the bare strerror."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise OutputPathError(f"{flag} {path}: cannot write ({err.strerror or err})") from None
    return path


def move_aside(out: str | Path) -> Path:
    """Rename folder `out` to ``<out>.<UTC time>`` (``results/sweep-quick.20261203T104500Z``) and
    return the new path: a result that this run's would overwrite is kept, under a name that
    says when it was moved."""
    import time

    out = Path(out)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = out.with_name(f"{out.name}.{stamp}")
    n = 1
    while target.exists():
        target = out.with_name(f"{out.name}.{stamp}-{n}")
        n += 1
    try:
        out.rename(target)
    except OSError as err:
        raise OutputPathError(f"--out {out}: cannot move it aside to {target} ({err.strerror or err})") from None
    return target
