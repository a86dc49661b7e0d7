"""The claim registry: each claim of SPEC §2–3 is one function registered by name.

A claim function takes a ``Checker`` and returns nothing; it passes when every check it makes
passes. A check that fails raises ``ClaimFailed`` with the offending instance, so the report can
show exactly where the math or the code broke. Adding a claim is one decorated function:

    @claim("expectation_under_pi", method="symbolic (general n) + torch float64")
    def expectation_under_pi(check: Checker) -> None:
        ...
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import mpmath


class ClaimFailed(AssertionError):
    """A claim's check failed; the message names the check, the values and the instance."""


@dataclass
class Checker:
    """What a claim function checks with: a seeded RNG, a check counter and comparison helpers.

    Attributes:
        rng: the claim's own random stream (seeded from the run seed and the claim name).
        count: how many individual checks passed so far.
    """

    rng: random.Random
    count: int = 0
    notes: list[str] = field(default_factory=list)

    def that(self, condition: bool, what: str, instance: object = None) -> None:
        """Check a condition; on failure raise with `what` and the instance's description."""
        if not condition:
            raise ClaimFailed(_with_instance(what, instance))
        self.count += 1

    def close(self, got: float, want, what: str, instance: object = None, *,
              atol: float = 1e-12, rtol: float = 1e-10) -> None:
        """Check |got − want| ≤ atol + rtol·|want|; `got` from torch float64, `want` high precision."""
        want_f = mpmath.mpf(want)
        got = got if isinstance(got, mpmath.mpf) else mpmath.mpf(float(got))  # tensors, floats
        err = abs(got - want_f)
        tol = atol + rtol * abs(want_f)
        if not err <= tol:
            raise ClaimFailed(_with_instance(
                f"{what}: got {mpmath.nstr(got, 17)}, expected {mpmath.nstr(want_f, 17)} "
                f"(|error| {mpmath.nstr(err, 3)} > tolerance {mpmath.nstr(tol, 3)})", instance))
        self.count += 1

    def note(self, text: str) -> None:
        """Record an observation for the report (not a failure)."""
        if text not in self.notes:
            self.notes.append(text)

    def zero(self, expr, what: str, instance: object = None) -> None:
        """Check that a sympy expression is identically zero (``expr == 0`` after simplification)."""
        if expr != 0:
            raise ClaimFailed(_with_instance(f"{what}: residual {expr} is not identically 0", instance))
        self.count += 1


def _with_instance(what: str, instance: object) -> str:
    if instance is None:
        return what
    describe = getattr(instance, "describe", None)
    return f"{what}\n    instance: {describe() if callable(describe) else instance}"


ClaimFunction = Callable[[Checker], None]


@dataclass(frozen=True)
class Claim:
    """A registered claim: its name, how it is checked (``method``), and the checking function."""

    name: str
    method: str
    function: ClaimFunction

    @property
    def statement(self) -> str:
        """The docstring's first paragraph, on one line: the claim in SPEC's symbols."""
        doc = (self.function.__doc__ or "").strip()
        paragraph = doc.split("\n\n")[0] if doc else self.name
        return " ".join(line.strip() for line in paragraph.splitlines())


#: Every claim, in registration order (the order of SPEC §2–3b).
CLAIMS: dict[str, Claim] = {}


def claim(name: str, *, method: str) -> Callable[[ClaimFunction], ClaimFunction]:
    """Decorator: register a claim function under `name`, checked by `method` (shown in the table)."""
    def wrap(fn: ClaimFunction) -> ClaimFunction:
        if name in CLAIMS:
            raise ValueError(f"claim {name!r} is already registered")
        CLAIMS[name] = Claim(name=name, method=method, function=fn)
        return fn
    return wrap
