"""Measurement helpers every stage's bench shares: best-of timing and peak memory on Linux."""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Seconds of the fastest of `repeat` calls after one warm-up (the least disturbed run)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def proc_status_kb(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss_kb() -> int:
    """Reset the peak-RSS mark (Linux clear_refs) and return the current RSS in kB.

    ``ru_maxrss`` cannot be reset and survives exec, so a child started by a large parent would
    report the parent's peak; VmHWM after clear_refs measures only what follows.
    """
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return proc_status_kb("VmRSS")


def peak_extra_mb(fn: Callable[[], Any]) -> float:
    """MB by which the peak RSS grows while `fn` runs (inputs already allocated)."""
    base = reset_peak_rss_kb()
    fn()
    return (proc_status_kb("VmHWM") - base) / 1024.0


def in_fresh_process(target: Callable, *args, timeout: float = 900) -> Any:
    """Run ``target(queue, *args)`` in a spawned process and return what it puts on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        proc.join()
