"""Verifiers: score a response against the reference answer. Model output is data, never code.

* ``math``: the last ``\\boxed{...}`` (or, failing that, the last ``Answer: ...`` line, DAPO's
  format) compared with the reference by normalised string equality, then by exact value with a
  small recursive-descent parser (numbers, + − × ÷ ^, parentheses, ``\\frac``, ``\\sqrt``, π)
  that builds sympy numbers directly (no ``eval``, no ``sympify`` of text). Linear in the
  completion's length with a hard budget per call (see the limits below): an adversarial answer
  is graded "unparseable" (``grade_math``), never a stall of the rank and its collectives.
* ``exact``: stripped string equality (the synthetic tasks).
* ``module:function``: any importable ``fn(response: str, answer: str) -> float``.

``score_responses`` runs a verifier over a batch and turns an exception into a skipped sample
(``reward.on_error: skip``, counted in the metrics) or a stop (``error``).
"""
from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass
from typing import Callable

import sympy

Verifier = Callable[[str, str], float]


# ---------------------------------------------------------------------------- budget

#: Hard limits per call (issue 9): a completion is data from a model, possibly adversarial, and one
#: stalled verifier call stalls its rank and, through the collectives, every rank.
MAX_ANSWER_CHARS = 512
"""Extracted answers longer than this are unparseable (a real final answer is short)."""
MAX_TOKENS = 200
"""Tokens in one parsed answer."""
MAX_BITS = 4096
"""Bit length cap on every numerator/denominator the parser keeps (about 1233 digits); a power is
refused *before* it is computed if its result would exceed it, so no intermediate ever exceeds
2·MAX_BITS (the product of two kept values, refused right after)."""
MAX_DEPTH = 32
"""Nesting depth of groups (parentheses, braces, fractions, roots)."""
MAX_ROOT = 64
"""Largest root index / exponent denominator: ``\\sqrt[n]{x}`` and ``x^{p/q}`` need n, q ≤ this."""
TIME_BUDGET_S = 1.0
"""Wall-clock guard per call: checked between parser steps, so one call never runs away."""


class _ParseError(ValueError):
    pass


class _Budget:
    """Counts parser steps and enforces the wall-clock guard; ``max_bits`` records the largest
    integer built (for tests bounding the worst case)."""

    def __init__(self, seconds: float = TIME_BUDGET_S):
        self.deadline = time.monotonic() + seconds
        self.ops = 0
        self.max_bits = 0

    def tick(self) -> None:
        self.ops += 1
        if time.monotonic() > self.deadline:
            raise _ParseError("time budget exceeded")

    def check(self, value: sympy.Expr) -> sympy.Expr:
        """Refuse a rational whose numerator or denominator exceeds ``MAX_BITS``."""
        if isinstance(value, sympy.Rational):
            bits = max(int(value.p).bit_length(), int(value.q).bit_length())
            self.max_bits = max(self.max_bits, bits)
            if bits > MAX_BITS:
                raise _ParseError("number too large")
        elif value.is_number:  # irrational: bound every rational inside it
            for atom in value.atoms(sympy.Rational):
                self.check(atom)
        return value


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
    the last one backwards (nested or unclosed ``\\boxed{`` ×1e4 used to take quadratic time).
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
_TRAILING_UNIT = re.compile(r"(?<=[\d}.])\s*\\(?:text|mathrm|mbox)\s*\{\s*[a-zA-Z]+\s*\}\s*$")


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
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators (also 1{,}000)
        s = s.replace(",", "")
    return s.lower()


# ---------------------------------------------------------------------------- safe value parser

_TOKEN = re.compile(r"\s*(\d+(?:\.\d*)?[eE][-+]?\d+|\.\d+[eE][-+]?\d+|\d+\.\d*|\.\d+|\d+"
                    r"|\\frac|\\sqrt|\\pi|\\cdot|\\times|\\div|[-+*/^(){}\[\]]|pi)")
_SCI = re.compile(r"([\d.]+)[eE]([-+]?\d+)")


def _rational(tok: str) -> sympy.Rational:
    """A decimal or scientific literal as an exact rational, its size bounded *before* it is built."""
    m = _SCI.fullmatch(tok)
    if m is None:
        if len(tok) > MAX_BITS // 3:
            raise _ParseError("number too long")
        return sympy.Rational(tok)
    mantissa, exp = m.group(1), int(m.group(2))
    if abs(exp) * 3.33 + len(mantissa) * 3.33 > MAX_BITS:  # 10^exp needs ~3.32·exp bits
        raise _ParseError("number too large")
    return sympy.Rational(mantissa) * sympy.Integer(10) ** exp


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/'|implicit) factor)*;
    factor := ('+'|'-') factor | power; power := atom ('^' factor)?;
    atom := number | π | '(' expr ')' | '{' expr '}' | \\frac{expr}{expr} | \\sqrt[n]{expr}.

    Every value built passes ``_Budget.check`` (bit-length caps); a power is computed only when
    its result fits (exponent bounded by the *result's* size, not by a fixed constant).
    """

    def __init__(self, text: str, budget: _Budget):
        self.budget = budget
        self.toks: list[str] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise _ParseError(f"unexpected {text[pos:pos + 10]!r}")
            self.toks.append(m.group(1))
            pos = m.end()
            if len(self.toks) > MAX_TOKENS:
                raise _ParseError("too long")
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        self.budget.tick()
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise _ParseError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> sympy.Expr:
        value = self.expr()
        if self.peek() is not None:
            raise _ParseError(f"trailing {self.peek()!r}")
        return value

    def expr(self) -> sympy.Expr:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = self.budget.check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> sympy.Expr:
        value = self.factor()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times", "/", "\\div"):
                self.take()
                rhs = self.factor()
                if tok in ("/", "\\div"):
                    if rhs == 0:
                        raise _ParseError("division by zero")
                    value = value / rhs
                else:
                    value = value * rhs
            elif tok is not None and (tok[0].isdigit() or tok[0] == "." or tok in ("(", "\\frac", "\\sqrt", "\\pi", "pi")):
                value = value * self.factor()  # implicit product: 2\pi, 3\sqrt{2}
            else:
                return value
            self.budget.check(value)

    def factor(self) -> sympy.Expr:
        if self.peek() in ("+", "-"):
            sign = self.take()
            value = self.factor()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            return self._pow(base, self.factor())
        return base

    def _pow(self, base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
        """base^exp for a rational exponent p/q (q ≤ MAX_ROOT) whose result fits the bit cap."""
        if not isinstance(exp, sympy.Rational) or exp.q > MAX_ROOT:
            raise _ParseError("exponent must be a rational p/q with a small q")
        if base == 0 and exp < 0:
            raise _ParseError("division by zero")
        p = abs(int(exp.p))
        # the result's size is about p × the bits of the base's largest rational (sympy folds
        # (√n)^p into n^{p/2}); π and friends count as 8 bits
        size = max((max(int(r.p).bit_length(), int(r.q).bit_length()) for r in base.atoms(sympy.Rational)),
                   default=8)
        if p * max(size, 1) > MAX_BITS:  # the result would not fit: refuse before computing it
            raise _ParseError("power too large")
        return self.budget.check(base ** exp)

    def atom(self) -> sympy.Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _ParseError("nested too deeply")
        try:
            return self._atom()
        finally:
            self.depth -= 1

    def _atom(self) -> sympy.Expr:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return self.budget.check(_rational(tok))
        if tok in ("\\pi", "pi"):
            return sympy.pi
        if tok in ("(", "{"):
            value = self.expr()
            self.take(")" if tok == "(" else "}")
            return value
        if tok == "\\frac":
            num = self._group()
            den = self._group()
            if den == 0:
                raise _ParseError("division by zero")
            return self.budget.check(num / den)
        if tok == "\\sqrt":
            index = sympy.Integer(2)
            if self.peek() == "[":
                self.take("[")
                index = self.expr()
                self.take("]")
            if not (isinstance(index, sympy.Integer) and 1 <= index <= MAX_ROOT):
                raise _ParseError(f"root index must be an integer in [1, {MAX_ROOT}]")
            return self._pow(self._group(), sympy.Rational(1, int(index)))
        raise _ParseError(f"unexpected {tok!r}")

    def _group(self) -> sympy.Expr:
        # \frac12 (single-digit shorthand) or \frac{..}{..}
        if self.peek() == "{":
            self.take("{")
            value = self.expr()
            self.take("}")
            return value
        tok = self.take()
        if tok.isdigit():
            if len(tok) > 1:  # \frac12: the first digit is the group, the rest stays in the stream
                self.toks.insert(self.i, tok[1:])
            return sympy.Integer(tok[0])
        raise _ParseError(f"expected a group, got {tok!r}")


def parse_value(s: str, budget: _Budget | None = None) -> sympy.Expr | None:
    """Exact value of a simple numeric expression (LaTeX or plain), or None if unparseable
    (not one, too long, too large, or over the time budget)."""
    if len(s) > MAX_ANSWER_CHARS:
        return None
    budget = budget or _Budget()
    try:
        value = _Parser(s, budget).parse()
    except (_ParseError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return None
    return value if value.is_number else None


#: Relative tolerance for irrational values, compared at ``_DIGITS`` significant digits. Tight
#: on purpose: with roots limited to index ≤ MAX_ROOT, distinct answers differ far above it, and a
#: loose 1e-9 made ``\sqrt[10^{64}]{2}`` equal to 1.
_DIGITS = 60
_REL_TOL = 1e-40


def grade_math(pred: str, ref: str) -> str:
    """``"equal"``, ``"unequal"``, or ``"unparseable"`` (a value could not be read within the
    budget). Normalised string equality first, then exact values."""
    if len(pred) > 4 * MAX_ANSWER_CHARS or len(ref) > 4 * MAX_ANSWER_CHARS:
        return "unparseable"  # no real final answer is this long; normalising it is wasted work
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return "equal"
    budget = _Budget()
    va, vb = parse_value(a, budget), parse_value(b, budget)
    if va is None or vb is None:
        return "unparseable"
    try:
        if va.is_rational and vb.is_rational:
            return "equal" if va == vb else "unequal"
        budget.tick()
        fa, fb = va.evalf(_DIGITS), vb.evalf(_DIGITS)
        budget.tick()
        scale = max(abs(fb), sympy.Integer(1))
        return "equal" if abs(fa - fb) <= _REL_TOL * scale else "unequal"
    except (_ParseError, TypeError, ValueError, OverflowError):
        return "unparseable"


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


VERIFIERS: dict[str, Verifier] = {"math": verify_math, "exact": verify_exact}


def get_verifier(name: str) -> Verifier:
    """A registered verifier, or ``module:function`` imported (plugins)."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward.verifier: cannot import {name!r}: {err}") from None
        if not callable(fn):
            raise ValueError(f"reward.verifier: {name!r} is not callable")
        return fn
    raise ValueError(f"reward.verifier: unknown {name!r}; valid: {', '.join(sorted(VERIFIERS))} "
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
