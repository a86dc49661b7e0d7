"""An exclusive lock on an output directory: one writer per run directory or sweep ``--out``.

``fcntl.flock`` on ``<dir>/.pdm_lab.lock``, which holds the holder's pid, host, start time and
command. The kernel drops the lock when the holder dies (even by SIGKILL), so a stale file never
blocks a restart; a second writer fails at once with one line naming the holder (two sweeps on
one ``--out`` would run every cell twice and tear its step logs). Re-entrant within a process, so
a sweep's driver and its inner function can both take it.

    with DirLock(run_dir, what="run directory"):
        ...  # sole writer here
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from pdm_lab.errors import UserInputError

LOCK_NAME = ".pdm_lab.lock"

#: Directories this process holds: path → (fd, depth).
_HELD: dict[str, list[int]] = {}


class LockHeldError(UserInputError, RuntimeError):
    """Another live process holds the directory's lock; the message names it."""


def holder(directory: str | Path) -> dict:
    """What the lock file says about its holder (may be stale if nobody holds the lock)."""
    try:
        return json.loads((Path(directory) / LOCK_NAME).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


class DirLock:
    """Exclusive, non-blocking, re-entrant lock on ``directory`` (created if missing)."""

    def __init__(self, directory: str | Path, *, what: str = "directory"):
        self.directory = Path(directory)
        self.what = what
        self.key = str(self.directory.resolve())

    def acquire(self) -> "DirLock":
        import fcntl

        if self.key in _HELD:
            _HELD[self.key][1] += 1
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by subprocesses (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = holder(self.directory)
            who = (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('start', '?')}"
                   f" ({info.get('command', '?')})") if info else "another process"
            raise LockHeldError(f"{self.directory}: {self.what} is in use by {who}; wait for it to "
                                f"finish or stop it (lock file {path})") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        _HELD[self.key] = [fd, 1]
        return self

    def release(self) -> None:
        import fcntl

        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[self.key]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
