"""Verifiers: score a response against the reference answer. Model output is data, never code.

* ``math``: the last ``\\boxed{...}`` (or, failing that, the last ``Answer: ...`` line, DAPO's
  format) compared with the reference by normalised string equality, then by exact value
  (``math_value``: a small parser that builds sympy numbers directly, no ``eval``, no
  ``sympify`` of text; equality decided symbolically where sympy can, numerically at 60 digits
  otherwise), under a budget counted in work, so the verdict never depends on load, computed in
  a worker process with time and memory limits as a safety net (``math_worker``). Extraction is linear in the completion's length; an adversarial answer is
  graded "unparseable" (``grade_math``), never a stall of the rank and its collectives.
* ``exact``: stripped string equality (the synthetic tasks).
* ``module:function``: any importable ``fn(response: str, answer: str) -> float``.

``score_responses`` runs a verifier over a batch and turns an exception into a skipped sample
(``reward.on_error: skip``, counted in the metrics) or a stop (``error``).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

from .math_value import MAX_ANSWER_CHARS
from .math_worker import worker

Verifier = Callable[[str, str], float]


# ---------------------------------------------------------------------------- extraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_UNBRACED = re.compile(r"[^\s$]+")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` → index of its matching ``}``, in one pass (unclosed ones absent)."""
    stack: list[int] = []
    match: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            match[stack.pop()] = i
    return match


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None.

    Linear in ``len(text)``: the braces are matched once, then the occurrences are read from
    the last one backwards, so nested or unclosed ``\\boxed{`` ×1e4 cannot take quadratic time.
    """
    hits = [m.end() for m in _BOX.finditer(text)]
    if not hits:
        return None
    closing = _closing_braces(text)
    for j in reversed(hits):
        if j < len(text) and text[j] == "{" and j in closing:
            return text[j + 1:closing[j]]
        tail = _UNBRACED.match(text, j)
        if tail:
            return tail.group(0)
    return None


def extract_answer_line(text: str) -> str | None:
    """DAPO-Math's format: the text after the last ``Answer:``, up to the end of its line."""
    hits = re.findall(r"Answer[ \t]*:[ \t]*([^\n]+)", text)
    return hits[-1].strip() if hits else None


def extract_final_answer(text: str) -> str | None:
    """Boxed answer first, then an ``Answer:`` line."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_answer_line(text)


# ---------------------------------------------------------------------------- normalisation

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(r"(?<=[0-9}.])\s*\\(?:text|mathrm|mbox)\s*\{\s*[a-zA-Z]+\s*\}\s*$")


def normalize_answer(s: str) -> str:
    """Canonical string form: no $, spacing commands, \\left/\\right, units of degrees, etc."""
    s = s.strip()
    s = _TRAILING_UNIT.sub("", s)  # "5 \text{ cm}" -> "5": a unit after a number
    s = _TEXT_CMD.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\:", ""), ("\\quad", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("^\\circ", ""), ("^{\\circ}", ""), ("\\circ", ""), ("\\%", ""), ("%", ""),
                     ("\\$", ""), ("$", ""), ("\\displaystyle", ""), ("{,}", ",")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?", s):  # thousands separators (also 1{,}000)
        s = s.replace(",", "")
    return s.lower()


def grade_math(pred: str, ref: str) -> str:
    """``"equal"``, ``"unequal"``, or ``"unparseable"`` (a value could not be read within the
    budget: not a number, too large, an undefined value such as 0/0, or past a safety net of the
    worker). Normalised string equality first, then exact values (``math_value.grade_values``,
    whose conventions: 0^0 = 1, 0/0 and 0^{-1} unparseable), computed in the worker process
    (``math_worker``)."""
    if len(pred) > 4 * MAX_ANSWER_CHARS or len(ref) > 4 * MAX_ANSWER_CHARS:
        return "unparseable"  # no real final answer is this long; normalising it is wasted work
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return "equal"
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return "unparseable"
    return worker().grade(a, b)


def math_equal(pred: str, ref: str) -> bool:
    """Normalised string equality, else equal exact values (irrational: within 1e-40 relative)."""
    return grade_math(pred, ref) == "equal"


# ---------------------------------------------------------------------------- verifiers

def verify_math(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0."""
    got = extract_final_answer(response)
    return 1.0 if got is not None and math_equal(got, answer) else 0.0


def verify_exact(response: str, answer: str) -> float:
    """1.0 if the stripped response equals the stripped reference."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def verify_length_parity(response: str, answer: str) -> float:
    """1.0 if the response has an odd number of characters. A reward for audit studies, not for
    learning a task: an untrained model earns it about half the time, so its groups have Â ≠ 0
    from the first step, where the task's own verifier would leave every advantage 0."""
    return float(len(response) % 2)


VERIFIERS: dict[str, Verifier] = {"math": verify_math, "exact": verify_exact, "length_parity": verify_length_parity}


def get_verifier(name: str) -> Verifier:
    """A registered verifier, or ``module:function`` imported (plugins); anything else is a
    ``ConfigError`` naming ``reward.verifier`` and the valid choices."""
    from pdm_lab.config import ConfigError

    if name in VERIFIERS:
        return VERIFIERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"reward.verifier: cannot import {name!r}: {err}") from None
        if not callable(fn):
            raise ConfigError(f"reward.verifier: {name!r} is not callable")
        return fn
    raise ConfigError(f"reward.verifier: unknown {name!r}; valid: {', '.join(sorted(VERIFIERS))} "
                     "or module:function")


class RewardError(RuntimeError):
    """A verifier raised and ``reward.on_error`` is ``error``."""


@dataclass
class Scores:
    """rewards [B] (0.0 where skipped), ok [B] (False: the verifier failed; sample leaves the loss)."""

    rewards: list[float]
    ok: list[bool]
    errors: list[str]


def score_responses(verifier: Verifier, responses: list[str], answers: list[str], *,
                    on_error: str = "skip") -> Scores:
    """Score each response; an exception or a non-finite reward skips the sample or raises."""
    rewards, ok, errors = [], [], []
    for i, (resp, ans) in enumerate(zip(responses, answers)):
        try:
            r = float(verifier(resp, ans))
            if r != r or r in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite reward {r}")
        except Exception as err:  # noqa: BLE001 - a verifier is user code; report, don't crash mid-step
            msg = f"sample {i}: verifier raised {type(err).__name__}: {err}"
            if on_error == "error":
                raise RewardError(msg + " (set reward.on_error: skip to skip such samples)") from err
            rewards.append(0.0)
            ok.append(False)
            errors.append(msg)
            continue
        rewards.append(r)
        ok.append(True)
    return Scores(rewards=rewards, ok=ok, errors=errors)
