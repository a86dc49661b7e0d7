"""``pdm-lab``: one command line whose commands are entry-point plugins (group
``pdm_lab.commands``, see ``pdm_lab.cli.plugins``): the core, each stage and any other installed
package register theirs the same way; this module names none of them.

``pdm-lab --help`` lists every command with the extra it needs (``needs_extras``: the entry
point's own ``[extra]`` when it declares one, else its register function's ``extras``
attribute); a command whose plugin fails to import because an extra is not installed is
still listed, "needs pip install 'pdm_lab[extra]'", and running it says the same."""
from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from pdm_lab.config import FINITE, ConfigError, Range, at_least, check_option
from pdm_lab.lab.yaml_config import parse_value
from pdm_lab.cli.plugins import COMMANDS, PluginError, discover, load


def number(rng: Range = FINITE, *, integer: bool = False, field: tuple[type, str] | None = None):
    """An argparse ``type`` for a number read by the config grammar (``1e-5`` is a number, ``.nan``
    parses and is refused unless the range allows it) and checked against its range: `rng`, or
    the ``Annotated`` range of a config field, ``field=(AuditConfig, "delta")``, so an option that
    feeds a config field declares no second range. argparse names the option in the error."""
    def parse(text: str) -> typing.Any:
        try:
            value = parse_value(text, source=repr(text))
        except ConfigError:
            value = text
        try:
            return check_option(value, integer=integer, rng=rng, field=field)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = "integer" if integer else "number"
    return parse


def integer(rng: Range = Range(), *, field: tuple[type, str] | None = None):
    """``number(rng, integer=True)``: an integer (``1e5`` is 100000) in `rng`, within int64."""
    return number(rng, integer=True, field=field)


def int_at_least(minimum: int):
    """An argparse ``type`` for an integer ≥ `minimum` (``--workers 0`` is an error, not a default)."""
    return integer(at_least(minimum))


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line naming the argument, with a pointer to --help instead of
    the full usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _extra_requirements(dist) -> dict[str, set[str]]:
    """Each extra of `dist` and the (normalised) distribution names it adds, nested extras
    (``pkg[a]`` inside ``b``) followed."""
    import re

    direct: dict[str, set[str]] = {}
    nested: dict[str, set[str]] = {}
    own = _norm(dist.metadata["Name"] or "")
    for req in dist.requires or []:
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?[^;]*;.*extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if not m:
            continue
        name, inner, extra = _norm(m.group(1)), m.group(2), m.group(3)
        if name == own and inner:
            nested.setdefault(extra, set()).update(e.strip() for e in inner.split(","))
        else:
            direct.setdefault(extra, set()).add(name)
    out = {extra: set(names) for extra, names in direct.items()}
    for extra, inners in nested.items():
        out.setdefault(extra, set()).update(*(direct.get(i, set()) for i in inners))
    return out


def _cover(module: str, extras: dict[str, set[str]]) -> list[str]:
    """The extras (in order of declaration) whose requirements hold the distribution ``module``
    is named after (its import name, normalised)."""
    return [extra for extra, names in extras.items() if _norm(module) in names]


def needs_extras(ep, register=None, missing: str | None = None) -> list[str]:
    """The extras of the plugin's distribution that its command needs: the entry point's declared
    ``[extra]``, else its register function's ``extras`` attribute, else (its import failed on
    the module ``missing``) the extras that install that module. Empty: none declared."""
    if getattr(ep, "extras", None):
        return list(ep.extras)
    if register is not None and getattr(register, "extras", None):
        return list(register.extras)
    dist = getattr(ep, "dist", None)
    if not missing or dist is None:
        return []
    try:
        return _cover(missing, _extra_requirements(dist))
    except Exception:  # noqa: BLE001 - unreadable metadata: nothing to say
        return []


def _install_hint(ep, extras: list[str]) -> str:
    dist = getattr(ep, "dist", None)
    name = dist.metadata["Name"] if dist is not None else "pdm_lab"
    return f"needs pip install '{name}[{','.join(extras)}]'"


def _missing_module(err: BaseException) -> str | None:
    """The top-level module a plugin's import failed on (``ModuleNotFoundError``), if that was it."""
    cause = err.__cause__ or err.__context__
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__ or cause.__context__
    return cause.name.split(".")[0] if cause is not None and cause.name else None


def _command_of(argv: list[str], names) -> str | None:
    """The command named on the line (the first word that is not an option), if it is known."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or only the one ``argv`` names (the others stay unloaded).

    A plugin that fails to load is a ``PluginError`` when it is the command asked for; otherwise
    (``--help``, an unknown word) it is reported on stderr in one line and left out — except one
    that fails for a missing extra: that command is listed, with the install line, and running
    it is that one-line error. Every listed command's help names the extras it needs.
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
            missing = _missing_module(err)
            extras = needs_extras(ep, missing=missing) if missing else []
            if extras:
                hint = _install_hint(ep, extras)
                if wanted is not None:
                    raise PluginError(f"pdm-lab {name}: {hint} (No module named {missing!r})") from None
                sub.add_parser(name, help=f"{hint} (not installed: {missing})")
                continue
            if wanted is not None:
                raise
            print(f"pdm-lab: warning: {err}", file=sys.stderr)
            continue
        if wanted is None and name in sub.choices:
            extras = needs_extras(ep, register)
            for action in sub._choices_actions:  # the --help line of this command
                if action.dest == name and extras:
                    action.help = f"{action.help or ''} [extra: {', '.join(extras)}]"
        if name not in sub.choices:
            err = PluginError(f"{COMMANDS} plugin {name!r} ({ep.value}) did not add a command named {name!r}")
            if wanted is not None:
                raise err
            print(f"pdm-lab: warning: {err}", file=sys.stderr)
    return parser


def traceback_folder(args: argparse.Namespace) -> Path | None:
    """Where an internal error's traceback goes: the run's own folder, ``args.traceback_dir``
    when the command set it (a training run's ``run_dir``), else ``--out`` when it is an existing
    folder, or the existing folder of an ``--out`` file; None when the command made none."""
    for value in (getattr(args, "traceback_dir", None), getattr(args, "out", None)):
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            return path
        if path.suffix and path.parent.is_dir() and str(path.parent) not in ("/", "/dev", "/proc"):
            return path.parent
    return None


def save_traceback(err: BaseException, argv: list[str], folder: Path | None) -> str:
    """Write `err`'s traceback (and the command line) to ``folder/pdm-lab-traceback.txt``; where it
    went, or how to see it (``--debug``) when there is no folder or it cannot be written."""
    import traceback

    if folder is None:
        return "rerun with --debug to print the traceback"
    path = folder / "pdm-lab-traceback.txt"
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(f"pdm-lab {' '.join(argv)}\npython {sys.version.split()[0]}\n\n")
            fh.write("".join(traceback.format_exception(err)))
        return f"traceback saved to {path}"
    except OSError as io_err:
        return f"traceback not saved to {path} ({io_err}); rerun with --debug to print it"


def internal_error_line(command: str, err: BaseException, argv: list[str], folder: Path | None = None) -> str:
    """The one line an internal error prints: that it is a pdm_lab bug, what it was, and where its
    traceback is (the run's own folder, never the system's temp folder)."""
    from pdm_lab.errors import one_line

    what = one_line(err)
    name = type(err).__name__
    what = what if what.startswith(name) else f"{name}: {what}"
    return (f"pdm-lab {command}: internal error (a pdm_lab bug, not a problem with your input): {what}; "
            f"{save_traceback(err, argv, folder)} (please report it)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # accepted anywhere on the line, also after the command's options
    argv = [a for a in argv if a != "--debug"]
    try:
        parser = build_parser(argv)
    except PluginError as err:
        print(f"pdm-lab: error: {err}", file=sys.stderr)
        return 2
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (also: PDM_LAB_DEBUG=1)")
    args, extra = parser.parse_known_args(argv)
    args.debug = debug
    if extra:  # key.path=value overrides may sit between options (argparse keeps one positional run)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - every failure is one line: bad input (2) or a bug (70)
        if args.debug or os.environ.get("PDM_LAB_DEBUG"):
            raise
        from pdm_lab.errors import exit_code, one_line

        status = exit_code(err)
        if status == 2:
            print(f"pdm-lab {args.command}: error: {one_line(err)} (--debug for the traceback)", file=sys.stderr)
        else:
            print(internal_error_line(args.command, err, argv, traceback_folder(args)), file=sys.stderr)
        return status
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
