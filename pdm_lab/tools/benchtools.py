"""Measurement helpers every stage's bench shares: timing (best-of, and alternated medians on a
shared machine), peak memory on Linux, and engine-like inputs for the mask pipeline."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import statistics
import time
import traceback
from typing import Any, Callable

import torch


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


class ChildFailed(RuntimeError):
    """A measurement's fresh process raised or died: the child's one-line error, and the child's
    traceback as the cause."""


class ChildTraceback(Exception):
    """The traceback text of an exception raised in a child process (chained as the cause)."""


def _report_to_parent(queue, target: Callable, args: tuple) -> None:
    """The child's entry point: run the measurement; on an exception hand the parent its one-line
    message and traceback instead of only printing them to a stderr nobody waits on."""
    try:
        target(queue, *args)
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        from pdm_lab.errors import one_line

        queue.put({"child_error": f"{type(err).__name__}: {one_line(err)}", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None


def in_fresh_process(target: Callable, *args, timeout: float = 900, poll_s: float = 0.2) -> Any:
    """Run ``target(queue, *args)`` in a spawned process and return what it puts on the queue.

    The parent fails at once when the child does: with the child's one-line error when it raised,
    with its exit status when it died without a word (a signal, ``os._exit``), and after `timeout`
    seconds without a result; the child is stopped on the way out either way.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_report_to_parent, args=(queue, target, args))
    proc.start()
    name = getattr(target, "__name__", repr(target))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = queue.get(timeout=poll_s)
                break
            except queue_module.Empty:
                pass
            if not proc.is_alive():
                try:  # it may have reported just before exiting
                    result = queue.get(timeout=1.0)
                    break
                except queue_module.Empty:
                    raise ChildFailed(f"{name} (fresh process) exited with status {proc.exitcode} "
                                      "before reporting a result") from None
            if time.monotonic() > deadline:
                raise ChildFailed(f"{name} (fresh process) reported nothing within {timeout:g} s")
    finally:
        proc.join(timeout=5)  # after its result (or its error) the child only exits
        if proc.is_alive():
            proc.kill()
            proc.join()
    if isinstance(result, dict) and "child_error" in result:
        raise ChildFailed(f"{name} (fresh process): {result['child_error']}") from ChildTraceback(result["traceback"])
    return result


def alternated_medians(fns: dict[str, Callable[[], Any]], rounds: int,
                       sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds of each fn over `rounds` rounds, the fns alternated within each round (after
    one warm-up each), so that a loaded machine's drift hits every fn alike. `sync` waits for an
    accelerator before each clock read."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


#: Settings that change how fresh memory is paid for: first touch of a large block (page faults)
#: dominates an eager reference pass on glibc's defaults (see ``pdm_lab.tools.bench``).
ALLOCATOR_SETTINGS = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def allocator_setting() -> str:
    """The allocator settings in this process's environment, or "default"."""
    found = [f"{key}={os.environ[key]}" for key in ALLOCATOR_SETTINGS if os.environ.get(key)]
    return ", ".join(found) or "default"


def rollout_like_inputs(n_tokens: int, k: int, vocab: int, seed: int = 0, device: str = "cpu") -> dict:
    """What a rollout engine returns for N tokens (top-K sorted by log-prob, ids in no order,
    sampled id inside ~90% of the time) and noise for a matching π on the support, without any [N, V] tensor."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, k + 1, generator=gen) * 2.0
    logits = torch.sort(logits, dim=1, descending=True).values
    head = torch.log_softmax(logits, dim=1)  # k+1 atoms: K head tokens and the tail
    topk_logp = head[:, :k]
    start = torch.randint(0, vocab - k - 1, (n_tokens, 1), generator=gen)
    # ids in the order an engine returns them (by log-prob, not by id): a sorted-id row would
    # flatter the duplicate check, whose eager form sorts each row
    topk_ids = start + torch.rand(n_tokens, k, generator=gen).argsort(dim=1)
    inside = torch.rand(n_tokens, generator=gen) < 0.9
    slot = torch.randint(0, k, (n_tokens,), generator=gen)
    sampled = torch.where(inside, topk_ids.gather(1, slot[:, None])[:, 0], (start[:, 0] + k) % vocab)
    sampled_logp = torch.where(inside, topk_logp.gather(1, slot[:, None])[:, 0], head[:, k] - 3.0)
    advantages = torch.where(torch.rand(n_tokens, generator=gen) < 0.5, -1.0, 1.0)
    out = {"topk_ids": topk_ids, "topk_logp": topk_logp.contiguous(), "sampled": sampled,
           "sampled_logp": sampled_logp, "advantages": advantages,
           "noise": torch.randn(n_tokens, k + 2, generator=gen) * 0.3}
    return {**{key: v.to(device) for key, v in out.items()}, "vocab": vocab}


def policy_like(support, noise: torch.Tensor):
    """π on the support (a leaf with grad): μ's head and tail atoms perturbed by `noise` [N, ≥ m+1]."""
    from pdm_lab.policy_side import PolicyOnSupport
    m = support.ids.shape[1]
    raw = torch.cat([support.mu_logp, support.mu_tail_logp[:, None]], dim=1) + noise[:, : m + 1]
    logp = torch.log_softmax(raw, dim=1)
    tail = logp[:, m]
    return PolicyOnSupport(logp=logp[:, :m].masked_fill(~support.valid, float("-inf")).requires_grad_(),
                           tail_logp=tail, tail_log_sumsq=2 * tail - 3.0)
