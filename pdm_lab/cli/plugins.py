"""Entry-point plugins: the commands and benchmarks of the stages (and of any other package).

A package adds a ``pdm-lab`` command by declaring, in its ``pyproject.toml``::

    [project.entry-points."pdm_lab.commands"]
    mycommand = "my_package.cli:register_mycommand"   # register_mycommand(subparsers) adds "mycommand"

and a benchmark (a ``pdm-lab bench --only NAME`` row source) with::

    [project.entry-points."pdm_lab.benchmarks"]
    mystage = "my_package.bench:run_bench"              # run_bench(args) -> list of row dicts

The core never names a stage: it lists these groups (``importlib.metadata.entry_points``) and
loads an entry point only when its command or benchmark is used. A plugin that fails to load is
one line naming it, its target and the error.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any
from pdm_lab.errors import UserInputError

COMMANDS = "pdm_lab.commands"
BENCHMARKS = "pdm_lab.benchmarks"
#: benchmarks that run only when named (``pdm-lab bench --suite NAME``): minutes each
BENCHMARKS_ON_DEMAND = "pdm_lab.benchmarks.on_demand"


class PluginError(UserInputError, RuntimeError):
    """An entry point that cannot be loaded or does not do what its group promises."""


def discover(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name; two packages claiming one name is an error."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise PluginError(f"{group} plugin {ep.name!r} is declared twice: {other.value} and {ep.value}")
        found[ep.name] = ep
    return dict(sorted(found.items()))


def load(ep: EntryPoint) -> Any:
    """The object an entry point names; any failure is one ``PluginError`` line naming it."""
    try:
        return ep.load()
    except Exception as err:  # an import error, a missing attribute, an error at import time
        raise PluginError(f"{ep.group} plugin {ep.name!r} ({ep.value}) failed to load: "
                          f"{type(err).__name__}: {err}") from None
