"""``pdm-lab prove``: check every claim of SPEC §2–3 and write the table as Markdown.

    pdm-lab prove                       # all claims, results/proofs.md
    pdm-lab prove --only bound --seed 3 # claims whose name contains "bound"
    python -m pdm_lab.proofs.commands        # the same without the umbrella command

Exit status 0 when every selected claim passes, 1 when one fails (its instance is printed), 2 for
a pattern that matches no claim.
"""
from __future__ import annotations

import argparse
import sys

from pdm_lab.lab.outputs import write_output
from pdm_lab.config import at_least
from pdm_lab.cli.main import integer

from .runner import ClaimResult, run_proofs, select_claims

DEFAULT_OUT = "results/proofs.md"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="FILE.md",
                        help=f"where to write the Markdown report (default: {DEFAULT_OUT})")
    parser.add_argument("--only", default=None, metavar="PATTERN",
                        help="run only claims whose name matches: a glob (*bound*) or a substring; "
                             "comma-separate several")
    parser.add_argument("--seed", type=integer(at_least(0)), default=0,
                        help="seed of the random instances (default: 0)")
    parser.add_argument("--list", action="store_true", help="list the claims and exit")
    parser.set_defaults(func=prove)
    return parser


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``prove`` subcommand to the umbrella ``pdm-lab`` parser."""
    parser = subparsers.add_parser(
        "prove", help="check the math of SPEC §2–3 with sympy and against the torch code",
        description="Check each claim of SPEC §2–3 symbolically with sympy (or exhaustively and "
                    "at 50 digits where sympy cannot), and evaluate pdm_lab's torch code in "
                    "float64 on the same instances. Prints a table (claim, method, verdict, "
                    "checks, seconds), writes it as Markdown, exits 1 if any claim fails.")
    return add_arguments(parser)


def _progress(total: int):
    done = [0]

    def show(result: ClaimResult) -> None:
        done[0] += 1
        print(f"[{done[0]:>2}/{total}] {result.verdict:<5} {result.name} ({result.seconds:.2f} s)",
              file=sys.stderr, flush=True)
    return show


def prove(args: argparse.Namespace) -> int:
    """Run the selected claims; print the table and any failing instance; return the exit status."""
    try:
        chosen = select_claims(args.only)
    except ValueError as err:
        print(f"pdm-lab prove: {err}", file=sys.stderr)
        return 2
    if args.list:
        for item in chosen:
            print(f"{item.name:<40} {item.statement}")
        return 0
    # the report's path is checked before minutes of proofs: an unwritable --out is one line, exit 2
    write_output(args.out, "# pdm-lab prove: running\n")
    report = run_proofs(only=args.only, seed=args.seed, out=args.out, progress=_progress(len(chosen)))
    print(report.table())
    print(f"report written to {args.out}")
    if not report.passed:
        print("\n" + report.failure_details(), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="pdm-lab prove", description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
