"""The math verifier's budgeted worker process: sympy never runs in the caller's process.

One worker per process, started on first use and reused (a reply costs a pipe round trip, not a
Python start-up), running ``math_value.py --serve`` with its own limits. The grading's budget is
counted work (``math_value``), so its verdict does not depend on load; three safety nets stop a
sympy algorithm the counts missed, the third even inside sympy's C-speed loops:

* the parent waits ``seconds`` (``math_value.SAFETY_S``) plus a small grace for the reply, then
  SIGKILLs the worker;
* the worker's soft CPU limit (``RLIMIT_CPU``) terminates it a second or so past its budget,
  also when the parent is gone;
* its address space is capped (``RLIMIT_AS``), so a runaway value raises MemoryError inside the
  worker, which replies and exits.

A killed or exited worker is replaced at the next call, which pays its start-up (about 0.3 s),
outside the budget of the grading it serves.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import math_value

#: Address space the worker may map beyond its baseline (Python + sympy, ~100 MB): legitimate
#: answers need a few MB; the adversarial ones asked for gigabytes.
WORKER_MEMORY_BYTES = 512 << 20
#: How long a starting worker may take to import sympy (a loaded machine, a cold disk cache).
START_TIMEOUT_S = 60.0
#: Slack on top of a grading's budget for the reply to cross the pipe.
REPLY_GRACE_S = 0.25

#: Run math_value.py by path, with neither the working directory nor the script's folder
#: (``scaling/``, whose module names could shadow the standard library's) on sys.path.
_BOOT = "import runpy, sys; sys.path.pop(0); sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"


class MathWorkerError(RuntimeError):
    """The worker could not be started or spoke out of protocol."""


@dataclass
class WorkerCounts:
    """What the worker has been through: starts, kills (over the wall-clock budget), exits
    (CPU limit, MemoryError or a crash), and the outcome of the last grading."""

    starts: int = 0
    kills: int = 0
    exits: int = 0
    last_outcome: str = ""
    pids: list[int] = field(default_factory=list)


class MathWorker:
    """A reusable budgeted ``math_value.grade_values`` in a child process (thread-safe)."""

    #: The worker's Python command (``-c``); a test may prepend to it (a clock that runs fast).
    boot = _BOOT

    def __init__(self, memory_bytes: int = WORKER_MEMORY_BYTES):
        self.memory_bytes = memory_bytes
        self.counts = WorkerCounts()
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()

    # -- lifetime
    def _start(self) -> subprocess.Popen:
        script = str(Path(math_value.__file__).resolve())
        proc = subprocess.Popen([sys.executable, "-c", self.boot, script, "--serve", str(self.memory_bytes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                close_fds=True)
        line = _read_line(proc, time.monotonic() + START_TIMEOUT_S)
        if line != math_value.READY:
            _kill(proc)
            raise MathWorkerError(f"the math verifier's worker did not start (exit code {proc.returncode}, "
                                  f"said {line!r})")
        self.counts.starts += 1
        self.counts.pids.append(proc.pid)
        return proc

    def close(self) -> None:
        """Stop the worker (closing its stdin ends its loop; a busy one is killed)."""
        proc, self._proc = self._proc, None
        if proc is not None and os.getpid() == self._owner:
            _kill(proc)

    # -- a grading
    def grade(self, a: str, b: str, seconds: float = math_value.SAFETY_S, **limits: int) -> str:
        """``grade_values(a, b, **limits)`` in the worker: its verdict, or ``"unparseable"`` when the
        worker reached a safety net, `seconds` of wall or CPU time or its memory
        (``counts.last_outcome`` says which)."""
        with self._lock:
            if os.getpid() != self._owner:  # a forked child must not share its parent's pipes
                self._proc, self._owner = None, os.getpid()
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            request = json.dumps([a, b, {**limits, "seconds": seconds}]).encode() + b"\n"
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except BrokenPipeError:  # it died since its last reply: a fresh one takes the request
                self._proc = proc = self._start()
                proc.stdin.write(request)
                proc.stdin.flush()
            line = _read_line(proc, time.monotonic() + seconds + REPLY_GRACE_S)
            if line is None:  # late: still computing inside sympy
                _kill(proc)
                self._proc = None
                self.counts.kills += 1
                return self._outcome("unparseable", "killed")
            if not line:  # it exited: CPU limit, or a crash
                _kill(proc)
                self._proc = None
                self.counts.exits += 1
                return self._outcome("unparseable", "exited")
            verdict, outcome = json.loads(line)
            if outcome == "memory":  # it replied, then exits: the next call starts a fresh one
                _kill(proc)
                self._proc = None
                self.counts.exits += 1
            return self._outcome(verdict, outcome)

    def _outcome(self, verdict: str, outcome: str) -> str:
        self.counts.last_outcome = outcome
        return verdict


def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
    """One line from the worker's stdout: the bytes up to and with the newline, ``b""`` at EOF,
    None past the deadline."""
    fd = proc.stdout.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return b""
        buf += chunk
    return buf


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except (OSError, ValueError):
            pass


_WORKER = MathWorker()
atexit.register(_WORKER.close)


def worker() -> MathWorker:
    """This process's math worker (tests read its ``counts``)."""
    return _WORKER
