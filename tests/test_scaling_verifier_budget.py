"""The math verifier under adversarial completions: linear extraction, bounded numbers, and a
budget counted in work (parser steps, the height of every value, the terms an expansion may
make), so a verdict never depends on load. sympy runs in a worker process whose safety nets (the
parent's kill, its CPU limit, its memory limit) are tested with the work limits raised past what
sympy can do: the tests assert the verdict and which of these happened, never a duration."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pdm_lab.lab.lifetime import alive
from pdm_lab.scaling import math_worker, verifiers
from pdm_lab.scaling.math_value import MAX_BITS, MAX_TOKENS, _Budget, grade_values, parse_value
from pdm_lab.scaling.math_worker import MathWorker, worker
from pdm_lab.scaling.verifiers import extract_final_answer, grade_math, verify_math

#: LaTeX-ish pieces the fuzzer strings together: nesting, huge powers, roots, scientific literals.
PIECES = ["9", "64", "2", "10", "1e3", "1e-300", "1e999", "0.5", "\\pi", "\\frac{", "\\sqrt{", "\\sqrt[64]{",
          "\\sqrt[3]{", "^", "^{", "}", "{", "(", ")", "+", "-", "*", "/", "\\boxed{", "\\fbox{", "Answer: ",
          "{,}", "\\text{ cm}", "4096", "999999999999", "\\cdot", "\\div", "[", "]", " "]

#: Inputs that once stalled the parser or that the fuzzer found slowest, each with its verdict
#: against the reference "1": bounded work, and the right answer where one can be read.
WORST = [
    ("\\boxed{((((9^64)^64)^64)^64)}", "unparseable"),  # power too large: refused before computing
    ("\\boxed{(((((9^64)^64)^64)^64)^64)}", "unparseable"),
    ("\\boxed{" * 10_000, "unparseable"),  # no closed box: nothing extracted
    ("\\boxed{" * 10_000 + "}" * 10_000, "unparseable"),  # the innermost box is empty
    ("{" * 30_000 + "\\boxed{1}", "equal"),
    ("\\boxed{\\sqrt[64]{\\sqrt[64]{\\sqrt[64]{\\sqrt[64]{2}}}}}", "unequal"),  # 2^(1/64⁴) ≠ 1
    ("\\boxed{1e999999999}", "unparseable"),  # too large to build
    ("\\boxed{2^{10^{-64}}}", "unparseable"),  # exponent's denominator over MAX_ROOT
    ("\\boxed{(\\pi+1)^{64}}", "unequal"),
    ("\\boxed{" + "(" * 150 + "}", "unparseable"),  # nested too deeply
    ("\\boxed{(\\sqrt{" + "9" * 400 + "})^{512}}", "unparseable"),  # power too large
]

#: Exactly 0, but deciding it takes sympy's minimal_polynomial minutes and gigabytes (^{20}) or
#: more than any memory (^{300}); before the worker: 82 s / 1.5 GB for "unequal", a MemoryError.
#: Their height (``math_value._height``) is far over ``MAX_BITS``: unparseable by counting.
SYMPY_BOMBS = [r"(((1+\sqrt{2})^{64})^{64})^{20}-(((3+2\sqrt{2})^{32})^{64})^{20}",
               r"(((1+\sqrt{2})^{64})^{64})^{300}-(((3+2\sqrt{2})^{32})^{64})^{300}"]


def worst_case_holds(grade, text: str, expected: str) -> bool:
    """The check each WORST case runs, given the grader: bounded parser work and the verdict."""
    budget = _Budget()
    got = extract_final_answer(text)
    if got is not None:
        parse_value(got, budget)
    bounded = budget.ops <= 4 * MAX_TOKENS and budget.max_bits <= 2 * MAX_BITS
    return bounded and grade(got or "", "1") == expected


@pytest.mark.parametrize("response,answer,expected", [
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("\\boxed{2.5e-1}", "\\frac14", 1.0),
    ("\\boxed{\\sqrt[10^{64}]{2}}", "1", 0.0),  # a 1e-9 tolerance would call this 1
    ("\\boxed{2^{10^{-64}}}", "1", 0.0),
    ("\\boxed{2^{1000}}", "2^{1000}", 1.0),  # a large but bounded power is still exact
    ("\\boxed{2^{1000}}", "2^{1000}+1", 0.0),
    ("\\boxed{\\sqrt[3]{27}}", "3", 1.0),
    ("\\boxed{\\text{A}}", "a", 1.0),  # a lone \text is the answer, not a unit
])
def test_grading_cases(response, answer, expected):
    assert verify_math(response, answer) == expected


@pytest.mark.parametrize("text,expected", WORST)
def test_worst_cases_are_bounded_work_with_the_right_verdict(text, expected):
    assert worst_case_holds(grade_math, text, expected)


def test_worst_case_check_catches_a_grader_that_answers_wrongly():
    # planted bug: a grader that calls everything it cannot decide "unequal" (the verifier's
    # answer to the sympy bombs before the worker) fails the check on the WORST list
    assert not all(worst_case_holds(lambda a, b: "unequal", t, e) for t, e in WORST)
    assert not all(worst_case_holds(lambda a, b: "unparseable", t, e) for t, e in WORST)


@pytest.mark.parametrize("text,ascii_twin", [("٣", "3"), ("１２３", "123"), ("2²", "4"), ("1٫5", "1.5"),
                                             ("\\frac{١}{٢}", "\\frac{1}{2}")])
def test_only_ascii_digits_are_numbers(text, ascii_twin):
    assert parse_value(text) is None and parse_value(ascii_twin) is not None
    assert grade_math(text, ascii_twin) == grade_math(ascii_twin, text) == "unparseable"
    assert grade_math(text, text) == "equal"  # the same text is still the same answer


def served_and_stopped(counts_before: dict, w: MathWorker, outcome: str) -> bool:
    """The last grading ended with `outcome` (``killed``/``exited``/``memory``) and the worker
    process that served it is gone."""
    return (w.counts.last_outcome == outcome and not alive(w.counts.pids[-1])
            and w.counts.kills + w.counts.exits == counts_before["stops"] + 1)


def _before(w: MathWorker) -> dict:
    return {"stops": w.counts.kills + w.counts.exits}


#: Work limits raised past what sympy can do in any time: only a safety net stops these gradings.
UNBOUNDED = {"bits": 10**9, "terms": 10**12}


@pytest.mark.parametrize("bomb", SYMPY_BOMBS)
def test_sympy_bomb_is_refused_by_counting_not_by_a_safety_net(bomb):
    w = worker()
    grade_math("1", "2")
    before = _before(w)
    assert grade_math(bomb, "0") == "unparseable" and w.counts.last_outcome == "done"
    assert w.counts.kills + w.counts.exits == before["stops"]  # the work count refused it


@pytest.mark.parametrize("bomb", SYMPY_BOMBS[:1])
def test_a_safety_net_stops_what_the_counts_let_through(bomb):
    w = worker()
    grade_math("1", "2")  # the worker is up: its start-up is not part of the grading
    before = _before(w)
    assert w.grade(bomb, "0", 1.0, **UNBOUNDED) == "unparseable"
    # Which net stops it first depends on the machine's speed: the parent's deadline ("killed"),
    # the worker's own CPU limit ("exited") or its address-space cap ("memory").
    assert any(served_and_stopped(before, w, outcome) for outcome in ("killed", "exited", "memory")), (
        w.counts.last_outcome)
    assert grade_math("\\frac{1}{2}", "0.5") == "equal" and w.counts.last_outcome == "done"  # a fresh one


def test_stopped_check_catches_a_worker_that_finished():
    # planted bug: a grading that completed in budget must not pass as killed
    w = worker()
    before = _before(w)
    assert grade_math("\\sqrt{8}", "2\\sqrt{2}") == "equal"
    assert not served_and_stopped(before, w, "killed")


def test_cpu_limit_holds_without_the_parents_kill(monkeypatch):
    # the parent waits far longer than the budget (as if it were gone): the worker's own CPU
    # limit must end the grading
    monkeypatch.setattr(math_worker, "REPLY_GRACE_S", 120.0)
    w = MathWorker()
    try:
        w.grade("1", "2", 0.5)
        before = _before(w)
        assert w.grade(SYMPY_BOMBS[0], "0", 0.5, **UNBOUNDED) == "unparseable"
        assert served_and_stopped(before, w, "exited")
    finally:
        w.close()


def test_memory_limit_stops_a_runaway_value(monkeypatch):
    monkeypatch.setattr(math_worker, "REPLY_GRACE_S", 120.0)
    w = MathWorker(memory_bytes=16 << 20)
    try:
        w.grade("1", "2", 60.0)
        before = _before(w)
        assert w.grade(SYMPY_BOMBS[1], "0", 60.0, **UNBOUNDED) == "unparseable"
        assert served_and_stopped(before, w, "memory")
        assert w.grade("2^{10}", "1024", 60.0) == "equal"
    finally:
        w.close()


def test_worker_grades_as_in_process():
    cases = [("\\frac{6}{4}", "1.5"), ("\\pi", "3.14"), ("2\\sqrt{2}", "\\sqrt{8}"), ("x", "1"), ("1/0", "1")]
    assert [worker().grade(a, b) for a, b in cases] == [grade_values(a, b) for a, b in cases] \
        == ["equal", "unequal", "equal", "unparseable", "unparseable"]


def test_extraction_is_one_pass_over_the_text(monkeypatch):
    # _closing_braces is the only loop over characters; count its calls on a nested input
    calls = []
    real = verifiers._closing_braces
    monkeypatch.setattr(verifiers, "_closing_braces", lambda text: calls.append(len(text)) or real(text))
    text = "\\boxed{" * 5_000
    verifiers.extract_boxed(text)
    assert calls == [len(text)]


def test_over_budget_is_unparseable_not_a_stall():
    assert parse_value("1+1", _Budget(max_ops=1)) is None
    assert grade_math("9^{64^{64}}", "1") == "unparseable"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.integers(0, 2),
       st.sampled_from(["1", "8", "\\pi", "1000"]))
def test_fuzzed_completions_stay_within_budget(parts, repeat, answer):
    text = "\\boxed{" + "".join(parts) * (1 + 40 * repeat) + "}"
    budget = _Budget()
    got = extract_final_answer(text)
    if got is not None:
        value = parse_value(got, budget)
        assert value is None or value.is_number
    assert budget.ops <= 4 * MAX_TOKENS and budget.max_bits <= 2 * MAX_BITS
