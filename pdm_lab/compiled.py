"""Opt-in ``torch.compile`` of the hot tensor math: the same functions, fused into few passes.

Off by default (compiling costs ~10–20 s once per process and needs a C++ compiler on CPU);
``PDM_LAB_COMPILE=1`` or ``compiled=True`` turns it on. Tests check compiled == eager.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

_CACHE: dict[Callable, Callable] = {}


def compile_default() -> bool:
    """True when ``PDM_LAB_COMPILE`` is set to anything but 0/false/empty."""
    return os.environ.get("PDM_LAB_COMPILE", "0").lower() not in ("", "0", "false", "no")


def maybe_compiled(fn: Callable, compiled: bool | None) -> Callable:
    """`fn` itself, or its ``torch.compile(dynamic=True)`` twin (built once per process)."""
    if not (compile_default() if compiled is None else compiled):
        return fn
    if fn not in _CACHE:
        _CACHE[fn] = torch.compile(fn, dynamic=True)
    return _CACHE[fn]
