"""How one rollout batch is split into the M mini-batches of its optimiser steps (SPEC §6b, §7):
contiguous and equal, in the batch's order. The loop and the toy audit split with this one
function, so "mini-batch j" names the same rows in both."""
from __future__ import annotations


def split(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` in ``parts`` contiguous chunks of equal size (n must divide)."""
    if n % parts:
        raise ValueError(f"{n} sequences do not split into {parts} equal parts")
    size = n // parts
    return [list(range(i, i + size)) for i in range(0, n, size)]
