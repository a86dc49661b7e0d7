"""Two ways to run the hot row-wise tensor math in few passes over memory: the same functions.

* ``torch.compile``: opt-in (compiling costs ~10–20 s once per process and needs a C++ compiler
  on CPU); ``PDM_LAB_COMPILE=1`` or ``compiled=True`` turns it on. Inductor fuses the ~20
  elementwise passes of a function into one loop over each row.
* Eager, by row blocks (``row_blocks=True``, CPU tensors): a function whose rows are independent
  runs over blocks of `BLOCK_ROWS` rows, so that its temporaries stay in cache and each of its
  passes reads cache instead of memory. Each row sees the same ops as in one whole-tensor call.
  With torch running T > 1 threads, T workers take the blocks in turn, each block on one thread:
  a block's ~60 small ops then never wait for each other's threads (torch splits every op across
  its threads and joins them after it; on a shared machine each join waits for a busy core).

Tests check compiled == eager == one whole-tensor call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import Tensor

#: Rows per eager block: a [rows, 21] float32 temporary is ~5.5 MB, so the ~20 a function makes
#: mostly stay in the last-level cache. Measured (``token_stats``, N = 10⁶, K = 20, one thread):
#: 16k rows 1.53×, 64k rows 1.57×, one whole call 3.84× the one-pass reference.
BLOCK_ROWS = 65536

_CACHE: dict[tuple[Callable, bool], Callable] = {}
_WORKER = threading.local()


def compile_default() -> bool:
    """True when ``PDM_LAB_COMPILE`` is set to anything but 0/false/empty."""
    return os.environ.get("PDM_LAB_COMPILE", "0").lower() not in ("", "0", "false", "no")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def lowered_isa() -> str | None:
    """Why compiling is unsafe here, or None: ``ATEN_CPU_CAPABILITY`` set below an AVX-512 CPU's
    own ISA. Torch 2.13's inductor then emits AVX2 code whose int64 selects and gathers return
    wrong values (measured here: ``_pads_to_real`` 80 of 84 ids wrong; compiled ``token_stats``
    off by up to 0.3 in D, NaN tails), and its on-disk cache does not key on the ISA (a later run
    without the variable loaded those kernels and crashed), so ``maybe_compiled`` runs eager."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap and cap not in ("avx512", "avx512_vnni", "avx512_bf16") and "avx512f" in _cpu_flags():
        return (f"ATEN_CPU_CAPABILITY={cap} on an AVX-512 CPU: torch.compile's AVX2 code miscomputes int64 "
                "selects and gathers in torch 2.13, so pdm_lab runs these functions eager (unset it to compile)")
    return None


_WARNED: list[str] = []


def maybe_compiled(fn: Callable, compiled: bool | None, *, row_blocks: bool = False) -> Callable:
    """`fn`'s ``torch.compile(dynamic=True)`` twin (built once per process) when compiling; else
    `fn` itself, or ``by_row_blocks(fn)`` with `row_blocks`. Where compiling is known to give
    wrong numbers (``lowered_isa``) the eager function is returned, with one warning."""
    wanted = compile_default() if compiled is None else compiled
    unsafe = lowered_isa() if wanted else None
    if unsafe and not _WARNED:
        import warnings

        _WARNED.append(unsafe)
        warnings.warn(f"pdm_lab: {unsafe}", RuntimeWarning, stacklevel=2)
    if not wanted or unsafe:
        return by_row_blocks(fn) if row_blocks else fn
    if (fn, True) not in _CACHE:
        graph = torch.compile(fn, dynamic=True)
        _CACHE[(fn, True)] = functools.wraps(fn)(lambda *args: graph(*unaliased(args)))
    # Not by row blocks: views at other storage offsets and the workers' thread count are guards
    # that recompile the graph (5 compiles of the stats seen at N = 300k, K = 20).
    return _CACHE[(fn, True)]


def unaliased(args: tuple) -> tuple:
    """`args` with a copy of each tensor whose storage an earlier one already uses (tensors given
    directly, or as fields of a dataclass argument, or as values of such a field's dict).

    Torch 2.13's compiled graphs with dynamic shapes fail building their guards, depending on the
    hash seed, when two inputs alias ("sources must not be empty for symbol …": AOT autograd
    gives the shared base a symbol that no input names). A caller's views (two columns of one
    [N, 2] tensor, a reshape of a mask also passed whole) are legitimate, so they are copied here,
    where only the compiled path pays (an [N] copy), rather than refused.
    """
    seen: set[int] = set()

    def own(t):
        if not isinstance(t, Tensor) or t.numel() == 0:
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return t.clone()
        seen.add(ptr)
        return t

    def walk(a):
        if isinstance(a, Tensor):
            return own(a)
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            changes = {}
            for f in dataclasses.fields(a):
                v = getattr(a, f.name)
                new = {k: own(x) for k, x in v.items()} if isinstance(v, dict) else own(v)
                if new is not v and (not isinstance(v, dict) or any(new[k] is not v[k] for k in v)):
                    changes[f.name] = new
            return dataclasses.replace(a, **changes) if changes else a
        return a

    return tuple(walk(a) for a in args)


@contextlib.contextmanager
def one_thread(device: torch.device):
    """Run the enclosed CPU ops on one thread: for per-token [N] vectors (the mask, the loss, the
    metrics), each op is ~1 ms of work, and splitting it across threads costs a fork/join per op
    that, on a shared machine, waits for a busy core (measured at N = 10⁶, 2 threads, load 3–8:
    the metrics 530–650 ms, one thread 64–125 ms). No-op off the CPU or on one thread already."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _one_thread() -> None:
    torch.set_num_threads(1)  # this worker's own setting; the caller's threads keep theirs
    _WORKER.active = True


def by_row_blocks(fn: Callable, rows: int | None = None) -> Callable:
    """Run ``fn(*args)`` over blocks of rows and assemble what one whole call would return.

    `fn` must be row-independent: every Tensor argument is [N, ...] and is sliced by rows (other
    arguments pass through); it returns a dict of [N, ...] tensors, written into one output each,
    plus optionally ``flags``: a bool tensor of any-row facts, OR-ed over the blocks. Tensors off
    the CPU run in one call (an accelerator's kernels are launched, not run, here).
    """
    @functools.wraps(fn)
    def run(*args):
        block = BLOCK_ROWS if rows is None else rows
        first = next(a for a in args if isinstance(a, Tensor))
        n = first.shape[0]
        if n <= block or first.device.type != "cpu":
            return fn(*args)
        starts = range(0, n, block)
        grad = torch.is_grad_enabled()
        out: dict[str, Tensor] = {}
        lock = threading.Lock()

        def part(lo: int) -> Tensor | None:
            with torch.set_grad_enabled(grad):  # grad mode is per thread
                got = fn(*(a[lo:lo + block] if isinstance(a, Tensor) else a for a in args))
            with lock:
                if not out:  # the first block done allocates the outputs
                    out.update({key: v.new_empty((n, *v.shape[1:])) for key, v in got.items() if key != "flags"})
            for key, v in got.items():
                if key != "flags":
                    out[key][lo:lo + v.shape[0]] = v
            return got.get("flags")

        workers = min(torch.get_num_threads(), len(starts))
        if workers == 1 or getattr(_WORKER, "active", False):
            flags = list(map(part, starts))
        else:  # a pool per call: no thread outlives it (a later fork stays safe); starting two costs µs
            threads = torch.get_num_threads()
            try:
                with ThreadPoolExecutor(workers, initializer=_one_thread) as pool:
                    flags = list(pool.map(part, starts))
            finally:  # the workers' setting is also the default of threads started later: restore it
                torch.set_num_threads(threads)
        if flags[0] is not None:
            out["flags"] = functools.reduce(torch.bitwise_or, flags)
        return out
    return run
