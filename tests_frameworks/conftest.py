"""Shared fixtures for the framework environments."""
import sys
from pathlib import Path

import pytest


@pytest.fixture
def install_diff() -> tuple[list[str], list[str]]:
    """(lines only before, lines only after) in ``pip freeze`` around installing pdm_lab's core into
    this environment (the Makefile writes both files when it builds the environment)."""
    env = Path(sys.prefix)
    before = set((env / "freeze-before.txt").read_text().splitlines())
    after = set((env / "freeze-after.txt").read_text().splitlines())
    return sorted(before - after), sorted(after - before)
