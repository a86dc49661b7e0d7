"""``pdm-lab``: one command line over the three stages. Each stage registers its own subcommands."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

#: Modules that expose ``register(subparsers)``; imported lazily so `--help` stays fast.
STAGE_CLIS = ("pdm_lab.proofs.cli", "pdm_lab.envs.cli", "pdm_lab.scaling.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdm-lab",
        description="Predictive Divergence Masks testbed: proofs, toy sweeps, and a real vLLM + FSDP loop.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from . import bench, demo

    demo.register(sub)
    bench.register(sub)
    for name in STAGE_CLIS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback (also: PDM_LAB_DEBUG=1)")
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - every failure is one line naming the input (issue 9)
        if args.debug or os.environ.get("PDM_LAB_DEBUG"):
            raise
        from .errors import exit_code, one_line

        print(f"pdm-lab {args.command}: error: {one_line(err)} (--debug for the traceback)", file=sys.stderr)
        return exit_code(err)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
