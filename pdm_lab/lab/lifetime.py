"""Workers die with their launcher: torchrun starts workers in their own session, so ``kill -9``
of ``pdm-lab train``'s process group does not reach them, and without these guards they would
keep writing into the run directory.

Two guards, both set up by the process that must die:

* ``die_with_parent()``: Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` — the kernel kills this
  process the moment its parent exits, whatever the cause (SIGKILL included). The launcher sets
  it in torchrun's agent (``preexec_fn``), every rank sets it for itself (its parent is the agent).
* ``watch_launcher()``: a daemon thread that polls the launcher's pid (``PDM_LAB_LAUNCHER_PID``,
  set by ``launch``) and SIGKILLs this process once it is gone: for platforms without prctl and
  for a parent that is not the launcher (the agent may outlive it by a moment).
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading

LAUNCHER_ENV = "PDM_LAB_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent exits. False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return ok


def alive(pid: int) -> bool:
    """True if a process ``pid`` exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: it only waits to be reaped
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def watch_launcher(pid: int | None = None, poll_s: float = POLL_S) -> threading.Thread | None:
    """Start a daemon thread that SIGKILLs this process when the launcher ``pid`` is gone
    (default: ``$PDM_LAB_LAUNCHER_PID``; nothing to watch without it)."""
    if pid is None:
        raw = os.environ.get(LAUNCHER_ENV, "")
        if not raw.isdigit():
            return None
        pid = int(raw)

    def watch() -> None:
        while alive(pid):
            threading.Event().wait(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: a half-step must not write anything

    thread = threading.Thread(target=watch, name="pdm-lab-launcher-watch", daemon=True)
    thread.start()
    return thread


def guard_rank() -> None:
    """Call first thing in a rank started by ``launch``: both guards."""
    if os.environ.get(LAUNCHER_ENV):
        die_with_parent()
        watch_launcher()
