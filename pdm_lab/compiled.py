"""Two ways to run the hot row-wise tensor math in few passes over memory: the same functions.

* ``torch.compile``: opt-in (compiling costs ~10–20 s once per process and needs a C++ compiler
  on CPU); ``PDM_LAB_COMPILE=1`` or ``compiled=True`` turns it on. Inductor fuses the ~20
  elementwise passes of a function into one loop over each row.
* Eager, by row blocks (``row_blocks=True``): a function whose rows are independent runs over
  blocks of `BLOCK_ROWS` rows, so that its temporaries stay in cache and each of its passes
  reads cache instead of memory. Each row sees the same ops as in one whole-tensor call.

Tests check compiled == eager == one whole-tensor call.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
from torch import Tensor

#: Rows per eager block: a [rows, 21] float32 temporary is ~5.5 MB, so the ~20 a function makes
#: mostly stay in the last-level cache. Measured (``token_stats``, N = 10⁶, K = 20, one thread):
#: 16k rows 1.53×, 64k rows 1.57×, one whole call 3.84× the one-pass reference. Fewer, larger
#: blocks also mean fewer thread hand-offs, which cost a loaded machine dearly.
BLOCK_ROWS = 65536

_CACHE: dict[tuple[Callable, bool], Callable] = {}


def compile_default() -> bool:
    """True when ``PDM_LAB_COMPILE`` is set to anything but 0/false/empty."""
    return os.environ.get("PDM_LAB_COMPILE", "0").lower() not in ("", "0", "false", "no")


def maybe_compiled(fn: Callable, compiled: bool | None, *, row_blocks: bool = False) -> Callable:
    """`fn`'s ``torch.compile(dynamic=True)`` twin (built once per process) when compiling; else
    `fn` itself, or ``by_row_blocks(fn)`` with `row_blocks` when torch runs one thread: with more,
    each block's small ops hand work between threads, and on a loaded 2-core machine those
    hand-offs cost more than the cache saves (measured: ``token_stats`` 5× slower by blocks)."""
    if not (compile_default() if compiled is None else compiled):
        return by_row_blocks(fn) if row_blocks and torch.get_num_threads() == 1 else fn
    if (fn, True) not in _CACHE:
        _CACHE[(fn, True)] = torch.compile(fn, dynamic=True)
    return _CACHE[(fn, True)]


def by_row_blocks(fn: Callable, rows: int | None = None) -> Callable:
    """Run ``fn(*args)`` over blocks of rows and assemble what one whole call would return.

    `fn` must be row-independent: every Tensor argument is [N, ...] and is sliced by rows (other
    arguments pass through); it returns a dict of [N, ...] tensors, written into one output each,
    plus optionally ``flags``: a bool tensor of any-row facts, OR-ed over the blocks.
    """
    @functools.wraps(fn)
    def run(*args):
        block = BLOCK_ROWS if rows is None else rows
        n = next(a.shape[0] for a in args if isinstance(a, Tensor))
        if n <= block:
            return fn(*args)
        out: dict[str, Tensor] = {}
        for lo in range(0, n, block):
            part = fn(*(a[lo:lo + block] if isinstance(a, Tensor) else a for a in args))
            if not out:  # first block: allocate the outputs
                out = {key: v.clone() if key == "flags" else v.new_empty((n, *v.shape[1:]))
                       for key, v in part.items()}
            for key, v in part.items():
                if key == "flags":
                    out[key] |= v
                else:
                    out[key][lo:lo + v.shape[0]] = v
        return out
    return run
