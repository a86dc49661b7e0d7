"""``pdm-lab``: one command line over the three stages. Each stage registers its own subcommands."""
from __future__ import annotations

import argparse
import importlib
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
    args = parser.parse_args(argv)
    code = args.func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
