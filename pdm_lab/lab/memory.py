"""A memory estimate before a large allocation: a size that cannot fit this machine is refused
as bad input, naming the fields that set it, instead of reaching the allocator (whose message
names no field, after minutes of work).

    check_memory(8 * sequences * max_len * vocab, "groups_per_step × group_size = 1e12 sequences")
"""
from __future__ import annotations

import os

from pdm_lab.config import ConfigError


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 when the platform does not say: then nothing is refused)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def human_bytes(n: float) -> str:
    """``8e12`` → ``8 TB`` (decimal units, two significant digits)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB", "EB"):
        if abs(n) < 1000 or unit == "EB":
            return f"{n:.2g} {unit}" if n < 10 else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} EB"


def check_memory(need_bytes: float, what: str, *, memory_bytes: int | None = None) -> None:
    """Refuse (``ConfigError``) when `need_bytes` exceeds this machine's physical memory; `what`
    names the fields and values that set the size."""
    have = machine_memory_bytes() if memory_bytes is None else memory_bytes
    if have and need_bytes > have:
        raise ConfigError(f"{what}: needs ~{human_bytes(need_bytes)}; this machine has {human_bytes(have)}")
