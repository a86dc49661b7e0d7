"""The math verifier under adversarial completions (issue 9): linear extraction, bounded numbers,
"unparseable" instead of a stall. Work is bounded by counting, not by timing: the parser's step
count and the largest integer it builds; extraction is checked linear by construction (one pass)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdm_lab.scaling import verifiers
from pdm_lab.scaling.verifiers import (MAX_BITS, MAX_TOKENS, _Budget, extract_final_answer, grade_math,
                                       parse_value, verify_math)

#: LaTeX-ish pieces the fuzzer strings together: nesting, huge powers, roots, scientific literals.
PIECES = ["9", "64", "2", "10", "1e3", "1e-300", "1e999", "0.5", "\\pi", "\\frac{", "\\sqrt{", "\\sqrt[64]{",
          "\\sqrt[3]{", "^", "^{", "}", "{", "(", ")", "+", "-", "*", "/", "\\boxed{", "\\fbox{", "Answer: ",
          "{,}", "\\text{ cm}", "4096", "999999999999", "\\cdot", "\\div", "[", "]", " "]

#: Inputs that stalled before (issue 9) or that the fuzzer found slowest; each must be graded
#: "unparseable"/"unequal" within a bounded amount of work.
WORST = [
    "\\boxed{((((9^64)^64)^64)^64)}",
    "\\boxed{(((((9^64)^64)^64)^64)^64)}",
    "\\boxed{" * 10_000,
    "\\boxed{" * 10_000 + "}" * 10_000,
    "{" * 30_000 + "\\boxed{1}",
    "\\boxed{\\sqrt[64]{\\sqrt[64]{\\sqrt[64]{\\sqrt[64]{2}}}}}",
    "\\boxed{1e999999999}",
    "\\boxed{2^{10^{-64}}}",
    "\\boxed{(\\pi+1)^{64}}",
    "\\boxed{" + "(" * 150 + "}",
    "\\boxed{(\\sqrt{" + "9" * 400 + "})^{512}}",
]


@pytest.mark.parametrize("response,answer,expected", [
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("\\boxed{2.5e-1}", "\\frac14", 1.0),
    ("\\boxed{\\sqrt[10^{64}]{2}}", "1", 0.0),  # was "equal to 1" (1e-9 tolerance)
    ("\\boxed{2^{10^{-64}}}", "1", 0.0),
    ("\\boxed{2^{1000}}", "2^{1000}", 1.0),  # a large but bounded power is still exact
    ("\\boxed{\\sqrt[3]{27}}", "3", 1.0),
    ("\\boxed{\\text{A}}", "a", 1.0),  # a lone \text is the answer, not a unit
])
def test_grading_cases(response, answer, expected):
    assert verify_math(response, answer) == expected


@pytest.mark.parametrize("text", WORST)
def test_worst_cases_are_bounded_work(text):
    budget = _Budget(seconds=60.0)  # generous: the bound under test is the counted work below
    got = extract_final_answer(text)
    if got is not None:
        parse_value(got, budget)
    assert budget.ops <= 4 * MAX_TOKENS and budget.max_bits <= 2 * MAX_BITS
    assert grade_math(got or "", "1") in ("unparseable", "unequal", "equal")


def test_extraction_is_one_pass_over_the_text(monkeypatch):
    # _closing_braces is the only loop over characters; count its calls on a nested input
    calls = []
    real = verifiers._closing_braces
    monkeypatch.setattr(verifiers, "_closing_braces", lambda text: calls.append(len(text)) or real(text))
    text = "\\boxed{" * 5_000
    verifiers.extract_boxed(text)
    assert calls == [len(text)]


def test_over_budget_is_unparseable_not_a_stall():
    assert parse_value("1+1", _Budget(seconds=-1.0)) is None
    assert grade_math("9^{64^{64}}", "1") == "unparseable"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.integers(0, 2),
       st.sampled_from(["1", "8", "\\pi", "1000"]))
def test_fuzzed_completions_stay_within_budget(parts, repeat, answer):
    text = "\\boxed{" + "".join(parts) * (1 + 40 * repeat) + "}"
    budget = _Budget(seconds=60.0)
    got = extract_final_answer(text)
    if got is not None:
        value = parse_value(got, budget)
        assert value is None or value.is_number
    assert budget.ops <= 4 * MAX_TOKENS and budget.max_bits <= 2 * MAX_BITS
    assert verify_math(text, answer) in (0.0, 1.0)
