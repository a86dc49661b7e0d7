"""Run the registered claims and report: a table (claim, method, verdict, checks, seconds).

``run_proofs`` is the library entry point behind ``pdm-lab prove``.
"""
from __future__ import annotations

import fnmatch
import random
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import mpmath

from pdm_lab.lab.outputs import write_output

from .reference import PRECISION
from .registry import CLAIMS, Checker, Claim, ClaimFailed

# Importing the claim modules registers their claims, in SPEC order.
from . import ddot_closed_form, estimators, bounds, divergences, other_measures  # noqa: E402,F401
from . import coupled_direction, kernel_probe  # noqa: E402,F401


@dataclass(frozen=True)
class ClaimResult:
    """Outcome of one claim. verdict: ``pass``, ``FAIL`` (a check failed) or ``ERROR`` (it raised)."""

    name: str
    method: str
    statement: str
    verdict: str
    checks: int
    seconds: float
    detail: str = ""
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


@dataclass(frozen=True)
class ProofReport:
    """All results of one run, with the seed and the wall time."""

    results: tuple[ClaimResult, ...]
    seed: int
    seconds: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> tuple[ClaimResult, ...]:
        return tuple(r for r in self.results if not r.passed)

    def table(self) -> str:
        """The plain-text table printed by ``pdm-lab prove``."""
        header = ("claim", "method", "verdict", "checks", "seconds")
        rows = [(r.name, r.method, r.verdict, str(r.checks), f"{r.seconds:.2f}") for r in self.results]
        widths = [max(len(h), *(len(row[c]) for row in rows)) for c, h in enumerate(header)]
        line = lambda cells: "  ".join(  # noqa: E731
            cell.rjust(w) if c >= 3 else cell.ljust(w) for c, (cell, w) in enumerate(zip(cells, widths)))
        out = [line(header), line(tuple("-" * w for w in widths))] + [line(row) for row in rows]
        passed = sum(r.passed for r in self.results)
        out.append(f"{passed}/{len(self.results)} claims pass, {sum(r.checks for r in self.results)} "
                   f"checks, {self.seconds:.1f} s (seed {self.seed})")
        return "\n".join(out)

    def failure_details(self) -> str:
        return "\n\n".join(f"{r.verdict} {r.name}: {r.detail}" for r in self.failures)

    def markdown(self) -> str:
        """The report as Markdown: the table, each claim's statement, and any failing instance."""
        lines = ["# pdm_lab proofs", "",
                 "Each claim of SPEC §2–3 checked with sympy (symbolic where it can, otherwise "
                 f"exhaustive small cases and random instances at {PRECISION} digits), and pdm_lab's "
                 "torch code evaluated in float64 on the same instances against that reference.", "",
                 f"Seed {self.seed}; {len(self.results)} claims; "
                 f"{'all pass' if self.passed else f'{len(self.failures)} FAIL'}; "
                 f"{self.seconds:.1f} s.", "",
                 "| claim | method | verdict | checks | seconds |",
                 "| --- | --- | --- | ---: | ---: |"]
        for r in self.results:
            verdict = r.verdict if r.passed else f"**{r.verdict}**"
            lines.append(f"| `{r.name}` | {r.method} | {verdict} | {r.checks} | {r.seconds:.2f} |")
        lines += ["", "## Claims", ""]
        lines += [f"- `{r.name}`: {r.statement}" for r in self.results]
        notes = [(r.name, text) for r in self.results for text in r.notes]
        if notes:
            lines += ["", "## Notes", ""] + [f"- `{name}`: {text}" for name, text in notes]
        if self.failures:
            lines += ["", "## Failures", ""]
            for r in self.failures:
                lines += [f"### `{r.name}` ({r.verdict})", "", "```", r.detail, "```", ""]
        return "\n".join(lines) + "\n"


def select_claims(only: str | None = None) -> list[Claim]:
    """Claims whose name matches `only`: a glob (``*bound*``) or, without wildcards, a substring.

    Several patterns may be given separated by commas. Raises ValueError naming the valid claims
    when nothing matches.
    """
    if not only:
        return list(CLAIMS.values())
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    globs = [p if any(ch in p for ch in "*?[") else f"*{p}*" for p in patterns]
    chosen = [c for c in CLAIMS.values() if any(fnmatch.fnmatchcase(c.name, g) for g in globs)]
    if not chosen:
        raise ValueError(f"--only {only!r} matches no claim; claims: {', '.join(CLAIMS)}")
    return chosen


def run_claim(item: Claim, seed: int) -> ClaimResult:
    """Run one claim with its own RNG stream (seeded by the run seed and the claim name)."""
    checker = Checker(rng=random.Random(f"{seed}:{item.name}"))
    start = time.perf_counter()
    verdict, detail = "pass", ""
    try:
        with mpmath.workdps(PRECISION):
            item.function(checker)
    except ClaimFailed as failure:
        verdict, detail = "FAIL", str(failure)
    except Exception:  # a crash in the code under test is a failed claim, shown in full
        verdict, detail = "ERROR", traceback.format_exc(limit=-4)
    return ClaimResult(name=item.name, method=item.method, statement=item.statement,
                       verdict=verdict, checks=checker.count,
                       seconds=time.perf_counter() - start, detail=detail,
                       notes=tuple(checker.notes))


def run_proofs(*, only: str | None = None, seed: int = 0, out: str | Path | None = None,
               progress=None) -> ProofReport:
    """Run the claims matching `only` (all by default) and return the report.

    Args:
        only: glob or substring of claim names (comma-separated for several); None: all.
        seed: seed of every claim's random instances.
        out: if given, the Markdown report is written there (parent folders created).
        progress: optional callable receiving each ClaimResult as it finishes.
    """
    start = time.perf_counter()
    results = []
    for item in select_claims(only):
        result = run_claim(item, seed)
        results.append(result)
        if progress is not None:
            progress(result)
    report = ProofReport(results=tuple(results), seed=seed, seconds=time.perf_counter() - start)
    if out is not None:
        write_output(out, report.markdown())
    return report
