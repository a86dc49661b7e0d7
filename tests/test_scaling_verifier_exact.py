"""The math verifier is right and deterministic: an answer exactly equal to the reference but
written differently is graded equal (decided symbolically where sympy can), the conventions for
0^0, 0/0 and x^{-1} at 0 hold as stated, and the verdicts do not move when the clock runs 1000×
fast (what a loaded machine looks like to a wall-clock budget)."""
from __future__ import annotations

import time

import pytest
import sympy
from hypothesis import HealthCheck, given, settings, strategies as st

from pdm_lab.scaling import math_value
from pdm_lab.scaling.math_value import grade_values
from pdm_lab.scaling.math_worker import _BOOT, MathWorker
from pdm_lab.scaling.verifiers import extract_final_answer, grade_math, normalize_answer
from test_scaling_verifier_budget import SYMPY_BOMBS, WORST


@pytest.mark.parametrize("pred,ref,verdict", [
    (r"(1+\sqrt{2})^{2}-(3+2\sqrt{2})", "0", "equal"),  # zero, written as a difference
    (r"(1+\sqrt{2})^{2}", r"3+2\sqrt{2}", "equal"),  # expanded
    (r"\sqrt{3+2\sqrt{2}}", r"1+\sqrt{2}", "equal"),  # denested
    (r"\frac{1}{1+\sqrt{2}}", r"\sqrt{2}-1", "equal"),  # rationalised
    (r"\frac{1}{\sqrt{3}-\sqrt{2}}", r"\sqrt{3}+\sqrt{2}", "equal"),
    (r"(\pi+1)^{2}", r"\pi^{2}+2\pi+1", "equal"),
    (r"(1+\sqrt{2})^{2}", r"3+2\sqrt{2}+10^{-50}", "unequal"),  # a nonzero rational apart: exact
    (r"\sqrt{2}", r"\frac{99}{70}", "unequal"),
    # the conventions: 0^0 = 1; 0/0 and x^{-1} at x = 0 are undefined
    ("0^0", "1", "equal"),
    ("0^{0}", "0", "unequal"),
    ("0/0", "1", "unparseable"),
    (r"\frac{0}{0}", "0", "unparseable"),
    ("0^{-1}", "1", "unparseable"),
    ("(1-1)^{-1}", "1", "unparseable"),
    ("(2-2)^{-2}", "0", "unparseable"),
])
def test_exact_values_and_conventions(pred, ref, verdict):
    assert grade_values(pred, ref) == verdict
    assert grade_math(pred, ref) == verdict  # the same through the worker


# ---- random rewrites of a reference are graded equal

_SQ = [sympy.sqrt(2), sympy.sqrt(3), sympy.sqrt(5), sympy.Integer(1)]


@st.composite
def references(draw) -> sympy.Expr:
    """(a + b·√r)^n / (c + d·√s) (+ e·π): a value with radicals in numerator and denominator."""
    a, b, c, d = (draw(st.integers(-4, 4)) for _ in range(4))
    r, s = draw(st.sampled_from(_SQ)), draw(st.sampled_from(_SQ))
    n = draw(st.integers(1, 4))
    den = c + d * s
    if den == 0:
        den = sympy.Integer(7)
    value = (a + b * r) ** n / den
    if draw(st.booleans()):
        value += draw(st.integers(-3, 3)) * sympy.pi
    return value


REWRITES = {"expand": sympy.expand, "factor": sympy.factor, "rationalise": sympy.radsimp,
            "together": sympy.together, "expand-rationalise": lambda e: sympy.expand(sympy.radsimp(e))}


def latex(value: sympy.Expr) -> str:
    """A value as a model would write it (sympy's LaTeX, read back by the verifier's grammar)."""
    return normalize_answer(sympy.latex(value))


def rewrites_graded_equal(grader, ref: sympy.Expr) -> bool:
    """Every rewrite of `ref` is graded equal to it, both ways round."""
    return all(grader(latex(fn(ref)), latex(ref)) == "equal" and grader(latex(ref), latex(fn(ref))) == "equal"
               for fn in REWRITES.values())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(references())
def test_random_rewrites_of_a_reference_are_graded_equal(ref):
    assert rewrites_graded_equal(grade_values, ref)


def test_rewrite_check_catches_a_grader_without_the_symbolic_test():
    # planted bug: a grader that compares structure (the parsed values with ==), as the verifier
    # effectively did for (1+√2)² − (3+2√2) against 0, fails the property on a plain reference
    def structural(a: str, b: str) -> str:
        va, vb = math_value.parse_value(a), math_value.parse_value(b)
        return "unparseable" if va is None or vb is None else "equal" if va == vb else "unequal"

    ref = (1 + sympy.sqrt(2)) ** 2 / (1 + sympy.sqrt(3))
    assert rewrites_graded_equal(grade_values, ref)
    assert not rewrites_graded_equal(structural, ref)


# ---- load independence: the clock runs 1000× fast, the verdicts stay

PAIRS = [(r"(1+\sqrt{2})^{2}-(3+2\sqrt{2})", "0"), (r"\sqrt{3+2\sqrt{2}}", r"1+\sqrt{2}"), ("0^0", "1"),
         ("0/0", "1"), (r"\pi", "3.14"), (r"\sqrt[3]{27}", "3"), ("2^{1000}", "2^{1000}+1"),
         (r"(\pi+1)^{64}", "1"), *[(bomb, "0") for bomb in SYMPY_BOMBS]]
PAIRS += [(extract_final_answer(text) or "", "1") for text, _ in WORST]

#: Python run in the worker before it starts: monotonic and perf_counter run 1000× fast.
FAST_CLOCK = ("import time\n"
              "for _n in ('monotonic', 'perf_counter'):\n"
              "    _real = getattr(time, _n)\n"
              "    _t0 = _real()\n"
              "    setattr(time, _n, lambda _real=_real, _t0=_t0: _t0 + 1000.0 * (_real() - _t0))\n")


class FastClockWorker(MathWorker):
    boot = FAST_CLOCK + _BOOT


def fast_clock(monkeypatch) -> None:
    """This process's monotonic and perf_counter run 1000× fast from now on."""
    for name in ("monotonic", "perf_counter"):
        real = getattr(time, name)
        t0 = real()
        monkeypatch.setattr(time, name, lambda real=real, t0=t0: t0 + 1000.0 * (real() - t0))


def test_verdicts_do_not_depend_on_the_clock_in_process(monkeypatch):
    idle = [grade_values(a, b) for a, b in PAIRS]
    fast_clock(monkeypatch)
    assert [grade_values(a, b) for a, b in PAIRS] == idle


def test_verdicts_do_not_depend_on_the_clock_in_the_worker():
    idle = [grade_values(a, b) for a, b in PAIRS]
    w = FastClockWorker()
    try:
        assert [w.grade(a, b) for a, b in PAIRS] == idle
        assert w.counts.kills == w.counts.exits == 0 and w.counts.starts == 1
    finally:
        w.close()


def test_fast_clock_catches_a_wall_clock_budget(monkeypatch):
    # planted bug: a grader with a 1 s deadline (the verifier's budget before it counted work)
    # reads a grading of more than 1 ms as over budget once the clock runs 1000× fast
    def deadline_grader(a: str, b: str) -> str:
        sympy.core.cache.clear_cache()  # as a fresh worker: the first grading of a pair
        start = time.monotonic()
        verdict = grade_values(a, b)
        return "unparseable" if time.monotonic() - start > 1.0 else verdict

    idle = [deadline_grader(a, b) for a, b in PAIRS]
    fast_clock(monkeypatch)
    assert [deadline_grader(a, b) for a, b in PAIRS] != idle
