"""For your own tests: ``conformance`` (check *your* mask or divergence code against the mpmath
oracle: ``check_divergence``, ``check_mask``, ``llm_cases``; needs ``pdm_lab[test]``) and
``call_site_batch`` (one batch in the layouts vLLM, TRL and verl hand over; torch only).

The conformance names load on first use, so ``pdm_lab.testing.call_site_batch`` works where
hypothesis and mpmath are not installed (a verl or TRL environment)."""
from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    value = getattr(importlib.import_module(f"{__name__}.conformance"), name)
    globals()[name] = value
    return value
