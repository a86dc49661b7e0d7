"""Where built artefacts (the tiny model, synthetic data) are cached.

``$PDM_LAB_CACHE`` if set, else ``~/.cache/pdm_lab``. Entries are directories named by a hash of
everything that determines their content, created atomically (build in a temporary directory,
then rename), so concurrent ranks or runs never see a half-written entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """The cache root: ``$PDM_LAB_CACHE`` or ``~/.cache/pdm_lab``."""
    env = os.environ.get("PDM_LAB_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/pdm_lab").expanduser()


def spec_hash(spec: dict) -> str:
    """Stable 12-hex-digit hash of a JSON-serialisable spec."""
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cached_dir(kind: str, spec: dict, build: Callable[[Path], None]) -> Path:
    """Return ``cache_root()/kind/<hash(spec)>``, building it with ``build(tmp_dir)`` if absent.

    ``build`` writes into an empty temporary directory; on success it is renamed into place.
    A ``spec.json`` beside the content records what was built.
    """
    final = cache_root() / kind / spec_hash(spec)
    if (final / "spec.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / "spec.json").write_text(json.dumps(spec, indent=2, sort_keys=True, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is equivalent
            if not (final / "spec.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
