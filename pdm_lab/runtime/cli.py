"""``pdm-lab``: one command line whose commands are entry-point plugins (group
``pdm_lab.commands``, see ``pdm_lab.runtime.plugins``): the core, each stage and any other installed
package register theirs the same way; this module names none of them."""
from __future__ import annotations

import argparse
import os
import sys

from .plugins import COMMANDS, PluginError, discover, load


def int_at_least(minimum: int):
    """An argparse ``type`` for an integer ≥ `minimum` (``--workers 0`` is an error, not a default)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {value}")
        return value
    parse.__name__ = f"integer ≥ {minimum}"
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line naming the argument (issue 9), with a pointer to --help
    instead of the full usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def _command_of(argv: list[str], names) -> str | None:
    """The command named on the line (the first word that is not an option), if it is known."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or only the one ``argv`` names (the others stay unloaded).

    A plugin that fails to load is a ``PluginError`` when it is the command asked for; otherwise
    (``--help``, an unknown word) it is reported on stderr in one line and left out.
    """
    parser = OneLineParser(
        prog="pdm-lab",
        description="Predictive Divergence Masks testbed: proofs, toy sweeps, and a real vLLM + FSDP loop.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plugins = discover(COMMANDS)
    wanted = _command_of(list(argv or []), plugins)
    for name, ep in plugins.items():
        if wanted is not None and name != wanted:
            continue
        try:
            register = load(ep)
            register(sub)
        except PluginError as err:
            if wanted is not None:
                raise
            print(f"pdm-lab: warning: {err}", file=sys.stderr)
            continue
        if name not in sub.choices:
            err = PluginError(f"{COMMANDS} plugin {name!r} ({ep.value}) did not add a command named {name!r}")
            if wanted is not None:
                raise err
            print(f"pdm-lab: warning: {err}", file=sys.stderr)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(argv)
    except PluginError as err:
        print(f"pdm-lab: error: {err}", file=sys.stderr)
        return 2
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (also: PDM_LAB_DEBUG=1)")
    args, extra = parser.parse_known_args(argv)
    if extra:  # key.path=value overrides may sit between options (argparse keeps one positional run)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - every failure is one line naming the input (issue 9)
        if args.debug or os.environ.get("PDM_LAB_DEBUG"):
            raise
        from ..errors import exit_code, one_line

        print(f"pdm-lab {args.command}: error: {one_line(err)} (--debug for the traceback)", file=sys.stderr)
        return exit_code(err)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
